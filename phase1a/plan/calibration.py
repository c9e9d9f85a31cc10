"""Calibration: time a few real optimizer steps of each candidate configuration on the hardware present, and
keep the fastest that fits, all inside `plan.calibration_budget`.

The global batch is fixed; candidates differ only in how a step is executed: examples per micro-batch (the
token budget of one packed row), gradient checkpointing, dataloader workers, torch.compile. The search is
greedy, one knob at a time in `plan.sweep` order, starting from the memory model's pick: a change is kept when
it is faster by more than the noise between repeated measurements (`_MIN_GAIN`). Every candidate runs the same
steps of the same data, spread evenly over the run so that their lengths are the run's.

The budget covers everything calibration does: loading the model, the trials, and timing a checkpoint and the
validate stage. A trial warms up on every shape the run's rows take (two probes of one example in the smallest
row, one in each other row length a static row allows, then one step of the trial's own rows: compilation and
kernel set-up happen there, not in the measured steps) and then measures up to `plan.calibration_steps` steps not seen
before; no step starts that is predicted to end past the trial's deadline. A step
too long for the budget is shortened to fewer of its micro-batches (each of the run's shape, so attention over
a packed row costs what it will). A step's forward and backward and its update are timed apart, so a shortened
step still prices the update once per whole step. docs/stages.md ("Calibration") has the rest: deadlines, the
share, the footing of the estimate.
"""
from __future__ import annotations

import tempfile
import time
import uuid
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal

import numpy as np
import torch

from phase1a.config.schema import Phase1aConfig
from phase1a.core import layout
from phase1a.core.hardware import training_device, usable_cores
from phase1a.core.logs import run_logger
from phase1a.core.meter import Meter, stage_meter
from phase1a.core.units import GIB, parse_duration_seconds
from phase1a.evaluate.benchmarks import HARNESS_GUESS_SECONDS, Benchmark, time_harness
from phase1a.evaluate.metrics import (
    TimingAllowance,
    time_training_rows,
    time_validation,
    training_rows_timing_seconds,
    validation_timing_seconds,
)
from phase1a.evaluate.result import ValidationSpeed
from phase1a.model import liger
from phase1a.model.cost_model import MemoryModel, checkpoint_bytes
from phase1a.model.loading import adapter_off, load_tokenizer, merges_for_scoring
from phase1a.plan.footing import floor
from phase1a.plan.interruptions import ASSUMED_DISK_BYTES_PER_SECOND, ASSUMED_STORE_BYTES_PER_SECOND
from phase1a.plan.result import Calibration, Candidate, Trial
from phase1a.store.base import Store
from phase1a.store.bundles import delete_bundle, upload_bundle
from phase1a.train.checkpoints import TrainingState, optimizer_state_dict, save_checkpoint, trainable_state_dict
from phase1a.train.evaluation import evaluating
from phase1a.train.packing import (
    RowBudget,
    StepBatch,
    StepBatches,
    TokenRows,
    example_stream,
    pack,
    rows_of_every_length,
    start_fork_server,
    static_rows,
    step_loader,
    token_budget,
)
from phase1a.train.settings import EvalSettings
from phase1a.train.steps import apply_update, train_step

_MIN_GAIN = 0.03  # a candidate must be this much faster to replace the current best
_FIRST_TRIAL_SHARE = 0.6  # of the budget left once the model is loaded; the rest times a checkpoint and validation
# The first trial's warm-up step and first measured step may end within this larger share, so that it measures one
# step at least: a speed from warm-up steps is an upper bound (on the tiny shape with a 30 s budget, a warm-up step
# three steady steps long left no room for a measured one by the deadline: 882 tokens/s where the run made 2,562).
_FIRST_MEASURED_SHARE = 0.8
_COMPILE_SECONDS = 60.0  # a compiled candidate's trial takes about this much longer
# A measured step this many times the other steps' median seconds per token is a burst, not the run's speed: the
# steps of a calibrated CPU run varied by about ±10 % (the demo's, 2026-11-29), a busy moment of the host made one
# 6.6x, and one of qa300's two measured steps 2.2x (its estimate 1.5x the actual, 2026-11-29).
_BURST = 1.5


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
        if knob == "cuda_graphs":  # only where there are CUDA graphs, on top of a compiled model
            return ([best.model_copy(update={"cuda_graphs": not best.cuda_graphs})]
                    if best.compile and torch.cuda.is_available() else [])
        return [best.model_copy(update={"compile": not best.compile, "cuda_graphs": False})]

    return alternatives


@dataclass
class CalibrationJob:
    """What to calibrate on: the run's data as training will read it, and the candidates to try."""

    train_path: str
    max_seq_length: int
    start: Candidate  # the memory model's pick, measured first
    train_tokens: int  # the run's first estimate: the sweep may spend a share of its time
    work_dir: Path  # where training will write its checkpoints: one is timed there
    alternatives: Alternatives = no_alternatives
    validation_path: str | None = None  # the held-out set, to time the validate stage on this model
    evaluation: EvalSettings | None = None  # the train stage's evaluations, to time one as it will run
    benchmarks: list[Benchmark] = field(default_factory=list)  # validation.benchmarks, loaded: their harness timed
    upload_to: Store | None = None  # a store to time the checkpoint's upload to (checkpoint.interval auto, spot)


def calibrate(config: Phase1aConfig, model_dir: Path, job: CalibrationJob) -> Calibration:
    with stage_meter("calibration", planned_trials(config, job), "trials",
                     what=f"budget {config.plan.calibration_budget}") as meter:
        meter.ends_by = meter.clock() + parse_duration_seconds(config.plan.calibration_budget)
        if job.start.dataloader_workers or job.alternatives(job.start, "dataloader_workers"):
            start_fork_server()  # while the model loads: a trial with workers then times steps, not imports
        session = _Session(config, model_dir, job, meter)  # 1. the model and optimizer as training builds them
        first = session.run(job.start, *session.first_deadlines())  # 2. the memory model's pick
        if first.status != "measured":
            raise MemoryError(f"calibration: the memory model's pick ({job.start.label()}) could not run: "
                              f"{first.note}")
        deadline = session.sweep_deadline(first)
        best = session.sweep(first, deadline)  # 3. one knob at a time, within the budget
        measurement = session.confirm(best, deadline)  # 4. the winner measured again
        return session.result(best, measurement, first)  # 5. a checkpoint and the validate stage, timed


def planned_trials(config: Phase1aConfig, job: CalibrationJob) -> int:
    """The trials a sweep from the start would run (for progress: "trial k of n"): the start, each knob's
    alternatives to it, and the winner's confirmation when there is a choice. The greedy sweep proposes from
    the best so far, so the count can move as it goes."""
    alternatives = sum(len(job.alternatives(job.start, knob)) for knob in config.plan.sweep)
    return 1 + alternatives + (1 if alternatives else 0)


class _Session:
    """One model and optimizer, reused by every trial (a candidate changes how a step runs, not the model)."""

    def __init__(self, config: Phase1aConfig, model_dir: Path, job: CalibrationJob, meter: Meter) -> None:
        from phase1a.model.build import build_model, make_optimizer

        self.began = time.perf_counter()
        self.config, self.job, self.trials, self.meter, self.notes = config, job, [], meter, []
        self.model_dir = model_dir
        meter.note("loading the model")
        self.device_setup = _set_up_device()
        method = config.method
        self.model = build_model(model_dir, method, job.start.gradient_checkpointing, config.model.trust_remote_code)
        self.optimizer = make_optimizer(self.model, method)
        self.model.train()  # as training runs it: train mode takes other code paths (dropout, mask construction)
        self.startup = time.perf_counter() - self.began
        self.order, _ = example_stream(len(TokenRows.load(job.train_path)), method.epochs, method.seed)
        self.budget = parse_duration_seconds(config.plan.calibration_budget)
        self.end = self.began + self.budget
        steps = -(-len(self.order) // method.batch_size)
        self.step_tokens = job.train_tokens / max(1, steps)  # a whole step's tokens, on average
        self.step_cap: int | None = None  # the first trial's, so that all trials compare alike
        self.first_step_at = 0.0
        self.sweep_limit = f"plan.calibration_budget {self.budget:.0f} s"  # sweep_deadline names the one that binds
        self.budget_deadline = self.end

    def elapsed(self) -> float:
        return time.perf_counter() - self.began

    def first_deadlines(self) -> tuple[float, float]:
        """The first trial may take a share of what the model's loading left; the rest is for the others and the
        checkpoint and validation timing. Its first measured step, where none has run by then, a larger share."""
        now = time.perf_counter()
        left = max(0.0, self.end - now)
        return now + _FIRST_TRIAL_SHARE * left, now + _FIRST_MEASURED_SHARE * left

    def sweep_deadline(self, first: Trial) -> float:
        """The other trials end in time for a checkpoint and validation to be timed unhurried, and within
        `plan.calibration_share` of the first estimate of training time."""
        training = self.job.train_tokens / first.tokens_per_second
        share = self.config.plan.calibration_share * training
        by_budget = self.end - self._final_seconds(1.0 / first.tokens_per_second)
        by_share = time.perf_counter() + share
        self.budget_deadline = by_budget  # what the winner's confirmation must end by
        # What a skipped candidate's note names: the limit that ended the sweep, and the setting that moves it.
        self.sweep_limit = (f"plan.calibration_share {self.config.plan.calibration_share:g} of the estimated "
                            f"{training:.0f} s of training ({share:.0f} s); "
                            "a larger plan.calibration_share lets it run" if by_share < by_budget else
                            f"plan.calibration_budget {self.budget:.0f} s, less the checkpoint and validation "
                            "timings; a larger plan.calibration_budget lets it run")
        return min(by_budget, by_share)

    def run(self, candidate: Candidate, deadline: float, first_measured_deadline: float | None = None) -> Trial:
        from phase1a.model.build import Compilation, set_compiled, set_gradient_checkpointing

        set_gradient_checkpointing(self.model, candidate.gradient_checkpointing)
        set_compiled(self.model, Compilation(candidate.cuda_graphs, self.config.cache_dir / layout.COMPILE_CACHE)
                     if candidate.compile else None)
        method, job = self.config.method, self.job
        budget = RowBudget(token_budget(candidate.micro_batch_size, job.max_seq_length),
                           static_rows(training_device(), candidate.compile))
        batches = StepBatches(job.train_path, job.max_seq_length, self.order, method.batch_size, budget)
        self._announce(candidate, deadline)
        first = not self.trials
        if first:
            self.first_step_at = self.elapsed()
            if self.first_step_at >= self.budget:
                self.notes.append(f"the budget was spent before the first step ({self.startup:.0f} s loading the "
                                  f"model); one step ran past it, the least that measures a speed")
        trial = _trial(self.model, self.optimizer, batches, candidate,
                       _Steps(self.config.plan.calibration_steps, deadline, self.step_tokens, self.step_cap,
                              first_measured_deadline))
        if first:
            self.step_cap = trial.step_cap
        self.trials.append(trial)
        self.meter.advance(1)
        print(f"calibration trial {len(self.trials)} ({self.elapsed():.0f} s of the {self.budget:.0f} s budget): "
              f"{candidate.label()}: {_outcome(trial)}", flush=True)
        return trial

    def _announce(self, candidate: Candidate, deadline: float) -> None:
        number = len(self.trials) + 1
        if self.meter.total is not None and number > self.meter.total:
            self.meter.total = number  # the sweep moved to a best with more alternatives than the start had
        self.meter.note(f"trial {number} of {self.meter.total}: {candidate.label()} "
                        f"(until {deadline - self.began:.0f} s of the {self.budget:.0f} s budget)")

    def sweep(self, best: Trial, deadline: float) -> Trial:
        """Greedy, one knob at a time in `plan.sweep` order: a change is kept when it is faster by more than the
        noise; a slower one ends that knob (further steps the same way will not help)."""
        for knob in self.config.plan.sweep:
            for candidate in self.job.alternatives(best.candidate, knob):
                if any(t.candidate == candidate for t in self.trials):
                    continue
                expected = best.seconds + (_COMPILE_SECONDS if candidate.compile else 0.0)
                if time.perf_counter() + expected > deadline:
                    self._skip(candidate, deadline, expected)
                    continue
                trial = self.run(candidate, deadline)
                if trial.status == "measured" and trial.tokens_per_second > best.tokens_per_second * (1 + _MIN_GAIN):
                    best = trial
                elif trial.status == "measured":
                    break
        return best

    def _skip(self, candidate: Candidate, deadline: float, expected: float) -> None:
        left = max(0.0, deadline - time.perf_counter())
        self.trials.append(Trial(candidate=candidate, status="skipped", note=(
            f"not tried: a trial takes ~{expected:.0f} s and {left:.0f} s were left of the sweep's limit, "
            f"{self.sweep_limit}")))
        self.meter.advance(1)

    def confirm(self, best: Trial, deadline: float) -> Trial:
        """The measurement the estimate uses. The fastest of several noisy measurements is biased fast (the
        winner's curse), and a host's speed moves over seconds: when several were measured, the winner is measured
        again and both measurements pooled. The confirmation measures the choice rather than trying a candidate:
        it starts within the sweep's limit and ends within the budget's (on this project's CPU host the chat job's
        share left 9-11 s after two trials, the confirmation takes about 10)."""
        measured = sum(t.status == "measured" for t in self.trials)
        expected = best.seconds - (best.warmup_excess_seconds or 0.0)  # first-call costs are paid once
        now = time.perf_counter()
        if measured <= 1 or now >= deadline or now + expected > self.budget_deadline:
            return best
        again = self.run(best.candidate, self.budget_deadline)
        self.trials[-1] = again.model_copy(update={"note": "the chosen candidate, measured again"})
        return pooled(best, self.trials[-1], floor(training_device().type)) if again.status == "measured" else best

    def result(self, best: Trial, measurement: Trial, first: Trial) -> Calibration:
        from phase1a.model.build import set_gradient_checkpointing

        set_gradient_checkpointing(self.model, best.candidate.gradient_checkpointing)
        per_token = 1.0 / measurement.tokens_per_second
        self.meter.note("timing a checkpoint write" + (" and upload" if self.job.upload_to else "")
                        + (" and validation" if self.job.validation_path else ""))
        checkpoint = self._checkpoint()
        validation = self._validation(per_token, best.candidate)
        # A fresh process pays its first calls as the first trial did, and its candidate's own warm-up (compilation).
        warmup = max(first.warmup_excess_seconds or 0.0, best.warmup_excess_seconds or 0.0)
        warm = self._warm_excess(best)
        return Calibration(
            chosen=best.candidate, seconds_per_token=per_token, warmup_excess_seconds=warmup,
            first_calls_seconds=0.0 if warm is None else max(0.0, warmup - warm),
            startup_seconds=self.startup, device_setup_seconds=self.device_setup,
            first_step_at_seconds=self.first_step_at,
            checkpoint_seconds=checkpoint.write_seconds, checkpoint_bytes=checkpoint.bytes,
            checkpoint_upload_seconds=checkpoint.upload_seconds, peak_memory_gib=best.peak_memory_gib,
            trials=self.trials, budget_seconds=self.budget, seconds=self.elapsed(), validation=validation,
            footing=measurement.footing(), needed_seconds=self._needed(first, per_token, validation), notes=self.notes)

    def _warm_excess(self, best: Trial) -> float | None:
        """The chosen candidate's first-step costs in this process after its first trial: its own trial's where
        another ran first, else its measurement again's, else none (a run in this process paid 0.25 s of a first
        trial's 3.7 s on an H200, and none of 5.9 s on this project's CPU host, the tiny shape). None for a
        compiled candidate measured first: a run's new model compiles again."""
        if best.candidate.compile and self.trials[0].candidate == best.candidate:
            return None
        later = [t for t in self.trials[1:] if t.status == "measured" and t.candidate == best.candidate]
        return (later[0].warmup_excess_seconds or 0.0) if later else 0.0

    def _checkpoint_guess(self) -> tuple[int, float]:
        """The checkpoint's bytes and its write (and upload) at the assumed speeds."""
        trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        size = checkpoint_bytes(trainable, self.config.method.optimizer)
        upload = size / ASSUMED_STORE_BYTES_PER_SECOND if self.job.upload_to else 0.0
        return size, size / ASSUMED_DISK_BYTES_PER_SECOND + upload

    def _checkpoint(self) -> _CheckpointTiming:
        size, guess = self._checkpoint_guess()
        left = self.end - time.perf_counter()
        if guess > left / 2:  # half at most: validation's timing needs the rest
            self.notes.append(f"checkpoint not timed: ~{guess:.1f} s at the assumed speeds, {max(0.0, left):.0f} s "
                              f"of the budget left")
            return _CheckpointTiming(None, size)
        return _time_checkpoint(self.model, self.optimizer, self.job.work_dir, self.job.upload_to)

    def _validation(self, per_token: float, chosen: Candidate) -> ValidationSpeed | None:
        if not self.job.validation_path:
            return None
        rows, indices = self._validation_sample()
        guess = per_token / 3
        during_guess = training_rows_timing_seconds(rows, self._eval_sample(rows), guess)
        # Uncompiled and without Liger's kernels, as the validate stage loads the model, with the adapter's path as
        # the candidate is scored (off where it is merged), then off as the base is scored where it is not; then
        # the pass of an evaluation during training, the model as it trains.
        with evaluating(self.model), torch.no_grad():
            merged = merges_for_scoring(next(self.model.parameters()).dtype)
            # First: the merge's cost is its first write to the weights, which nothing before it may pay.
            fits = time.perf_counter() + self._merge_guess() < self.end
            merge = _time_merge(self.model) if merged and fits else None
            left = self.end - time.perf_counter()
            with liger.kernels_off(self.model):
                with adapter_off(self.model) if merged else nullcontext():
                    began = time.perf_counter()
                    speed = time_validation(self.model, rows, indices, self.config.validation, TimingAllowance(
                        seconds=left - during_guess - self._harness_guess(), forward_guess=guess))
                    candidate_seconds = time.perf_counter() - began
                base = None if merged or speed is None else self._base_validation(
                    rows, indices, speed, candidate_seconds, during_guess)
                with adapter_off(self.model):  # lm-eval scores the base's share as the base model
                    harness = None if speed is None else self._harness(base or speed)
            budget = token_budget(chosen.micro_batch_size, self.job.max_seq_length)  # training/loop.py's rows
            during = None if speed is None or self.job.evaluation is None else time_training_rows(
                self.model, rows, self._eval_sample(rows), budget, speed.forward_seconds_per_token, self.end)
        if speed is None:
            self.notes.append(f"validation not timed within the {max(0.0, left):.0f} s of the budget left; its "
                              f"speed is derived from the training speed")
            return None
        if speed.source != "measured":
            self.notes.append(f"validation timed within the {left:.0f} s left: {speed.source}")
        if merged and merge is None and self._merge_guess():
            self.notes.append("the adapter's merge before scoring not timed within the budget: not priced")
        if self.job.evaluation is not None and during is None:
            self.notes.append("an evaluation during training not timed within the budget: priced at the validate "
                              "stage's speed")
        if self.job.benchmarks and harness is None:
            self.notes.append("the benchmarks' harness not timed (generation only, or no time left): its own "
                              "seconds not priced")
        return speed.model_copy(update={"training_forward_seconds_per_token": during, "merge_seconds": merge,
                                        "harness_seconds": harness, "base": base})

    def _base_validation(self, rows: TokenRows, indices: np.ndarray, candidate: ValidationSpeed,
                         candidate_seconds: float, during_guess: float) -> ValidationSpeed | None:
        """The base model's costs, timed as the candidate's were with the adapter's path off, where what is left
        of the budget (less the evaluation during training's pass and the harness) holds the candidate's timing
        again: the base's share costs no more. None: not timed (the base is priced at the candidate's costs)."""
        left = self.end - time.perf_counter() - during_guess - self._harness_guess()
        if left < candidate_seconds:
            self.notes.append(f"the base model's validation not timed ({left:.0f} s left of the budget): priced at "
                              f"the candidate's costs")
            return None
        with adapter_off(self.model):
            return time_validation(self.model, rows, indices, self.config.validation, TimingAllowance(
                seconds=left, forward_guess=candidate.forward_seconds_per_token))

    def _harness(self, speed: ValidationSpeed) -> float | None:
        """lm-eval's own seconds in one benchmark's scoring (`time_harness`), on the model as the base is scored."""
        if not self.job.benchmarks:
            return None
        tokenizer = load_tokenizer(self.model_dir, self.config.model.trust_remote_code)
        return time_harness(self.model, tokenizer, self.job.benchmarks, self.config.validation.batch_size, speed,
                            self.end)

    def _harness_guess(self) -> float:
        return HARNESS_GUESS_SECONDS if self.job.benchmarks else 0.0

    def _final_seconds(self, per_token: float) -> float:
        """The checkpoint's and validation's timing, unhurried, at a training speed."""
        validation = 0.0
        if self.job.validation_path:
            rows, indices = self._validation_sample()
            validation = (validation_timing_seconds(rows, indices, self.config.validation, per_token / 3)
                          + training_rows_timing_seconds(rows, self._eval_sample(rows), per_token / 3))
        return self._checkpoint_guess()[1] + validation + self._merge_guess() + self._harness_guess()

    def _merge_guess(self) -> float:
        """The adapter's merge (`_time_merge`) before it is timed: the frozen weights' bytes at first writes'
        speed, 225 MB/s on this project's CPU host (425 MB in 1.9 s); device memory, far faster, is assumed at
        100 GB/s. 0 where the stage scores the adapter unmerged."""
        weights = [p for p in self.model.parameters() if not p.requires_grad]
        if not weights or not merges_for_scoring(next(self.model.parameters()).dtype):
            return 0.0
        rate = 225e6 if weights[0].device.type == "cpu" else 100e9
        return sum(p.numel() * p.element_size() for p in weights) / rate

    def _validation_sample(self) -> tuple[TokenRows, np.ndarray]:
        """The held-out rows and the sample the validate stage scores."""
        rows = TokenRows.load(self.job.validation_path)
        return rows, np.arange(min(len(rows), self.config.validation.max_examples))

    def _eval_sample(self, rows: TokenRows) -> np.ndarray:
        """The held-out rows an evaluation during training scores; none without one."""
        return self.job.evaluation.sample(rows) if self.job.evaluation is not None else np.arange(0)

    def _needed(self, first: Trial, per_token: float, validation: ValidationSpeed | None) -> float | None:
        """What a whole calibration of the first candidate would take, when this one was cut short: loading, the
        probe and the whole steps, and the unhurried checkpoint and validation timing."""
        whole = first.measured_steps >= self.config.plan.calibration_steps and (
            first.micro_batches >= first.step_micro_batches)
        if whole and not self.notes and (validation is None or validation.source == "measured"):
            return None
        steps = (1 + self.config.plan.calibration_steps) * self.step_tokens * per_token
        return self.startup + (first.warmup_excess_seconds or 0.0) + steps + self._final_seconds(per_token)


def _time_merge(model: torch.nn.Module) -> float | None:
    """Seconds to fold the LoRA adapter into the weights, as the validate stage does before scoring the candidate
    (`for_scoring`), then unfolded. None for a model without an adapter. The first write to weights read from disk
    is what costs (1.9 s for SmolLM2-135M on this project's CPU host, a second merge 0.12 s): the stage's merge is
    a first, and so is this one, timed before any other write."""
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        return None
    began = time.perf_counter()
    model.merge_adapter()
    seconds = time.perf_counter() - began
    model.unmerge_adapter()
    return seconds


def pooled(first: Trial, again: Trial, least: float) -> Trial:
    """One candidate's two measurements as one: seconds per token averaged over their measured steps, the spread
    the wider of each one's and the range between them (the host's speed moved between the two). Two whose ranges
    at ±`least` (the device's floor) do not overlap are not averaged: a host's load slows a measurement and never speeds
    it, so the slower one met a slow spell and the faster stands, its range still widened to the slower (on this
    project's CPU host a confirmation measured 136 tokens/s against 208; averaged, the run's 209 fell outside)."""
    steps = [max(1, t.measured_steps) for t in (first, again)]
    per_token = [1.0 / t.tokens_per_second for t in (first, again)]
    mean = float(np.average(per_token, weights=steps))
    between = abs(per_token[0] - per_token[1]) / 2 / mean
    said = f"measured twice: {first.tokens_per_second:.0f} and {again.tokens_per_second:.0f} tokens/s"
    common = {"spread": max(first.spread, again.spread, between), "seconds": first.seconds + again.seconds,
              "longest_step_seconds": max(first.longest_step_seconds, again.longest_step_seconds)}
    if between > least:
        faster, slower = sorted((first, again), key=lambda t: -t.tokens_per_second)
        reach = faster.tokens_per_second / slower.tokens_per_second - 1  # the slower's time, over the faster's
        note = f"{said}, {reach:.0%} apart: the faster stands, the slower met a slow spell"
        return faster.model_copy(update={**common, "spread": max(first.spread, again.spread, reach),
                                         "note": "; ".join(filter(None, [faster.note, note]))})
    return first.model_copy(update={
        **common, "tokens_per_second": 1.0 / mean, "measured_steps": first.measured_steps + again.measured_steps,
        "micro_batches": float(np.average([first.micro_batches, again.micro_batches], weights=steps)),
        "note": "; ".join(filter(None, [first.note, f"{said}, pooled"]))})


def _outcome(trial: Trial) -> str:
    if trial.status == "measured":
        speed = f"{trial.tokens_per_second:.0f} tokens/s in {trial.seconds:.0f} s"
        return f"{speed} ({trial.note})" if trial.note else speed
    return f"{trial.status}: {trial.note}"


@dataclass(frozen=True)
class _Steps:
    measured: int  # after the warm-up steps
    deadline: float  # perf_counter time: no step starts that is predicted to end past it
    step_tokens: float  # a whole step's tokens in the run: the update is priced once per this many
    cap: int | None = None  # micro-batches a measured step runs at most; None: the most the deadline holds
    first_measured_deadline: float | None = None  # the warm-up's and first measured step's, if later than `deadline`

    def ends_by(self, index: int) -> float:
        """The deadline of the trial's `index`th step (0: the warm-up step): the warm-up and the first measured
        step may run to the later one, so that a trial measures one step at least."""
        return max(self.deadline, self.first_measured_deadline or self.deadline) if index <= 1 else self.deadline


@dataclass(frozen=True)
class _Timed:
    """One step: its forward and backward (waiting for the loader included) and its update, timed apart."""

    forward_backward: float
    update: float
    tokens: int  # the examples' tokens: what the run's speed counts
    row_tokens: int  # the rows' tokens, padding included: what the time of a row follows
    micro_batches: int  # run
    whole: int  # in the step
    role: Literal["probe", "warmup", "measured"] = "measured"  # probe: one of `_probes`' small rows

    @property
    def warmup(self) -> bool:
        """Not a measured step: its first-call costs count as warm-up."""
        return self.role != "measured"

    @property
    def probe(self) -> bool:
        return self.role == "probe"

    @property
    def seconds(self) -> float:
        return self.forward_backward + self.update

    @property
    def per_token(self) -> float:
        return self.forward_backward / max(1, self.tokens)

    @property
    def per_row_token(self) -> float:
        return self.forward_backward / max(1, self.row_tokens)


def _probes(batches: StepBatches, position: int) -> list[StepBatch]:
    """One example (the `position`th of the run's order) in a row of each length the run's rows take (static rows:
    every allowed length, so that every shape is compiled and set up before a step is measured, the run's shortest
    example where that one is longer than the length; exact rows: the
    example's own, and a row of it and the next example where two fit, so that `_RowCost` can tell a row's fixed
    cost from its tokens'). The first comes twice: a first call costs several steady ones."""
    rows, shape, order = batches.rows, batches.shape, batches.order
    example, other = int(order[position]), int(order[(position + 1) % len(order)])
    if shape.static:
        made = rows_of_every_length(rows, shape, example)
        made = [made[0], *made]
    else:
        sizes = rows.lengths()
        pair = [[example, other]] if other != example and sizes[example] + sizes[other] <= shape.tokens else []
        made = [pack(rows, np.array(group), shape) for group in ([example], [example], *pair)]
    return [StepBatch(micro_batches=[row], supervised=row.supervised, step_tokens=row.tokens) for row in made]


@dataclass(frozen=True)
class _RowCost:
    """What a step is predicted to take: each row's forward and backward (a fixed part and a part per row token),
    and one update."""

    fixed: float
    per_row_token: float
    update: float

    @classmethod
    def of(cls, timed: list[_Timed]) -> "_RowCost":
        """At the last step's speed; while only probes have run, fitted over those after the first call. A probe's
        row holds one or two examples, and its fixed cost (a call through every layer) is much of it: priced per
        token, a full row of the run would be predicted several times too slow, and a trial cut before its first
        measured step (a 60 s budget on this project's CPU host measured 32 tokens/s where the run made ~120)."""
        last = timed[-1]
        points = [t for t in timed[1:] if t.probe]
        if not last.probe or len({t.row_tokens for t in points}) < 2:
            return cls(0.0, last.per_row_token, last.update)
        slope, intercept = np.polyfit([t.row_tokens for t in points], [t.forward_backward for t in points], 1)
        if slope <= 0:  # timing noise over rows this small: the dearest probe's rate, an upper bound
            return cls(0.0, max(t.per_row_token for t in points), last.update)
        return cls(max(0.0, float(intercept)), float(slope), last.update)

    @classmethod
    def fitted(cls, points: list["_Timed"], update: float) -> "_RowCost | None":
        """Fitted over steps of different shapes (the probes' one-example rows, the measured steps' full ones) to
        price the run's steps: on an H200 the eager SmolLM2-135M step was bound by kernel launches, 0.23 s
        whatever its 1,580-2,490 tokens (no correlation over 563 steps), so a trial's four steps priced per token
        give the speed of their own mix of tokens (the plan's came out 7-14 % above the run's, 2026-11-30: the
        likely cause); on a CPU the part per token is most of a step. Each point weighs by its own time (relative
        errors: a probe counts as much as a step); a part the noise puts below zero is left out and the other
        fitted alone. None: the points cannot tell the parts apart (their tokens a row differ by less than a
        quarter)."""
        rows = np.array([t.micro_batches for t in points], dtype=float)
        tokens = np.array([t.row_tokens for t in points], dtype=float)
        seconds = np.array([t.forward_backward for t in points])
        if len(points) < 3 or np.ptp(tokens / rows) < 0.25 * float(np.mean(tokens / rows)):
            return None
        design = np.column_stack([rows, tokens]) / seconds[:, None]  # each row over its time: relative errors
        (fixed, per_token), *_ = np.linalg.lstsq(design, np.ones(len(points)), rcond=None)
        if fixed < 0 or per_token < 0:
            kept = 1 if fixed < 0 else 0
            alone = design[:, kept]
            value = float(alone.sum() / (alone**2).sum())  # the least squares of that part alone
            fixed, per_token = (0.0, value) if kept else (value, 0.0)
        return cls(float(fixed), float(per_token), update)

    def rows(self, sizes: np.ndarray) -> np.ndarray:
        return self.fixed + sizes * self.per_row_token

    def seconds(self, rows: float, row_tokens: float) -> float:
        """A step's forward and backward, predicted: each of its rows' fixed part and its tokens'."""
        return rows * self.fixed + row_tokens * self.per_row_token

    def step(self, timed: "_Timed") -> float:
        return self.seconds(timed.micro_batches, timed.row_tokens)


def _trial(model, optimizer, batches: StepBatches, candidate: Candidate, steps: _Steps) -> Trial:
    """Warm-up and measured steps of one candidate, none started that is predicted to end past the deadline."""
    # Steps spread over the whole run, so their lengths are the run's; a short run repeats its steps. The first
    # gives the probes' example, the second is the warm-up step of the trial's own rows, the rest are measured.
    count = 2 + steps.measured
    sampler = [int(step) % len(batches) for step in np.linspace(0, len(batches), count, endpoint=False)]
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    began = time.perf_counter()
    timed: list[_Timed] = []
    try:
        last = began
        for probe in _probes(batches, sampler[0] * batches.batch_size):
            if timed and last + timed[-1].seconds > steps.deadline:
                break
            timed.append(_timed_step(model, optimizer, probe, 1, last, role="probe"))
            last = time.perf_counter()
        cap, chosen = steps.cap, steps.cap is not None  # the measured steps' cap: given, or set at the first
        for index, step_batch in enumerate(step_loader(batches, sampler[1:], candidate.dataloader_workers,
                                                       pin_memory=cuda)):
            left = count - 1 - index
            cost = _RowCost.of(timed)
            run = cap if chosen else _micro_batches_within(
                step_batch, cost, (steps.deadline - time.perf_counter()) / left)
            if index > 0 and not chosen:
                cap, chosen = run, True
            if time.perf_counter() + _predicted(step_batch, run, cost) > steps.ends_by(index):
                break
            timed.append(_timed_step(model, optimizer, step_batch, run, last, "warmup" if index == 0 else "measured"))
            last = time.perf_counter()
    except torch.cuda.OutOfMemoryError as error:
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        return Trial(candidate=candidate, status="out_of_memory", seconds=time.perf_counter() - began,
                     note=str(error).splitlines()[0])
    except Exception as error:  # a compiler missing on this host, say: that candidate is out, not the plan
        optimizer.zero_grad(set_to_none=True)
        return Trial(candidate=candidate, status="failed", seconds=time.perf_counter() - began,
                     note=f"{type(error).__name__}: {error}".splitlines()[0][:300])
    return _measured(candidate, timed, steps, time.perf_counter() - began).model_copy(update={"step_cap": cap})


def _timed_step(model, optimizer, step_batch: StepBatch, cap: int | None, since: float,
                role: Literal["probe", "warmup", "measured"] = "measured") -> _Timed:
    """One step, of its first `cap` micro-batches (None: all), as training runs a step (`optimizer_step`), timed
    from `since` (the end of the last step: waiting for the loader counts)."""
    rows = step_batch.micro_batches[:cap]
    train_step(model, step_batch, rows=cap)
    _sync()
    middle = time.perf_counter()
    apply_update(model, optimizer)
    _sync()
    return _Timed(middle - since, time.perf_counter() - middle, sum(row.tokens for row in rows),
                  sum(row.length for row in rows), len(rows), len(step_batch.micro_batches), role)


def _micro_batches_within(step_batch: StepBatch, cost: _RowCost, seconds: float) -> int | None:
    """The most of this step's micro-batches (one at least) whose forward and backward and one update are
    predicted to take at most `seconds`; None: all of them."""
    sizes = np.array([row.length for row in step_batch.micro_batches])
    fits = int(np.searchsorted(np.cumsum(cost.rows(sizes)), seconds - cost.update, side="right"))
    return None if fits >= len(sizes) else max(1, fits)


def _predicted(step_batch: StepBatch, cap: int | None, cost: _RowCost) -> float:
    sizes = np.array([row.length for row in step_batch.micro_batches[:cap]])
    return float(cost.rows(sizes).sum()) + cost.update


def _measured(candidate: Candidate, timed: list[_Timed], steps: _Steps, seconds: float) -> Trial:
    """The speed from the measured steps (from the last warm-up step where there are none): their forward and
    backward as a ratio of sums over the examples' tokens (padding costs time and counts nothing), so per-step
    costs weigh as in the run, and the update priced once per whole step of the run. A step slower than the others
    as the run's steps vary counts too (always leaving out the slowest of four made the estimate fast: by 1.6 % on
    the demo's even steps, resampled from a run's own step times); a burst, `_BURST` times the other steps' median
    seconds per token or more (the host busy for a moment, a first call), is left out and named."""
    warmup, measured = [t for t in timed if t.warmup], [t for t in timed if not t.warmup]
    notes = [] if len(measured) == steps.measured else [
        f"cut at the budget after {len(measured)} of {steps.measured} measured steps"]
    basis = measured or warmup[-1:]
    if not measured:
        notes.append("speed from warm-up steps")
    # Against the others' median, not all steps': of two steps, the slow one is half of all steps' median.
    over = [t.per_token / float(np.median([o.per_token for o in basis if o is not t])) if len(basis) > 1 else 1.0
            for t in basis]
    bursts = [t for t, times in zip(basis, over) if times >= _BURST]
    if bursts:
        basis = [t for t, times in zip(basis, over) if times < _BURST]
        notes.append(f"{len(bursts)} step{'s' if len(bursts) > 1 else ''} of {max(t.seconds for t in bursts):.1f} s "
                     f"left out, {max(over):.1f}x the others' time a token")
    update = float(np.mean([t.update for t in basis]))
    run, whole = float(np.mean([t.micro_batches for t in basis])), float(np.mean([t.whole for t in basis]))
    cost = _RowCost.fitted([t for t in timed[1:] if t.probe] + basis, update) if measured else None
    if cost is None:  # the steps' cost per token, as a ratio of sums
        forward_backward = sum(t.forward_backward for t in basis) / sum(t.tokens for t in basis)
        cost = _RowCost(0.0, sum(t.forward_backward for t in basis) / sum(t.row_tokens for t in basis), update)
        rates = [t.per_token for t in basis]
    else:  # the measured steps' mean time, moved by the fit from their mean shape to a whole step of the run's
        # mean tokens (padded as the measured steps were): the probes only tell how the time follows the shape
        padding = sum(t.row_tokens for t in basis) / sum(t.tokens for t in basis)
        sample = cost.seconds(run, float(np.mean([t.row_tokens for t in basis])))
        forward_backward = (float(np.mean([t.forward_backward for t in basis])) / sample
                            * cost.seconds(whole, padding * steps.step_tokens) / steps.step_tokens)
        rates = [t.forward_backward / cost.step(t) for t in basis]  # what the fit leaves unexplained
    per_token = forward_backward + update / steps.step_tokens
    excess = sum(t.seconds - cost.step(t) - update for t in warmup)
    if run < whole:
        notes.append(f"steps cut to {run:.3g} of their {whole:.3g} micro-batches on average")
    return Trial(candidate=candidate, status="measured", tokens_per_second=1.0 / per_token, note="; ".join(notes),
                 warmup_excess_seconds=max(0.0, excess), seconds=seconds,
                 peak_memory_gib=torch.cuda.max_memory_allocated() / GIB if torch.cuda.is_available() else None,
                 measured_steps=len(measured) - len(bursts) if measured else 0, micro_batches=run,
                 step_micro_batches=whole,
                 spread=(max(rates) - min(rates)) / 2 / float(np.mean(rates)),
                 longest_step_seconds=max(t.seconds for t in timed))


@dataclass(frozen=True)
class _CheckpointTiming:
    write_seconds: float | None
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


def _set_up_device() -> float:
    """Seconds to create the device's context and its matrix library's handle, as a process's first use of it
    does: part of calibration's start-up that a run in the same process does not pay again (on an H200 the first
    plan of a process measured 3.0 s to load SmolLM2-135M, the second 0.6 s). 0 on a CPU."""
    if not torch.cuda.is_available():
        return 0.0
    began = time.perf_counter()
    ones = torch.ones(8, 8, device="cuda", dtype=torch.bfloat16)
    (ones @ ones).sum().item()
    return time.perf_counter() - began


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
