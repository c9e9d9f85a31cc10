"""Train: LoRA (or full) fine-tuning on packed rows, sparse checkpoints, exact resume, honest progress.

The recipe, `train()`, in named phases (torchtune's setup / train / save):
  0. reuse     a run with the same training key that finished is returned as it is
  1. setup     build the model and optimizer the plan chose (`phase1a/model/build.py`), its adapter starting from
               the warm start's weights when there is one (`method.init_from`); resume from the latest
               complete checkpoint of this run: weights, optimizer, scheduler, RNG, step. The data position is
               the step number itself (`StepBatches` is a pure function of the step), so nothing is re-iterated
  2. train     each optimizer step: this rank's packed rows, the loss normalised over the whole step's
               supervised tokens, clip, step (`phase1a/train/steps.py`). Out of memory: halve the row's token budget
               (accumulation doubles, the global batch and the gradient stay the same), restore the step's
               RNG, redo the step. Evaluate on the held-out sample when its interval fires (or at each
               checkpoint), and once more at the end; with early stopping, stop when the patience is spent
               (`phase1a/evaluate/during_training.py`). Checkpoint when the interval fires
               (`phase1a/core/units.py`), and on SIGTERM/SIGINT or a spot notice (`phase1a/train/spot_notice.py`)
               before exiting
  3. save      the adapter in peft's format (with early stopping: the best weights), with `result.json`, marked
               complete last

Several GPUs: `run` launches `torchrun` over this module's `__main__`; see `phase1a/train/distributed.py`.
Imports without Prefect, so the same loop runs on a bare GPU host.
"""
from __future__ import annotations

import json
import socket
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel

from phase1a.config.schema import MethodConfig, Phase1aConfig, ProgressConfig
from phase1a.config.stores import open_store
from phase1a.core import layout
from phase1a.core.atomic import atomic_path, write_atomically
from phase1a.core.fingerprint import hash_json
from phase1a.core.hardware import detect, training_device
from phase1a.core.locks import exclusive
from phase1a.core.logs import run_logger
from phase1a.core.meter import MeterSettings, current_settings
from phase1a.core.units import AUTO, Clock, parse_duration_seconds, parse_interval
from phase1a.data.tokenized import TokenizedData
from phase1a.evaluate.during_training import DURING_TRAINING_FIELDS, EvalSettings, Evaluator
from phase1a.model.build import Compilation, build_model, make_optimizer, make_scheduler
from phase1a.model.cost_model import significant
from phase1a.model.loading import ResolvedModel
from phase1a.plan.result import Plan
from phase1a.plan.training import record_run
from phase1a.start.replay import write_trained_on
from phase1a.start.warmstart import StartPoint
from phase1a.store.base import Store
from phase1a.store.lease import LeaseLost
from phase1a.train import distributed, run_files
from phase1a.train.checkpoints import (
    MARKER,
    StepArithmetic,
    TrainingState,
    checkpoint_step,
    list_checkpoints,
    load_checkpoint,
    load_optimizer_state,
    optimizer_state_dict,
    resumed_arithmetic,
    save_checkpoint,
    trainable_state_dict,
)
from phase1a.train.history import history_path, share_record
from phase1a.train.launch import Launch, LaunchError, LaunchStopped, launch_for, run_agents
from phase1a.train.packing import (
    RowBudget,
    StepBatch,
    StepBatches,
    TokenRows,
    example_stream,
    static_rows,
    step_loader,
    token_budget,
)
from phase1a.train.preemption import Preempted, StopRequest, StopSignals
from phase1a.train.progress import ProgressReporter, StepStats, Yardstick, append_event
from phase1a.train.result import StoreTraining, TrainResult
from phase1a.train.spot_notice import SpotNotices
from phase1a.train.steps import StepOutcome, optimizer_step
from phase1a.train.train_store import CheckpointMirror, RemoteRun, job_prefix
from tasks.caching import task

ENTRY = ["-m", "tasks.train"]  # what torchrun runs on every rank: this module's __main__


class TrainSettings(BaseModel):
    model_dir: str
    train_path: str
    output_dir: str
    method: MethodConfig
    micro_batch_size: int  # a packed row's token budget, in examples of max_seq_length
    gradient_checkpointing: bool
    compile: bool = False
    cuda_graphs: bool = False
    compile_cache: str | None = None  # where compiled code is kept (the plan's calibration compiled into it)
    dataloader_workers: int = 0
    max_seq_length: int | None = None  # the plan's truncation, when it is shorter than the tokenized data
    checkpoint_interval: str = "30m"
    keep_last: int = 2
    trust_remote_code: bool = False
    show_progress: bool = True
    # The config's `progress` section: torchrun ranks are other processes, where the flow's `configure` never
    # ran. None: this process's settings.
    progress: ProgressConfig | None = None
    launch: Launch = Launch()  # one process, or torchrun agents: ranks a node, nodes (phase1a/train/launch.py)
    strategy: Literal["ddp", "fsdp", "hsdp"] = "ddp"  # with several processes
    model_flops_per_token: float | None = None  # for MFU: 4N (LoRA) or 6N plus attention, no recompute
    peak_flops: float | None = None  # the device's dense bf16 peak; None on CPUs
    planned_seconds: float | None = None  # the plan's train estimate, for "on track"
    init_adapter: str | None = None  # a warm start: the adapter the trainable one starts from (local)
    carry_run_files: bool = False  # checkpoints carry the curves and best weights: a store resumes them elsewhere
    # A resume computes with its checkpoint's micro-batch and compilation (StepArithmetic); False after an
    # out-of-memory relaunch, whose smaller rows are the point.
    arithmetic_from_checkpoint: bool = True
    evaluation: EvalSettings | None = None  # evaluation during training and early stopping; None: neither


def _display(settings: TrainSettings) -> MeterSettings | None:
    if not settings.show_progress:
        return None
    return MeterSettings.of(settings.progress) if settings.progress is not None else current_settings()


# init_from enters as the start's content, replay_fraction as the data's; evaluation during training changes no
# weight, and early stopping enters as `EvalSettings.key`, beside where it looks.
_NOT_IN_METHOD_KEY = {"init_from", "replay_fraction", *DURING_TRAINING_FIELDS}


def training_key(tokenized_fingerprint: str, model_fingerprint: str, method: MethodConfig, max_seq_length: int,
                 start_fingerprint: str | None = None, early_stopping: dict | None = None) -> str:
    """What makes two runs the same run: same data, weights (the base's, and the adapter a warm start continues)
    and training semantics (not micro-batching). The code is left out on purpose: a run preempted before a fix
    resumes from its checkpoints after it. `init_from` enters as its adapter's content, not its name: `promoted`
    names another adapter after each promotion. Early stopping enters (`EvalSettings.key`: it decides which
    weights are final); the cadence of evaluations without it does not, since evaluating changes no weight. A
    start from the base without early stopping keeps the key it had before either existed."""
    key = {"data": tokenized_fingerprint, "model": model_fingerprint, "max_seq_length": max_seq_length,
           "method": method.model_dump(exclude=_NOT_IN_METHOD_KEY)}
    if start_fingerprint is not None:
        key["start"] = start_fingerprint
    if early_stopping is not None:
        key["early_stopping"] = early_stopping
    return hash_json(key)[:16]


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


def train(settings: TrainSettings, on_model=None, stops: tuple[StopRequest, ...] = ()) -> TrainResult:
    """`on_model(model)` runs once the model is built: a hook for instrumentation and fault injection. `stops`,
    when another thread sets one, stop training at a checkpoint as a signal does (the store's lease was lost, a
    spot notice came)."""
    if (finished := finished_run(Path(settings.output_dir))) is not None:  # 0. reuse
        return finished
    recipe = TrainRecipe(settings)
    recipe.setup(on_model)  # 1. setup
    recipe.train(stops)  # 2. train
    return recipe.save()  # 3. save


def finished_run(output_dir: Path) -> TrainResult | None:
    final_dir = output_dir / layout.FINAL
    if not (final_dir / MARKER).is_file():
        return None
    summary = TrainResult.model_validate_json((final_dir / layout.RESULT).read_text())
    return summary.model_copy(update={"reused_completed_run": True})


@dataclass(frozen=True)
class _Mark:
    """When something last happened (a checkpoint, an evaluation): the time, the step, the tokens so far."""

    at: float
    step: int
    tokens: int


class _Progress:
    """Where the loop is, in every unit that checkpoint and evaluation intervals and the result count."""

    def __init__(self, start_step: int, prior_seconds: float, epochs_per_step: float,
                 evaluated_at: int | None = None) -> None:
        """`evaluated_at`: the step of the last evaluation before a resume, when the checkpoint says."""
        self.epochs_per_step = epochs_per_step  # the global batch over the training examples
        self.step, self.prior_seconds, self.tokens, self.loss, self.backoffs = start_step, prior_seconds, 0, None, 0
        self.checkpoints, self.checkpoint_seconds = 0, 0.0
        self.stopped_at: int | None = None  # early stopping's step
        # A resume counts the steps to the next evaluation from the last one before it, not from itself: a step
        # cadence then evaluates at the steps an uninterrupted run does (resumed at 730, '500steps' still
        # evaluates at 1000). Time and tokens count from the resume.
        self.last_save = _Mark(0.0, start_step, 0)
        self.last_eval = _Mark(0.0, start_step if evaluated_at is None else evaluated_at, 0)
        self.begin()

    def begin(self) -> None:
        """The clocks start now (setup is not training); the marks keep their steps."""
        self.started = time.perf_counter()
        self.last_save, self.last_eval = (_Mark(self.started, mark.step, self.tokens)
                                          for mark in (self.last_save, self.last_eval))

    def mark(self) -> _Mark:
        return _Mark(time.perf_counter(), self.step, self.tokens)

    def since(self, mark: _Mark) -> Clock:
        steps = self.step - mark.step
        return Clock(seconds=time.perf_counter() - mark.at, steps=steps, tokens=self.tokens - mark.tokens,
                     epochs=steps * self.epochs_per_step)


class TrainRecipe:
    def __init__(self, settings: TrainSettings) -> None:
        self.settings, self.method = settings, settings.method
        self.output_dir = Path(settings.output_dir)
        self.world = distributed.init_world()
        self.began = time.perf_counter()
        torch.manual_seed(self.method.seed)
        rows = TokenRows.load(settings.train_path)
        self.max_length = settings.max_seq_length or int(rows.lengths().max())
        self.order, _ = example_stream(len(rows), self.method.epochs, self.method.seed)
        self.epochs_per_step = self.method.batch_size / len(rows)
        self.arithmetic, self.arithmetic_taken = self._arithmetic()
        self.micro = self.arithmetic.micro_batch_size
        self.static_rows = static_rows(training_device(), self.arithmetic.compile)
        self.total_steps = len(self._batches(self.micro))
        self.sharded = settings.strategy in ("fsdp", "hsdp") and self.world.size > 1
        evaluation = settings.evaluation
        self.evaluator = Evaluator(evaluation, self.output_dir, self.world, self.max_length) if evaluation else None
        self.eval_interval = evaluation.interval(settings.checkpoint_interval) if evaluation else None

    # ---- 1. setup ----------------------------------------------------------------------------------------

    def setup(self, on_model=None) -> None:
        settings, method = self.settings, self.method
        # torch.compile is not combined with FSDP's per-layer hooks here: the sharded run is eager.
        init_adapter = Path(settings.init_adapter) if settings.init_adapter else None
        compile = Compilation(settings.cuda_graphs, Path(settings.compile_cache) if settings.compile_cache else None)
        compiled = self.arithmetic.compile and not self.sharded
        model = build_model(Path(settings.model_dir), method, settings.gradient_checkpointing,
                            settings.trust_remote_code, compile if compiled else None, init_adapter)
        if on_model is not None:
            on_model(model)
        self.model = distributed.wrap(model, self.world, settings.strategy)
        self.optimizer = make_optimizer(self.model, method)
        self.scheduler = make_scheduler(self.optimizer, round(method.warmup_fraction * self.total_steps),
                                        self.total_steps)
        resumed_from = self._resume()
        self.output_dir.mkdir(parents=True, exist_ok=True)
        if self.world.main:  # later steps and their evaluations are redone
            for curve in (layout.METRICS, layout.EVALUATIONS):
                _trim_metrics(self.output_dir / curve, self.progress.step)
        yardstick = Yardstick(settings.model_flops_per_token, settings.peak_flops, settings.planned_seconds)
        self.reporter = ProgressReporter(self.output_dir, self.total_steps, self.progress.step, yardstick,
                                         display=_display(settings),
                                         enabled=self.world.main)
        if resumed_from is not None:
            taken = {name: checkpoint for name, (checkpoint, _) in self.arithmetic_taken.items()}
            self.reporter.event("resumed", from_step=self.progress.step, checkpoint=resumed_from.name,
                                **({"arithmetic_from_checkpoint": taken} if taken else {}))
        self.model.train()
        self.startup = time.perf_counter() - self.began

    def _arithmetic(self) -> tuple[StepArithmetic, dict[str, tuple]]:
        """The knobs this run computes with: the plan's, or on a resume the checkpoint's (said in the log)."""
        settings = self.settings
        planned = StepArithmetic(settings.micro_batch_size, settings.compile, training_device().type)
        existing = list_checkpoints(self.output_dir / "checkpoints") if settings.arithmetic_from_checkpoint else []
        arithmetic, taken = resumed_arithmetic(planned, existing[-1] if existing else None)
        if taken and self.world.main:
            said = ", ".join(f"{name} {checkpoint} (the plan: {plan})" for name, (checkpoint, plan) in taken.items())
            run_logger().warning(f"resuming from {existing[-1].name} with its {said}: the steps compute as they did "
                                 "before the interruption")
        return arithmetic, taken

    def _resume(self) -> Path | None:
        """Load the latest complete checkpoint of this run, if any; the progress starts where it left off."""
        existing = list_checkpoints(self.output_dir / "checkpoints")
        self.resumed_from_step = None
        model = distributed.unwrap(self.model)
        state = load_checkpoint(existing[-1], model) if existing else None
        if self.evaluator is not None:  # the best so far and the patience spent survive a preemption
            self.evaluator.restore(state.evaluation if state else None)
        if state is None:
            self.progress = _Progress(0, 0.0, self.epochs_per_step)
            return None
        load_optimizer_state(model, self.optimizer, state.optimizer)
        self.scheduler.load_state_dict(state.scheduler)
        torch.set_rng_state(state.torch_rng)
        if state.cuda_rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state.cuda_rng)
        self.progress = _Progress(state.step, state.elapsed_seconds, self.epochs_per_step,
                                  (state.evaluation or {}).get("evaluated_at"))  # None: an older checkpoint
        self.resumed_from_step = state.step
        return existing[-1]

    def _batches(self, micro_batch_size: int) -> StepBatches:
        settings, world = self.settings, self.world
        budget = RowBudget(token_budget(micro_batch_size, self.max_length), self.static_rows)
        return StepBatches(settings.train_path, settings.max_seq_length, self.order, self.method.batch_size, budget,
                           world)

    def _loader(self, from_step: int):
        return iter(step_loader(self._batches(self.micro), range(from_step, self.total_steps),
                                self.settings.dataloader_workers, pin_memory=torch.cuda.is_available()))

    # ---- 2. train ----------------------------------------------------------------------------------------

    def train(self, stops: tuple[StopRequest, ...] = ()) -> None:
        progress, world = self.progress, self.world
        interval = parse_interval(self.settings.checkpoint_interval)
        progress.begin()
        loader = self._loader(progress.step)
        with StopSignals(*stops) as stop:
            # A preemption checkpoints before its step's evaluation: one due there is made first on resuming.
            stopped = self._evaluation_due(False) and self._evaluate_and_stop()
            while not stopped and progress.step < self.total_steps:
                step_batch, rng = next(loader), torch.get_rng_state()
                outcome = self._step(step_batch, rng)
                if outcome is None:  # out of memory: the same step again, in smaller rows
                    loader = self._loader(progress.step)
                    continue
                self._record(outcome, step_batch.step_tokens)
                if distributed.any_rank(stop.requested is not None, world):
                    path = self._checkpoint()
                    self.reporter.event("preempted", signal=stop.requested or "peer", step=progress.step,
                                        checkpoint=path.name)
                    self.reporter.close()
                    raise Preempted(stop.requested or "a signal to another rank", progress.step, str(path), stop.at)
                due = progress.step < self.total_steps and distributed.any_rank(
                    interval.due(progress.since(progress.last_save)), world)
                if self._evaluation_due(due) and self._evaluate_and_stop():
                    break
                if due:  # after the evaluation: the checkpoint holds early stopping's state as of this step
                    self._checkpoint()
                    progress.last_save = progress.mark()
        if self.evaluator is not None and progress.stopped_at is None:
            # The final weights: the curve ends where training ended. It may be the best, but it stops nothing:
            # every step was trained, whatever the patience left.
            self._evaluate()
        self.reporter.close()

    def _evaluation_due(self, checkpoint_due: bool) -> bool:
        """At each checkpoint, or at the evaluation's own interval; never at the last step, where the final
        weights are evaluated after the loop."""
        progress = self.progress
        if self.evaluator is None or progress.step >= self.total_steps:
            return False
        if self.evaluator.settings.at_checkpoints:
            return checkpoint_due
        return distributed.any_rank(self.eval_interval.due(progress.since(progress.last_eval)), self.world)

    def _evaluate(self) -> None:
        """The held-out sample on the weights as they are now (with early stopping, `best/` when they are best)."""
        progress = self.progress
        point = self.evaluator(self.model, progress.step, token_budget(self.micro, self.max_length))
        self.reporter.evaluation(point.model_dump())
        progress.last_eval = progress.mark()

    def _evaluate_and_stop(self) -> bool:
        """An evaluation before the last step; True when it spends early stopping's patience: training stops."""
        self._evaluate()
        progress, evaluator = self.progress, self.evaluator
        if not evaluator.stopping.exhausted:
            return False
        progress.stopped_at = progress.step
        self.reporter.event("early_stopping", step=progress.step, best_step=evaluator.stopping.best_step,
                            best_eval_loss=evaluator.stopping.best_loss, patience=evaluator.settings.patience)
        return True

    def _step(self, step_batch: StepBatch, rng: torch.Tensor) -> StepOutcome | None:
        """One optimizer step (its loss and grad norm on the device), or None after an out-of-memory back-off."""
        try:
            return optimizer_step(self.model, self.optimizer, step_batch, self.world.size)
        except torch.OutOfMemoryError:
            step = self.progress.step
            if self.micro == 1:
                raise  # a row of one example has nowhere to go
            if self.world.size > 1:
                # One rank cannot back off alone: its peers wait in a collective. It leaves a note and fails;
                # `run` relaunches every rank with half the budget, resuming from the last checkpoint.
                note = self.output_dir / f"out_of_memory.rank{self.world.rank}.json"
                write_atomically(note, json.dumps({"step": step + 1}))
                raise
            self.optimizer.zero_grad(set_to_none=True)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            torch.set_rng_state(rng)
            self.micro, self.progress.backoffs = self.micro // 2, self.progress.backoffs + 1
            self.reporter.event("out_of_memory", step=step + 1, micro_batch_size=self.micro,
                                token_budget=token_budget(self.micro, self.max_length))
            return None

    def _record(self, outcome: StepOutcome, tokens: int) -> None:
        """The step counted; its loss and grad norm stay on the device until the reporter reads them."""
        progress = self.progress
        loss = distributed.step_loss(outcome.loss, self.world)  # the step's, not rank 0's share
        self.scheduler.step()
        progress.step += 1
        progress.tokens += tokens
        progress.loss = loss
        stats = StepStats(loss=loss, lr=self.scheduler.get_last_lr()[0], grad_norm=outcome.grad_norm, tokens=tokens)
        self.reporter.step(progress.step, stats, time.perf_counter() - progress.started, progress.prior_seconds)

    def _checkpoint(self) -> Path:
        progress, world = self.progress, self.world
        self.reporter.flush()  # the curves a checkpoint carries end at its step
        began = time.perf_counter()
        root = self.output_dir / "checkpoints"
        path = root / f"step-{progress.step:08d}"
        model = distributed.unwrap(self.model)
        weights = trainable_state_dict(model)  # every rank: FSDP gathers the shards
        optimizer_state = optimizer_state_dict(model, self.optimizer)
        if world.main:
            cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
            state = TrainingState(progress.step, optimizer_state, self.scheduler.state_dict(), torch.get_rng_state(),
                                  cuda_rng, progress.prior_seconds + began - progress.started,
                                  self._evaluation_state(),
                                  replace(self.arithmetic, micro_batch_size=self.micro))  # after any back-off
            carry = self._carried() if self.settings.carry_run_files else None
            path = save_checkpoint(root, weights, state, self.settings.keep_last, carry)
        distributed.barrier(world)
        if self.evaluator is not None:
            self.evaluator.saved()
        progress.checkpoints += 1
        progress.checkpoint_seconds += time.perf_counter() - began
        return path

    def _carried(self) -> dict[str, Path]:
        """What a checkpoint takes along to another host: the curves so far and the best weights it names."""
        curves = (layout.METRICS, layout.EVALUATIONS, layout.EVENTS)
        carried = {name: self.output_dir / name for name in curves}
        best = self.evaluator.stopping.best_step if self.evaluator is not None else None
        if best is not None:
            for path in (self.evaluator.best_dir / "evaluation.json", self.evaluator.weights_path(best)):
                carried[f"best/{path.name}"] = path
        return carried

    def _evaluation_state(self) -> dict | None:
        """A checkpoint's share of evaluation: early stopping's state, and the step a cadence counts from."""
        if self.evaluator is None:
            return None
        return {**self.evaluator.stopping.state(), "evaluated_at": self.progress.last_eval.step}

    # ---- 3. save -----------------------------------------------------------------------------------------

    def save(self) -> TrainResult:
        progress, world = self.progress, self.world
        wall = time.perf_counter() - progress.started
        tokens = progress.tokens  # every rank's: summed at each step
        final_dir = self.output_dir / layout.FINAL
        result = TrainResult(
            adapter_dir=str(final_dir), output_dir=str(self.output_dir), steps=self.total_steps,
            resumed_from_step=self.resumed_from_step, reused_completed_run=False, wall_seconds=round(wall, 3),
            train_tokens=tokens, tokens_per_second=round(tokens / max(wall, 1e-9), 2),
            final_loss=None if progress.loss is None else float(progress.loss),
            checkpoints_written=progress.checkpoints, checkpoint_seconds=round(progress.checkpoint_seconds, 3),
            startup_seconds=round(self.startup, 3),
            checkpoint_share=round(progress.checkpoint_seconds / max(wall, 1e-9), 5), micro_batch_size=self.micro,
            out_of_memory_backoffs=progress.backoffs,
            arithmetic_from_checkpoint={name: checkpoint for name, (checkpoint, _) in self.arithmetic_taken.items()},
            mean_mfu=significant(sum(mfus) / len(mfus)) if (mfus := self.reporter.mfus) else None,
            **self._evaluation_summary(),  # with early stopping: the best weights are put back into the model
        )
        weights = trainable_state_dict(self.model) if self.sharded else None  # every rank: FSDP gathers the shards
        if world.main:
            _save_final(distributed.unwrap(self.model), final_dir, result, self.settings.train_path, weights)
        distributed.barrier(world)
        if self.evaluator is not None:
            self.evaluator.saved()
        return result


    def _evaluation_summary(self) -> dict:
        """The result's evaluation fields. With early stopping the final adapter is the best weights, loaded back
        from `best/`, whose record names them (even where a resume redid the steps since)."""
        evaluator = self.evaluator
        if evaluator is None:
            return {}
        stopping = evaluator.stopping
        best = evaluator.restore_best(self.model) or {"step": stopping.best_step, "eval_loss": stopping.best_loss}
        return {"evaluations": evaluator.count, "eval_seconds": round(evaluator.seconds, 3),
                "best_step": best["step"], "best_eval_loss": best["eval_loss"],
                "stopped_early": self.progress.stopped_at is not None, "stopped_at_step": self.progress.stopped_at}


def _trim_metrics(path: Path, last_step: int) -> None:
    """Keep the records up to the checkpoint a run resumes from: the curve stays continuous, without repeats. A
    torn line (the crash that made this a resume) is dropped, not a reason to fail every resume after it."""
    if not path.exists():
        return
    kept = [record for record in run_files.read_lines(path) if record.get("step", 0) <= last_step]
    write_atomically(path, "".join(json.dumps(record) + "\n" for record in kept))  # a crash here keeps the curve


def _save_final(model, final_dir: Path, result: TrainResult, train_path: str, weights: dict | None = None) -> None:
    """The adapter in peft's own format (PeftModel.from_pretrained loads it), with the shards it was trained
    from (a later warm start replays from them), marked complete last. `weights`: the trainable tensors
    gathered whole, when the model holds only its shards (FSDP)."""
    with atomic_path(final_dir) as partial:
        model.save_pretrained(partial, **({"state_dict": weights} if weights is not None else {}))
        write_trained_on(partial, train_path)
        (partial / layout.RESULT).write_text(result.model_dump_json(indent=2))
        (partial / MARKER).write_text("ok\n")


# ---- several processes ---------------------------------------------------------------------------------------

def run(settings: TrainSettings, stops: tuple[StopRequest, ...] = ()) -> TrainResult:
    """One process, or the launch's ranks under torchrun; the result is rank 0's, read from the run. `stops` reach
    torchrun's ranks as SIGTERM does: the launch stops its agents, which pass it on (phase1a/train/launch.py)."""
    if not settings.launch.several:
        return train(settings, stops=stops)
    output_dir = Path(settings.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    settings_path = output_dir / layout.SETTINGS
    _out_of_memory_notes(output_dir)  # a crashed launcher's leftovers do not count for this launch
    backoffs, restarts, launch = 0, 0, settings.launch
    while True:
        write_atomically(settings_path, settings.model_dump_json(indent=2))
        try:  # each launch its own rendezvous: a lost node's stale state never joins the next group
            run_id = f"{launch.run_id}-{backoffs + restarts}"
            run_agents(launch.model_copy(update={"run_id": run_id, "entry": ENTRY}), settings_path,
                       cwd=Path(__file__).resolve().parents[1], stop=lambda: any(s.requested for s in stops))
            break
        except LaunchStopped:
            raise _launch_preempted(output_dir, stops) from None
        except LaunchError as failed:
            notes = _out_of_memory_notes(output_dir)
            if notes and settings.micro_batch_size > 1:
                micro = settings.micro_batch_size // 2
                settings = settings.model_copy(update={"micro_batch_size": micro, "arithmetic_from_checkpoint": False})
                backoffs += 1
                # The ranks are gone: the launcher records it.
                append_event(output_dir, "out_of_memory", step=min(notes), micro_batch_size=micro, relaunched=True)
            elif launch.nodes > 1 and restarts < launch.max_restarts:  # a node lost: the group from its checkpoint
                restarts += 1
                append_event(output_dir, "group_restarted", failure=str(failed), restart=restarts)
                run_logger().warning(f"{failed}: starting every node's agent again from the latest checkpoint "
                                     f"({restarts} of {launch.max_restarts} restarts)")
            else:
                raise
    result_path = output_dir / layout.FINAL / layout.RESULT
    result = TrainResult.model_validate_json(result_path.read_text())
    if backoffs:
        result = result.model_copy(update={"out_of_memory_backoffs": result.out_of_memory_backoffs + backoffs})
        write_atomically(result_path, result.model_dump_json(indent=2))
    return result


def _launch_preempted(output_dir: Path, stops: tuple[StopRequest, ...]) -> Preempted:
    """The ranks' stop, as the launcher sees it: what asked, and the checkpoint they wrote at their last step."""
    request = next(stop for stop in stops if stop.requested)
    checkpoints = list_checkpoints(output_dir / "checkpoints")
    if not checkpoints:  # stopped before the first step ended
        return Preempted(request.requested, 0, "(none: stopped before the first step)", request.at)
    return Preempted(request.requested, checkpoint_step(checkpoints[-1]), str(checkpoints[-1]), request.at)


def _out_of_memory_notes(output_dir: Path) -> list[int]:
    """The steps at which ranks ran out of memory in the launch that just failed; the notes are consumed."""
    steps = []
    for note in output_dir.glob("out_of_memory.rank*.json"):
        steps.append(json.loads(note.read_text())["step"])
        note.unlink()
    return steps


# ---- the store -----------------------------------------------------------------------------------------------

def run_with_store(settings: TrainSettings, store: Store, config: Phase1aConfig,
                   notice: StopRequest | None = None) -> TrainResult:
    """The same run, kept in the store (phase1a/train/train_store.py) so that any host can go on with it: the lease
    first (one host trains it at a time), then what the store has (the finished adapter, or the latest
    checkpoint), then training with each checkpoint uploaded in the background; on a signal, the last checkpoint
    uploaded within the grace period (a lost lease and `notice`, a spot notice, stop it as a signal does); the
    finished adapter last."""
    output_dir, settings = Path(settings.output_dir), settings.model_copy(update={"carry_run_files": True})
    remote = RemoteRun(store, job_prefix(config.name) + output_dir.name)
    wait = config.store.lease_wait
    lease = remote.lease(parse_duration_seconds(config.store.lease_ttl),
                         None if wait is None else parse_duration_seconds(wait), output_dir)
    with lease:
        remote.claim(lease)  # from here on, a host that lost the lease to this one cannot commit (train_store.py)
        silent = lease.taken_over_silent_seconds
        report = StoreTraining(location=remote.location, pulled=remote.pull(output_dir),
                               lease_waited_seconds=round(lease.waited_seconds, 3),
                               taken_over_from=lease.taken_over.model_dump(mode="json") if lease.taken_over else None,
                               taken_over_silent_seconds=None if silent is None else round(silent, 1))
        with CheckpointMirror(remote, output_dir, settings.keep_last, lease) as mirror:
            try:
                lost = StopRequest("the store's lease lost", lease.lost)
                result = run(settings, stops=(lost,) if notice is None else (lost, notice))
            except Preempted as stopped:
                if not lease.lost.is_set():  # a lost lease writes nothing more, not even the stopping checkpoint
                    _upload_within_grace(mirror, stopped, parse_duration_seconds(config.checkpoint.grace_period))
                if lease.lost.is_set():
                    raise LeaseLost(f"{lease.lost_why}; this run stopped at step {stopped.step} and left the store "
                                    "to the host that took it") from stopped
                raise
            finally:
                report.checkpoint_uploads, report.uploaded_step = mirror.uploads, mirror.uploaded_step
                report.checkpoint_upload_seconds = round(mirror.upload_seconds, 3)
                report.upload_failures = mirror.failures
        try:  # committed, or refused: the lease lost, the run fails and records nothing (no throughput record)
            report.final_uploaded = remote.push_final(output_dir / layout.FINAL)
        except LeaseLost as refused:
            lease.lose(str(refused))
            raise
    if lease.taken_over is not None and lease.taken_over.step is not None:
        report.lost_steps = max(0, lease.taken_over.step - (result.resumed_from_step or 0))
    return result.model_copy(update={"store": report})


def _upload_within_grace(mirror: CheckpointMirror, stopped: Preempted, grace: float) -> None:
    """After a signal: the checkpoint training just wrote, into the store before the grace period is over."""
    began = stopped.signalled_at if stopped.signalled_at is not None else time.monotonic()
    uploaded = mirror.flush(max(0.0, grace - (time.monotonic() - began)))
    append_event(mirror.output_dir, "preempted_upload", uploaded=uploaded, step=mirror.uploaded_step,
                 seconds_since_signal=round(time.monotonic() - began, 3), grace_period=grace)
    if not uploaded:
        run_logger().warning(f"{mirror.remote.location}: the checkpoint of step {stopped.step} did not reach the "
                             f"store within the grace period ({grace:.0f} s); the store's latest is step "
                             f"{mirror.uploaded_step}")


# ---- the task ------------------------------------------------------------------------------------------------

@task(name="train")
def train_task(config: Phase1aConfig, model: ResolvedModel, data: TokenizedData, plan: Plan,
               start: StartPoint) -> TrainResult:
    """Trains what the plan chose from `start`, then appends the run's measured speed to the history the next
    plan reads. The result names its start, which promotion records as the new version's parent."""
    settings = train_settings(config, plan, data, model, start)
    # Two runs with the same training key share output_dir (a duplicate manual run, or one during the nightly
    # run): training side by side would interleave metrics, race on checkpoint renames and write one
    # final.partial. The second waits, then reuses the finished run, or resumes if the first one died. The
    # launching process holds the lock for all its torchrun ranks.
    # With a store, a lease in it does the same between hosts.
    store = open_store(config.store)
    # A spot VM's notice comes from its metadata service, not as a signal: watched here, in the process SIGTERM
    # reaches, and answered the same way (phase1a/train/spot_notice.py).
    notice = StopRequest("a spot notice")
    with (exclusive(Path(settings.output_dir + ".lock"), f"training directory {settings.output_dir}"),
          SpotNotices.of(config.checkpoint.spot_notice, notice, Path(settings.output_dir))):
        result = run(settings, (notice,)) if store is None else run_with_store(settings, store, config, notice)
    result = result.model_copy(update={"start": start})
    if result.reused_completed_run:
        return result
    record = record_run(history_path(config.cache_dir), config, model, plan, result)
    if store is not None:
        share_record(store, record)
    return result.model_copy(update={"recorded": record})


def rank_settings(path: Path) -> TrainSettings:
    """A rank's settings, written by the launcher into the run's directory: a node that cannot see it does not
    share the launching host's filesystem."""
    if not path.is_file():
        raise FileNotFoundError(f"{socket.gethostname()}: {path} is not here: training on several nodes needs the "
                                "run's work_dir and cache_dir on a filesystem every node mounts at the same path")
    return TrainSettings.model_validate_json(path.read_text())


if __name__ == "__main__":  # a torchrun rank: python -m tasks.train SETTINGS.json
    distributed.run_rank(lambda: train(rank_settings(Path(sys.argv[1]))))
