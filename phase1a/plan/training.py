"""The plan applied to a training run: the run's settings from the config and the plan (train_settings), in the
directory its training key names (training_dir), and once it ends its measured speed against the plan's
estimate, appended to the history the next plan reads (record_run). Here, not in phase1a/train/, because the
planner measures with training's code: training's own modules never see the plan."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from phase1a.config.schema import MethodConfig, Phase1aConfig
from phase1a.core import layout
from phase1a.core.hardware import detect, history_kind
from phase1a.core.units import AUTO
from phase1a.data.tokenized import TokenizedData
from phase1a.model.result import ResolvedModel
from phase1a.plan.result import Plan
from phase1a.start.result import StartPoint
from phase1a.train.history import RunRecord, append_run
from phase1a.train.launch import launch_for
from phase1a.train.result import TrainResult
from phase1a.train.settings import EvalSettings, TrainSettings, training_key


@dataclass(frozen=True)
class _Choices:
    """What the config and the plan decide for a run's training: the method at the plan's epochs (a window may
    have cut them), evaluation during training, and the checkpoint interval (auto's choice, or as configured)."""

    method: MethodConfig
    evaluation: EvalSettings | None
    interval: str

    @classmethod
    def of(cls, config: Phase1aConfig, plan: Plan, data: TokenizedData) -> "_Choices":
        return cls(method=config.method.model_copy(update={"epochs": plan.epochs}),
                   evaluation=EvalSettings.of(config, data.validation_path, data.validation_examples),
                   interval=plan.checkpoint_interval or config.checkpoint.interval)


def training_dir(config: Phase1aConfig, plan: Plan, data: TokenizedData, model: ResolvedModel,
                 start: StartPoint) -> Path:
    """The run's training directory, keyed by what makes two runs the same run (`training_key`)."""
    return _directory(config, plan, data, model, start, _Choices.of(config, plan, data))


def _directory(config: Phase1aConfig, plan: Plan, data: TokenizedData, model: ResolvedModel, start: StartPoint,
               choices: _Choices) -> Path:
    evaluation = choices.evaluation
    early_stopping = evaluation.key(choices.interval) if evaluation else None
    if early_stopping and evaluation.at_checkpoints and config.checkpoint.interval == AUTO:
        # The key holds the policy, not auto's choice, which hosts measuring a few seconds apart make differently:
        # a resume on another host must find the same training directory.
        early_stopping["interval"] = AUTO
    run_key = training_key(data.fingerprint, model.fingerprint, choices.method, plan.max_seq_length,
                           start.fingerprint, early_stopping)
    return config.work_dir / config.name / f"train-{run_key}"


def train_settings(config: Phase1aConfig, plan: Plan, data: TokenizedData, model: ResolvedModel,
                   start: StartPoint) -> TrainSettings:
    """The train stage's settings from the config and the plan: its knobs, its epochs, its truncation, its
    starting adapter, its directory (`training_dir`)."""
    choices = _Choices.of(config, plan, data)
    output_dir = _directory(config, plan, data, model, start, choices)
    return TrainSettings(
        model_dir=model.path, train_path=data.train_path, method=choices.method, max_seq_length=plan.max_seq_length,
        output_dir=str(output_dir), init_adapter=start.adapter_dir,
        micro_batch_size=plan.micro_batch_size, gradient_checkpointing=plan.gradient_checkpointing,
        compile=plan.compile, cuda_graphs=plan.cuda_graphs, compile_cache=str(config.cache_dir / layout.COMPILE_CACHE),
        dataloader_workers=plan.dataloader_workers,
        checkpoint_interval=choices.interval, keep_last=config.checkpoint.keep_last,
        trust_remote_code=config.model.trust_remote_code, progress=config.progress,
        launch=launch_for(config.hardware, output_dir.name), strategy=config.hardware.strategy,
        model_flops_per_token=plan.model_flops_per_token, peak_flops=detect()[1].peak_flops,
        planned_seconds=plan.estimated_train_seconds, evaluation=choices.evaluation,
    )


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
        **_evaluation_speeds(plan, result),
    )
    append_run(path, record)
    return record


def _evaluation_speeds(plan: Plan, result: TrainResult) -> dict:
    """The evaluation speeds the plan estimated with, the forward pass's (and the prefill's, a forward pass too)
    scaled by what this run's evaluations during training took, each, against the plan's estimate of one: a whole
    run's evaluations are a steadier measurement than calibration's few timed passes."""
    speed, estimate = plan.estimate.evaluation_speed, plan.estimate
    if speed is None:
        return {}
    scale = 1.0
    if result.evaluations and estimate.evaluations_during_training and estimate.eval_during_training_seconds:
        planned_each = estimate.eval_during_training_seconds / estimate.evaluations_during_training
        scale = (result.eval_seconds / result.evaluations) / planned_each
    prefill, during = speed.prefill_seconds_per_token, speed.training_forward_seconds_per_token
    return {"eval_forward_seconds_per_token": speed.forward_seconds_per_token * scale,
            "eval_prefill_seconds_per_token": None if prefill is None else prefill * scale,
            "eval_decode_seconds_per_step": speed.decode_seconds_per_step,
            "eval_decode_seconds_per_context_token": speed.decode_seconds_per_context_token,
            "eval_training_forward_seconds_per_token": None if during is None else during * scale,
            "eval_merge_seconds": speed.merge_seconds, "eval_harness_seconds": speed.harness_seconds}
