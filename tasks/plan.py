"""Plan: pick micro-batch, accumulation, precision, gradient checkpointing, compilation and dataloader workers
from a memory and FLOPs model (`phase1a/cost_model.py`) and measured steps (`tasks/calibration.py`), estimate
time and cost, fit the time window (`phase1a/window.py`) and price the other hardware options
(`phase1a/options.py`).

Where the throughput comes from, best first: the last whole run of this model and method on this hardware
(`cache_dir/history.jsonl`, with that run's knobs when they still fit); a calibration sweep when the target
hardware is the one present; else peak FLOP/s x `plan.assumed_mfu`, flagged as assumed.

Estimate (seconds):
    startup      load the model, wrap it, build the optimizer (measured; else the weights at 1 GiB/s + 10 s)
    train        train_tokens x seconds per token + the warm-up steps' excess (compilation, allocator growth)
                 + checkpoints x seconds per checkpoint (measured: one real checkpoint written in calibration)
    checkpoints  how often `checkpoint.interval` fires within the train time (wall time and/or steps)
    evaluation   the validate stage for the base, the trained (and a promoted baseline's) model: a teacher-forced
                 pass over the sample and greedy generation (a prefill per batch, a step per token of the batch's
                 longest reference, at most max_new_tokens), timed in calibration on the planned model; else a
                 forward pass at 2N of the step's FLOPs a token and a step at the weights' read from memory
    total        startup + train + evaluation; cost = GPUs x price per GPU-hour x total
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from pydantic import BaseModel

from phase1a.config import Phase1aConfig
from phase1a.cost_model import (
    GIB, OPTIMIZER_STATE_BYTES, MemoryEstimate, ModelFacts, TrainingShape, choose_micro_batch, fitting_micro_batches,
    flops_per_token, lora_parameters, micro_batch_memory, model_facts,
)
from phase1a.evaluation import ValidationSpeed, validation_seconds
from phase1a.fingerprint import hash_json
from phase1a.hardware import CATALOGUE, Accelerator, detect, target_accelerator, training_device, training_dtype
from phase1a.history import RunRecord, latest_run
from phase1a.lengths import OUTLIER_FACTOR, Outliers, right_size
from phase1a.modeling import attention_implementation, release_device_memory
from phase1a.options import OptionRow, format_options, option_rows
from phase1a.packing import TokenRows
from phase1a.units import Interval, parse_duration_seconds, parse_interval
from phase1a.window import FAST_PERCENTILE, Adjustment, Workload, fit_window
from tasks.caching import FingerprintCache, task
from tasks.calibration import Calibration, Candidate, calibrate, default_workers
from tasks.tokenize import TokenizedData

_ASSUMED_DISK_BYTES_PER_SECOND = GIB  # for start-up and checkpoints on hardware that is not here to measure
_ASSUMED_STARTUP_SECONDS = 10.0  # interpreter, imports, CUDA context


class Estimate(BaseModel):
    startup_seconds: float
    steady_seconds: float  # train tokens at the measured steady-state speed
    warmup_seconds: float
    checkpoints: int
    checkpoint_seconds: float  # all checkpoints together
    evaluation_seconds: float
    train_seconds: float  # steady + warm-up + checkpoints: what the train stage's loop takes
    total_seconds: float


class Plan(BaseModel):
    profile: str
    epochs: float
    adjustments: list[Adjustment]
    target: str
    detected: str
    calibrated: bool
    precision: str
    base_precision: str
    optimizer: str
    attention: str = "sdpa"  # the implementation training runs (phase1a/modeling.py: attention_implementation)
    micro_batch_size: int
    gradient_accumulation: int
    gradient_checkpointing: bool
    compile: bool
    dataloader_workers: int
    max_seq_length: int
    model: ModelFacts
    trainable_parameters: int
    memory: MemoryEstimate
    measured_peak_memory_gib: float | None
    flops_per_token: float  # what a step computes, recompute included
    model_flops_per_token: float  # what MFU counts: no recompute
    tokens_per_second: float
    steps: int
    train_tokens: int
    estimate: Estimate
    estimated_train_seconds: float
    estimated_total_seconds: float
    estimated_cost_usd: float | None
    window_seconds: float | None
    fits_in_window: bool | None
    throughput_source: str
    calibration: Calibration | None
    options: list[OptionRow]
    notes: list[str]


class _Throughput(BaseModel):
    chosen: Candidate
    seconds_per_token: float
    warmup_seconds: float
    startup_seconds: float
    checkpoint_seconds_each: float
    source: str
    calibration: Calibration | None = None


def make_plan(config: Phase1aConfig, model_dir: Path, data: TokenizedData, model_fingerprint: str = "",
              history_path: Path | None = None) -> Plan:
    notes: list[str] = []
    policy, method = config.plan, config.method
    facts = model_facts(model_dir)
    target = target_accelerator(config.hardware.target)
    detected_key, detected = detect()
    present = detected_key == config.hardware.target
    if not present:
        notes.append(f"target {config.hardware.target} ({target.name}) is not present; this machine has {detected.name}")
    dtype = training_dtype(training_device()) if present else torch.bfloat16
    attention = attention_implementation(method, training_device(), dtype)
    shape = TrainingShape(full=method.kind == "full", weight_bytes=torch.finfo(dtype).bits // 8,
                          base_bits=4 if method.base_precision == "4bit" else 16, optimizer=method.optimizer,
                          shards=config.hardware.num_gpus if config.hardware.strategy == "fsdp" else 1,
                          dense_mask=attention == "sdpa")
    trainable = facts.parameters if shape.full else lora_parameters(facts, method.lora.r, method.lora.target_modules)
    available = int(target.memory_bytes * (1 - config.hardware.memory_headroom))

    lengths = TokenRows.from_arrow(data.train_path).lengths()
    max_seq_length = data.max_seq_length
    # fast: the longest 0.1 % of examples are truncated rather than sizing every batch; balanced: only when a few
    # far-out examples would size every row.
    if policy.profile == "fast" or (policy.profile == "balanced" and data.outliers):
        capped = min(max_seq_length, right_size(lengths, FAST_PERCENTILE, data.model_max_length, None))
        if policy.profile == "balanced":
            notes.append(_outlier_note(data.outliers, max_seq_length, capped, int((lengths > capped).sum())))
        max_seq_length = capped
    start = _start_candidate(policy, facts, trainable, shape, method.batch_size, max_seq_length, available)
    train_tokens = int(np.minimum(lengths, max_seq_length).sum() * method.epochs)

    def fits(candidate: Candidate) -> bool:
        return method.batch_size % candidate.micro_batch_size == 0 and micro_batch_memory(
            facts, trainable, shape, candidate.micro_batch_size, max_seq_length, candidate.gradient_checkpointing,
            available).total_gib <= available / GIB

    remembered = history_path and latest_run(history_path, model_fingerprint, config.hardware.target, method.kind)
    sweeps = policy.profile not in ("custom", "memory_efficient")  # those fix the knobs themselves
    if remembered and fits(candidate := _candidate_of(remembered)) and (sweeps or candidate == start):
        throughput = _from_history(remembered, candidate, facts, trainable, shape)
        notes.append(f"throughput {remembered.tokens_per_second:.0f} tokens/s and knobs from the last run of this "
                     f"model on {config.hardware.target} ({remembered.timestamp:%Y-%m-%d %H:%M})")
    elif present and config.hardware.calibration_steps > 0:
        calibration = calibrate(
            config, model_dir, data.train_path, max_seq_length, start,
            _alternatives(facts, trainable, shape, method.batch_size, max_seq_length, available) if sweeps else _none,
            train_tokens, config.work_dir / config.name, validation_path=data.validation_path)
        release_device_memory()  # the calibration's model: training builds its own
        throughput = _Throughput(chosen=calibration.chosen, seconds_per_token=calibration.seconds_per_token,
                                 warmup_seconds=calibration.warmup_excess_seconds,
                                 startup_seconds=calibration.startup_seconds,
                                 checkpoint_seconds_each=calibration.checkpoint_seconds, source="measured",
                                 calibration=calibration)
    else:
        flops = flops_per_token(facts, shape.full, start.gradient_checkpointing, _mean(lengths, max_seq_length))
        throughput = _Throughput(chosen=start, seconds_per_token=flops / (_peak_flops(target) * policy.assumed_mfu),
                                 warmup_seconds=0.0, startup_seconds=_assumed_startup(facts, shape),
                                 checkpoint_seconds_each=_assumed_checkpoint(trainable, shape), source="assumed")
        notes.append(f"throughput assumed at {policy.assumed_mfu:.0%} MFU of {target.name}'s peak, not measured; "
                     f"start-up and checkpoint writes assumed at 1 GiB/s")
    chosen = throughput.chosen
    memory = micro_batch_memory(facts, trainable, shape, chosen.micro_batch_size, max_seq_length,
                                chosen.gradient_checkpointing, available)
    flops = flops_per_token(facts, shape.full, chosen.gradient_checkpointing, _mean(lengths, max_seq_length))
    spt = throughput.seconds_per_token

    evaluation = _validation_estimate(config, data, facts, shape, spt * (2 * facts.parameters) / flops, target,
                                      throughput)
    interval = parse_interval(config.checkpoint.interval)
    tokens_per_step = float(np.minimum(lengths, max_seq_length).sum()) / max(1, math.ceil(len(lengths) / method.batch_size))
    # The window fit sees checkpoints as a surcharge on every token, the rate of whichever interval fires first.
    work = Workload(lengths=lengths, epochs=method.epochs, max_seq_length=max_seq_length,
                    model_max_length=data.model_max_length,
                    seconds_per_token=spt + _checkpoint_cost_per_token(interval, throughput.checkpoint_seconds_each,
                                                                       spt, tokens_per_step),
                    fixed_seconds=throughput.startup_seconds + throughput.warmup_seconds + evaluation)

    epochs, profile, adjustments, window = method.epochs, policy.profile, [], None
    if config.window.max_duration:
        window = parse_duration_seconds(config.window.max_duration)
        budget = window - parse_duration_seconds(config.window.safety_margin)
        epochs, max_seq_length, profile, adjustments = fit_window(work, budget, policy.profile, policy.min_epochs)
    total_examples = max(1, round(len(lengths) * epochs))
    steps = -(-total_examples // method.batch_size)
    train_tokens = int(round(np.minimum(lengths, max_seq_length).sum() * epochs))
    steady = train_tokens * spt
    checkpoints = _checkpoint_count(interval, steps, steady)
    train_seconds = steady + throughput.warmup_seconds + checkpoints * throughput.checkpoint_seconds_each
    estimate = Estimate(
        startup_seconds=throughput.startup_seconds, steady_seconds=steady, warmup_seconds=throughput.warmup_seconds,
        checkpoints=checkpoints, checkpoint_seconds=checkpoints * throughput.checkpoint_seconds_each,
        evaluation_seconds=evaluation, train_seconds=train_seconds,
        total_seconds=throughput.startup_seconds + train_seconds + evaluation)
    price = config.hardware.price_per_gpu_hour or target.price_per_hour

    # The options table needs a catalogue GPU as its reference: the target's own throughput when it is one,
    # else an H100 at the assumed MFU (flagged in the table's notes via its implied MFU).
    reference = config.hardware.target if config.hardware.target in CATALOGUE else "h100"
    reference_tps = 1.0 / spt if reference == config.hardware.target else CATALOGUE["h100"].peak_flops * policy.assumed_mfu / flops
    options = option_rows(
        train_tokens, flops, reference, reference_tps, memory.total_gib * GIB, (memory.weights_gib + memory.trainable_gib) * GIB,
        method.batch_size, method.learning_rate, scaling_efficiency=policy.scaling_efficiency,
        prices={config.hardware.target: config.hardware.price_per_gpu_hour} if config.hardware.price_per_gpu_hour else None,
        fixed_overhead_seconds=estimate.total_seconds - steady, lr_rule=policy.lr_rule,
        memory_headroom=config.hardware.memory_headroom)
    return Plan(
        profile=profile, epochs=epochs, adjustments=adjustments, target=config.hardware.target, detected=detected.name,
        calibrated=throughput.source == "measured", precision=str(dtype).removeprefix("torch."),
        base_precision=method.base_precision, optimizer=method.optimizer, attention=attention,
        micro_batch_size=chosen.micro_batch_size, gradient_accumulation=method.batch_size // chosen.micro_batch_size,
        gradient_checkpointing=chosen.gradient_checkpointing, compile=chosen.compile,
        dataloader_workers=chosen.dataloader_workers, max_seq_length=max_seq_length, model=facts,
        trainable_parameters=trainable, memory=memory,
        measured_peak_memory_gib=throughput.calibration.peak_memory_gib if throughput.calibration else None,
        flops_per_token=flops, tokens_per_second=1.0 / spt,
        model_flops_per_token=flops_per_token(facts, shape.full, False, _mean(lengths, max_seq_length)), steps=steps, train_tokens=train_tokens, estimate=estimate,
        estimated_train_seconds=train_seconds, estimated_total_seconds=estimate.total_seconds,
        estimated_cost_usd=None if price is None else price * config.hardware.num_gpus * estimate.total_seconds / 3600,
        window_seconds=window, fits_in_window=None if window is None else True, throughput_source=throughput.source,
        calibration=throughput.calibration, options=options, notes=notes,
    )


def _start_candidate(policy, facts: ModelFacts, trainable: int, shape: TrainingShape, batch_size: int,
                     max_seq_length: int, available: int) -> Candidate:
    """memory_efficient: one example with checkpointing; custom: the user's knobs, checked; else the memory
    model's pick (the largest micro-batch that fits, checkpointing only when needed)."""
    if policy.profile == "memory_efficient":
        candidate = Candidate(micro_batch_size=1, gradient_checkpointing=True)
    elif policy.profile == "custom":
        if policy.micro_batch_size is None or policy.gradient_checkpointing is None:
            raise ValueError("plan.profile custom needs plan.micro_batch_size and plan.gradient_checkpointing")
        if batch_size % policy.micro_batch_size:
            raise ValueError(f"plan.micro_batch_size {policy.micro_batch_size} must divide method.batch_size {batch_size}")
        candidate = Candidate(micro_batch_size=policy.micro_batch_size, gradient_checkpointing=policy.gradient_checkpointing,
                              compile=bool(policy.compile), dataloader_workers=policy.dataloader_workers or 0)
    else:
        micro, checkpointing, _ = choose_micro_batch(facts, trainable, shape, batch_size, max_seq_length, available)
        return Candidate(micro_batch_size=micro, gradient_checkpointing=checkpointing)
    memory = micro_batch_memory(facts, trainable, shape, candidate.micro_batch_size, max_seq_length,
                                candidate.gradient_checkpointing, available)
    if memory.total_gib > memory.available_gib:
        raise MemoryError(f"plan.profile {policy.profile}: micro-batch {candidate.micro_batch_size} needs "
                          f"{memory.total_gib:.1f} GiB, {memory.available_gib:.1f} GiB are available")
    return candidate


def _alternatives(facts: ModelFacts, trainable: int, shape: TrainingShape, batch_size: int, max_seq_length: int,
                  available: int):
    """The candidates calibration tries for each knob, from the best so far; only ones the memory model admits."""

    def alternatives(best: Candidate, knob: str) -> list[Candidate]:
        def fitting(checkpointing: bool) -> list[int]:
            return [m for m, _ in fitting_micro_batches(facts, trainable, shape, batch_size, max_seq_length,
                                                        available, checkpointing)]

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


def _none(best: Candidate, knob: str) -> list[Candidate]:
    return []


def _candidate_of(record: RunRecord) -> Candidate:
    return Candidate(micro_batch_size=record.micro_batch_size, gradient_checkpointing=record.gradient_checkpointing,
                     compile=record.compile, dataloader_workers=record.dataloader_workers)


def _from_history(record: RunRecord, candidate: Candidate, facts: ModelFacts, trainable: int,
                  shape: TrainingShape) -> _Throughput:
    return _Throughput(
        chosen=candidate, seconds_per_token=1.0 / record.tokens_per_second, warmup_seconds=0.0,
        startup_seconds=record.startup_seconds if record.startup_seconds is not None else _assumed_startup(facts, shape),
        checkpoint_seconds_each=(record.checkpoint_seconds_each if record.checkpoint_seconds_each is not None
                                 else _assumed_checkpoint(trainable, shape)),
        source="history")


def _assumed_startup(facts: ModelFacts, shape: TrainingShape) -> float:
    return _ASSUMED_STARTUP_SECONDS + facts.parameters * shape.weight_bytes / _ASSUMED_DISK_BYTES_PER_SECOND


def _assumed_checkpoint(trainable: int, shape: TrainingShape) -> float:
    return trainable * (4 + OPTIMIZER_STATE_BYTES[shape.optimizer]) / _ASSUMED_DISK_BYTES_PER_SECOND


def _checkpoint_cost_per_token(interval: Interval, each: float, seconds_per_token: float, tokens_per_step: float) -> float:
    rates = []
    if interval.seconds:
        rates.append(each / interval.seconds * seconds_per_token)
    if interval.steps:
        rates.append(each / (interval.steps * tokens_per_step))
    return max(rates, default=0.0)


def _checkpoint_count(interval: Interval, steps: int, steady_seconds: float) -> int:
    """Checkpoints written during training: none after the last step (the final save replaces it)."""
    counts = []
    if interval.steps:
        counts.append((steps - 1) // interval.steps)
    if interval.seconds:
        counts.append(int(steady_seconds // interval.seconds))
    return max(counts, default=0)


def _mean(lengths: np.ndarray, max_seq_length: int) -> float:
    return float(np.minimum(lengths, max_seq_length).mean())


def _peak_flops(accelerator: Accelerator) -> float:
    if accelerator.peak_flops is None:
        raise ValueError(f"no peak FLOP/s is known for {accelerator.name}; calibrate on the hardware itself")
    return accelerator.peak_flops


def publish_plan(plan: Plan, run_dir: Path) -> Path:
    """plan.json in the run directory, and the plan as a Prefect table artifact."""
    path = Path(run_dir) / "plan.json"
    path.write_text(plan.model_dump_json(indent=2) + "\n")
    try:
        from prefect.artifacts import create_table_artifact
    except ImportError:
        return path
    nested = {"model", "memory", "estimate", "calibration", "options"}
    rows = [{"setting": key, "value": str(value)} for key, value in plan.model_dump(exclude=nested).items()]
    for section in ("memory", "estimate"):
        rows += [{"setting": f"{section}.{key}", "value": f"{value:.3f}"}
                 for key, value in getattr(plan, section).model_dump().items()]
    for trial in plan.calibration.trials if plan.calibration else []:
        rows.append({"setting": f"calibration: {trial.candidate.label()}", "value": _trial_result(trial)})
    create_table_artifact(key="plan", table=rows, description="phase1a plan: knobs, estimate, window, calibration")
    return path


def _validation_estimate(config: Phase1aConfig, data: TokenizedData, facts: ModelFacts, shape: TrainingShape,
                         forward_seconds_per_token: float, target, throughput: _Throughput) -> float:
    """The validate stage as it will run: it scores the base, the trained and a promoted baseline's model
    (phase1a.evaluation.validation_seconds each) and loads the trained model, the base of a full fine-tune and
    a promoted baseline anew. Measured costs where the calibration timed them, else a forward pass at 2N of the
    step's FLOPs a token and a greedy step at the weights' read from memory (or, with no bandwidth catalogued,
    one forward token per row of the generation batch)."""
    settings = config.validation
    promoted = settings.baseline == "promoted"
    loads = 1 + (config.method.kind == "full") + promoted
    rows = TokenRows.from_arrow(data.validation_path)
    indices = np.arange(min(len(rows), settings.max_examples))
    speed = throughput.calibration.validation if throughput.calibration is not None else None
    if speed is None:
        step = (facts.parameters * shape.weight_bytes / target.memory_bandwidth if target.memory_bandwidth
                else forward_seconds_per_token * settings.generation_batch_size)
        speed = ValidationSpeed(forward_seconds_per_token=forward_seconds_per_token, decode_seconds_per_step=step)
    return loads * throughput.startup_seconds + validation_seconds(speed, rows, indices, settings, 2 + promoted)


def _outlier_note(outliers: Outliers, max_seq_length: int, capped: int, truncated: int) -> str:
    where, tokens = outliers.longest[0]
    return (f"balanced: max_seq_length {capped} (the p{FAST_PERCENTILE:g} length) instead of {max_seq_length}: "
            f"{outliers.count} example(s) beyond {OUTLIER_FACTOR:g}x p{FAST_PERCENTILE:g} (the longest {tokens} "
            f"tokens at {where}); {truncated} training example(s) truncated. plan.profile quality keeps them")


def format_plan(plan: Plan) -> str:
    e = plan.estimate
    lines = [f"hardware: {plan.target} (running on {plan.detected}); throughput {plan.throughput_source}",
             f"precision {plan.precision} (base {plan.base_precision}, optimizer {plan.optimizer}), attention "
             f"{plan.attention}, micro-batch "
             f"{plan.micro_batch_size} x accumulation {plan.gradient_accumulation}, gradient checkpointing "
             f"{_on(plan.gradient_checkpointing)}, compile {_on(plan.compile)}, dataloader workers "
             f"{plan.dataloader_workers}, max_seq_length {plan.max_seq_length}",
             f"memory {plan.memory.total_gib:.2f} of {plan.memory.available_gib:.2f} GiB (model)"
             + (f", {plan.measured_peak_memory_gib:.2f} GiB measured" if plan.measured_peak_memory_gib else "")
             + f"; {plan.tokens_per_second:.0f} tokens/s; {plan.steps} steps, {plan.train_tokens} tokens",
             f"estimate: start-up {e.startup_seconds:.0f} s + train {e.train_seconds:.0f} s (warm-up "
             f"{e.warmup_seconds:.0f} s, {e.checkpoints} checkpoints {e.checkpoint_seconds:.0f} s) + evaluation "
             f"{e.evaluation_seconds:.0f} s = {e.total_seconds / 3600:.3f} h"
             + (f", ${plan.estimated_cost_usd:.2f}" if plan.estimated_cost_usd is not None else ""),
             f"fits window: {'n/a' if plan.fits_in_window is None else plan.fits_in_window}"]
    lines += [f"adjusted {a.step}: {a.before} -> {a.after} ({a.estimated_hours:.2f} h)" for a in plan.adjustments]
    if plan.calibration:
        lines.append(f"calibration ({plan.calibration.seconds:.0f} s of a {plan.calibration.budget_seconds:.0f} s budget):")
        lines += [f"  {t.candidate.label()}: {_trial_result(t)}" for t in plan.calibration.trials]
    return "\n".join(lines + [f"note: {note}" for note in plan.notes] + ["", format_options(plan.options)])


def _trial_result(trial) -> str:
    if trial.status != "measured":
        return f"{trial.status}: {trial.note}"
    return f"{trial.tokens_per_second:.0f} tokens/s" + (f", peak {trial.peak_memory_gib:.2f} GiB" if trial.peak_memory_gib else "")


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def plan_fingerprint(config: Phase1aConfig, model_fingerprint: str, data: TokenizedData) -> str:
    """Everything a plan depends on, including the hardware it would calibrate on."""
    sections = config.model_dump(mode="json", include={"method", "plan", "hardware", "window", "checkpoint", "validation"})
    return hash_json({"config": sections, "model": model_fingerprint, "data": data.fingerprint, "device": detect()[1].name})


@task(name="plan", cache_policy=FingerprintCache(), persist_result=True, result_serializer="json")
def plan_task(config: Phase1aConfig, model_dir: str, data: TokenizedData, fingerprint: str,
              model_fingerprint: str = "", history_path: str | None = None) -> Plan:
    return make_plan(config, Path(model_dir), data, model_fingerprint, Path(history_path) if history_path else None)
