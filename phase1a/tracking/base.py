"""What every tracker does (`Tracker`), what a run starts from (`TrackedRun`), and the shared naming: flattened
params and per-step metric names."""
from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from phase1a.run_report import RunOutcome


def flatten(tree: dict, prefix: str = "") -> dict[str, str]:
    """{'method': {'lora': {'r': 16}}} -> {'method.lora.r': '16'}; lists and nulls as JSON."""
    flat: dict[str, str] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value if isinstance(value, str) else json.dumps(value)
    return flat


def metric_values(source: str, record: dict) -> dict[str, float]:
    """A record of `metrics.jsonl` (source "train") or `eval.jsonl` (source "eval") as flat metric names, as
    transformers' MLflowCallback names them: `loss`, `lr`, ... and `eval_loss`, `eval_token_accuracy`, ...
    Numbers only: the step is the x axis, booleans and nulls are left out."""
    values = {}
    for key, value in record.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        values[key if source == "train" or key.startswith("eval_") else f"eval_{key}"] = float(value)
    return values


@dataclass
class TrackedRun:
    """What a tracker's run starts with."""

    job: str  # the config's `name`: the default experiment or project
    run_name: str  # the Prefect flow run's name
    run_dir: Path  # where report.json and the plots are
    params: dict  # nested: {"config": the resolved config}; credentials already cut out of URLs
    tags: dict[str, str] = field(default_factory=dict)  # links back to the Prefect flow run


class Tracker(ABC):
    """One run in one tracking system. Methods raise on failure; `Trackers` (trackers.py) turns a failure into
    a warning, so a tracker never fails a training run."""

    name: str

    @abstractmethod
    def log_params(self, params: dict) -> None:
        """Nested params, e.g. {"plan": {...}}, added to those the run started with."""

    @abstractmethod
    def log_metrics(self, source: str, rows: list[tuple[int, dict[str, float]]]) -> None:
        """Per-step values, in step order: `source` "train" (metrics.jsonl) or "eval" (eval.jsonl)."""

    @abstractmethod
    def log_summary(self, values: dict[str, float | str]) -> None:
        """Once-per-run values: numbers (final metrics) and words (the gate's verdict)."""

    @abstractmethod
    def log_table(self, name: str, rows: list[dict]) -> None:
        """Rows with the same keys, e.g. the validation table."""

    @abstractmethod
    def log_text(self, name: str, text: str) -> None:
        """A short text file, e.g. the gate's verdict and reasons."""

    @abstractmethod
    def log_images(self, paths: list[Path]) -> None:
        """PNG files, e.g. the run directory's plots."""

    def log_directory(self, path: Path, name: str) -> None:
        """A directory as an artifact (the adapter); a tracker that does not keep files ignores it."""

    @abstractmethod
    def finish(self, outcome: RunOutcome) -> None:
        """End the run as the flow run ended: passed or planned (finished), failed, or preempted (stopped at a
        checkpoint by a signal, for the next run to resume)."""

    @abstractmethod
    def reference(self) -> dict:
        """Where the run is: {"run_id", "url"} (url None where there is no web page), or {"run_id", "dir"}."""
