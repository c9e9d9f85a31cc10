"""Interruptions: spot / preemptible hosts, the checkpoint interval that costs least (`checkpoint.interval: auto`,
Young/Daly), and what the interruptions a run should expect cost it
(docs/plan-models.md#checkpoints-and-interruptions)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel

from phase1a.core.units import GIB

BOUNDED_PARTS = 4
BOUNDED_MAX_SECONDS = 1800.0
BOUNDED_MIN_COST_MULTIPLE = 10.0
ASSUMED_STORE_BYTES_PER_SECOND = 100e6  # one upload stream to S3 from a cloud host, roughly; flagged where used
ASSUMED_DISK_BYTES_PER_SECOND = GIB  # a local disk, for hardware that is not here to measure; flagged too

IntervalRule = Literal["young-daly", "bounded", "configured"]


class NotExpectedToFinish(ValueError):
    """Interruptions come faster than a run recovers from one: r c >= 1."""


def young_daly_seconds(checkpoint_seconds: float, mean_seconds_between: float) -> float:
    """Daly's first-order optimum: sqrt(2 delta M) - delta for delta < 2M, else M."""
    delta, mean = checkpoint_seconds, mean_seconds_between
    return math.sqrt(2 * delta * mean) - delta if delta < 2 * mean else mean


def bounded_seconds(train_seconds: float, checkpoint_seconds: float) -> float:
    """Without an interruption rate to trade against: a few checkpoints a run, at most 30 min apart, each interval
    at least ten checkpoint costs long."""
    return max(min(train_seconds / BOUNDED_PARTS, BOUNDED_MAX_SECONDS), BOUNDED_MIN_COST_MULTIPLE * checkpoint_seconds)


def auto_interval(rate_per_hour: float, checkpoint_seconds: float, train_seconds: float,
                  store: bool) -> tuple[float, IntervalRule]:
    """`checkpoint.interval: auto`'s interval in seconds (whole, at least one) and the rule that chose it."""
    if rate_per_hour > 0 and store:
        seconds, rule = young_daly_seconds(checkpoint_seconds, 3600.0 / rate_per_hour), "young-daly"
    else:
        seconds, rule = bounded_seconds(train_seconds, checkpoint_seconds), "bounded"
    return max(1.0, float(round(seconds))), rule


def interval_text(seconds: float) -> str:
    """An interval in phase1a.core.units' grammar, e.g. '754s'."""
    return f"{max(1, round(seconds))}s"


@dataclass(frozen=True)
class Exposure:
    """One run as interruptions see it: how long it runs and what each interruption costs it."""

    run_seconds: float  # start-up + train + evaluation, uninterrupted
    train_seconds: float  # the train stage's loop: what a fresh host without a store does again
    interval_seconds: float  # between checkpoints (tau); the train time when none fires
    checkpoint_seconds: float  # delta: one checkpoint written and uploaded
    restart_seconds: float  # a fresh host to its first step
    store: bool

    @property
    def lost_each(self) -> float:
        if not self.store:
            return self.train_seconds / 2
        return min(self.interval_seconds, self.train_seconds) / 2 + self.checkpoint_seconds

    @property
    def cost_each(self) -> float:
        return self.lost_each + self.restart_seconds


def overhead_share(rate_per_hour: float, cost_each_seconds: float) -> float:
    """The expected extra time as a share of the uninterrupted run: r c / (1 - r c)."""
    exposed = rate_per_hour / 3600.0 * cost_each_seconds
    if exposed >= 1.0:
        raise NotExpectedToFinish(
            f"at {rate_per_hour:g} interruptions an hour, each costing {cost_each_seconds:.0f} s of lost work and "
            f"restart, interruptions come faster than the run recovers from one: it is not expected to finish; "
            f"run on demand (hardware.spot false), or shorten what an interruption costs (a store, a shorter "
            f"checkpoint.interval, store.lease_ttl)")
    return exposed / (1.0 - exposed)


class Expected(BaseModel):
    """The interruptions one run should expect and what they cost it, in seconds."""

    interruptions: float
    lost_seconds_each: float
    restart_seconds_each: float
    lost_seconds: float
    restart_seconds: float
    extra_seconds: float  # lost + restarts: what the run's wall time grows by


def expected(rate_per_hour: float, exposure: Exposure) -> Expected:
    share = overhead_share(rate_per_hour, exposure.cost_each)
    count = rate_per_hour / 3600.0 * exposure.run_seconds * (1.0 + share)  # r T / (1 - r c)
    return Expected(interruptions=count, lost_seconds_each=exposure.lost_each,
                    restart_seconds_each=exposure.restart_seconds, lost_seconds=count * exposure.lost_each,
                    restart_seconds=count * exposure.restart_seconds, extra_seconds=count * exposure.cost_each)


class CheckpointCost(BaseModel):
    """delta and where its parts come from."""

    write_seconds: float
    write_source: Literal["measured", "history", "assumed"]
    upload_seconds: float = 0.0
    upload_source: Literal["measured", "history", "assumed", "no store"] = "no store"
    bytes: int = 0  # one checkpoint: measured in calibration, else trainable weights and optimizer state

    @property
    def seconds(self) -> float:
        return self.write_seconds + self.upload_seconds


class InterruptionEstimate(BaseModel):
    """The plan's section on interruptions: the rate, the checkpoint interval and why, what interruptions cost."""

    spot: bool
    rate_per_hour: float
    rate_source: str  # the catalogue's spot rate for a kind, hardware.interruptions_per_hour, or on demand
    store: bool
    checkpoint: CheckpointCost
    interval: str  # what training uses: auto's choice, or checkpoint.interval as configured
    interval_rule: IntervalRule
    interval_seconds: float  # tau in wall time (a steps or tokens interval at the planned speed)
    expected: Expected


class InterruptionOutcome(BaseModel):
    """The plan's expectation beside what this run saw: a run knows only its own attempt and the host it took
    over from, not the attempts before that."""

    expected_interruptions: float | None  # over the whole run, every host together
    expected_lost_seconds: float | None
    resumed_after_interruption: bool  # this host started from a checkpoint in the store
    resumed_from_step: int | None
    taken_over_from_step: int | None  # the gone host's last renewed step
    lost_steps: int | None  # that host's steps past the checkpoint this run resumed from (at least: to its renewal)
    lost_seconds: float | None  # lost_steps at this attempt's own seconds per step
    # How long the gone host's lease had gone unrenewed when this host took it over: what it trained in that time
    # (if anything: it may have stopped at once) is not in lost_steps, the store cannot know it.
    taken_over_silent_seconds: float | None = None
