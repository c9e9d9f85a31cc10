"""The training loop: LoRA (or full) fine-tuning on packed rows, sparse checkpoints, exact resume, honest progress.

`train()`, in named phases (torchtune's setup / train / save):
  0. reuse     a run with the same training key that finished is returned as it is (phase1a/train/final.py)
  1. setup     build the model and optimizer the plan chose (`phase1a/model/build.py`), its adapter starting from
               the warm start's weights when there is one (`method.init_from`); resume from the latest
               complete checkpoint of this run: weights, optimizer, scheduler, RNG, step. The data position is
               the step number itself (`StepBatches` is a pure function of the step), so nothing is re-iterated
  2. train     each optimizer step: this rank's packed rows, the loss normalised over the whole step's
               supervised tokens, clip, step (`phase1a/train/steps.py`). Out of memory: halve the row's token budget
               (accumulation doubles, the global batch and the gradient stay the same), restore the step's
               RNG, redo the step. Evaluate on the held-out sample when its interval fires (or at each
               checkpoint), and once more at the end; with early stopping, stop when the patience is spent
               (`phase1a/train/evaluation.py`). Checkpoint when the interval fires
               (`phase1a/core/units.py`), and on SIGTERM/SIGINT or a spot notice (`phase1a/train/spot_notice.py`)
               before exiting
  3. save      the adapter in peft's format (with early stopping: the best weights), with `result.json`, marked
               complete last

Several GPUs: `phase1a/train/runner.py` launches `torchrun`, each rank running this loop
(`phase1a/train/rank.py`); see `phase1a/train/distributed.py`. Imports without Prefect, so the same loop runs on a
bare GPU host.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from phase1a.core import layout
from phase1a.core.atomic import write_atomically
from phase1a.core.hardware import training_device
from phase1a.core.layout import list_checkpoints
from phase1a.core.logs import run_logger
from phase1a.core.meter import MeterSettings, current_settings
from phase1a.core.units import Clock, parse_interval
from phase1a.model.build import Compilation, build_model, make_optimizer, make_scheduler
from phase1a.model.cost_model import significant
from phase1a.train import distributed, run_files
from phase1a.train.checkpoints import (
    StepArithmetic,
    TrainingState,
    load_checkpoint,
    load_optimizer_state,
    optimizer_state_dict,
    resumed_arithmetic,
    save_checkpoint,
    trainable_state_dict,
)
from phase1a.train.evaluation import Evaluator
from phase1a.train.final import finished_run, save_final
from phase1a.train.packing import (
    RowBudget,
    StepBatch,
    StepBatches,
    TokenRows,
    example_stream,
    start_fork_server,
    static_rows,
    step_loader,
    token_budget,
)
from phase1a.train.preemption import Preempted, StopRequest, StopSignals
from phase1a.train.progress import ProgressReporter, StepStats, Yardstick
from phase1a.train.result import TrainResult
from phase1a.train.settings import TrainSettings
from phase1a.train.steps import StepOutcome, optimizer_step


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


def _display(settings: TrainSettings) -> MeterSettings | None:
    if not settings.show_progress:
        return None
    return MeterSettings.of(settings.progress) if settings.progress is not None else current_settings()


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
        if settings.dataloader_workers:
            start_fork_server()
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
                run_files.trim_to_step(self.output_dir / curve, self.progress.step)
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
            save_final(distributed.unwrap(self.model), final_dir, result, self.settings.train_path, weights)
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
