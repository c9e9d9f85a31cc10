"""Length analysis: percentiles, a right-sized max_seq_length, the padding each batching choice wastes."""
from __future__ import annotations

from typing import Callable

import numpy as np
from pydantic import BaseModel

SEQ_MULTIPLE = 64  # right-sized lengths round up to this, a friendly shape for GPU kernels
# An outlier would size the run alone (every packed row, every memory estimate). It is both over OUTLIER_FACTOR x
# the p99.9 length of the others (the second longest below 1,001 examples) and OUTLIER_SPREAD robust deviations
# above the median log length: either alone misfires (docs/stages.md, tokenize: why, and how it was checked).
OUTLIER_FACTOR = 4.0
OUTLIER_SPREAD = 4.0
OUTLIER_PERCENTILE = 99.9
_MAD_TO_SIGMA = 1.4826  # a normal distribution's standard deviation is 1.4826 x its median absolute deviation
_SHOWN_OUTLIERS = 5


class LengthStats(BaseModel):
    count: int
    total_tokens: int
    supervised_tokens: int
    min: int
    p50: float
    p90: float
    p99: float
    p99_9: float
    max: int


class Outliers(BaseModel):
    count: int  # examples longer than `threshold` tokens
    threshold: int  # the longest length that is not an outlier: the larger of the rule's two bounds
    reference: int  # the p99.9 length of the others (below 1,001 examples: the second longest)
    others_length: int  # the max_seq_length the other examples right-size to: what balanced and fast train at
    longest: list[tuple[str, int]]  # (where, tokens) of the longest few: file and line


def outlier_threshold(lengths: np.ndarray) -> tuple[int, int]:
    """(reference, threshold): an example longer than `threshold` tokens is an outlier (the rule above)."""
    reference = int(np.percentile(lengths, OUTLIER_PERCENTILE, method="lower"))
    logs = np.log(np.maximum(lengths, 1))
    median = float(np.median(logs))
    spread = _MAD_TO_SIGMA * float(np.median(np.abs(logs - median)))
    far = float(np.exp(median + OUTLIER_SPREAD * spread))
    return reference, int(np.floor(max(OUTLIER_FACTOR * reference, far)))


def find_outliers(lengths: np.ndarray, where: Callable[[int], str],
                  size_for: Callable[[np.ndarray], int]) -> Outliers | None:
    """The outliers among `lengths`, longest first, or None when there are none. `where` names an example (file
    and line); `size_for` is the run's right-sizing, applied to the other examples."""
    reference, threshold = outlier_threshold(lengths)
    beyond = lengths > threshold
    if not beyond.any():
        return None
    indices = np.flatnonzero(beyond)
    longest = indices[np.argsort(-lengths[indices], kind="stable")[:_SHOWN_OUTLIERS]]
    return Outliers(count=int(indices.size), threshold=threshold, reference=reference,
                    others_length=size_for(lengths[~beyond]),
                    longest=[(where(int(index)), int(lengths[index])) for index in longest])


def describe_outliers(outliers: Outliers) -> str:
    named = ", ".join(f"{where} ({tokens} tokens)" for where, tokens in outliers.longest)
    more = f" and {outliers.count - len(outliers.longest)} more" if outliers.count > len(outliers.longest) else ""
    return (f"{outliers.count} outlier example(s), longer than {outliers.threshold} tokens ({OUTLIER_FACTOR:g}x the "
            f"p{OUTLIER_PERCENTILE:g} length of the others, {outliers.reference} tokens, and {OUTLIER_SPREAD:g} robust "
            f"deviations above the median): {named}{more}. Sized for, one sets the length of every packed row; "
            f"plan.profile balanced (the default) and fast size the run from the other examples "
            f"(max_seq_length {outliers.others_length}), quality keeps them")


class WasteRow(BaseModel):
    batching: str
    sequence_length: int | None
    computed_tokens: int
    waste_fraction: float


def length_stats(lengths: np.ndarray, supervised: int) -> LengthStats:
    p50, p90, p99, p999 = np.percentile(lengths, [50, 90, 99, 99.9])
    return LengthStats(count=int(lengths.size), total_tokens=int(lengths.sum()), supervised_tokens=int(supervised),
                       min=int(lengths.min()), p50=float(p50), p90=float(p90), p99=float(p99), p99_9=float(p999),
                       max=int(lengths.max()))


def right_size(lengths: np.ndarray, percentile: float, model_max_length: int, user_cap: int | None) -> int:
    """Next multiple of SEQ_MULTIPLE at or above the given length percentile (100 = the longest example),
    capped by the model's positions and the user's cap."""
    target = int(np.ceil(np.percentile(lengths, percentile))) if percentile < 100 else int(lengths.max())
    size = -(-target // SEQ_MULTIPLE) * SEQ_MULTIPLE
    return min(size, model_max_length, user_cap or model_max_length)


def waste_table(lengths: np.ndarray, configured_length: int, right_sized: int) -> list[WasteRow]:
    """Tokens computed per epoch, and the share of them that is padding, for three ways to batch.

    Padded rows compute every row at full length (truncated examples count at that length); packed rows
    concatenate examples with no padding at all."""
    useful = int(np.minimum(lengths, right_sized).sum())
    rows = []
    for name, length in (("padded to the configured length", configured_length),
                         ("padded to the right-sized length", right_sized)):
        computed = int(lengths.size) * length
        rows.append(WasteRow(batching=name, sequence_length=length, computed_tokens=computed,
                             waste_fraction=1 - int(np.minimum(lengths, length).sum()) / computed))
    rows.append(WasteRow(batching="packed (phase1a)", sequence_length=None, computed_tokens=useful, waste_fraction=0.0))
    return rows

