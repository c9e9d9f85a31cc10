"""The run's trackers as one: each call goes to every tracker that is up. A tracker that fails (its server went
down, a bad key) is a warning, never the run's failure: it is marked down, later calls skip it, and the
per-step values it did not get are counted (`dropped_metrics` in its report section). MLflow's client and
wandb already retry transient network errors, so one failure means the tracker is gone for this run."""
from __future__ import annotations

import importlib.util
import os
import threading
from pathlib import Path
from typing import Callable

from phase1a.config.schema import ConfigError, TrackingConfig
from phase1a.core.logs import run_logger
from phase1a.core.redaction import redact
from phase1a.run_report import RunOutcome
from phase1a.tracking.base import TrackedRun, Tracker, metric_values

INSTALL = "pip install 'phase1a[tracking]' (in this project: make setup, which installs the dev group)"


def wanted(settings: TrackingConfig) -> list[str]:
    """The trackers this config turns on: a section given, and for wandb a mode other than disabled."""
    names = ["mlflow"] if settings.mlflow is not None else []
    if settings.wandb is not None and (settings.wandb.mode or os.environ.get("WANDB_MODE")) != "disabled":
        names.append("wandb")
    return names


def require_packages(settings: TrackingConfig) -> None:
    """Fail before any stage when a tracker the config asks for is not installed."""
    missing = [name for name in wanted(settings) if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError("; ".join(f"tracking.{name}: the {name} package is not installed" for name in missing)
                          + f": {INSTALL}, or remove the section")


class Trackers:
    def __init__(self) -> None:
        self.up: dict[str, Tracker] = {}
        self.sections: dict[str, dict] = {}  # report.json's `tracking`: each tracker's reference and health
        self.log = run_logger()  # taken on the flow's thread: the thread that follows training has no run context
        self._lock = threading.Lock()  # the flow's thread and the follower's never interleave calls

    @classmethod
    def start(cls, settings: TrackingConfig, context: TrackedRun) -> "Trackers":
        trackers = cls()
        for name in wanted(settings):
            section = trackers.sections[name] = {"run_id": None, "dropped_metrics": 0, "errors": []}
            try:
                tracker = _open(name, settings, context)
            except Exception as error:  # a tracker that cannot start is reported; the run goes on
                trackers._failed(name, "start", error)
                continue
            trackers.up[name] = tracker
            section.update(tracker.reference())
        return trackers

    def log_params(self, params: dict) -> None:
        self._each("params", lambda tracker: tracker.log_params(params))

    def log_records(self, source: str, records: list[dict]) -> None:
        rows = [(record["step"], values) for record in records if (values := metric_values(source, record))]
        self._each("metrics", lambda tracker: tracker.log_metrics(source, rows), sum(len(v) for _, v in rows))

    def log_summary(self, values: dict[str, float | str]) -> None:
        self._each("summary", lambda tracker: tracker.log_summary(values))

    def log_table(self, name: str, rows: list[dict]) -> None:
        self._each(name, lambda tracker: tracker.log_table(name, rows))

    def log_text(self, name: str, text: str) -> None:
        self._each(name, lambda tracker: tracker.log_text(name, text))

    def log_images(self, paths: list[Path]) -> None:
        self._each("images", lambda tracker: tracker.log_images(paths))

    def log_directory(self, path: Path, name: str, names: list[str]) -> None:
        """To the trackers in `names` only: a directory's upload is each tracker's own choice."""
        if names:
            self._each(name, lambda tracker: tracker.log_directory(path, name), names=names)

    def finish(self, outcome: RunOutcome) -> None:
        self._each("finish", lambda tracker: tracker.finish(outcome))

    def _each(self, what: str, call: Callable[[Tracker], None], metrics: int = 0,
              names: list[str] | None = None) -> None:
        with self._lock:
            for name in names or list(self.sections):
                if name not in self.sections:
                    continue
                if name not in self.up:
                    self.sections[name]["dropped_metrics"] += metrics
                    continue
                try:
                    call(self.up[name])
                except Exception as error:  # tracking never fails the run
                    self._failed(name, what, error)
                    self.sections[name]["dropped_metrics"] += metrics

    def _failed(self, name: str, what: str, error: BaseException) -> None:
        self.up.pop(name, None)
        message = redact(f"{what}: {type(error).__name__}: {error}")[:2000]  # a URL's user-info never reaches a log
        self.sections[name]["errors"].append(message)
        self.log.warning("tracking: %s failed, left out for the rest of this run (%s)", name, message)


def _open(name: str, settings: TrackingConfig, context: TrackedRun) -> Tracker:
    """The tracker's module is imported only when it is used: neither package is a dependency of the run."""
    if name == "mlflow":
        from phase1a.tracking.mlflow_tracker import MlflowTracker

        return MlflowTracker(settings.mlflow, context)
    from phase1a.tracking.wandb_tracker import WandbTracker

    return WandbTracker(settings.wandb, context)
