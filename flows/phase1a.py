"""The phase1a flow: model -> start -> stage -> tokenize (-> replay) -> plan -> train -> validate -> gate ->
promote, one Prefect task each.

Each stage takes the config and the results it builds on, and derives its own cache key from them (tasks/);
the flow is the graph, and the run report (flows/report.py) records each stage as it ends and shows what it
presents (its artifacts and printed summary), whether its result was computed or cached.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.runtime import flow_run

from flows.report import ReportWriter
from flows.report_md import publish_length_report
from flows.tracking import RunTracking
from phase1a.config.schema import Phase1aConfig, config_from
from phase1a.config.stores import open_store
from phase1a.core.meter import configure as configure_progress
from phase1a.evaluate.present import present_validation
from phase1a.plan.present import present_plan
from phase1a.plan.result import Plan
from phase1a.promote.card import RunFacts
from phase1a.run_report import Lineage, ValidationSection, interruptions_vs_actual, promoted_line
from phase1a.train.result import TrainResult
from tasks.caching import kept_in, store_records, with_retries
from tasks.model import model_task
from tasks.plan import plan_task
from tasks.promote import promote_task
from tasks.stage import stage_task
from tasks.start import replay_task, start_task
from tasks.tokenize import tokenize_task
from tasks.train import train_task
from tasks.validate import validate_task


class GateFailed(RuntimeError):
    pass


@dataclass(frozen=True)
class _Stages:
    """The stage tasks as this run runs them: those that cross the network retried on transient errors
    (config.retries), the cached ones keeping their records in the store when there is one (every host finds
    them)."""

    model: Any
    start: Any
    stage: Any
    tokenize: Any
    replay: Any
    plan: Any
    validate: Any
    promote: Any

    @classmethod
    def of(cls, config: Phase1aConfig) -> "_Stages":
        store = open_store(config.store)
        if store is not None:  # one that cannot be used fails the run now, not at training
            store.probe()
        records, retried = store_records(config.store), lambda stage: with_retries(stage, config.retries)
        return cls(model=retried(model_task), start=retried(start_task),
                   stage=kept_in(retried(stage_task), records), tokenize=kept_in(tokenize_task, records),
                   replay=replay_task, plan=kept_in(plan_task, records), validate=kept_in(validate_task, records),
                   promote=retried(promote_task))


def _compare_training(report: ReportWriter, plan: Plan, trained: TrainResult) -> None:
    """The plan against the training run: its time (the history line it appended), its interruptions."""
    report.data.estimate_vs_actual = trained.recorded
    report.data.interruptions_vs_actual = interruptions_vs_actual(plan, trained)


@flow(name="phase1a")
def phase1a(config: Phase1aConfig | None = None, config_file: str | None = None, overrides: list[str] | None = None,
            plan_only: bool = False) -> str:
    """Returns the path of the run's report.json. A bad config fails the run before any stage.

    Args:
        config: The whole config. Give this or config_file.
        config_file: A YAML config file, e.g. configs/h100.yaml, relative to the project root; its own relative
            paths are relative to the file. Or its URL, s3://bucket/key.yaml or hf://[datasets/]org/name/path.yaml,
            whose relative paths are relative to the working directory. Give this or config.
        overrides: `key.sub=value` strings applied on top, as the CLI's --set, e.g. method.epochs=2.
        plan_only: Stop after the plan: no training.
    """
    # Deployment parameters arrive with `~` and relative paths: they resolve against the working directory.
    config = config_from(config, config_file, overrides, base=Path.cwd())
    configure_progress(config.progress)  # how the stages show progress: a bar, log lines (a worker), or neither
    report = ReportWriter.create(config, flow_run.get_name() or "local")
    with report.finishing() as outcome:
        tracking = RunTracking.start(config, report)  # MLflow / W&B when configured: finishes as the report closes
        stages = _Stages.of(config)
        model = report.run("model", stages.model, config=config)
        # Before any long stage: a missing or mismatched adapter fails in seconds.
        start = report.run("start", stages.start, config=config, model=model)
        report.data.lineage = Lineage.of(start)
        staged = report.run("stage", stages.stage, config=config)
        held_out = (report.run("stage_validation", stages.stage, config=config, field="validation_source")
                    if config.data.validation_source else None)
        data = report.run("tokenize", stages.tokenize, present=publish_length_report, config=config, model=model,
                          staged=staged, held_out=held_out)
        if config.method.replay_fraction is not None and start.kind != "base":
            data = report.run("replay", stages.replay, config=config, data=data, start=start)
            report.data.replay = data.replay

        plan = report.run("plan", stages.plan, present=present_plan, config=config, model=model, data=data)
        if plan_only:
            outcome.status = "planned"
            return str(report.path)

        trained = tracking.followed("train", train_task, config=config, model=model, data=data, plan=plan, start=start)
        _compare_training(report, plan, trained)

        verdict = report.run("validate", stages.validate, present=present_validation, config=config, model=model,
                             data=data, trained=trained)
        seconds, stated = plan.estimate.evaluation_for(verdict.base_cached)
        report.data.validation_estimate_vs_actual = report.estimate_of(
            "validate", seconds, base_cached=verdict.base_cached, low_seconds=stated and stated[0],
            high_seconds=stated and stated[1])
        report.data.validation = ValidationSection.of(verdict)
        if not verdict.passed:
            raise GateFailed(f"validation gate failed against {verdict.baseline.source}: " + "; ".join(verdict.reasons))

        if config.promotion.to:  # only a pass gets here: a failed gate never moves the pointer
            context = RunFacts(config=report.data.config, data=data, plan=plan, flow_run=report.data.flow_run)
            promotion = report.run("promote", stages.promote, config=config, model=model, verdict=verdict,
                                   trained=trained, run_dir=str(report.run_dir), run=context)
            report.data.validation = ValidationSection.of(verdict, promotion)
            report.data.lineage = Lineage.of(start, promotion)
            print(promoted_line(promotion.pointer.version, promotion.pointer.path, promotion.promoted))
        outcome.status = "passed"
    return str(report.path)
