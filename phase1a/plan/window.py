"""Fitting a run into a time window: the estimate as a function of epochs and truncation, and the documented
order of adjustments when it does not fit.

    seconds(epochs, L) = (epochs * sum(min(length_i, L)) * seconds_per_token + fixed_seconds) * (1 + overhead)

`overhead` is the expected cost of interruptions as a share of the run (phase1a/plan/interruptions.py: spot hosts),
so a window fits the run with the lost work and restarts it should expect, not only an uninterrupted attempt.

Order, each step tried only if the previous ones did not fit the budget (window minus safety margin):
  1. profile: `balanced` becomes `fast`, which truncates at the p99.9 length (a `quality` run never truncates;
     `memory_efficient` and `custom` keep their knobs and go on to step 2);
  2. epochs: down to `min_epochs`, no further;
  3. truncation: at p99, then p95, then p90 (never for `quality`), with epochs at the most that fits but at
     least `min_epochs`.
When even the last step does not fit, `WindowError` says by how much, before any training starts.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from pydantic import BaseModel

from phase1a.core.errors import UserError
from phase1a.data.lengths import right_size

FAST_PERCENTILE = 99.9
TRUNCATION_PERCENTILES = (99.0, 95.0, 90.0)


class WindowError(UserError, RuntimeError):
    """Nothing the plan can run fits the time window; the message names the window and what would fit."""


class Adjustment(BaseModel):
    step: str
    before: str
    after: str
    estimated_hours: float


@dataclass
class Workload:
    lengths: np.ndarray  # tokens per training example
    epochs: float
    max_seq_length: int
    model_max_length: int
    seconds_per_token: float
    fixed_seconds: float  # evaluation and start-up: independent of epochs and truncation
    overhead: float = 0.0  # expected interruptions' lost work and restarts, a share of the run

    def seconds(self, epochs: float, max_seq_length: int) -> float:
        tokens = float(np.minimum(self.lengths, max_seq_length).sum())
        return (epochs * tokens * self.seconds_per_token + self.fixed_seconds) * (1 + self.overhead)

    def epochs_that_fit(self, budget: float, max_seq_length: int) -> float:
        """The most epochs that fit, rounded down to three significant figures: to a fixed 0.01 an epoch, a
        50,000-example set whose window held 0.57 % of an epoch got 0 and trained one step at the floor."""
        per_epoch = self.seconds(1.0, max_seq_length) - self.seconds(0.0, max_seq_length)
        fixed = self.seconds(0.0, max_seq_length)
        return _floor_to_figures((budget - fixed) / per_epoch, 3) if per_epoch > 0 else math.inf


def _floor_to_figures(value: float, figures: int) -> float:
    """`value` rounded down to `figures` significant figures (0 and below: as it is)."""
    if value <= 0:
        return value
    scale = 10.0 ** (figures - 1 - math.floor(math.log10(value)))
    return math.floor(value * scale * (1 + 1e-12)) / scale  # 1e-12: 0.57 * 100 is 56.99... in binary


def fit_window(work: Workload, budget: float, profile: str,
               min_epochs: float) -> tuple[float, int, str, list[Adjustment]]:
    """(epochs, max_seq_length, profile, adjustments) that fit `budget` seconds, or WindowError."""
    epochs, length, adjustments = work.epochs, work.max_seq_length, []
    if work.seconds(epochs, length) <= budget:
        return epochs, length, profile, adjustments

    def record(step: str, before: str, after: str) -> None:
        adjustments.append(Adjustment(step=step, before=before, after=after,
                                      estimated_hours=work.seconds(epochs, length) / 3600))

    if profile == "balanced":
        fast_length = min(length, right_size(work.lengths, FAST_PERCENTILE, work.model_max_length, None))
        before, profile, length = f"balanced, max_seq_length {length}", "fast", fast_length
        record("profile", before, f"fast, max_seq_length {length} (p{FAST_PERCENTILE:g})")
        if work.seconds(epochs, length) <= budget:
            return epochs, length, profile, adjustments

    fitting = work.epochs_that_fit(budget, length)
    if fitting >= min_epochs:
        before, epochs = f"{epochs:g} epochs", min(epochs, fitting)
        record("epochs", before, f"{epochs:g} epochs")
        return epochs, length, profile, adjustments
    if epochs > min_epochs:
        before, epochs = f"{epochs:g} epochs", min_epochs
        record("epochs", before, f"{epochs:g} epochs (the floor)")

    if profile != "quality":
        for percentile in TRUNCATION_PERCENTILES:
            shorter = min(length, right_size(work.lengths, percentile, work.model_max_length, None))
            if shorter == length:
                continue
            before, length = f"max_seq_length {length}", shorter
            epochs = max(min_epochs, min(work.epochs, work.epochs_that_fit(budget, length)))
            record("truncation", before, f"max_seq_length {length} (p{percentile:g}), {epochs:g} epochs")
            if work.seconds(epochs, length) <= budget:
                return epochs, length, profile, adjustments

    need = work.seconds(epochs, length)
    interruptions = need * work.overhead / (1 + work.overhead)
    raise WindowError(
        f"nothing fits the time window: even {epochs:g} epochs at max_seq_length {length} need an estimated "
        f"{need / 3600:.2f} h"
        + (f" ({interruptions / 3600:.2f} h of it the lost work and restarts expected from interruptions: "
           f"hardware.spot, hardware.interruptions_per_hour)" if interruptions else "")
        + f", the window leaves {budget / 3600:.2f} h after the safety margin "
        f"(tried: {'; '.join(a.step + ' -> ' + a.after for a in adjustments) or 'nothing to adjust'})"
    )
