"""report.json as a type: what a run's report holds, written by the flow (flows/report.py) and read through this
model by the CLI, `phase1a runs`, report.md and the trackers (file names: phase1a/core/layout.py); how the run
ended (RunOutcome) and the interruptions the plan expected against what training met (interruptions_vs_actual)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, Field

from phase1a.core.atomic import write_atomically
from phase1a.evaluate.present import MetricRow, metric_rows, validation_table
from phase1a.evaluate.result import Answer, GateCheck, ValidationResult
from phase1a.evaluate.serving import ServingVerdict
from phase1a.plan.interruptions import InterruptionOutcome
from phase1a.plan.result import Plan
from phase1a.promote.card import FlowRunLink
from phase1a.promote.result import PromotionOutcome
from phase1a.start.result import StartPoint
from phase1a.train.history import RunRecord
from phase1a.train.result import TrainResult

T = TypeVar("T", bound=BaseModel)
# How a flow run ended (report.json `status`): passed the gate (and promoted when asked), stopped after the plan,
# failed (an error or a failed gate), or preempted (a signal stopped training at a checkpoint the next run
# resumes from).
RunOutcome = Literal["passed", "planned", "failed", "preempted"]


class StageRecord(BaseModel):
    """One stage as it ended: its Prefect state (Completed, Cached, Failed, Crashed), seconds, retries, result."""

    state: str
    seconds: float
    retries: int = 0
    error: str | None = None
    result: Any = None  # the stage's result as JSON; `RunReport.result` reads it as its type


class StageEstimate(BaseModel):
    """The plan's estimate of a stage against its measured seconds (a stage that ran, not one cached)."""

    estimated_seconds: float
    actual_seconds: float
    estimated_over_actual: float | None
    base_cached: bool | None = None  # validation: the base model's metrics came from the cache
    # The plan's own range for the stage as it ran (None: a report written before the field; the plan's range)
    low_seconds: float | None = None
    high_seconds: float | None = None


class PromotionSummary(BaseModel):
    promoted: bool  # False: the pointer already named this adapter
    version: str
    path: str
    artifacts: list[str] = []  # adapter, merged, gguf: each with its model card (README.md)


def promoted_line(version: str, path: str, promoted: bool) -> str:
    """What the flow prints and `phase1a show` repeats once a version is promoted."""
    return f"promoted: {version} at {path}" + ("" if promoted else " (already the promoted model)")


class ValidationSection(BaseModel):
    """Base, baseline and candidate side by side, deltas, the gate's checks and verdict, and the promotion."""

    verdict: Literal["pass", "fail"]
    reasons: list[str]
    baseline: str  # where the baseline's metrics came from
    examples: int
    metrics: dict[str, MetricRow]
    checks: list[GateCheck]
    answers: list[Answer]
    serving: ServingVerdict | None = None  # vLLM multi-LoRA's rules against the adapter: reported, not gated
    promotion: PromotionSummary | None = None

    @classmethod
    def of(cls, verdict: ValidationResult, promotion: PromotionOutcome | None = None) -> ValidationSection:
        summary = None if promotion is None else PromotionSummary(
            promoted=promotion.promoted, version=promotion.pointer.version, path=promotion.pointer.path,
            artifacts=sorted(promotion.pointer.artifacts))
        return cls(verdict="pass" if verdict.passed else "fail", reasons=verdict.reasons,
                   baseline=verdict.baseline.source, examples=verdict.candidate.examples, metrics=metric_rows(verdict),
                   checks=verdict.checks, answers=verdict.candidate.answers, serving=verdict.serving,
                   promotion=summary)

    def table(self) -> list[tuple[str, ...]]:
        """The validation table as text, its header first (phase1a/evaluate/present.py: validation_table)."""
        return validation_table(self.metrics, self.checks)


class Lineage(StartPoint):
    """What the run started from (`method.init_from`) and, once promoted, the version it became."""

    adapter_dir: str | None = Field(None, exclude=True)  # a local copy: no part of the report
    started_from: str
    promoted_as: str | None = None

    @classmethod
    def of(cls, start: StartPoint, promotion: PromotionOutcome | None = None) -> Lineage:
        return cls(**start.model_dump(), started_from=start.describe(),
                   promoted_as=promotion.pointer.version if promotion is not None else None)


class RunReport(BaseModel):
    """report.json: the run's stages as they ended, the plan against the actual, validation, lineage, links."""

    started_at: str
    run_dir: str
    config: dict[str, Any]  # the run's resolved config as written, credentials cut out of its URLs
    stages: dict[str, StageRecord] = {}
    flow_run: FlowRunLink | None = None
    lineage: Lineage | None = None
    replay: dict[str, float] | None = None  # a warm start's mix of new and replayed examples
    estimate_vs_actual: RunRecord | None = None  # training: the history line the run appended
    interruptions_vs_actual: InterruptionOutcome | None = None
    validation_estimate_vs_actual: StageEstimate | None = None
    validation: ValidationSection | None = None
    tracking: dict[str, dict[str, Any]] = {}  # a section per tracker: its run's id, address, or error
    error: str | None = None  # what ended the run, when not a pass
    status: RunOutcome | None = None
    finished_at: str | None = None
    wall_seconds: float | None = None

    def result(self, stage: str, kind: type[T]) -> T | None:
        """The stage's result as its type, when the stage got as far as one."""
        section = self.stages.get(stage)
        return None if section is None or section.result is None else kind.model_validate(section.result)

    @classmethod
    def load(cls, path: Path) -> RunReport:
        return cls.model_validate_json(Path(path).read_text())

    def save(self, path: Path) -> Path:
        write_atomically(path, self.model_dump_json(indent=2) + "\n")
        return path


def interruptions_vs_actual(plan: Plan, trained: TrainResult) -> InterruptionOutcome | None:
    """report.json's `interruptions_vs_actual`; None where the plan expected none and the run had no store."""
    if plan.interruptions is None and trained.store is None:
        return None
    return interruptions_outcome(plan, trained)


def interruptions_outcome(plan: Plan, trained: TrainResult) -> InterruptionOutcome:
    estimate, store = plan.interruptions, trained.store
    resumed = store is not None and store.pulled.what == "checkpoint"
    lost = store.lost_steps if store is not None else None
    own_steps = trained.steps - (trained.resumed_from_step or 0)
    per_step = trained.wall_seconds / own_steps if own_steps > 0 else None
    taken = (store.taken_over_from or {}).get("step") if store is not None else None
    return InterruptionOutcome(
        expected_interruptions=estimate.expected.interruptions if estimate else None,
        expected_lost_seconds=estimate.expected.lost_seconds if estimate else None,
        resumed_after_interruption=resumed, resumed_from_step=trained.resumed_from_step,
        taken_over_from_step=taken, lost_steps=lost,
        taken_over_silent_seconds=store.taken_over_silent_seconds if store is not None else None,
        lost_seconds=None if lost is None or per_step is None else lost * per_step)
