"""Length analysis: percentiles, a right-sized max_seq_length, the padding each batching choice wastes."""
from __future__ import annotations

from typing import Callable

import numpy as np
from pydantic import BaseModel

SEQ_MULTIPLE = 64  # right-sized lengths round up to this, a friendly shape for GPU kernels
# An example longer than this many times the p99.9 length is an outlier: sized for, it would set the length of
# every packed row and every memory estimate of the run. The `balanced` profile truncates outliers (at the
# p99.9 length), `quality` keeps them; the report names them either way.
OUTLIER_FACTOR = 2.0
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
    count: int  # examples longer than OUTLIER_FACTOR x p99_9 tokens
    p99_9: float
    longest: list[tuple[str, int]]  # (where, tokens) of the longest few: file and line


def find_outliers(lengths: np.ndarray, where: Callable[[int], str]) -> Outliers | None:
    """The examples longer than OUTLIER_FACTOR x p99.9, longest first, or None when there are none."""
    p999 = float(np.percentile(lengths, 99.9))
    threshold = int(OUTLIER_FACTOR * p999)
    beyond = np.flatnonzero(lengths > threshold)
    if beyond.size == 0:
        return None
    longest = beyond[np.argsort(-lengths[beyond], kind="stable")[:_SHOWN_OUTLIERS]]
    return Outliers(count=int(beyond.size), p99_9=p999,
                    longest=[(where(int(index)), int(lengths[index])) for index in longest])


def describe_outliers(outliers: Outliers) -> str:
    where, tokens = outliers.longest[0]
    return (f"{outliers.count} example(s) longer than {OUTLIER_FACTOR:g}x the p99.9 length ({outliers.p99_9:g} "
            f"tokens), the longest {tokens} tokens at {where}: sized for, it sets the length of every packed row; "
            "plan.profile balanced truncates such examples at the p99.9 length, quality keeps them")


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

