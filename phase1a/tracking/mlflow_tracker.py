"""An MLflow run through `MlflowClient` (no fluent API: no process-wide active run, so several flow runs in one
process, and the thread that follows training, each hold their own run).

Names as transformers' MLflowCallback gives them: params flattened with dots (`config.method.lora.r`,
`plan.micro_batch_size`), per-step metrics under their own names (`loss`, `lr`, `grad_norm`, `tokens_per_s`,
`mfu`, `peak_memory_gib`, `eval_loss`, ...) by optimizer step. Plots go under `plots/`, the adapter under
`adapter/`. The client reads MLFLOW_TRACKING_URI and the credentials (MLFLOW_TRACKING_TOKEN, or USERNAME and
PASSWORD) from the environment itself, and retries transient HTTP errors (MLFLOW_HTTP_REQUEST_MAX_RETRIES)."""
from __future__ import annotations

import os
import time
from pathlib import Path

from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from mlflow.utils.validation import MAX_METRICS_PER_BATCH, MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

from phase1a.config.schema import MlflowSettings
from phase1a.core.redaction import redact
from phase1a.run_report import RunOutcome
from phase1a.tracking.base import TrackedRun, Tracker, flatten


class MlflowTracker(Tracker):
    name = "mlflow"

    def __init__(self, settings: MlflowSettings, context: TrackedRun) -> None:
        self.client = MlflowClient(settings.tracking_uri)  # None: MLFLOW_TRACKING_URI, else MLflow's default
        experiment = settings.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or context.job
        self.experiment_id = _experiment_id(self.client, experiment)
        run = self.client.create_run(self.experiment_id, run_name=settings.run_name or context.run_name,
                                     tags={**context.tags, **settings.tags})
        self.run_id = run.info.run_id
        self.log_params(context.params)

    def log_params(self, params: dict) -> None:
        # MLflow keeps a param's first value and caps its length; the runs' params are never re-logged.
        items = [Param(key, value[:MAX_PARAM_VAL_LENGTH]) for key, value in flatten(params).items()]
        for start in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, params=items[start:start + MAX_PARAMS_TAGS_PER_BATCH])

    def log_metrics(self, source: str, rows: list[tuple[int, dict[str, float]]]) -> None:
        now = int(time.time() * 1000)
        items = [Metric(key, value, now, step) for step, values in rows for key, value in values.items()]
        for start in range(0, len(items), MAX_METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=items[start:start + MAX_METRICS_PER_BATCH])

    def log_summary(self, values: dict[str, float | str]) -> None:
        now = int(time.time() * 1000)
        metrics = [Metric(key, float(value), now, 0) for key, value in values.items() if not isinstance(value, str)]
        tags = [RunTag(key, value) for key, value in values.items() if isinstance(value, str)]
        self.client.log_batch(self.run_id, metrics=metrics, tags=tags)

    def log_table(self, name: str, rows: list[dict]) -> None:
        columns = {key: [row.get(key) for row in rows] for key in rows[0]} if rows else {}
        self.client.log_table(self.run_id, data=columns, artifact_file=f"{name}.json")

    def log_text(self, name: str, text: str) -> None:
        self.client.log_text(self.run_id, text, name)

    def log_images(self, paths: list[Path]) -> None:
        for path in paths:
            self.client.log_artifact(self.run_id, str(path), "plots")

    def log_directory(self, path: Path, name: str) -> None:
        self.client.log_artifacts(self.run_id, str(path), name)

    def finish(self, outcome: RunOutcome) -> None:
        self.client.set_terminated(self.run_id, {"failed": "FAILED", "preempted": "KILLED"}.get(outcome, "FINISHED"))

    def reference(self) -> dict:
        uri = redact(self.client.tracking_uri)
        url = (f"{uri.rstrip('/')}/#/experiments/{self.experiment_id}/runs/{self.run_id}"
               if uri.startswith(("http://", "https://")) else None)  # a local store has no web page of its own
        return {"run_id": self.run_id, "url": url, "tracking_uri": uri, "experiment_id": self.experiment_id}


def _experiment_id(client: MlflowClient, name: str) -> str:
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    try:
        return client.create_experiment(name)
    except MlflowException:  # another run created it since: use theirs
        return client.get_experiment_by_name(name).experiment_id
