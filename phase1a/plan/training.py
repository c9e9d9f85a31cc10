"""The plan applied to a training run: once it ends, its measured speed against the plan's estimate, appended to
the history the next plan reads (record_run)."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from phase1a.core.hardware import history_kind
from phase1a.plan.result import Plan
from phase1a.train.history import RunRecord, append_run
from phase1a.train.result import TrainResult

if TYPE_CHECKING:
    from phase1a.config.schema import Phase1aConfig
    from phase1a.model.loading import ResolvedModel


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
