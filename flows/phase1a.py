"""The phase1a flow: stage -> tokenize -> plan -> train -> validate -> promote, one Prefect task each.

Each stage takes the config and the results it builds on, and derives its own cache key from them (tasks/);
the flow is the graph, and the run report (flows/report.py) records each stage as it ends.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.runtime import flow_run

from flows.report import RunReport
from flows.report_md import publish_length_report
from flows.tracking import RunTracking
from phase1a.config.schema import Phase1aConfig, config_from
from phase1a.config.stores import open_store
from phase1a.core.meter import configure as configure_progress
from phase1a.model.loading import prepare_model
from phase1a.promote.replay import warm_start_data
from phase1a.promote.warmstart import lineage, resolve_start
from phase1a.results import Plan, TrainResult, interruptions_vs_actual
from tasks.caching import kept_in, store_records, with_retries
from tasks.plan import format_plan, plan_task, publish_plan
from tasks.promote import promote_task
from tasks.stage import stage_task
from tasks.tokenize import tokenize_task
from tasks.train import train_task
from tasks.validate import format_table, publish_validation, validate_task, validation_section


class GateFailed(RuntimeError):
    pass


@dataclass(frozen=True)
class _Stages:
    """The stage tasks as this run runs them: those that cross the network retried on transient errors
    (config.retries), the cached ones keeping their records in the store when there is one (every host finds
    them)."""

    stage: Any
    tokenize: Any
    plan: Any
    validate: Any
    promote: Any

    @classmethod
    def of(cls, config: Phase1aConfig) -> "_Stages":
        store = open_store(config.store)
        if store is not None:  # one that cannot be used fails the run now, not at training
            store.probe()
        records = store_records(config.store)
        return cls(stage=kept_in(with_retries(stage_task, config.retries), records),
                   tokenize=kept_in(tokenize_task, records), plan=kept_in(plan_task, records),
                   validate=kept_in(validate_task, records), promote=with_retries(promote_task, config.retries))


def _compare_training(report: RunReport, plan: Plan, trained: TrainResult) -> None:
    """The plan against the training run: its time (the history line it appended), its interruptions."""
    if trained.recorded is not None:
        report.set("estimate_vs_actual", trained.recorded.model_dump(mode="json"))
    report.set("interruptions_vs_actual", interruptions_vs_actual(plan, trained))


@flow(name="phase1a")
def phase1a(config: Phase1aConfig | None = None, config_file: str | None = None, overrides: list[str] | None = None,
            plan_only: bool = False) -> str:
    """Returns the path of the run's report.json. A bad config fails the run before any stage.

    Args:
        config: The whole config. Give this or config_file.
        config_file: A YAML config file, e.g. configs/h100.yaml, relative to the project root; its own relative
            paths are relative to the file. Give this or config.
        overrides: `key.sub=value` strings applied on top, as the CLI's --set, e.g. method.epochs=2.
        plan_only: Stop after the plan: no training.
    """
    # Deployment parameters arrive with `~` and relative paths: they resolve against the working directory.
    config = config_from(config, config_file, overrides, base=Path.cwd())
    configure_progress(config.progress)  # how the stages show progress: a bar, log lines (a worker), or neither
    report = RunReport.create(config, flow_run.get_name() or "local")
    with report.finishing() as outcome:
        tracking = RunTracking.start(config, report)  # MLflow / W&B when configured: finishes as the report closes
        model = prepare_model(config)
        start = resolve_start(config, model)  # before any stage: a missing or mismatched adapter fails in seconds
        report.set("lineage", lineage(start))
        stages = _Stages.of(config)
        staged = report.run("stage", stages.stage, config=config)
        held_out = (report.run("stage_validation", stages.stage, config=config, field="validation_source")
                    if config.data.validation_source else None)
        data = report.run("tokenize", stages.tokenize, config=config, model=model, staged=staged, held_out=held_out)
        publish_length_report(data, report.run_dir)
        data = warm_start_data(data, start, config.data.replay_fraction, config.method.seed)
        if data.replay:
            report.set("replay", data.replay)

        plan = report.run("plan", stages.plan, config=config, model=model, data=data)
        publish_plan(plan, report.run_dir)
        print(format_plan(plan))
        if plan_only:
            outcome.status = "planned"
            return str(report.path)

        trained = tracking.followed("train", train_task, config=config, model=model, data=data, plan=plan, start=start)
        _compare_training(report, plan, trained)

        verdict = report.run("validate", stages.validate, config=config, model=model, data=data, trained=trained)
        report.compare("validation_estimate_vs_actual", "validate", plan.estimate.evaluation_seconds,
                       base_cached=verdict.base_cached)
        report.set("validation", validation_section(verdict))
        publish_validation(verdict, report.run_dir)
        print(format_table(verdict))
        if not verdict.passed:
            raise GateFailed(f"validation gate failed against {verdict.baseline.source}: " + "; ".join(verdict.reasons))

        if config.validation.promote_to:  # only a pass gets here: a failed gate never moves the pointer
            promotion = report.run("promote", stages.promote, config=config, model=model, verdict=verdict,
                                   trained=trained, run_dir=str(report.run_dir))
            report.set("validation", validation_section(verdict, promotion))
            report.set("lineage", lineage(start, promotion))
            print(f"promoted: {promotion.pointer.version} at {promotion.pointer.path}"
                  + ("" if promotion.promoted else " (already the promoted model)"))
        outcome.status = "passed"
    return str(report.path)
