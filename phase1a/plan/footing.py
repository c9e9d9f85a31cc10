"""How sure a time estimate is: what its speed rests on, and the range that follows (docs/stages.md, "The
estimate's footing"). The range multiplies the seconds that scale with the speed: training and evaluation."""
from __future__ import annotations

import math

from pydantic import BaseModel

FIRM_STEPS = 4  # measured steps below which an estimate says it rests on few
_STEADY_SPREAD = 0.05  # the least relative range of a firm measurement on a GPU: its speed moves a few per cent
# A CPU host's speed over minutes, which a calibration of seconds cannot see: on this project's 2-core VM, in 18 fresh
# runs of three jobs (2026-11-29, benchmarks/estimate_accuracy.py), calibration's speed was 0.80-1.20 of the run's own
# steps' (mean 1.02, standard deviation 0.10), in either direction: ±22 % holds all 18; ±15 % missed 4. Nine runs
# after it, in a slower hour, met 0.78 and 1.27: two of the nine trainings fell outside (docs/benchmarks.md).
_CPU_SPREAD = 0.22
_THIN_SPREAD = 0.10  # the same for one measured step, widened by sqrt(FIRM_STEPS / steps) below FIRM_STEPS
# Warm-up steps carry first-call costs (lazy set-up, allocator growth, kernel selection): an upper bound. On this
# project's CPU host a first one-example step took 3-10x a steady step's time per token.
_WARMUP_ONLY = (0.1, 1.0)
_ASSUMED = (0.5, 2.0)  # a peak-FLOP/s fraction: realised MFU varies about 2x either way between models and kernels
_HISTORY_SPREAD = 0.10  # past runs on this hardware: the upper median of the last few, which moves this much
# Evaluation's speed derived from training's (2N of the step's FLOPs a token, a greedy step at the weights' read):
# how far the forward pass's share of a step and the decode step's cost move between models and devices.
_DERIVED = (0.67, 1.5)
# Evaluation's speeds from the last run: its evaluations during training measured the forward pass over the whole
# run; within one run on this project's CPU host single evaluations moved ±15 %.
_REMEMBERED_EVALUATION = 0.15


class Footing(BaseModel):
    """What the speed rests on, in words, and the estimate's range as multiples of its speed-bound seconds."""

    source: str  # measured, history or assumed
    words: str
    low: float
    high: float
    firm: bool  # enough measured steps of whole shape: no caveat to print
    warmup_only: bool = False  # no step was measured past the warm-up


def floor(device_type: str) -> float:
    """The least relative range of a measurement on this kind of device."""
    return _CPU_SPREAD if device_type == "cpu" else _STEADY_SPREAD


def measured(steps: int, micro_batches: float, step_micro_batches: float, spread: float,
             least: float = _STEADY_SPREAD) -> Footing:
    """From calibration: `steps` measured steps of `micro_batches` micro-batches (a whole step has
    `step_micro_batches` on average) whose seconds per token spread by `spread` (half range over mean), at least
    `least` (the device's `floor`)."""
    if steps == 0:
        return Footing(source="measured", words="warm-up steps only: an upper bound", low=_WARMUP_ONLY[0],
                       high=_WARMUP_ONLY[1], firm=False, warmup_only=True)
    shortened = micro_batches < step_micro_batches
    lowest = least if steps >= FIRM_STEPS and not shortened else max(least, _THIN_SPREAD)
    relative = max(spread, lowest) * math.sqrt(max(1.0, FIRM_STEPS / steps))
    words = f"{steps} measured step{'s' if steps != 1 else ''}"
    if shortened:
        words += f" cut to {micro_batches:.3g} of ~{step_micro_batches:.3g} micro-batches"
    # Steps that spread by more than their mean leave no lower bound a measurement can give: warm-up's.
    return Footing(source="measured", words=words + f", ±{relative:.0%}", low=max(1 - relative, _WARMUP_ONLY[0]),
                   high=1 + relative, firm=steps >= FIRM_STEPS and not shortened)


def history(runs: int) -> Footing:
    return Footing(source="history", words=f"{runs} past run{'s' if runs != 1 else ''}, ±{_HISTORY_SPREAD:.0%}",
                   low=1 - _HISTORY_SPREAD, high=1 + _HISTORY_SPREAD, firm=True)


def modelled(value: float, low: float, high: float, words: str) -> Footing:
    """From the GPU model (phase1a/plan/gpu_model.py): its tokens/s `value` within [`low`, `high`]."""
    return Footing(source="modelled", words=f"modelled, not measured: {words}", low=value / high, high=value / low,
                   firm=False)


def assumed(mfu: float) -> Footing:
    return Footing(source="assumed", words=f"assumed at {mfu:.0%} MFU, not measured: {_ASSUMED[0]:g}x to "
                                           f"{_ASSUMED[1]:g}x", low=_ASSUMED[0], high=_ASSUMED[1], firm=False)


def timed_evaluation(passes: int, spread: float, least: float = _STEADY_SPREAD) -> Footing:
    """Evaluation's speed from `passes` timed teacher-forced passes (and the greedy steps timed beside them) whose
    seconds per token spread by `spread`: at least the thin floor, widened by sqrt(FIRM_STEPS / passes) as a
    measurement of few steps is. On this project's CPU host the same 53-example pass took 11.2 to 15.1 s within
    one run: one short pass says little more than that."""
    relative = max(spread, least, _THIN_SPREAD) * math.sqrt(max(1.0, FIRM_STEPS / max(passes, 1)))
    return Footing(source="measured", words=f"{passes} timed pass{'es' if passes != 1 else ''}, ±{relative:.0%}",
                   low=1 - relative, high=1 + relative, firm=passes >= FIRM_STEPS)


def derived_evaluation() -> Footing:
    return Footing(source="derived", words=f"derived from the training speed, not timed: {_DERIVED[0]:g}x to "
                                           f"{_DERIVED[1]:g}x", low=_DERIVED[0], high=_DERIVED[1], firm=False)


def remembered_evaluation() -> Footing:
    return Footing(source="history", words=f"the last run's evaluations, ±{_REMEMBERED_EVALUATION:.0%}",
                   low=1 - _REMEMBERED_EVALUATION, high=1 + _REMEMBERED_EVALUATION, firm=True)
