"""Progress of the long stages besides training: staging and promotion (bytes), tokenize (examples, tokens),
calibration (trials), validation (loss and generation batches). Training has its own (phase1a/train/progress.py).

    with stage_meter("tokenize", total=n, unit="examples") as meter:
        for chunk in chunks:
            meter.advance(len(chunk), tokens=chunk.tokens)

Where it shows (`progress` in the config, set once per process by `configure`):
- a terminal bar (tqdm) where stderr is a terminal (`display: auto` or `bar`);
- else one line at most every `progress.interval`, the first and the last always: done of total, the rate
  (MiB/s for bytes; examples/s and tokens/s for tokenize), the time left. Inside a Prefect run through the
  run's logger (the worker's log and the UI); outside one through the `phase1a` logger where logging shows
  INFO, else on stderr, so a bare host sees them too (phase1a/core/logs.py);
- inside a Prefect run, a progress artifact keyed `<stage>-progress`, updated at most every 10 s, its
  description the latest line.

Callers advance once per file chunk, chunk of records, batch or trial, never per example: a call is a lock, a
few additions and a clock read. Nothing here feeds back into what a stage computes, and a failing sink (the
Prefect API, say) is dropped rather than allowed to fail the stage. A meter with a total of 0 (nothing to
copy) shows nothing.
"""
from __future__ import annotations

import logging
import re
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol

from phase1a.core.logs import run_logger
from phase1a.core.units import GIB, KIB, MIB, format_seconds, parse_duration_seconds


class ProgressFields(Protocol):
    """What the meter reads of the config's `progress` section (phase1a/config/schema.py)."""

    display: str
    interval: str

ARTIFACT_EVERY_SECONDS = 10.0
_BAR_POSTFIX_EVERY_SECONDS = 0.5  # the bar's rates: formatted at most this often, not per advance


@dataclass(frozen=True)
class MeterSettings:
    display: str = "auto"  # auto: a bar on a terminal, else lines; bar; lines; off
    interval_seconds: float = 15.0  # between two log lines of one meter
    clock: Callable[[], float] = time.monotonic  # tests pass a fake one

    @classmethod
    def of(cls, progress: "ProgressFields") -> "MeterSettings":
        return cls(progress.display, parse_duration_seconds(progress.interval))


_settings = MeterSettings()


def configure(progress: "ProgressFields") -> None:
    """The process's meter settings, from the config's `progress` section (the flow sets them as it starts): a
    display preference, not part of any stage's inputs."""
    global _settings
    _settings = MeterSettings.of(progress)


@dataclass
class _Count:
    """What a meter has counted: `done` of `total` in `unit`, and named extras (tokens)."""

    unit: str
    total: float | None
    done: float = 0.0
    carried: float = 0.0  # done before the meter started (a resumed download): not part of the rate
    extras: dict[str, float] = field(default_factory=dict)


class Meter:
    """One stage's progress; `stage_meter` makes one and closes it."""

    def __init__(self, name: str, count: _Count, settings: MeterSettings, what: str = "") -> None:
        self.name, self.count, self.settings, self.what = name, count, settings, what
        self.clock = settings.clock
        self.began = self.line_at = self.artifact_at = self.postfix_at = self.clock()
        self.note_text = ""
        self.ends_by: float | None = None  # a budget's end on `clock`: the time left never reads past it
        self._lock = threading.Lock()
        self.active = count.total != 0
        display = resolved_display(settings)
        self.logger = run_logger()  # taken here: advances may come from threads outside the run's context
        self.bar = _bar(name, count) if self.active and display == "bar" else None
        self.lines = self.active and display == "lines"
        self.artifact = ProgressArtifact.create(name, self.describe()) if self.active else None
        if self.lines:
            self._emit(self.start_line())

    @property
    def total(self) -> float | None:
        return self.count.total

    @total.setter
    def total(self, value: float | None) -> None:
        """A better estimate of the total (tokenize learns a shard's count as it finishes it)."""
        with self._lock:
            self.count.total = value
            if self.bar is not None:
                self.bar.total = value
                self.bar.refresh()

    def advance(self, n: float = 1, **extras: float) -> None:
        """`n` more of the unit done, and of each named extra (tokens=...)."""
        with self._lock:
            self._add(n, extras)
            if self.bar is not None:
                self.bar.update(n)
            artifact_due = self._maybe_report()
        if artifact_due is not None:  # an HTTP call to Prefect's API: outside the lock the download threads share
            self.artifact.update(*artifact_due)

    def carry(self, n: float) -> None:
        """`n` done before this meter started (bytes an earlier attempt downloaded): counted, not in the rate."""
        with self._lock:
            self.count.carried += n
            self._add(n, {})
            if self.bar is not None:
                self.bar.update(n)

    def note(self, text: str) -> None:
        """What the stage is doing now ("trial 2 of 5: micro 4, ..."): logged at once, and on the bar."""
        with self._lock:
            self.note_text = text
            if self.bar is not None:
                self.bar.set_description_str(f"{self.name}: {text}")
            elif self.lines:
                self._emit(f"{self.name}: {text}")
                self.line_at = self.clock()

    def _add(self, n: float, extras: dict[str, float]) -> None:
        self.count.done += n
        for key, value in extras.items():
            self.count.extras[key] = self.count.extras.get(key, 0.0) + value

    def _maybe_report(self) -> tuple[float, str] | None:
        """Lines and the bar's rates when due; the artifact's update when due, for the caller to send."""
        now = self.clock()
        unfinished = self.count.total is None or self.count.done < self.count.total  # else the last line says it
        if self.lines and unfinished and now - self.line_at >= self.settings.interval_seconds:
            self._emit(self.describe(now))
            self.line_at = now
        if self.bar is not None and self.count.extras and now - self.postfix_at >= _BAR_POSTFIX_EVERY_SECONDS:
            self.bar.set_postfix_str(", ".join(_rates(self.count, now - self.began)[1:]), refresh=False)
            self.postfix_at = now
        if self.artifact is not None and now - self.artifact_at >= ARTIFACT_EVERY_SECONDS:
            self.artifact_at = now
            return self.percent(), self.describe(now)
        return None

    def percent(self) -> float:
        total = self.count.total
        return 0.0 if not total else min(100.0, 100.0 * self.count.done / total)

    # ---- the lines ----------------------------------------------------------------------------------------

    def start_line(self) -> str:
        parts = [] if self.count.total is None else [f"{_amount(self.count.total, self.count.unit)} to do"]
        return f"{self.name}: " + ("; ".join(parts + [self.what] if self.what else parts) or "started")

    def describe(self, now: float | None = None) -> str:
        """e.g. `tokenize: 200 of 1,000 examples (20.0 %), 20.0 examples/s, 400 tokens/s, 40s left`."""
        count = self.count
        elapsed = (self.clock() if now is None else now) - self.began
        done = _amount(count.done, count.unit, with_unit=count.total is None)
        if count.total is not None:
            done += f" of {_amount(count.total, count.unit)} ({self.percent():.1f} %)"
        parts = [done, *_rates(count, elapsed)]
        rate = (count.done - count.carried) / elapsed if elapsed > 0 else 0.0
        if count.total is not None and rate > 0:
            left = (count.total - count.done) / rate
            if self.ends_by is not None:
                left = min(left, self.ends_by - (self.clock() if now is None else now))
            parts.append(f"{format_seconds(max(0.0, left))} left")
        line = f"{self.name}: " + ", ".join(parts)
        return f"{line}; {self.note_text}" if self.note_text else line

    def final_line(self, finished: bool) -> str:
        count, elapsed = self.count, self.clock() - self.began
        summary = f"{_amount(count.done, count.unit)} in {format_seconds(elapsed)}"
        extras = ", ".join(f"{_number(value)} {key}" for key, value in count.extras.items())
        rates = ", ".join(_rates(count, elapsed))
        details = "; ".join(part for part in (extras, rates) if part)
        return f"{self.name}: {'' if finished else 'stopped after '}{summary}" + (f" ({details})" if details else "")

    def close(self, finished: bool) -> None:
        if not self.active:
            return
        with self._lock:
            if self.bar is not None:
                self.bar.close()
            if self.settings.display != "off":
                self._emit(self.final_line(finished))
            if self.artifact is not None:
                self.artifact.update(100.0 if finished else self.percent(), self.final_line(finished))

    def _emit(self, line: str) -> None:
        emit(self.logger, line)


def current_settings() -> MeterSettings:
    """The process's settings (`configure`); training's progress (phase1a/train/progress.py) shows by them too."""
    return _settings


def resolved_display(settings: MeterSettings) -> str:
    """bar, lines or off: `auto` is a bar where stderr is a terminal, else lines (a worker's log)."""
    return settings.display if settings.display != "auto" else ("bar" if _is_terminal() else "lines")


def emit(logger: logging.Logger | logging.LoggerAdapter, line: str) -> None:
    """One progress line through `logger` (phase1a.core.logs.run_logger: the Prefect run's inside a run)."""
    if isinstance(logger, logging.LoggerAdapter) or logger.isEnabledFor(logging.INFO):
        logger.info("%s", line)
    else:  # no logging set up to show INFO (a bare host, a script): the line must still be seen
        print(line, file=sys.stderr, flush=True)


@contextmanager
def stage_meter(name: str, total: float | None = None, unit: str = "items", *, what: str = "",
                settings: MeterSettings | None = None) -> Iterator[Meter]:
    """A meter for one stage (or one part of it): `total` in `unit` ("bytes" shows MiB and MiB/s), None when
    unknown (no percentage, no time left); `what` says more in the first line. Closed with a last line."""
    meter = Meter(name, _Count(unit, total), settings or _settings, what)
    try:
        yield meter
    except BaseException:
        meter.close(finished=False)
        raise
    meter.close(finished=True)


# ---- formatting ---------------------------------------------------------------------------------------------

def _number(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 or float(value).is_integer() else f"{value:,.1f}"


def _bytes(value: float) -> str:
    for size, name in ((GIB, "GiB"), (MIB, "MiB"), (KIB, "KiB")):
        if value >= size:
            return f"{value / size:.1f} {name}"
    return f"{value:.0f} B"


def _amount(value: float, unit: str, with_unit: bool = True) -> str:
    if unit == "bytes":
        return _bytes(value)
    if not with_unit:
        return _number(value)
    if value == 1:  # "1 batch to do", not "1 batches"
        unit = unit[:-2] if unit.endswith(("ches", "shes", "sses")) else unit.removesuffix("s")
    return f"{_number(value)} {unit}"


def _rates(count: _Count, elapsed: float) -> list[str]:
    """The unit's rate, then each extra's, over the time since the meter started; none before any time passed."""
    if elapsed <= 0:
        return []
    own = (count.done - count.carried) / elapsed
    first = f"{_bytes(own)}/s" if count.unit == "bytes" else f"{_number(own)} {count.unit}/s"
    return [first, *(f"{_number(value / elapsed)} {key}/s" for key, value in count.extras.items())]


# ---- the sinks ----------------------------------------------------------------------------------------------

def _is_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stderr
        return False


def _bar(name: str, count: _Count):
    try:
        from tqdm.auto import tqdm
    except ImportError:  # no tqdm: no bar; the last line still comes
        return None
    in_bytes = count.unit == "bytes"
    return tqdm(total=count.total, desc=name, unit="B" if in_bytes else f" {count.unit}", unit_scale=in_bytes,
                unit_divisor=KIB if in_bytes else 1000, leave=False, dynamic_ncols=True, file=sys.stderr)


def artifact_key(name: str) -> str:
    """A Prefect artifact key (lowercase letters, digits, dashes) from a meter's name."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") + "-progress"


class ProgressArtifact:
    """A Prefect progress artifact, inside a Prefect run only; dropped at its first failure."""

    def __init__(self, artifact_id) -> None:
        self.id = artifact_id

    @classmethod
    def create(cls, name: str, description: str) -> "ProgressArtifact | None":
        try:
            from prefect.artifacts import create_progress_artifact
            from prefect.context import get_run_context

            get_run_context()
        except Exception:  # no Prefect (a bare GPU host) or no run (a test, a script): no artifact
            return None
        try:
            return cls(create_progress_artifact(0.0, key=artifact_key(name), description=description))
        except Exception as error:  # the API is unreachable: the stage goes on without it
            logging.getLogger("phase1a").debug("progress artifact for %s: %s", name, error)
            return None

    def update(self, percent: float, description: str) -> None:
        if self.id is None:
            return
        try:
            from prefect.artifacts import update_progress_artifact

            update_progress_artifact(self.id, progress=percent, description=description)
        except Exception as error:
            logging.getLogger("phase1a").debug("progress artifact update: %s", error)
            self.id = None
