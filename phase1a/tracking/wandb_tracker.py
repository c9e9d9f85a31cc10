"""A Weights & Biases run, named as transformers' WandbCallback names things: per-step values as `train/<key>`
and `eval/<key>` against `train/global_step` (the optimizer step), the config nested as it is.

wandb reads WANDB_API_KEY (or the `wandb login` netrc), WANDB_MODE, WANDB_PROJECT, WANDB_ENTITY and WANDB_DIR
itself; the settings here only override them. Each flow run gets a run of its own (`reinit="create_new"`), so
several flow runs in one process do not share one."""
from __future__ import annotations

import os
from pathlib import Path

import wandb

from phase1a.config.schema import WandbSettings
from phase1a.run_report import RunOutcome
from phase1a.tracking.base import TrackedRun, Tracker

STEP = "train/global_step"


class WandbTracker(Tracker):
    name = "wandb"

    def __init__(self, settings: WandbSettings, context: TrackedRun) -> None:
        self.job, self.links = context.job, context.tags
        directory = Path(settings.dir or os.environ.get("WANDB_DIR") or context.run_dir)
        directory.mkdir(parents=True, exist_ok=True)
        # console "off": the flow's own output stays unwrapped; it reaches Prefect's logs.
        self.run = wandb.init(
            project=settings.project or os.environ.get("WANDB_PROJECT") or context.job, entity=settings.entity,
            mode=settings.mode, dir=str(directory), name=context.run_name, tags=settings.tags or None,
            notes=context.tags.get("prefect.flow_run_url"), reinit="create_new",
            config={**context.params, "prefect": context.tags}, settings=wandb.Settings(console="off"))
        self.run.define_metric(STEP)
        self.run.define_metric("*", step_metric=STEP, step_sync=True)

    def log_params(self, params: dict) -> None:
        self.run.config.update(params, allow_val_change=True)

    def log_metrics(self, source: str, rows: list[tuple[int, dict[str, float]]]) -> None:
        for step, values in rows:
            named = {(f"train/{key}" if source == "train" else f"eval/{key.removeprefix('eval_')}"): value
                     for key, value in values.items()}
            self.run.log({**named, STEP: step})

    def log_summary(self, values: dict[str, float | str]) -> None:
        self.run.summary.update(values)

    def log_table(self, name: str, rows: list[dict]) -> None:
        columns = list(rows[0]) if rows else []
        self.run.log({name: wandb.Table(columns=columns, data=[[row.get(key) for key in columns] for row in rows])})

    def log_text(self, name: str, text: str) -> None:
        self.run.summary[f"{Path(name).stem}_text"] = text  # gate.txt: `gate_text`, beside the verdict `gate`

    def log_images(self, paths: list[Path]) -> None:
        if paths:
            self.run.log({f"plots/{path.stem}": wandb.Image(str(path)) for path in paths})

    def log_directory(self, path: Path, name: str) -> None:
        """A `model` artifact `<job>-<name>`: W&B versions it (v0, v1, ...) across the job's runs."""
        artifact = wandb.Artifact(f"{self.job}-{name}", type="model", metadata={"prefect": self.links})
        artifact.add_dir(str(path))
        self.run.log_artifact(artifact)

    def finish(self, outcome: RunOutcome) -> None:
        # W&B has no "killed" for a finished call: a preempted run ends as a process ended by SIGTERM would.
        self.run.finish(exit_code={"failed": 1, "preempted": 128 + 15}.get(outcome, 0))

    def reference(self) -> dict:
        if self.run.offline:  # no page until `wandb sync DIR` uploads it
            return {"run_id": self.run.id, "dir": str(Path(self.run.dir).parent)}
        return {"run_id": self.run.id, "url": self.run.url}
