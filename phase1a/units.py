"""Composer-style time units: "30m", "2h", "90s", "500steps", or both ("30m,500steps")."""
from __future__ import annotations

import re
from dataclasses import dataclass

_UNIT_SECONDS = {"s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "hr": 3600}
_TOKEN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|sec|m|min|h|hr|steps?|ba)\s*$")


@dataclass(frozen=True)
class Interval:
    """Fires when either the wall-time or the step budget since the last firing is spent."""

    seconds: float | None = None
    steps: int | None = None

    def due(self, seconds_since: float, steps_since: int) -> bool:
        return (self.seconds is not None and seconds_since >= self.seconds) or (
            self.steps is not None and steps_since >= self.steps
        )

    def __str__(self) -> str:
        parts = []
        if self.seconds is not None:
            parts.append(f"{self.seconds:g}s")
        if self.steps is not None:
            parts.append(f"{self.steps}steps")
        return ",".join(parts) or "never"


def parse_interval(text: str) -> Interval:
    """Parse "30m", "500steps" or "30m,500steps"; raise ValueError naming the bad part."""
    if text.strip().lower() in {"never", "none", "off"}:
        return Interval()
    seconds: float | None = None
    steps: int | None = None
    for part in text.split(","):
        match = _TOKEN.match(part.lower())
        if not match:
            raise ValueError(f"{part.strip()!r} is not a time unit; use e.g. '30m', '2h', '90s' or '500steps'")
        value, unit = match.groups()
        if unit in _UNIT_SECONDS:
            seconds = float(value) * _UNIT_SECONDS[unit]
        else:
            if "." in value:
                raise ValueError(f"{part.strip()!r}: a step count must be a whole number")
            steps = int(value)
    return Interval(seconds=seconds, steps=steps)


def parse_duration_seconds(text: str) -> float:
    """A pure wall-time span such as "30m" or "12h"."""
    interval = parse_interval(text)
    if interval.seconds is None or interval.steps is not None:
        raise ValueError(f"{text!r} must be a wall-time span such as '30m' or '12h'")
    return interval.seconds
