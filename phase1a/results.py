"""What the plan, train and validate stages hand the next: the results the flow passes between tasks, which
report.json records and the task caches store. Stages read each other's results from here (the plan's, `Plan`,
is defined beside its planner in phase1a/plan/result.py, below the packages the others need; the tokenized
dataset's is read from phase1a/data/tokenized.py), never from each other's modules."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel

from phase1a.core.hardware import history_kind
from phase1a.evaluate.gate import Baseline, GateCheck
from phase1a.evaluate.metrics import Metrics
from phase1a.evaluate.serving import ServingVerdict
from phase1a.plan.interruptions import InterruptionOutcome
from phase1a.plan.result import Plan
from phase1a.start.warmstart import StartPoint
from phase1a.train.history import RunRecord, append_run
from phase1a.train.train_store import Pulled

if TYPE_CHECKING:
    from phase1a.config.schema import Phase1aConfig
    from phase1a.model.loading import ResolvedModel

# How a flow run ended (report.json `status`): passed the gate (and promoted when asked), stopped after the plan,
# failed (an error or a failed gate), or preempted (a signal stopped training at a checkpoint the next run
# resumes from).
RunOutcome = Literal["passed", "planned", "failed", "preempted"]


class StoreTraining(BaseModel):
    """The train stage's dealings with the store, for the report."""

    location: str
    pulled: Pulled
    lease_waited_seconds: float = 0.0
    taken_over_from: dict | None = None  # the holder whose lease had expired, and the step it had reached
    # Steps that holder trained past the checkpoint this run resumed from, at least: its last renewal's step (it
    # renews every lease_ttl/3 and at each checkpoint it commits); what it trained after that, the store cannot know.
    lost_steps: int | None = None
    taken_over_silent_seconds: float | None = None  # how long its lease had gone unrenewed at the takeover
    checkpoint_uploads: int = 0
    checkpoint_upload_seconds: float = 0.0  # all uploads together, in the background
    uploaded_step: int | None = None  # the newest checkpoint in the store when training ended
    upload_failures: list[str] = []
    final_uploaded: bool = False
    preempted_upload_seconds: float | None = None  # signal to the final checkpoint in the store


class TrainResult(BaseModel):
    adapter_dir: str
    output_dir: str
    steps: int
    resumed_from_step: int | None
    reused_completed_run: bool
    wall_seconds: float
    train_tokens: int
    tokens_per_second: float
    final_loss: float | None
    checkpoints_written: int
    checkpoint_seconds: float
    startup_seconds: float = 0.0  # model load, adapter, optimizer, resume: before the first step
    checkpoint_share: float = 0.0  # checkpoint writes as a share of the wall time
    micro_batch_size: int = 0  # at the end: smaller than planned after out-of-memory back-offs
    out_of_memory_backoffs: int = 0
    # A resume's knobs that its checkpoint decided against the plan (phase1a.train.checkpoints.StepArithmetic):
    # knob -> the checkpoint's value, which the steps computed with
    arithmetic_from_checkpoint: dict[str, Any] = {}
    padding_tokens: int = 0  # computed tokens that were not an example's: zero when rows are packed
    mean_mfu: float | None = None
    evaluations: int = 0  # during training (eval.jsonl), the final weights' included; this process's
    eval_seconds: float = 0.0  # their time, part of wall_seconds, early stopping's writes of best/ included
    best_step: int | None = None  # the lowest eval loss during training; with early stopping, the final weights
    best_eval_loss: float | None = None
    stopped_early: bool = False  # early stopping's patience was spent before the last step
    stopped_at_step: int | None = None
    recorded: RunRecord | None = None  # the history line this run appended (None when a finished run was reused)
    start: StartPoint | None = None  # where its weights started (set by the train task)
    store: StoreTraining | None = None  # with a store: what came from it, what went to it (set by the train task)


class ValidationResult(BaseModel):
    base: Metrics
    candidate: Metrics
    baseline: Baseline
    checks: list[GateCheck]
    passed: bool
    reasons: list[str]
    sample_fingerprint: str
    metric_settings: str
    model_fingerprint: str
    adapter_sha256: str
    base_cached: bool
    promoted_seen: str | None = None  # the pointer's version the gate compared against (baseline: promoted)
    serving: ServingVerdict | None = None  # whether vLLM's multi-LoRA serves the adapter (reported, not gated)


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


def record_run(path: Path, config: Phase1aConfig, model: ResolvedModel, plan: Plan, result: TrainResult) -> RunRecord:
    """A finished training run, measured against its plan, appended to the history the next plan reads."""
    record = RunRecord(
        model_fingerprint=model.fingerprint, model_name=config.model.name_or_path,
        hardware=history_kind(config.hardware.target, plan.detected), device_name=plan.detected,
        precision=plan.precision, method_kind=config.method.kind,
        world_size=config.hardware.world_size,
        # The knobs its speed was measured at: a resume's may be its checkpoint's
        micro_batch_size=result.arithmetic_from_checkpoint.get("micro_batch_size", plan.micro_batch_size),
        gradient_checkpointing=plan.gradient_checkpointing,
        compile=result.arithmetic_from_checkpoint.get("compile", plan.compile),
        cuda_graphs=plan.cuda_graphs, dataloader_workers=plan.dataloader_workers,
        max_seq_length=plan.max_seq_length,
        # Steady speed: checkpoint writes and evaluations are estimated separately, from their own measured costs.
        tokens_per_second=result.train_tokens / max(
            result.wall_seconds - result.checkpoint_seconds - result.eval_seconds, 1e-9),
        startup_seconds=result.startup_seconds,
        checkpoint_seconds_each=(result.checkpoint_seconds / result.checkpoints_written
                                 if result.checkpoints_written else None),
        checkpoint_upload_seconds_each=(result.store.checkpoint_upload_seconds / result.store.checkpoint_uploads
                                        if result.store and result.store.checkpoint_uploads else None),
        # A run that stopped early did not run what the plan estimated: it says nothing of the estimate.
        estimated_train_seconds=None if result.stopped_early else plan.estimated_train_seconds,
        actual_train_seconds=result.wall_seconds,
    )
    append_run(path, record)
    return record
