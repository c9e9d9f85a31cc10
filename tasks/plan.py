"""Plan: pick micro-batch, accumulation, precision and gradient checkpointing from a memory and FLOPs model,
calibrate throughput with a few measured steps on the hardware present, estimate time and cost.

Memory model (bytes), N = parameters, T = trainable parameters, b = bytes per weight in the compute dtype,
L layers, h hidden, i intermediate, V vocabulary, t = tokens in one micro-batch:
    weights      N*b (LoRA: frozen base in compute dtype) or N*4 (full: fp32 master weights)
    trainable    T*(4 grad + 8 Adam moments) (+ T*4 fp32 copies for LoRA adapters)
    activations  t*L*b*(10h + 8i) without checkpointing (inputs of every norm, projection and MLP product);
                 with checkpointing t*L*b*h (one saved input per layer) + one layer's full activations
    logits       t*V*4*2 (fp32 logits and their gradient)
Throughput model: FLOPs per token = 4N (LoRA: forward 2N + input gradients 2N, no weight gradients) or 6N
(full), plus 2N when checkpointing recomputes the forward, plus causal attention 6*L*s*h for mean length s.
Where the target hardware is the one present, the seconds per token are measured (`calibration_steps`)
instead of assumed; elsewhere peak FLOP/s times `assumed_mfu` gives an uncalibrated estimate, flagged.
"""
from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from pydantic import BaseModel

from phase1a.config import Phase1aConfig
from phase1a.fingerprint import hash_json
from phase1a.hardware import CATALOGUE, GIB, Accelerator, detect, target_accelerator, training_device, training_dtype
from phase1a.history import last_throughput
from phase1a.options import OptionRow, format_options, option_rows
from phase1a.lengths import right_size
from phase1a.packing import TokenRows, example_stream
from phase1a.units import parse_duration_seconds
from phase1a.window import FAST_PERCENTILE, Adjustment, Workload, fit_window
from tasks.caching import FingerprintCache, task
from tasks.tokenize import TokenizedData


class ModelFacts(BaseModel):
    parameters: int
    layers: int
    hidden: int
    intermediate: int
    vocab: int
    max_positions: int
    kv_width: int  # key/value heads x head dim: the output size of k_proj and v_proj


class MemoryEstimate(BaseModel):
    weights_gib: float
    trainable_gib: float
    activations_gib: float
    logits_gib: float
    total_gib: float
    available_gib: float


class Plan(BaseModel):
    profile: str
    epochs: float
    adjustments: list[Adjustment]
    target: str
    detected: str
    calibrated: bool
    precision: str
    micro_batch_size: int
    gradient_accumulation: int
    gradient_checkpointing: bool
    max_seq_length: int
    trainable_parameters: int
    memory: MemoryEstimate
    flops_per_token: float
    tokens_per_second: float
    steps: int
    train_tokens: int
    estimated_train_seconds: float
    estimated_total_seconds: float
    estimated_cost_usd: float | None
    window_seconds: float | None
    fits_in_window: bool | None
    throughput_source: str
    options: list[OptionRow]
    notes: list[str]


def model_facts(model_dir: Path) -> ModelFacts:
    """Shapes from the config and the parameter count from a meta-device model: no weights are read."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        parameters = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return ModelFacts(
        parameters=parameters, layers=config.num_hidden_layers, hidden=config.hidden_size,
        intermediate=getattr(config, "intermediate_size", 4 * config.hidden_size), vocab=config.vocab_size,
        max_positions=getattr(config, "max_position_embeddings", 2048), kv_width=kv_heads * head_dim,
    )


def lora_parameters(facts: ModelFacts, config: Phase1aConfig) -> int:
    kv = facts.kv_width
    shapes = {  # (in, out) of each projection LoRA can target
        "q_proj": (facts.hidden, facts.hidden), "k_proj": (facts.hidden, kv), "v_proj": (facts.hidden, kv),
        "o_proj": (facts.hidden, facts.hidden), "gate_proj": (facts.hidden, facts.intermediate),
        "up_proj": (facts.hidden, facts.intermediate), "down_proj": (facts.intermediate, facts.hidden),
    }
    r = config.method.lora.r
    return facts.layers * sum(r * (shapes[m][0] + shapes[m][1]) for m in config.method.lora.target_modules if m in shapes)


def memory_estimate(facts: ModelFacts, trainable: int, full: bool, weight_bytes: int, tokens: int,
                    checkpointing: bool, available: int) -> MemoryEstimate:
    gib = 1024**3
    weights = facts.parameters * (4 if full else weight_bytes)
    trainable_bytes = trainable * (12 if full else 16)
    per_layer_token = weight_bytes * (10 * facts.hidden + 8 * facts.intermediate)
    if checkpointing:
        activations = tokens * (facts.layers * weight_bytes * facts.hidden + per_layer_token)
    else:
        activations = tokens * facts.layers * per_layer_token
    logits = tokens * facts.vocab * 4 * 2
    total = weights + trainable_bytes + activations + logits
    return MemoryEstimate(
        weights_gib=weights / gib, trainable_gib=trainable_bytes / gib, activations_gib=activations / gib,
        logits_gib=logits / gib, total_gib=total / gib, available_gib=available / gib,
    )


def flops_per_token(facts: ModelFacts, full: bool, checkpointing: bool, mean_length: float) -> float:
    n = facts.parameters
    return (6 if full else 4) * n + (2 * n if checkpointing else 0) + 6 * facts.layers * mean_length * facts.hidden


def choose_micro_batch(facts: ModelFacts, trainable: int, full: bool, weight_bytes: int, batch_size: int,
                       max_seq_length: int, available: int) -> tuple[int, bool, MemoryEstimate]:
    """The largest micro-batch (a divisor of the global batch) that fits, preferring no checkpointing, which
    saves the 2N recompute; checkpointing only when even a micro-batch of one would not fit otherwise."""
    divisors = [d for d in range(batch_size, 0, -1) if batch_size % d == 0]
    for checkpointing in (False, True):
        for micro in divisors:
            estimate = memory_estimate(facts, trainable, full, weight_bytes, micro * max_seq_length, checkpointing, available)
            if estimate.total_gib <= estimate.available_gib:
                return micro, checkpointing, estimate
    estimate = memory_estimate(facts, trainable, full, weight_bytes, max_seq_length, True, available)
    raise MemoryError(
        f"the model does not fit: one sequence of {max_seq_length} tokens needs {estimate.total_gib:.1f} GiB "
        f"with gradient checkpointing, {estimate.available_gib:.1f} GiB are available"
    )


def measure_seconds_per_token(config: Phase1aConfig, model_dir: Path, rows: TokenRows, micro: int,
                              checkpointing: bool) -> float:
    """Time real optimizer steps of the chosen configuration on real batches: two warm-up steps, then the median
    seconds per token of the measured steps, so one slow step (allocator growth, a page-fault burst) does not
    set the estimate."""
    from tasks.train import build_model, make_optimizer, train_step

    method = config.method
    model = build_model(model_dir, method, checkpointing, config.model.trust_remote_code)
    optimizer = make_optimizer(model, method)
    order, _ = example_stream(len(rows), 1.0, method.seed)
    per_token = []
    warmup = 2
    for step in range(config.hardware.calibration_steps + warmup):
        indices = order[(step * method.batch_size) % len(rows):][: method.batch_size]
        _sync()
        began = time.perf_counter()
        _, step_tokens = train_step(model, optimizer, rows, indices, micro)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync()
        if step >= warmup:
            per_token.append((time.perf_counter() - began) / step_tokens)
    return float(np.median(per_token))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def make_plan(config: Phase1aConfig, model_dir: Path, data: TokenizedData, model_fingerprint: str = "",
              history_path: Path | None = None) -> Plan:
    notes: list[str] = []
    policy = config.plan
    facts = model_facts(model_dir)
    full = config.method.kind == "full"
    target = target_accelerator(config.hardware.target)
    detected_key, detected = detect()
    present = detected_key == config.hardware.target
    if not present:
        notes.append(f"target {config.hardware.target} ({target.name}) is not present; this machine has {detected.name}")
    dtype = training_dtype(training_device()) if present else torch.bfloat16
    weight_bytes = torch.finfo(dtype).bits // 8
    trainable = facts.parameters if full else lora_parameters(facts, config)
    available = int(target.memory_bytes * (1 - config.hardware.memory_headroom))

    rows = TokenRows.from_arrow(data.train_path)
    lengths = rows.lengths()
    max_seq_length = data.max_seq_length
    if policy.profile == "fast":  # the longest 0.1 % of examples are truncated rather than sizing every batch
        max_seq_length = min(max_seq_length, right_size(lengths, FAST_PERCENTILE, data.model_max_length, None))
    micro, checkpointing, memory = _micro_batch_for_profile(
        policy, facts, trainable, full, weight_bytes, config.method.batch_size, max_seq_length, available)
    flops = flops_per_token(facts, full, checkpointing, float(np.minimum(lengths, max_seq_length).mean()))

    # A whole earlier run of this model and configuration on this hardware is the best predictor; a few
    # calibration steps see only the first, slower steps of a run; an assumed MFU is the last resort.
    remembered = history_path and last_throughput(history_path, model_fingerprint, config.hardware.target, micro,
                                                  checkpointing)
    calibrated = not remembered and present and config.hardware.calibration_steps > 0
    if remembered:
        seconds_per_token, source = 1.0 / remembered, "history"
        notes.append(f"throughput {remembered:.0f} tokens/s from the last run of this model on {config.hardware.target}")
    elif calibrated:
        # Calibrate on the rows as training will see them, truncated to this plan's length.
        truncated = replace(rows, max_length=max_seq_length)
        seconds_per_token, source = measure_seconds_per_token(config, model_dir, truncated, micro, checkpointing), "measured"
    else:
        seconds_per_token, source = flops / (_peak_flops(target) * policy.assumed_mfu), "assumed"
        notes.append(f"throughput assumed at {policy.assumed_mfu:.0%} MFU of {target.name}'s peak, not measured")
    # Evaluation runs the forward pass only (2N of the training FLOPs) for the base and the trained model.
    validation_tokens = int(TokenRows.from_arrow(data.validation_path).lengths()[: config.validation.max_examples].sum())
    eval_seconds = 2 * validation_tokens * seconds_per_token * (2 * facts.parameters) / flops
    work = Workload(lengths=lengths, epochs=config.method.epochs, max_seq_length=max_seq_length,
                    model_max_length=data.model_max_length, seconds_per_token=seconds_per_token,
                    fixed_seconds=eval_seconds)

    epochs, profile, adjustments, window = config.method.epochs, policy.profile, [], None
    if config.window.max_duration:
        window = parse_duration_seconds(config.window.max_duration)
        budget = window - parse_duration_seconds(config.window.safety_margin)
        epochs, max_seq_length, profile, adjustments = fit_window(work, budget, policy.profile, policy.min_epochs)
    total_examples = max(1, round(len(rows) * epochs))
    total_seconds = work.seconds(epochs, max_seq_length)
    price = config.hardware.price_per_gpu_hour or target.price_per_hour
    train_tokens = int(round(np.minimum(lengths, max_seq_length).sum() * epochs))
    # The options table needs a catalogue GPU as its reference: the target's own throughput when it is one,
    # else an H100 at the assumed MFU (flagged in the table's notes via its implied MFU).
    reference = config.hardware.target if config.hardware.target in CATALOGUE else "h100"
    reference_tps = (1.0 / seconds_per_token if reference == config.hardware.target
                     else CATALOGUE["h100"].peak_flops * policy.assumed_mfu / flops)
    options = option_rows(
        train_tokens, flops, reference, reference_tps, memory.total_gib * GIB, (memory.weights_gib + memory.trainable_gib) * GIB,
        config.method.batch_size, config.method.learning_rate, scaling_efficiency=policy.scaling_efficiency,
        prices={config.hardware.target: config.hardware.price_per_gpu_hour} if config.hardware.price_per_gpu_hour else None,
        fixed_overhead_seconds=eval_seconds, lr_rule=policy.lr_rule, memory_headroom=config.hardware.memory_headroom)
    return Plan(
        profile=profile, epochs=epochs, adjustments=adjustments,
        target=config.hardware.target, detected=detected.name, calibrated=calibrated,
        precision=str(dtype).removeprefix("torch."), micro_batch_size=micro,
        gradient_accumulation=config.method.batch_size // micro, gradient_checkpointing=checkpointing,
        max_seq_length=max_seq_length, trainable_parameters=trainable, memory=memory, flops_per_token=flops,
        tokens_per_second=1.0 / seconds_per_token, steps=-(-total_examples // config.method.batch_size),
        train_tokens=train_tokens,
        estimated_train_seconds=total_seconds - eval_seconds, estimated_total_seconds=total_seconds,
        estimated_cost_usd=None if price is None else price * config.hardware.num_gpus * total_seconds / 3600,
        window_seconds=window, fits_in_window=None if window is None else True, throughput_source=source,
        options=options, notes=notes,
    )


def _micro_batch_for_profile(policy, facts: ModelFacts, trainable: int, full: bool, weight_bytes: int,
                             batch_size: int, max_seq_length: int, available: int) -> tuple[int, bool, MemoryEstimate]:
    """memory_efficient: one example with checkpointing; custom: the user's knobs, checked; else the model's pick."""
    if policy.profile == "memory_efficient":
        micro, checkpointing = 1, True
    elif policy.profile == "custom":
        if policy.micro_batch_size is None or policy.gradient_checkpointing is None:
            raise ValueError("plan.profile custom needs plan.micro_batch_size and plan.gradient_checkpointing")
        if batch_size % policy.micro_batch_size:
            raise ValueError(f"plan.micro_batch_size {policy.micro_batch_size} must divide method.batch_size {batch_size}")
        micro, checkpointing = policy.micro_batch_size, policy.gradient_checkpointing
    else:
        return choose_micro_batch(facts, trainable, full, weight_bytes, batch_size, max_seq_length, available)
    memory = memory_estimate(facts, trainable, full, weight_bytes, micro * max_seq_length, checkpointing, available)
    if memory.total_gib > memory.available_gib:
        raise MemoryError(f"plan.profile {policy.profile}: micro-batch {micro} needs {memory.total_gib:.1f} GiB, "
                          f"{memory.available_gib:.1f} GiB are available")
    return micro, checkpointing, memory


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
    rows = [{"setting": key, "value": str(value)} for key, value in plan.model_dump(exclude={"memory", "options"}).items()]
    rows += [{"setting": f"memory.{key}", "value": f"{value:.3f}"} for key, value in plan.memory.model_dump().items()]
    create_table_artifact(key="plan", table=rows, description="phase1a plan: knobs, estimate, window")
    return path


def format_plan(plan: Plan) -> str:
    lines = [f"hardware: {plan.target} (running on {plan.detected}), {'calibrated' if plan.calibrated else 'not calibrated'}",
             f"precision {plan.precision}, micro-batch {plan.micro_batch_size} x accumulation {plan.gradient_accumulation}, "
             f"gradient checkpointing {'on' if plan.gradient_checkpointing else 'off'}, max_seq_length {plan.max_seq_length}",
             f"memory {plan.memory.total_gib:.2f} of {plan.memory.available_gib:.2f} GiB; "
             f"{plan.tokens_per_second:.0f} tokens/s; {plan.steps} steps, {plan.train_tokens} tokens",
             f"estimate: train {plan.estimated_train_seconds / 3600:.3f} h, total {plan.estimated_total_seconds / 3600:.3f} h"
             + (f", ${plan.estimated_cost_usd:.2f}" if plan.estimated_cost_usd is not None else ""),
             f"fits window: {'n/a' if plan.fits_in_window is None else plan.fits_in_window}"]
    lines += [f"adjusted {a.step}: {a.before} -> {a.after} ({a.estimated_hours:.2f} h)" for a in plan.adjustments]
    return "\n".join(lines + [f"note: {note}" for note in plan.notes] + ["", format_options(plan.options)])


def plan_fingerprint(config: Phase1aConfig, model_fingerprint: str, data: TokenizedData) -> str:
    """Everything a plan depends on, including the hardware it would calibrate on."""
    sections = config.model_dump(mode="json", include={"method", "plan", "hardware", "window", "validation"})
    return hash_json({"config": sections, "model": model_fingerprint, "data": data.fingerprint, "device": detect()[1].name})


@task(name="plan", cache_policy=FingerprintCache(), persist_result=True, result_serializer="json")
def plan_task(config: Phase1aConfig, model_dir: str, data: TokenizedData, fingerprint: str,
              model_fingerprint: str = "", history_path: str | None = None) -> Plan:
    return make_plan(config, Path(model_dir), data, model_fingerprint, Path(history_path) if history_path else None)
