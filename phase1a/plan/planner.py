"""The planner: pick micro-batch, accumulation, precision, gradient checkpointing, compilation and dataloader workers
from a memory and FLOPs model (`phase1a/model/cost_model.py`) and measured steps (`phase1a/plan/calibration.py`),
estimate time and cost, fit the time window (`phase1a/plan/window.py`) and price the other hardware options
(`phase1a/plan/options.py`).

`make_plan`, in named phases (the plan stage, tasks/plan.py, runs it):
  1. setup        the model's shape, the target hardware and whether it is the one present, the precision,
                  the attention, the memory model
  2. truncation   the profile's max_seq_length (fast cut at the p99.9 length; fast and balanced cut outliers)
  3. throughput   best first: the last whole runs of this model and method on this hardware (the history:
                  the latest run's knobs when they still fit, the upper median speed of the last few runs with
                  those knobs, so one run slowed by a neighbour does not set the plan); a calibration sweep
                  when the target hardware is the one present; else peak FLOP/s x `plan.assumed_mfu`, flagged
                  as assumed
  4. checkpoints  what one costs (written, and uploaded to the store) and the interval: `checkpoint.interval`, or
                  with `auto` Young/Daly's against the interruption rate (`phase1a/plan/interruptions.py`)
  5. window       epochs and truncation that fit `window.max_duration` (`phase1a/plan/window.py`), the expected
                  interruptions' lost work and restarts included
  6. estimate     seconds and dollars (below)
  7. plan         the knobs, the estimate and the options table

The estimate's formulas: docs/plan-models.md#the-estimate.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import torch
from pydantic import BaseModel

from phase1a.config.schema import Phase1aConfig
from phase1a.config.stores import open_store
from phase1a.core.hardware import (
    CATALOGUE,
    CPU,
    CUDA,
    DATA_SHEET,
    Accelerator,
    detect,
    history_kind,
    is_present,
    target_accelerator,
    training_device,
    training_dtype,
)
from phase1a.core.labels import IGNORE_INDEX
from phase1a.core.logs import run_logger
from phase1a.core.units import AUTO, GIB, Clock, parse_duration_seconds, parse_interval
from phase1a.data.lengths import right_size
from phase1a.data.tokenized import TokenizedData
from phase1a.evaluate.benchmarks import Benchmark, benchmark_work, load_benchmark
from phase1a.evaluate.metrics import validation_work
from phase1a.evaluate.result import EvaluationWork, ValidationSpeed
from phase1a.evaluate.scoring import Scoring
from phase1a.model.build import attention_implementation, release_device_memory
from phase1a.model.cost_model import (
    OPTIMIZER_STATE_BYTES,
    MemoryEstimate,
    MemoryModel,
    TrainingShape,
    checkpoint_bytes,
    flops_per_token,
    lora_parameters,
    model_facts,
)
from phase1a.model.loading import load_tokenizer
from phase1a.model.result import ResolvedModel
from phase1a.plan import footing
from phase1a.plan.calibration import CalibrationJob, calibrate, memory_alternatives, no_alternatives
from phase1a.plan.communication import StepTraffic, step_communication
from phase1a.plan.footing import Footing
from phase1a.plan.gpu_model import GpuStep, StepJob, gpu_step, load_overheads, modelled_speed
from phase1a.plan.interruptions import (
    ASSUMED_DISK_BYTES_PER_SECOND,
    ASSUMED_STORE_BYTES_PER_SECOND,
    CheckpointCost,
    Expected,
    Exposure,
    InterruptionEstimate,
    IntervalRule,
    auto_interval,
    expected,
    interval_text,
    overhead_share,
)
from phase1a.plan.notes import NO_STORE_WARNING, auto_note, history_note, outlier_note
from phase1a.plan.options import (
    DEFAULT_OPTIONS,
    DEFAULT_SCALING,
    OptionRow,
    OptionsJob,
    OptionsPolicy,
    OtherWork,
    SpotJob,
    option_rows,
    scaling_factor,
    with_option,
)
from phase1a.plan.result import Calibration, Candidate, Estimate, Plan
from phase1a.plan.target import gpu_hour_price, interruption_rate, own_option, own_overrides, shards
from phase1a.plan.window import FAST_PERCENTILE, Adjustment, Workload, fit_window
from phase1a.train.distributed import World
from phase1a.train.history import Remembered, RunRecord, history_path, remembered
from phase1a.train.packing import RowBudget, StepBatches, TokenRows, example_stream, static_rows, token_budget
from phase1a.train.settings import EvalSettings

_ASSUMED_STARTUP_SECONDS = 10.0  # interpreter, imports, CUDA context


def make_plan(config: Phase1aConfig, model: ResolvedModel, data: TokenizedData) -> Plan:
    planner = _Planner(config, model, data)  # 1. setup
    max_seq_length = planner.truncation()  # 2. truncation
    throughput = planner.throughput(max_seq_length)  # 3. throughput
    checkpoints = planner.checkpoints(throughput, max_seq_length)  # 4. checkpoints
    fit = planner.window(throughput, checkpoints, max_seq_length)  # 5. window
    estimate = planner.estimate(throughput, checkpoints, fit)  # 6. estimate
    return planner.plan(throughput, checkpoints, fit, estimate)  # 7. plan


class _Throughput(BaseModel):
    chosen: Candidate
    seconds_per_token: float
    warmup_seconds: float
    startup_seconds: float
    # What a process that did not calibrate (a plan from the cache, a restart on a fresh host) pays beyond
    # warmup_seconds and startup_seconds: the first calls and the device's set-up calibration paid in this one.
    first_calls_seconds: float = 0.0
    device_setup_seconds: float = 0.0
    checkpoint: CheckpointCost  # one checkpoint's write, and its upload as it would be with a store
    source: str
    footing: Footing  # what the speed rests on: the estimate's range
    calibration: Calibration | None = None
    remembered_evaluation: ValidationSpeed | None = None  # the last run's evaluation speeds (the history)

    def warm_load_seconds(self) -> float:
        """A load in the process that calibrated, as the validate stage's whatever the world size (torchrun's ranks
        exit first): calibration's start-up without the device's set-up; without a calibration, the start-up."""
        if self.calibration is None:
            return self.startup_seconds
        return self.calibration.startup_seconds - self.calibration.device_setup_seconds


def _evaluation_of(record: RunRecord) -> ValidationSpeed | None:
    """The evaluation speeds a past run of this job left (None: a record written before them)."""
    if record.eval_forward_seconds_per_token is None or record.eval_decode_seconds_per_step is None:
        return None
    return ValidationSpeed(forward_seconds_per_token=record.eval_forward_seconds_per_token,
                           decode_seconds_per_step=record.eval_decode_seconds_per_step,
                           decode_seconds_per_context_token=record.eval_decode_seconds_per_context_token,
                           prefill_seconds_per_token=record.eval_prefill_seconds_per_token,
                           training_forward_seconds_per_token=record.eval_training_forward_seconds_per_token,
                           merge_seconds=record.eval_merge_seconds, harness_seconds=record.eval_harness_seconds,
                           source="the last run's, its evaluations during training measured")


@dataclass
class _Checkpoints:
    """What a checkpoint costs, how often one is written, and what an interruption costs (phase 4)."""

    interval: str  # what training uses: checkpoint.interval, or auto's choice
    rule: IntervalRule
    cost: CheckpointCost  # delta: without a store, the write alone
    rate_per_hour: float  # interruptions per hour of a host
    rate_source: str
    restart_seconds: float  # a fresh host to its first step
    store: bool


@dataclass
class _Fit:
    """What the window fit decided, and what it was decided from."""

    epochs: float
    max_seq_length: int
    profile: str
    adjustments: list[Adjustment]
    window: float | None  # seconds
    evaluation_seconds: float
    before_window: int  # max_seq_length the memory and FLOPs were sized at
    eval_each_seconds: float = 0.0  # one evaluation during training (0: none)


class _Planner:
    """One plan's facts, gathered once (phase 1), and the phases that read them."""

    def __init__(self, config: Phase1aConfig, model: ResolvedModel, data: TokenizedData) -> None:
        self.config, self.model, self.data, self.notes = config, model, data, []
        self.policy, self.method = config.plan, config.method
        self.facts = model_facts(Path(model.path))
        self.target = target_accelerator(config.hardware.target)
        detected_key, self.detected = detect()
        self.present = is_present(config.hardware.target, detected_key)
        self.hardware_kind = history_kind(config.hardware.target, self.detected.name)  # what the history keys on
        if not self.present:
            self.notes.append(f"target {config.hardware.target} ({self.target.name}) is not present; this machine "
                              f"has {self.detected.name}")
        if self.target.peak_flops and self.target.peak_source != DATA_SHEET:
            self.notes.append(f"{self.target.name} is not in the hardware catalogue: its peak "
                              f"{self.target.peak_flops / 1e12:,.0f} TFLOP/s is {self.target.peak_source} (the "
                              "achieved rate, below a data sheet's figure)")
        if config.hardware.target == CUDA and gpu_hour_price(config.hardware, self.target) is None:
            self.notes.append(f"no price is known for {self.target.name}: the plan shows no cost; set "
                              f"hardware.{'spot_' if config.hardware.spot else ''}price_per_gpu_hour (USD per "
                              "GPU-hour)")
        self.dtype = training_dtype(training_device()) if self.present else torch.bfloat16
        self.attention = attention_implementation(self.method, training_device(), self.dtype)
        self.shape = TrainingShape(
            full=self.method.kind == "full", weight_bytes=torch.finfo(self.dtype).bits // 8,
            base_bits=4 if self.method.base_precision == "4bit" else 16, optimizer=self.method.optimizer,
            shards=shards(config.hardware),
            dense_mask=self.attention == "sdpa")
        trainable = (self.facts.parameters if self.shape.full
                     else lora_parameters(self.facts, self.method.lora.r, self.method.lora.target_modules))
        self.memory = MemoryModel(self.facts, self.shape, trainable,
                                  int(self.target.memory_bytes * (1 - config.plan.memory_headroom)))
        self.lengths = TokenRows.load(data.train_path).lengths()
        self.eval_settings = EvalSettings.of(config, data.validation_path, data.validation_examples)
        self.rate_per_hour, self.rate_source = interruption_rate(config, self.target)

    # ---- 2. truncation -----------------------------------------------------------------------------------

    def truncation(self) -> int:
        """fast: the longest 0.1 % of examples are truncated rather than sizing every batch; fast and balanced: an
        outlier (phase1a/data/lengths.py) never sizes the run, it is cut to the length the other examples size to."""
        data, profile = self.data, self.policy.profile
        length = data.max_seq_length
        if profile == "fast":
            length = min(length, right_size(self.lengths, FAST_PERCENTILE, data.model_max_length, None))
        if profile in ("fast", "balanced") and data.outliers and data.outliers.others_length < length:
            length = data.outliers.others_length
            truncated = np.flatnonzero(self.lengths > length)
            self.notes.append(outlier_note(profile, data.outliers, data.max_seq_length, truncated.size,
                                            self._left_without_labels(truncated, length)))
        return length

    def _left_without_labels(self, truncated: np.ndarray, length: int) -> int:
        """Of the truncated training examples, those with no trained token left within `length` (an answer past the
        cut): they train as nothing, and the note says how many."""
        rows = TokenRows.load(self.data.train_path)
        return sum(not np.any(rows.labels[rows.offsets[i] + 1 : rows.offsets[i] + length] != IGNORE_INDEX)
                   for i in truncated)

    # ---- 3. throughput -----------------------------------------------------------------------------------

    def throughput(self, max_seq_length: int) -> _Throughput:
        start = self._start_candidate(max_seq_length)
        sweeps = self.policy.profile not in ("custom", "memory_efficient")  # those fix the knobs themselves
        config = self.config
        past = remembered(history_path(config.cache_dir), self.model.fingerprint, self.hardware_kind,
                          self.method.kind, config.hardware.world_size)
        if past and self._fits(candidate := _candidate_of(past.record), max_seq_length) and (
                sweeps or candidate == start):
            self.notes.append(history_note(past, self.hardware_kind))
            return self._from_history(past, candidate)  # a run on as many GPUs: its whole speed
        if self.present and config.plan.calibration_steps > 0:
            return self._on_every_rank(self._calibrated(start, max_seq_length, sweeps), max_seq_length)
        flops = flops_per_token(self.facts, self.shape.full, start.gradient_checkpointing,
                                _mean(self.lengths, max_seq_length))
        if config.hardware.target in CATALOGUE and self.target.peak_flops:  # a GPU not here: the GPU model's
            return self._on_every_rank(self._modelled(start, max_seq_length, flops), max_seq_length)
        peak = "" if self.target.peak_source == DATA_SHEET else " (measured)"
        self.notes.append(f"throughput assumed at {self.policy.assumed_mfu:.0%} MFU of {self.target.name}'s peak"
                          f"{peak}, not measured; start-up and checkpoint writes assumed at 1 GiB/s")
        return self._on_every_rank(_Throughput(
            chosen=start, seconds_per_token=flops / (_peak_flops(self.target) * self.policy.assumed_mfu),
            warmup_seconds=0.0, startup_seconds=self._assumed_startup(), checkpoint=self._checkpoint_cost(None, None),
            source="assumed", footing=footing.assumed(self.policy.assumed_mfu)), max_seq_length)

    def _modelled(self, start: Candidate, max_seq_length: int, flops: float) -> _Throughput:
        """A catalogue GPU that is not present: its speed for this job's steps from the GPU model (kernel launches
        and per-step overhead fitted to committed GPU measurements, compute at `plan.assumed_mfu`), with its range."""
        target = self.config.hardware.target
        speed = modelled_speed(self._gpu_step(start, max_seq_length, flops), target, self.policy.assumed_mfu)
        words = f"{speed.words(load_overheads())}, {speed.low:,.0f}-{speed.high:,.0f} tokens/s"
        self.notes.append(f"throughput modelled for {self.target.name}, not measured: {words} "
                          f"(phase1a/plan/gpu_model.py); start-up and checkpoint writes assumed at 1 GiB/s")
        return _Throughput(chosen=start, seconds_per_token=1.0 / speed.value, warmup_seconds=0.0,
                           startup_seconds=self._assumed_startup(), checkpoint=self._checkpoint_cost(None, None),
                           source="modelled", footing=footing.modelled(speed.value, speed.low, speed.high, words))

    def _on_every_rank(self, one: _Throughput, max_seq_length: int) -> _Throughput:
        """One GPU's speed (measured or assumed) as the run's on every GPU of every node: each takes its share of
        a step, and the step's transfers between them cost what compute does not hide
        (phase1a/plan/communication.py)."""
        hardware = self.config.hardware
        ranks = hardware.world_size
        if ranks == 1:
            return one
        if hardware.target == CPU:
            self.notes.append(f"{ranks} processes on {self.target.name}: they share its cores and no interconnect is "
                              "catalogued for it; the estimate keeps one process's speed")
            return one
        if hardware.target not in CATALOGUE:  # this machine's GPU: no link bandwidth to price a step's transfers by
            efficiency = scaling_factor(ranks)
            self.notes.append(f"{ranks} GPUs ({hardware.num_nodes} x {hardware.num_gpus}) of {self.target.name}: no "
                              f"interconnect is catalogued for it, so the default {DEFAULT_SCALING:.0%} a doubling: "
                              f"scaling {efficiency:.1%} of {ranks}x")
            return one.model_copy(update={"seconds_per_token": one.seconds_per_token / (ranks * efficiency)})
        traffic = self._traffic(one.seconds_per_token, one.chosen.micro_batch_size, max_seq_length, ranks)
        moved = step_communication(traffic, hardware.strategy, hardware.target, hardware.num_gpus,
                                   hardware.num_nodes, hardware.network)
        self.notes.append(f"{ranks} GPUs ({hardware.num_nodes} x {hardware.num_gpus}, {hardware.strategy}): a step "
                          f"moves {moved.seconds:.2f} s of transfers, {moved.exposed_seconds:.2f} s of them not "
                          f"hidden by compute: scaling {moved.efficiency:.1%} of {ranks}x")
        return one.model_copy(update={"seconds_per_token": one.seconds_per_token / (ranks * moved.efficiency)})

    def _traffic(self, seconds_per_token: float, micro_batch_size: int, max_seq_length: int,
                 ranks: int = 1) -> StepTraffic:
        """One step on one of `ranks` GPUs, each with its share of the global batch, at one GPU's speed."""
        step_tokens = self.method.batch_size * _mean(self.lengths, max_seq_length)
        weight_bytes = self.facts.parameters * (4 if self.shape.full else self.shape.weight_bytes)
        return StepTraffic(weight_bytes=weight_bytes, gradient_bytes=self.memory.trainable * 4,
                           micro_batches=max(1, self.method.batch_size // micro_batch_size // ranks),
                           compute_seconds=step_tokens / ranks * seconds_per_token,
                           backward_share=2 / 3 if self.shape.full else 1 / 2)

    def _calibrated(self, start: Candidate, max_seq_length: int, sweeps: bool) -> _Throughput:
        config = self.config
        job = CalibrationJob(
            train_path=self.data.train_path, max_seq_length=max_seq_length, start=start,
            train_tokens=int(np.minimum(self.lengths, max_seq_length).sum() * self.method.epochs),
            work_dir=config.work_dir / config.name, validation_path=self.data.validation_path,
            evaluation=self.eval_settings, benchmarks=self._benchmarks,
            alternatives=memory_alternatives(self.memory, self.method.batch_size, max_seq_length) if sweeps
            else no_alternatives,
            # Timed only where the plan weighs it: the interval auto chooses, the cost of interruptions.
            upload_to=open_store(config.store) if config.checkpoint.interval == AUTO or self.rate_per_hour else None)
        calibration = calibrate(config, Path(self.model.path), job)
        release_device_memory()  # the calibration's model: training builds its own
        self.notes += [f"calibration: {note}" for note in calibration.notes]
        if calibration.checkpoint_seconds is None:  # the budget had no room to time one
            checkpoint = self._checkpoint_cost(None, None)
        else:
            checkpoint = _with_upload(CheckpointCost(write_seconds=calibration.checkpoint_seconds,
                                                     write_source="measured", bytes=calibration.checkpoint_bytes),
                                      calibration.checkpoint_upload_seconds, "measured")
        # One rank trains in this process, after calibration paid the process's first calls: it pays neither
        # them nor the device's set-up again (ranks under torchrun are fresh processes and pay both).
        warm = self.config.hardware.world_size == 1
        first_calls = calibration.first_calls_seconds if warm else 0.0
        setup = calibration.device_setup_seconds if warm else 0.0
        return _Throughput(chosen=calibration.chosen, seconds_per_token=calibration.seconds_per_token,
                           warmup_seconds=calibration.warmup_excess_seconds - first_calls,
                           startup_seconds=calibration.startup_seconds - setup, first_calls_seconds=first_calls,
                           device_setup_seconds=setup, checkpoint=checkpoint,
                           source="measured", footing=calibration.footing, calibration=calibration)

    def _start_candidate(self, max_seq_length: int) -> Candidate:
        """memory_efficient: one example with checkpointing; custom: the user's knobs, checked; else the memory
        model's pick (the largest micro-batch that fits, checkpointing only when needed)."""
        policy, batch_size = self.policy, self.method.batch_size
        if policy.profile == "memory_efficient":
            candidate = Candidate(micro_batch_size=1, gradient_checkpointing=True)
        elif policy.profile == "custom":
            if policy.micro_batch_size is None or policy.gradient_checkpointing is None:
                raise ValueError("plan.profile custom needs plan.micro_batch_size and plan.gradient_checkpointing")
            if batch_size % policy.micro_batch_size:
                raise ValueError(f"plan.micro_batch_size {policy.micro_batch_size} must divide method.batch_size "
                                 f"{batch_size}")
            candidate = Candidate(micro_batch_size=policy.micro_batch_size,
                                  gradient_checkpointing=policy.gradient_checkpointing,
                                  compile=bool(policy.compile), cuda_graphs=bool(policy.compile and policy.cuda_graphs),
                                  dataloader_workers=policy.dataloader_workers or 0)
        else:
            micro, checkpointing, _ = self.memory.choose(batch_size, max_seq_length)
            return Candidate(micro_batch_size=micro, gradient_checkpointing=checkpointing)
        memory = self.memory.micro_batch(candidate.micro_batch_size, max_seq_length, candidate.gradient_checkpointing)
        if memory.total_gib > memory.available_gib:
            raise MemoryError(f"plan.profile {policy.profile}: micro-batch {candidate.micro_batch_size} needs "
                              f"{memory.total_gib:.1f} GiB, {memory.available_gib:.1f} GiB are available")
        return candidate

    def _fits(self, candidate: Candidate, max_seq_length: int) -> bool:
        memory = self.memory.micro_batch(candidate.micro_batch_size, max_seq_length, candidate.gradient_checkpointing)
        return self.method.batch_size % candidate.micro_batch_size == 0 and memory.total_gib <= memory.available_gib

    def _from_history(self, past: Remembered, candidate: Candidate) -> _Throughput:
        record = past.record
        return _Throughput(
            chosen=candidate, seconds_per_token=1.0 / past.tokens_per_second, warmup_seconds=0.0,
            startup_seconds=record.startup_seconds if record.startup_seconds is not None else self._assumed_startup(),
            checkpoint=self._checkpoint_cost(record.checkpoint_seconds_each, record.checkpoint_upload_seconds_each),
            source="history", footing=footing.history(past.runs), remembered_evaluation=_evaluation_of(record))

    def _assumed_startup(self) -> float:
        return (_ASSUMED_STARTUP_SECONDS
                + self.facts.parameters * self.shape.weight_bytes / ASSUMED_DISK_BYTES_PER_SECOND)

    def _checkpoint_cost(self, write: float | None, upload: float | None) -> CheckpointCost:
        """From a run's measurements where it made them, else the trainable weights (fp32) and their optimizer
        state, written at 1 GiB/s."""
        size = checkpoint_bytes(self.memory.trainable, self.shape.optimizer)
        cost = CheckpointCost(write_seconds=size / ASSUMED_DISK_BYTES_PER_SECOND if write is None else write,
                              write_source="assumed" if write is None else "history", bytes=size)
        return _with_upload(cost, upload, "history")

    # ---- 4. checkpoints ----------------------------------------------------------------------------------

    def checkpoints(self, throughput: _Throughput, max_seq_length: int) -> _Checkpoints:
        """delta (the write, and the upload to a store), the interval (auto: phase1a/plan/interruptions.py) and a
        fresh host's restart: the gone host's lease running out, start-up, warm-up, the checkpoint's download at
        the upload's speed."""
        config, rate = self.config, self.rate_per_hour
        store = config.store.url is not None
        cost = throughput.checkpoint if store else throughput.checkpoint.model_copy(
            update={"upload_seconds": 0.0, "upload_source": "no store"})
        restart = (throughput.startup_seconds + throughput.device_setup_seconds + throughput.warmup_seconds
                   + throughput.first_calls_seconds  # a fresh host's process pays its first calls
                   + (parse_duration_seconds(config.store.lease_ttl) + cost.upload_seconds if store else 0.0))
        interval, rule = config.checkpoint.interval, "configured"
        if interval == AUTO:
            train = self._train_tokens(self.method.epochs, max_seq_length) * throughput.seconds_per_token
            seconds, rule = auto_interval(rate, cost.seconds, train, store)
            interval = interval_text(seconds)
            self.notes.append(auto_note(interval, rule, cost, rate, self.rate_source))
        if store and cost.upload_source == "assumed" and (rule != "configured" or rate):
            self.notes.append(f"checkpoint upload assumed at {ASSUMED_STORE_BYTES_PER_SECOND / 1e6:.0f} MB/s "
                              f"({cost.bytes / 1e6:.1f} MB: {cost.upload_seconds:.1f} s), not measured")
        if config.hardware.spot and not store:
            self.notes.append(NO_STORE_WARNING)
            run_logger().warning(NO_STORE_WARNING)
        return _Checkpoints(interval=interval, rule=rule, cost=cost, rate_per_hour=rate,
                            rate_source=self.rate_source, restart_seconds=restart, store=store)

    # ---- 5. window ---------------------------------------------------------------------------------------

    def window(self, throughput: _Throughput, checkpoints: _Checkpoints, max_seq_length: int) -> _Fit:
        config, spt = self.config, throughput.seconds_per_token
        speed = self._validation_speed(throughput, max_seq_length)
        evaluation = self._validation_estimate(throughput, speed)
        eval_each = self._eval_during_training_each(throughput, speed)
        # The window fit sees checkpoints and evaluations during training as a surcharge on every token, the rate
        # of whichever limit of their interval fires first; the final weights' evaluation is a fixed cost.
        per_token = self._per_token(spt, max_seq_length)
        checkpoints_per_token = parse_interval(checkpoints.interval).rate(per_token)
        evals_per_token = self.eval_settings.interval(checkpoints.interval).rate(per_token) if eval_each else 0.0
        work = Workload(lengths=self.lengths, epochs=self.method.epochs, max_seq_length=max_seq_length,
                        model_max_length=self.data.model_max_length,
                        seconds_per_token=(spt + checkpoints_per_token * checkpoints.cost.write_seconds
                                           + evals_per_token * eval_each),
                        fixed_seconds=throughput.startup_seconds + throughput.warmup_seconds + evaluation + eval_each)
        fit = _Fit(self.method.epochs, max_seq_length, self.policy.profile, [], None, evaluation, max_seq_length,
                   eval_each)
        if checkpoints.rate_per_hour:
            # The share at the run as configured: cutting epochs only shortens what an interruption can lose.
            run = work.seconds(work.epochs, max_seq_length)
            exposure = self._exposure(checkpoints, run, run - throughput.startup_seconds - evaluation, spt,
                                      max_seq_length)
            work.overhead = overhead_share(checkpoints.rate_per_hour, exposure.cost_each)
        if config.window.max_duration:
            fit.window = parse_duration_seconds(config.window.max_duration)
            budget = fit.window - parse_duration_seconds(config.window.safety_margin)
            fit.epochs, fit.max_seq_length, fit.profile, fit.adjustments = fit_window(
                work, budget, self.policy.profile, self.policy.min_epochs)
        return fit

    def _validation_speed(self, throughput: _Throughput, max_seq_length: int) -> ValidationSpeed:
        """Measured where the calibration timed it, else modelled from the training speed on the target."""
        if throughput.calibration is not None and throughput.calibration.validation is not None:
            return throughput.calibration.validation
        if throughput.remembered_evaluation is not None:
            return throughput.remembered_evaluation
        return self._modelled_validation_speed(throughput.seconds_per_token, self.target,
                                               throughput.chosen.gradient_checkpointing, max_seq_length)

    @staticmethod
    def _evaluation_footing(throughput: _Throughput) -> Footing:
        """Evaluation's range: from the passes calibration timed, else derived from the training speed."""
        timed = throughput.calibration.validation if throughput.calibration is not None else None
        if timed is not None:
            return footing.timed_evaluation(max(timed.passes, 1), timed.spread, footing.floor(training_device().type))
        if throughput.remembered_evaluation is not None:
            return footing.remembered_evaluation()
        return footing.derived_evaluation()

    def _modelled_validation_speed(self, seconds_per_token: float, accelerator: Accelerator, checkpointing: bool,
                                   max_seq_length: int) -> ValidationSpeed:
        """A forward pass at 2N of the step's FLOPs a token and a greedy step at the weights' read from memory (or,
        with no bandwidth catalogued, one forward token per row of the generation batch)."""
        facts = self.facts
        flops = flops_per_token(facts, self.shape.full, checkpointing, _mean(self.lengths, max_seq_length))
        forward = seconds_per_token * (2 * facts.parameters) / flops
        step = (facts.parameters * self.shape.weight_bytes / accelerator.memory_bandwidth
                if accelerator.memory_bandwidth else forward * self.config.validation.generation_batch_size)
        return ValidationSpeed(forward_seconds_per_token=forward, decode_seconds_per_step=step,
                               source="modelled from the training speed")

    def _validation_loads(self) -> int:
        """Models the validate stage loads anew: the trained one, the base of a full fine-tune, a promoted
        baseline."""
        return 1 + (self.method.kind == "full") + (self.config.validation.baseline == "promoted")

    def _scored_work(self) -> EvaluationWork:
        """The validate stage's work on the trained model and a promoted baseline's (the adapter's path as each is
        scored); the base model's share is `_base_work`, left out where its metrics and benchmark scores on this
        device are on disk."""
        settings = self.config.validation
        models = 1 + (settings.baseline == "promoted")
        return validation_work(*self._validation_sample, settings, models) + self._benchmark_work * models

    def _base_seconds(self, speed: ValidationSpeed) -> float:
        """The base model's share at the base's own costs (the adapter's path off), where calibration timed them."""
        return self._base_work().seconds(speed.for_base())

    def _base_work(self) -> EvaluationWork:
        """The base model's share of the validate stage: the teacher-forced pass, generation (untuned: its answers
        run to max_new_tokens) and its benchmarks."""
        return validation_work(*self._validation_sample, self.config.validation, 0, untuned=1) + self._benchmark_work

    @cached_property
    def _validation_sample(self) -> tuple[TokenRows, np.ndarray]:
        """The validate stage's sample (read once: the window, the estimate and the options table price it)."""
        rows = TokenRows.load(self.data.validation_path)
        return rows, np.arange(min(len(rows), self.config.validation.max_examples))

    @cached_property
    def _base_cached(self) -> bool:
        """Whether an earlier run on this device left the base model's scores of this sample (the validate stage
        reads them instead of scoring the base again; phase1a/evaluate/scoring.py)."""
        if not self.present or not self.data.validation_path:  # another device's scores are its own
            return False
        return Scoring.of(self.config, self.model, Path(self.data.validation_path)).base_cached(training_device())

    @cached_property
    def _benchmarks(self) -> list[Benchmark]:
        """validation.benchmarks, loaded once: the plan prices them and calibration times their harness."""
        return [load_benchmark(spec) for spec in self.config.validation.benchmarks]

    @cached_property
    def _benchmark_work(self) -> EvaluationWork:
        """One model's benchmarks (validation.benchmarks): their requests, as the harness will run them."""
        if not self._benchmarks:
            return EvaluationWork()
        tokenizer = load_tokenizer(Path(self.model.path), self.config.model.trust_remote_code)
        work = EvaluationWork()
        for benchmark in self._benchmarks:
            work = work + benchmark_work(benchmark, tokenizer, self.config.validation.batch_size)
        return work

    def _validation_merges(self) -> int:
        """Adapters the validate stage folds into their weights before scoring: the candidate's, a promoted
        baseline's."""
        return (self.method.kind != "full") * (1 + (self.config.validation.baseline == "promoted"))

    def _validation_estimate(self, throughput: _Throughput, speed: ValidationSpeed) -> float:
        """The validate stage as it will run: its loads and merges, and its work
        (phase1a.evaluate.metrics.validation_work)."""
        return (self._validation_loads() * throughput.warm_load_seconds()
                + self._validation_merges() * (speed.merge_seconds or 0.0)
                + self._scored_work().seconds(speed) + (0.0 if self._base_cached else self._base_seconds(speed)))

    def _eval_during_training_work(self) -> EvaluationWork:
        """One evaluation during training (phase1a/train/evaluation.py): the forward pass over its sample."""
        settings = self.eval_settings
        if settings is None:
            return EvaluationWork()
        rows = TokenRows.load(settings.validation_path)
        return EvaluationWork(forward_tokens=float(rows.lengths()[settings.sample(rows)].sum()))

    def _eval_during_training_each(self, throughput: _Throughput, speed: ValidationSpeed) -> float:
        """One evaluation during training at the validate stage's speed and, with early stopping, a write of the
        trainable weights to best/ (their share of a checkpoint, which also holds the optimizer state), counted
        at every evaluation: an upper bound."""
        settings = self.eval_settings
        if settings is None:
            return 0.0
        forward = self._eval_during_training_work().seconds(speed.during_training())
        if settings.patience is None:
            return forward
        weights_share = 4 / (4 + OPTIMIZER_STATE_BYTES[self.shape.optimizer])  # fp32 weights beside their state
        return forward + weights_share * throughput.checkpoint.write_seconds

    def _per_token(self, seconds_per_token: float, max_seq_length: int) -> Clock:
        """One token of the run in every dimension an interval is written in."""
        tokens_per_epoch = float(np.minimum(self.lengths, max_seq_length).sum())
        steps_per_epoch = max(1, math.ceil(len(self.lengths) / self.method.batch_size))
        return Clock(seconds=seconds_per_token, steps=steps_per_epoch / tokens_per_epoch, tokens=1,
                     epochs=1 / tokens_per_epoch)

    def _exposure(self, checkpoints: _Checkpoints, run_seconds: float, train_seconds: float,
                  seconds_per_token: float, max_seq_length: int) -> Exposure:
        """The run as interruptions see it; a steps, tokens or epochs interval in wall time at the planned speed."""
        per_token = parse_interval(checkpoints.interval).rate(self._per_token(seconds_per_token, max_seq_length))
        interval = seconds_per_token / per_token if per_token else train_seconds  # none fires: the whole run
        return Exposure(run_seconds=run_seconds, train_seconds=train_seconds, interval_seconds=min(interval,
                        train_seconds), checkpoint_seconds=checkpoints.cost.seconds,
                        restart_seconds=checkpoints.restart_seconds, store=checkpoints.store)

    # ---- 6. estimate -------------------------------------------------------------------------------------

    def estimate(self, throughput: _Throughput, checkpoints: _Checkpoints, fit: _Fit) -> Estimate:
        steps = self._steps(fit.epochs)
        train_tokens = self._train_tokens(fit.epochs, fit.max_seq_length)
        steady = train_tokens * throughput.seconds_per_token
        run = Clock(seconds=steady, steps=steps, tokens=train_tokens, epochs=fit.epochs)
        count = parse_interval(checkpoints.interval).count(run)
        checkpoint_seconds = count * checkpoints.cost.write_seconds  # the upload runs beside training
        # Early stopping may end the run sooner: the estimate is the whole run's, the most it can take.
        evaluations = self.eval_settings.evaluations(checkpoints.interval, run) if self.eval_settings else 0
        eval_seconds = evaluations * fit.eval_each_seconds
        train_seconds = steady + throughput.warmup_seconds + checkpoint_seconds + eval_seconds
        uninterrupted = throughput.startup_seconds + train_seconds + fit.evaluation_seconds
        interrupted = self._expected(throughput, checkpoints, fit, uninterrupted - fit.evaluation_seconds)
        speed = self._validation_speed(throughput, fit.max_seq_length)
        return Estimate(
            startup_seconds=throughput.startup_seconds, steady_seconds=steady, warmup_seconds=throughput.warmup_seconds,
            first_calls_seconds=throughput.first_calls_seconds, checkpoints=count,
            checkpoint_seconds=checkpoint_seconds, evaluation_seconds=fit.evaluation_seconds,
            base_cached=self._base_cached, base_evaluation_seconds=self._base_seconds(speed),
            evaluation_speed=speed,
            evaluations_during_training=evaluations, eval_during_training_seconds=eval_seconds,
            train_seconds=train_seconds, interruption_seconds=interrupted.extra_seconds,
            total_seconds=uninterrupted + interrupted.extra_seconds).with_range(throughput.footing,
                                                                                self._evaluation_footing(throughput))

    def _expected(self, throughput: _Throughput, checkpoints: _Checkpoints, fit: _Fit,
                  through_train_seconds: float) -> Expected:
        """The interruptions expected over the run (start-up and train, `through_train_seconds`, and the
        evaluation), and what they cost."""
        exposure = self._exposure(checkpoints, through_train_seconds + fit.evaluation_seconds,
                                  through_train_seconds - throughput.startup_seconds, throughput.seconds_per_token,
                                  fit.max_seq_length)
        return expected(checkpoints.rate_per_hour, exposure)

    def _steps(self, epochs: float) -> int:
        total_examples = max(1, round(len(self.lengths) * epochs))
        return -(-total_examples // self.method.batch_size)

    def _train_tokens(self, epochs: float, max_seq_length: int) -> int:
        return int(round(np.minimum(self.lengths, max_seq_length).sum() * epochs))

    # ---- 7. plan -----------------------------------------------------------------------------------------

    def plan(self, throughput: _Throughput, checkpoints: _Checkpoints, fit: _Fit, estimate: Estimate) -> Plan:
        chosen, hardware = throughput.chosen, self.config.hardware
        # Memory and FLOPs as sized for the calibrated knobs, before the window fit; MFU counts the final length.
        memory = self.memory.micro_batch(chosen.micro_batch_size, fit.before_window, chosen.gradient_checkpointing)
        flops = flops_per_token(self.facts, self.shape.full, chosen.gradient_checkpointing,
                                _mean(self.lengths, fit.before_window))
        price = gpu_hour_price(hardware, self.target)
        return Plan(
            profile=fit.profile, epochs=fit.epochs, adjustments=fit.adjustments, target=hardware.target,
            detected=self.detected.name, calibrated=throughput.source == "measured",
            precision=str(self.dtype).removeprefix("torch."), base_precision=self.method.base_precision,
            optimizer=self.method.optimizer, attention=self.attention, micro_batch_size=chosen.micro_batch_size,
            gradient_accumulation=self.method.batch_size // chosen.micro_batch_size,
            gradient_checkpointing=chosen.gradient_checkpointing, compile=chosen.compile,
            cuda_graphs=chosen.cuda_graphs,
            dataloader_workers=chosen.dataloader_workers, max_seq_length=fit.max_seq_length, model=self.facts,
            **self._rows(chosen, fit),
            trainable_parameters=self.memory.trainable, memory=memory,
            measured_peak_memory_gib=throughput.calibration.peak_memory_gib if throughput.calibration else None,
            flops_per_token=flops, tokens_per_second=1.0 / throughput.seconds_per_token,
            model_flops_per_token=flops_per_token(self.facts, self.shape.full, False,
                                                  _mean(self.lengths, fit.max_seq_length)),
            steps=self._steps(fit.epochs), train_tokens=self._train_tokens(fit.epochs, fit.max_seq_length),
            estimate=estimate, estimated_train_seconds=estimate.train_seconds,
            estimated_total_seconds=estimate.total_seconds,
            estimated_cost_usd=(None if price is None
                                else price * hardware.world_size * estimate.total_seconds / 3600),
            window_seconds=fit.window, fits_in_window=None if fit.window is None else True,
            throughput_source=throughput.source, calibration=throughput.calibration,
            options=self._options(throughput, checkpoints, fit, estimate, (flops, memory)), notes=self.notes,
            checkpoint_interval=checkpoints.interval,
            interruptions=self._interruptions(throughput, checkpoints, fit, estimate),
        )

    def _rows(self, chosen: Candidate, fit: _Fit) -> dict:
        """The rows training will run (phase1a/train/packing.py): their shape on the target, padding's share."""
        target = torch.device("cpu" if self.config.hardware.target == "cpu" else "cuda")
        order, _ = example_stream(len(self.lengths), fit.epochs, self.method.seed)
        budget = RowBudget(token_budget(chosen.micro_batch_size, fit.max_seq_length),
                           static_rows(target, chosen.compile))
        batches = StepBatches(self.data.train_path, fit.max_seq_length, order, self.method.batch_size, budget,
                              World(size=self.config.hardware.world_size))
        shape = batches.shape
        return {"row_tokens": shape.tokens, "row_lengths": shape.lengths() or None,
                "padding_share": round(batches.padding_share(), 4)}

    def _interruptions(self, throughput: _Throughput, checkpoints: _Checkpoints, fit: _Fit,
                       estimate: Estimate) -> InterruptionEstimate | None:
        """The plan's section on interruptions, where there is something to say: a rate, or auto's choice."""
        if not checkpoints.rate_per_hour and checkpoints.rule == "configured":
            return None
        through_train = estimate.startup_seconds + estimate.train_seconds
        exposure = self._exposure(checkpoints, through_train + fit.evaluation_seconds, estimate.train_seconds,
                                  throughput.seconds_per_token, fit.max_seq_length)
        return InterruptionEstimate(
            spot=self.config.hardware.spot, rate_per_hour=checkpoints.rate_per_hour,
            rate_source=checkpoints.rate_source, store=checkpoints.store, checkpoint=checkpoints.cost,
            interval=checkpoints.interval, interval_rule=checkpoints.rule, interval_seconds=exposure.interval_seconds,
            expected=self._expected(throughput, checkpoints, fit, through_train))

    def _options(self, throughput: _Throughput, checkpoints: _Checkpoints, fit: _Fit, estimate: Estimate,
                 sized: tuple[float, MemoryEstimate]) -> list[OptionRow]:
        """The options table needs a catalogue GPU as its reference: the target's own throughput when it is one
        (measured, or the GPU model's where it is not present), else an H100's training steps from the GPU model (kernel
        launches and per-step overhead fitted to committed GPU measurements, compute at `plan.assumed_mfu`:
        phase1a/plan/gpu_model.py); the other kinds from the GPU model too. Each row says which, with a range.
        Evaluation off the target stays priced at the assumed MFU (the GPU model times training steps only). Its
        spot columns weigh the same checkpoint, store and restart at each option's speed and its kind's
        interruption rate."""
        hardware, policy, (flops, memory) = self.config.hardware, self.policy, sized
        reference = hardware.target if hardware.target in CATALOGUE else "h100"
        own = reference == hardware.target  # the target's rows: its own measured (or assumed) speeds
        step = self._gpu_step(throughput.chosen, fit.max_seq_length, flops)
        reference_tps = (1.0 / throughput.seconds_per_token if own
                         else modelled_speed(step, reference, policy.assumed_mfu).value)
        assumed_tps = CATALOGUE["h100"].peak_flops * policy.assumed_mfu / flops
        speed = (self._validation_speed(throughput, fit.max_seq_length) if own else self._modelled_validation_speed(
            1.0 / assumed_tps, CATALOGUE["h100"], throughput.chosen.gradient_checkpointing, fit.max_seq_length))
        startup = (1 + self._validation_loads()) * (estimate.startup_seconds if own else self._assumed_startup())
        # Evaluations during training run the model as it trains: what that costs over the validate stage's pass,
        # as that many more forward tokens.
        during = speed.during_training().forward_seconds_per_token / speed.forward_seconds_per_token
        scored, base = self._scored_work(), self._base_work()
        evaluation = scored + base + self._eval_during_training_work() * (
            estimate.evaluations_during_training * during)
        other = OtherWork(
            host_seconds=startup + (estimate.warmup_seconds if own else 0.0) + estimate.checkpoint_seconds,
            forward_tokens=evaluation.forward_tokens + evaluation.prefill_tokens, decode_steps=evaluation.decode_steps,
            reference_forward_seconds_per_token=speed.forward_seconds_per_token,
            # a step as these steps attend on average, the base's at its own cost: the options price steps, not
            # what each attends to
            reference_decode_seconds_per_step=(scored.decode_seconds(speed) + base.decode_seconds(speed.for_base()))
            / max(evaluation.decode_steps, 1))
        configured = None if checkpoints.rule != "configured" else self._exposure(
            checkpoints, estimate.total_seconds, estimate.train_seconds, throughput.seconds_per_token,
            fit.max_seq_length).interval_seconds
        traffic = self._traffic(1.0 / reference_tps, throughput.chosen.micro_batch_size, fit.max_seq_length)
        footing = throughput.footing  # its low and high multiply seconds: the speed's range is their inverse
        job = OptionsJob(
            train_tokens=self._train_tokens(fit.epochs, fit.max_seq_length), flops_per_token=flops, traffic=traffic,
            reference=reference, reference_tokens_per_second=reference_tps,
            memory_needed_bytes_per_gpu=memory.total_gib * GIB,
            weights_and_state_bytes=(memory.weights_gib + memory.trainable_gib) * GIB,
            global_batch=self.method.batch_size, learning_rate=self.method.learning_rate, other=other,
            spot=SpotJob(checkpoint_seconds=checkpoints.cost.seconds, restart_seconds=checkpoints.restart_seconds,
                         startup_seconds=startup, interval_seconds=configured, store=checkpoints.store),
            gpu=step, assumed_mfu=policy.assumed_mfu,
            reference_source=("modelled" if not own or throughput.source == "modelled"
                              else "assumed" if throughput.source == "assumed" else "measured"),
            reference_basis=footing.words if own else "",
            reference_range=(1 / footing.high, 1 / footing.low) if own else (1.0, 1.0))
        options = with_option(own_option(hardware), DEFAULT_OPTIONS) if own else DEFAULT_OPTIONS
        return option_rows(job, OptionsPolicy(
            options=options, scaling_efficiency=policy.scaling_efficiency, lr_rule=policy.lr_rule,
            memory_headroom=policy.memory_headroom, **own_overrides(hardware)))

    def _gpu_step(self, chosen: Candidate, max_seq_length: int, flops: float) -> GpuStep:
        """One optimizer step as a GPU runs it, for the GPU model: the batch at the data's mean length, in
        micro-batches of the chosen row budget."""
        return gpu_step(self.facts, StepJob(
            examples=self.method.batch_size, mean_length=_mean(self.lengths, max_seq_length),
            row_tokens=token_budget(chosen.micro_batch_size, max_seq_length), flops_per_token=flops,
            full=self.shape.full, target_modules=self.method.lora.target_modules,
            checkpointing=chosen.gradient_checkpointing))


def _with_upload(cost: CheckpointCost, upload: float | None, source: str) -> CheckpointCost:
    """A measured upload, else one at the assumed store speed (flagged in the plan's notes where it matters)."""
    if upload is not None:
        return cost.model_copy(update={"upload_seconds": upload, "upload_source": source})
    return cost.model_copy(update={"upload_seconds": cost.bytes / ASSUMED_STORE_BYTES_PER_SECOND,
                                   "upload_source": "assumed"})


def _candidate_of(record: RunRecord) -> Candidate:
    return Candidate(micro_batch_size=record.micro_batch_size, gradient_checkpointing=record.gradient_checkpointing,
                     compile=record.compile, cuda_graphs=record.cuda_graphs,
                     dataloader_workers=record.dataloader_workers)


def _mean(lengths: np.ndarray, max_seq_length: int) -> float:
    return float(np.minimum(lengths, max_seq_length).mean())


def _peak_flops(accelerator: Accelerator) -> float:
    if accelerator.peak_flops is None:
        raise ValueError(f"no peak FLOP/s is known for {accelerator.name}; calibrate on the hardware itself")
    return accelerator.peak_flops
