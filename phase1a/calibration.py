"""Calibration: time a few real optimizer steps of each candidate configuration on the hardware present, and
keep the fastest that fits.

The global batch is fixed; candidates differ only in how a step is executed: examples per micro-batch (the
token budget of one packed row), gradient checkpointing, dataloader workers, torch.compile. The search is
greedy, one knob at a time in `plan.sweep` order, starting from the memory model's pick: a change is kept when
it is faster by more than the noise between repeated measurements (`_MIN_GAIN`). Every candidate runs the same
steps of the same data (the run's first steps), so they compare like with like.

Per candidate: two warm-up steps (allocator growth, kernel selection, compilation), then `calibration_steps`
measured steps, spread evenly over the run so that their lengths are the run's. Its speed is the measured
steps' total time over their total tokens (the slowest step left out), a ratio of sums so that fixed per-step
costs weigh as they will in the run. The warm-up steps' excess over that speed is kept too: a training run
pays it once at its start. Step time is taken from the end of one step
to the end of the next, so it includes waiting for the data loader.

When several candidates were measured, the winner is measured once more and that measurement sets the
estimate: the fastest of several noisy measurements is biased fast.

The sweep may spend at most `plan.calibration_budget`, and at most `plan.calibration_share` of the first
estimate of training time: a two-minute run does not get a five-minute search. What was skipped is listed. No
trial runs past the budget: a trial stops after the step that crosses it (one step at least, which is the
least that measures anything) and its speed comes from the steps it ran; where none was past warm-up, from the
warm-up steps, which overstates the time a little. Each trial prints one line as it ends.
"""
from __future__ import annotations

import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

import numpy as np
import torch
from pydantic import BaseModel

from phase1a.bundles import delete_bundle, upload_bundle
from phase1a.checkpoints import TrainingState, optimizer_state_dict, save_checkpoint, trainable_state_dict
from phase1a.config import Phase1aConfig
from phase1a.cost_model import MemoryModel
from phase1a.evaluation import ValidationSpeed, time_validation
from phase1a.hardware import usable_cores
from phase1a.logs import run_logger
from phase1a.meter import Meter, stage_meter
from phase1a.packing import StepBatches, TokenRows, example_stream, step_loader, token_budget
from phase1a.steps import optimizer_step
from phase1a.store import Store
from phase1a.training_eval import evaluating
from phase1a.units import GIB, parse_duration_seconds

_WARMUP_STEPS = 2
_MIN_GAIN = 0.03  # a candidate must be this much faster to replace the current best


class Candidate(BaseModel, frozen=True):
    micro_batch_size: int
    gradient_checkpointing: bool
    compile: bool = False
    dataloader_workers: int = 0

    def label(self) -> str:
        return (f"micro {self.micro_batch_size}, checkpointing {'on' if self.gradient_checkpointing else 'off'}, "
                f"compile {'on' if self.compile else 'off'}, workers {self.dataloader_workers}")


class Trial(BaseModel):
    candidate: Candidate
    status: Literal["measured", "out_of_memory", "failed", "skipped"]
    tokens_per_second: float | None = None
    warmup_excess_seconds: float | None = None  # what the first steps cost beyond steady state (compilation)
    peak_memory_gib: float | None = None  # CUDA only: the allocator's peak during the trial
    seconds: float = 0.0
    note: str = ""


class Calibration(BaseModel):
    chosen: Candidate
    seconds_per_token: float
    warmup_excess_seconds: float
    startup_seconds: float  # load the model, wrap it, build the optimizer
    checkpoint_seconds: float  # one checkpoint written, measured
    checkpoint_bytes: int = 0  # its size on disk
    checkpoint_upload_seconds: float | None = None  # its upload to the store, when the job asked for one
    peak_memory_gib: float | None
    trials: list[Trial]
    budget_seconds: float
    seconds: float
    validation: ValidationSpeed | None = None  # the validate stage's two costs, measured on this model


# Proposes the next candidates to try for one knob, given the best so far.
Alternatives = Callable[[Candidate, str], list[Candidate]]


def no_alternatives(best: Candidate, knob: str) -> list[Candidate]:
    """For profiles that fix the knobs themselves: only the start is measured."""
    return []


def memory_alternatives(memory: MemoryModel, batch_size: int, max_seq_length: int) -> Alternatives:
    """The candidates to try for each knob, from the best so far; only ones the memory model admits."""

    def fitting(checkpointing: bool) -> list[int]:
        return [micro for micro, _ in memory.fitting(batch_size, max_seq_length, checkpointing)]

    def alternatives(best: Candidate, knob: str) -> list[Candidate]:
        if knob == "micro_batch":  # smaller rows: sometimes faster on CPUs and small GPUs (cache, kernels)
            return [best.model_copy(update={"micro_batch_size": m}) for m in fitting(best.gradient_checkpointing)
                    if m < best.micro_batch_size]
        if knob == "gradient_checkpointing":  # on: more recompute, but maybe a larger micro-batch fits
            other = fitting(not best.gradient_checkpointing)
            return [best.model_copy(update={"gradient_checkpointing": not best.gradient_checkpointing,
                                            "micro_batch_size": other[0]})] if other else []
        if knob == "dataloader_workers":
            return [best.model_copy(update={"dataloader_workers": 0 if best.dataloader_workers else default_workers()})]
        return [best.model_copy(update={"compile": not best.compile})]

    return alternatives


@dataclass
class CalibrationJob:
    """What to calibrate on: the run's data as training will read it, and the candidates to try."""

    train_path: str
    max_seq_length: int
    start: Candidate  # the memory model's pick, measured first
    train_tokens: int  # the run's first estimate: the budget is a share of its time
    work_dir: Path  # where training will write its checkpoints: one is timed there
    alternatives: Alternatives = no_alternatives
    validation_path: str | None = None  # the held-out set, to time the validate stage on this model
    upload_to: Store | None = None  # a store to time the checkpoint's upload to (checkpoint.interval auto, spot)


def calibrate(config: Phase1aConfig, model_dir: Path, job: CalibrationJob) -> Calibration:
    with stage_meter("calibration", planned_trials(config, job), "trials",
                     what=f"budget {config.plan.calibration_budget}") as meter:
        session = _Session(config, model_dir, job, meter)  # 1. the model and optimizer as training builds them
        best = session.run(job.start, session.cap)  # 2. the memory model's pick
        if best.status != "measured":
            raise MemoryError(f"calibration: the memory model's pick ({job.start.label()}) could not run: "
                              f"{best.note}")
        budget = min(session.cap, config.plan.calibration_share * job.train_tokens / best.tokens_per_second)
        best = session.sweep(best, budget)  # 3. one knob at a time, within the budget
        speed = session.confirm(best, budget)  # 4. the winner measured again
        return session.result(best, speed, budget)  # 5. a checkpoint and the validate stage, timed


def planned_trials(config: Phase1aConfig, job: CalibrationJob) -> int:
    """The trials a sweep from the start would run (for progress: "trial k of n"): the start, each knob's
    alternatives to it, and the winner's confirmation when there is a choice. The greedy sweep proposes from
    the best so far, so the count can move as it goes."""
    alternatives = sum(len(job.alternatives(job.start, knob)) for knob in config.plan.sweep)
    return 1 + alternatives + (1 if alternatives else 0)


class _Session:
    """One model and optimizer, reused by every trial (a candidate changes how a step runs, not the model)."""

    def __init__(self, config: Phase1aConfig, model_dir: Path, job: CalibrationJob, meter: Meter) -> None:
        from phase1a.modeling import build_model, make_optimizer

        self.began = time.perf_counter()
        self.config, self.job, self.trials, self.meter = config, job, [], meter
        meter.note("loading the model")
        method = config.method
        self.model = build_model(model_dir, method, job.start.gradient_checkpointing, config.model.trust_remote_code)
        self.optimizer = make_optimizer(self.model, method)
        self.model.train()  # as training runs it: train mode takes other code paths (dropout, mask construction)
        self.startup = time.perf_counter() - self.began
        self.order, _ = example_stream(len(TokenRows.load(job.train_path)), method.epochs, method.seed)
        self.cap = parse_duration_seconds(config.plan.calibration_budget)

    def elapsed(self) -> float:
        return time.perf_counter() - self.began

    def run(self, candidate: Candidate, budget: float) -> Trial:
        from phase1a.modeling import set_gradient_checkpointing

        set_gradient_checkpointing(self.model, candidate.gradient_checkpointing)
        if candidate.compile and not getattr(self.model, "_compiled_call_impl", None):
            self.model.compile(dynamic=True)
        method, job = self.config.method, self.job
        batches = StepBatches(job.train_path, job.max_seq_length, self.order, method.batch_size,
                              token_budget(candidate.micro_batch_size, job.max_seq_length))
        self._announce(candidate, budget)
        trial = _trial(self.model, self.optimizer, batches, candidate,
                       _Steps(self.config.hardware.calibration_steps, self.began + budget))
        self.trials.append(trial)
        self.meter.advance(1)
        print(f"calibration trial {len(self.trials)} ({self.elapsed():.0f} of {budget:.0f} s): {candidate.label()}: "
              f"{_outcome(trial)}", flush=True)
        return trial

    def _announce(self, candidate: Candidate, budget: float) -> None:
        number = len(self.trials) + 1
        if self.meter.total is not None and number > self.meter.total:
            self.meter.total = number  # the sweep moved to a best with more alternatives than the start had
        self.meter.note(f"trial {number} of {self.meter.total}: {candidate.label()} "
                        f"({self.elapsed():.0f} of {budget:.0f} s used)")

    def sweep(self, best: Trial, budget: float) -> Trial:
        """Greedy, one knob at a time in `plan.sweep` order: a change is kept when it is faster by more than the
        noise; a slower one ends that knob (further steps the same way will not help)."""
        for knob in self.config.plan.sweep:
            for candidate in self.job.alternatives(best.candidate, knob):
                if any(t.candidate == candidate for t in self.trials):
                    continue
                expected = best.seconds + (60.0 if candidate.compile else 0.0)  # compiling takes about a minute
                if self.elapsed() + expected > budget:
                    left = max(0.0, budget - self.elapsed())
                    self.trials.append(Trial(candidate=candidate, status="skipped", note=(
                        f"not tried: {left:.0f} s of the {budget:.0f} s calibration budget left, a trial takes "
                        f"~{expected:.0f} s")))
                    self.meter.advance(1)
                    continue
                trial = self.run(candidate, budget)
                if trial.status == "measured" and trial.tokens_per_second > best.tokens_per_second * (1 + _MIN_GAIN):
                    best = trial
                elif trial.status == "measured":
                    break
        return best

    def confirm(self, best: Trial, budget: float) -> float:
        """The speed the estimate uses. The fastest of several noisy measurements is biased fast (the winner's
        curse): when several were measured and time is left, a fresh measurement of the winner sets it."""
        measured = sum(t.status == "measured" for t in self.trials)
        if measured <= 1 or self.elapsed() + best.seconds > budget:
            return best.tokens_per_second
        confirmation = self.run(best.candidate, budget)
        self.trials[-1] = confirmation.model_copy(update={"note": "the chosen candidate, measured again"})
        return confirmation.tokens_per_second if confirmation.status == "measured" else best.tokens_per_second

    def result(self, best: Trial, speed: float, budget: float) -> Calibration:
        from phase1a.modeling import set_gradient_checkpointing

        set_gradient_checkpointing(self.model, best.candidate.gradient_checkpointing)
        self.meter.note("timing a checkpoint write" + (" and upload" if self.job.upload_to else "")
                        + (" and validation" if self.job.validation_path else ""))
        checkpoint = _time_checkpoint(self.model, self.optimizer, self.job.work_dir, self.job.upload_to)
        validation = (_time_validation(self.model, self.job.validation_path, self.config)
                      if self.job.validation_path else None)
        return Calibration(
            chosen=best.candidate, seconds_per_token=1.0 / speed,
            warmup_excess_seconds=best.warmup_excess_seconds or 0.0, startup_seconds=self.startup,
            checkpoint_seconds=checkpoint.write_seconds, checkpoint_bytes=checkpoint.bytes,
            checkpoint_upload_seconds=checkpoint.upload_seconds, peak_memory_gib=best.peak_memory_gib,
            trials=self.trials, budget_seconds=budget, seconds=self.elapsed(), validation=validation,
        )


def _time_validation(model, validation_path: str, config: Phase1aConfig) -> ValidationSpeed:
    """Validation's costs on this model, uncompiled as the validate stage loads it."""
    rows = TokenRows.load(validation_path)
    indices = np.arange(min(len(rows), config.validation.max_examples))
    with evaluating(model), torch.no_grad():
        return time_validation(model, rows, indices, config.validation)


def _outcome(trial: Trial) -> str:
    if trial.status == "measured":
        speed = f"{trial.tokens_per_second:.0f} tokens/s in {trial.seconds:.0f} s"
        return f"{speed} ({trial.note})" if trial.note else speed
    return f"{trial.status}: {trial.note}"


@dataclass(frozen=True)
class _Steps:
    measured: int  # after the warm-up steps
    deadline: float  # perf_counter time: no step starts after the one that crosses it


def _trial(model, optimizer, batches: StepBatches, candidate: Candidate, steps: _Steps) -> Trial:
    """Warm-up and measured steps of one candidate, stopping after the step that crosses the deadline."""
    count = _WARMUP_STEPS + steps.measured
    # Steps spread over the whole run, so their lengths are the run's; a short run repeats its steps.
    sampler = [int(step) % len(batches) for step in np.linspace(0, len(batches), count, endpoint=False)]
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    durations, tokens = [], []
    began = last = time.perf_counter()
    try:
        for step_batch in step_loader(batches, sampler, candidate.dataloader_workers, pin_memory=cuda):
            _, step_tokens, _ = optimizer_step(model, optimizer, step_batch)
            _sync()
            now = time.perf_counter()
            durations.append(now - last)
            tokens.append(step_tokens)
            last = now
            if now > steps.deadline:
                break
    except torch.cuda.OutOfMemoryError as error:
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        return Trial(candidate=candidate, status="out_of_memory", seconds=time.perf_counter() - began,
                     note=str(error).splitlines()[0])
    except Exception as error:  # a compiler missing on this host, say: that candidate is out, not the plan
        optimizer.zero_grad(set_to_none=True)
        return Trial(candidate=candidate, status="failed", seconds=time.perf_counter() - began,
                     note=f"{type(error).__name__}: {error}".splitlines()[0][:300])
    measured = sorted(zip(durations[_WARMUP_STEPS:], tokens[_WARMUP_STEPS:]))
    note = "" if len(durations) == count else f"cut at the budget after {len(durations)} of {count} steps"
    if not measured:  # cut during warm-up: its steps are all there is, and they are the slow ones
        measured, durations, tokens = sorted(zip(durations, tokens)), [], []
        note += "; speed from warm-up steps"
    kept = measured[:-1] if len(measured) >= 4 else measured  # one outlier (a page-fault burst) does not count
    per_token = sum(d for d, _ in kept) / sum(t for _, t in kept)  # a ratio of sums: per-step overheads count
    excess = sum(d - t * per_token for d, t in zip(durations[:_WARMUP_STEPS], tokens[:_WARMUP_STEPS]))
    return Trial(candidate=candidate, status="measured", tokens_per_second=1.0 / per_token, note=note,
                 warmup_excess_seconds=max(0.0, excess), seconds=time.perf_counter() - began,
                 peak_memory_gib=torch.cuda.max_memory_allocated() / GIB if cuda else None)


@dataclass(frozen=True)
class _CheckpointTiming:
    write_seconds: float
    bytes: int
    upload_seconds: float | None = None


def _time_checkpoint(model, optimizer, work_dir: Path, store: Store | None = None) -> _CheckpointTiming:
    """Write one real checkpoint (trainable weights, optimizer state) where training will write them; with a
    store, upload it as training's mirror does (a bundle: hashed, then its manifest) under a scratch key, and
    delete it there."""
    work_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=work_dir, prefix=".calibration-") as scratch:
        began = time.perf_counter()
        state = TrainingState(0, optimizer_state_dict(model, optimizer), {}, torch.get_rng_state(), [])
        written = save_checkpoint(Path(scratch), trainable_state_dict(model), state, keep_last=1)
        write_seconds = time.perf_counter() - began
        size = sum(path.stat().st_size for path in written.rglob("*") if path.is_file())
        if store is None:
            return _CheckpointTiming(write_seconds, size)
        prefix = f"scratch/calibration-{uuid.uuid4().hex}/"
        began = time.perf_counter()
        try:
            upload_bundle(store, written, prefix)
            uploaded = time.perf_counter() - began
            delete_bundle(store, prefix)
        except Exception as error:  # noqa: BLE001 - the plan assumes an upload speed instead; training will tell
            run_logger().warning(f"calibration: the checkpoint upload to {store.where(prefix)} was not timed "
                                 f"({type(error).__name__}: {error})")
            return _CheckpointTiming(write_seconds, size)
        return _CheckpointTiming(write_seconds, size, uploaded)


def default_workers() -> int:
    """Workers to try: half the cores, at most four; the other half feed the accelerator (or compute, on CPU)."""
    return max(1, min(4, usable_cores() // 2))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
