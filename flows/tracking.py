"""The flow's experiment tracking (phase1a/tracking/, docs/tracking.md). The trackers' runs mirror the run's
report: what they log beyond the per-step metrics is read from report.json's sections as the flow fills them.

  started     the trackers' runs, once the config resolves: the config as params, tags that link back to the
              Prefect flow run, a Prefect link artifact forward to each run's page, report.json's `tracking`
  followed    the train stage (`report.run`): the plan's knobs as params, then the train directory's
              metrics.jsonl and eval.jsonl handed on every few seconds while it trains, then its totals
  the end     the plan's knobs if no training logged them (a plan-only run), the validation table, the gate's
              verdict and base/baseline/candidate metrics, every plot in the run directory, the adapter
              (an MLflow artifact, a W&B model artifact), and the outcome: finished, failed (whatever failed the run),
              or killed when a signal preempted training (MLflow's KILLED; W&B's exit code 143)

The flow's process owns the runs: training may be other processes (torchrun ranks), so it is followed
through its files. A tracker that fails is a warning in the run's log and its report section, never the
run's failure."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect.runtime import flow_run
from prefect.settings import PREFECT_UI_URL

from flows.report import ReportWriter
from phase1a.config.schema import Phase1aConfig
from phase1a.evaluate.present import format_table
from phase1a.evaluate.result import ValidationResult
from phase1a.plan.result import Plan
from phase1a.plan.training import training_dir
from phase1a.run_report import RunOutcome, ValidationSection
from phase1a.tracking import Follower, TrackedRun, Trackers, redacted, require_packages, wanted
from phase1a.train.result import TrainResult

# What the plan's params leave out: nested detail that is in plan.json (an artifact of the flow run).
PLAN_DETAIL = {"model", "memory", "estimate", "calibration", "options", "adjustments", "notes"}


class RunTracking:
    def __init__(self, config: Phase1aConfig, report: ReportWriter, trackers: Trackers) -> None:
        self.config, self.report, self.trackers = config, report, trackers
        self.plan_logged, self.adapter_dir = False, None

    @classmethod
    def start(cls, config: Phase1aConfig, report: ReportWriter) -> "RunTracking":
        """A tracker the config asks for but that is not installed fails here, before any stage. The trackers
        finish as the report closes: after the plots are drawn (they log them), before report.json is written
        (it records their sections)."""
        require_packages(config.tracking)
        context = run_context(config, report.run_dir)
        trackers = Trackers.start(config.tracking, context) if wanted(config.tracking) else Trackers()
        tracking = cls(config, report, trackers)
        tracking._announce()
        report.on_closing(tracking._finish)
        return tracking

    def followed(self, stage: str, task: Any, **inputs: Any) -> TrainResult:
        """`report.run(stage, task, **inputs)` for the train stage, with the directory the stage derives from the
        same inputs followed while it trains; the adapter it wrote is kept for the end."""
        if not self.trackers.sections:
            return self.report.run(stage, task, **inputs)
        self._log_plan(inputs["plan"].model_dump(mode="json"))
        output_dir = training_dir(**inputs)

        def unreadable(error: BaseException) -> None:
            self.trackers.log.warning("tracking: reading %s: %s", output_dir, error)

        with Follower(output_dir, self.trackers.log_records, on_error=unreadable):
            trained = self.report.run(stage, task, **inputs)
        totals = {"train_wall_seconds": trained.wall_seconds, "train_tokens_per_second": trained.tokens_per_second,
                  "train_final_loss": trained.final_loss, "train_mean_mfu": trained.mean_mfu,
                  "train_best_step": trained.best_step, "train_stopped_at_step": trained.stopped_at_step}
        self.trackers.log_summary({key: value for key, value in totals.items() if value is not None})
        self.adapter_dir = trained.adapter_dir
        return trained

    def _log_plan(self, plan: dict) -> None:
        if not self.plan_logged:
            self.trackers.log_params({"plan": {k: v for k, v in plan.items() if k not in PLAN_DETAIL}})
            self.plan_logged = True

    def _log_validation(self, section: ValidationSection, verdict: ValidationResult) -> None:
        """report.json's `validation` section: the table, the verdict, each model's metrics, the promotion."""
        rows = {name: row.model_dump() for name, row in section.metrics.items()}
        self.trackers.log_table("validation", [{"metric": name, **row} for name, row in rows.items()])
        values: dict[str, float | str] = {"gate": section.verdict}
        for name, row in rows.items():
            values.update({f"{role}_{name}": row[role] for role in ("base", "baseline", "candidate")
                           if row[role] is not None})
        if section.promotion:
            values["promoted_version"] = section.promotion.version
        self.trackers.log_summary(values)
        self.trackers.log_text("gate.txt", f"baseline: {section.baseline}\n{format_table(verdict)}\n")

    def _announce(self) -> None:
        self.report.data.tracking = self.trackers.sections
        for name, section in self.trackers.sections.items():
            where = section.get("url") or section.get("dir") or section.get("run_id")
            print(f"tracking: {name} run {where}" if where else f"tracking: {name} did not start")
            if (section.get("url") or "").startswith(("http://", "https://")):
                from prefect.artifacts import create_link_artifact

                create_link_artifact(link=section["url"], link_text=f"{name} run {section['run_id']}",
                                     key=f"{name}-run", description=f"This flow run in {name}")

    def _finish(self, outcome: RunOutcome) -> None:
        if self.trackers.sections:
            report = self.report.data
            plan, verdict = report.result("plan", Plan), report.result("validate", ValidationResult)
            if plan is not None:
                self._log_plan(plan.model_dump(mode="json"))
            if report.validation is not None and verdict is not None:
                self._log_validation(report.validation, verdict)
            self.trackers.log_images(sorted(self.report.run_dir.glob("*.png")))
            self._log_adapter()
            self.trackers.finish(outcome)
        self.report.data.tracking = self.trackers.sections

    def _log_adapter(self) -> None:
        if not (self.adapter_dir and Path(self.adapter_dir).is_dir()):
            return
        tracking, lora = self.config.tracking, self.config.method.kind == "lora"
        names = [name for name in wanted(tracking) if getattr(tracking, name).logs_adapter(lora)]
        self.trackers.log_directory(Path(self.adapter_dir), "adapter", names)


def run_context(config: Phase1aConfig, run_dir: Path) -> TrackedRun:
    """The run's params (the resolved config, credentials cut out of its URLs) and its links back to Prefect."""
    ui = PREFECT_UI_URL.value()  # None on the embedded server, where there is no UI to link to
    links = {"prefect.flow_run_id": flow_run.id, "prefect.flow_run_name": flow_run.get_name(),
             "prefect.flow_run_url": flow_run.ui_url if ui and flow_run.id else None, "phase1a.run_dir": str(run_dir)}
    return TrackedRun(job=config.name, run_name=flow_run.get_name() or Path(run_dir).name, run_dir=Path(run_dir),
                      params={"config": redacted(config.model_dump(mode="json"))},
                      tags={key: redacted(str(value)) for key, value in links.items() if value})
