"""Units, one home each: Composer-style time spans ("30m", "2h", "500steps", "2000000tok", "0.5ep", or several:
"30m,500steps") with the arithmetic of an interval, and byte sizes.

An `Interval` fires when any of its limits is spent since it last fired. A `Clock` is the same dimensions
measured: since the last firing (`due`), over a whole run (`count`), or per token (`rate`), so training, which
asks "is a checkpoint due", and the plan, which asks "how many checkpoints does this run write", share one
definition. A new unit is a row of `_UNITS` (and, for a new dimension, a field of `Clock` and `Interval`).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields

KIB = 1024
AUTO = "auto"  # checkpoint.interval: chosen by the plan (phase1a/plan/interruptions.py)
MIB = 1024**2
GIB = 1024**3

# unit as written -> (dimension, how many of the dimension's base unit it is)
_UNITS: dict[str, tuple[str, float]] = {
    "s": ("seconds", 1), "sec": ("seconds", 1), "m": ("seconds", 60), "min": ("seconds", 60),
    "h": ("seconds", 3600), "hr": ("seconds", 3600),
    "step": ("steps", 1), "steps": ("steps", 1), "ba": ("steps", 1),
    "tok": ("tokens", 1), "tokens": ("tokens", 1),
    "ep": ("epochs", 1), "epoch": ("epochs", 1), "epochs": ("epochs", 1),
}
_SHOWN = {"seconds": "s", "steps": "steps", "tokens": "tok", "epochs": "ep"}  # how a dimension is written back
_WHOLE = {"steps", "tokens"}  # counted dimensions: no fractions
_TOKEN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]+)\s*$")


@dataclass(frozen=True)
class Clock:
    """Where a run is, in every dimension an interval can be written in."""

    seconds: float = 0.0
    steps: float = 0
    tokens: float = 0
    epochs: float = 0.0


@dataclass(frozen=True)
class Interval:
    """Fires when any of its limits (None: not limited in that dimension) is spent since the last firing."""

    seconds: float | None = None
    steps: int | None = None
    tokens: int | None = None
    epochs: float | None = None

    def _limits(self) -> list[tuple[str, float]]:
        return [(f.name, getattr(self, f.name)) for f in fields(self) if getattr(self, f.name) is not None]

    def due(self, since: Clock) -> bool:
        """Whether it fires, `since` the last firing."""
        return any(getattr(since, name) >= limit for name, limit in self._limits())

    def count(self, run: Clock) -> int:
        """Firings strictly before the end of a run this long: the last step's is replaced by the final save."""
        return max((max(0, math.ceil(getattr(run, name) / limit) - 1) for name, limit in self._limits()), default=0)

    def rate(self, per: Clock) -> float:
        """Firings per whatever `per` measures (e.g. per token: its seconds, steps and tokens a token)."""
        return max((getattr(per, name) / limit for name, limit in self._limits()), default=0.0)

    def __str__(self) -> str:
        return ",".join(f"{limit:g}{_SHOWN[name]}" for name, limit in self._limits()) or "never"


def parse_interval(text: str) -> Interval:
    """Parse "30m", "500steps" or "30m,500steps"; raise ValueError naming the bad part."""
    if text.strip().lower() in {"never", "none", "off"}:
        return Interval()
    limits: dict[str, float] = {}
    for part in text.split(","):
        match = _TOKEN.match(part.lower())
        if not match or match.group(2) not in _UNITS:
            raise ValueError(f"{part.strip()!r} is not a time unit; use e.g. '30m', '2h', '90s', '500steps', "
                             f"'2000000tok' or '0.5ep'")
        value, unit = match.groups()
        dimension, scale = _UNITS[unit]
        if dimension in _WHOLE:
            if "." in value:
                raise ValueError(f"{part.strip()!r}: a {dimension[:-1]} count must be a whole number")
            limits[dimension] = int(value) * int(scale)
        else:
            limits[dimension] = float(value) * scale
    return Interval(**limits)


def parse_duration_seconds(text: str) -> float:
    """A pure wall-time span such as "30m" or "12h"."""
    interval = parse_interval(text)
    if interval.seconds is None or interval != Interval(seconds=interval.seconds):
        raise ValueError(f"{text!r} must be a wall-time span such as '30m' or '12h'")
    return interval.seconds


def format_seconds(seconds: float | None) -> str:
    """A duration as a person reads it in a log line or a report: 12.4 s below two minutes, then 2 min 05 s,
    then 1 h 02 min; '-' for none."""
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f} s"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest:02d} s" if minutes < 120 else f"{minutes // 60} h {minutes % 60:02d} min"
