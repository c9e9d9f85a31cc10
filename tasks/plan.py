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
from pathlib import Path

import torch
from pydantic import BaseModel

from phase1a.config import Phase1aConfig
from phase1a.hardware import Accelerator, detect, target_accelerator, training_dtype, training_device
from phase1a.packing import TokenRows, example_stream
from phase1a.units import parse_duration_seconds
from phase1a.fingerprint import hash_json
from tasks.caching import FingerprintCache, task
from tasks.tokenize import TokenizedData

ASSUMED_MFU = 0.35  # used only for hardware that is not present to measure; the plan says so when it applies


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
    """Time real optimizer steps of the chosen configuration on real batches (one warm-up step first)."""
    from tasks.train import build_model, make_optimizer, train_step

    method = config.method
    model = build_model(model_dir, method, checkpointing, config.model.trust_remote_code)
    optimizer = make_optimizer(model, method)
    order, _ = example_stream(len(rows), 1.0, method.seed)
    seconds, tokens = 0.0, 0
    for step in range(config.hardware.calibration_steps + 1):
        indices = order[(step * method.batch_size) % len(rows):][: method.batch_size]
        _sync()
        began = time.perf_counter()
        _, step_tokens = train_step(model, optimizer, rows, indices, micro)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync()
        if step > 0:
            seconds += time.perf_counter() - began
            tokens += step_tokens
    return seconds / tokens


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def make_plan(config: Phase1aConfig, model_dir: Path, data: TokenizedData) -> Plan:
    notes: list[str] = []
    max_seq_length = data.max_seq_length
    facts = model_facts(model_dir)
    full = config.method.kind == "full"
    device = training_device()
    target = target_accelerator(config.hardware.target)
    detected_key, detected = detect()
    present = detected_key == config.hardware.target
    if not present:
        notes.append(f"target {config.hardware.target} ({target.name}) is not present; this machine has {detected.name}")
    dtype = training_dtype(device) if present else torch.bfloat16
    weight_bytes = torch.finfo(dtype).bits // 8
    trainable = facts.parameters if full else lora_parameters(facts, config)
    available = int(target.memory_bytes * (1 - config.hardware.memory_headroom))
    micro, checkpointing, memory = choose_micro_batch(
        facts, trainable, full, weight_bytes, config.method.batch_size, max_seq_length, available
    )

    rows = TokenRows.from_arrow(data.train_path)
    lengths = rows.lengths()
    validation_tokens = int(TokenRows.from_arrow(data.validation_path).lengths()[: config.validation.max_examples].sum())
    total_examples = max(1, round(len(rows) * config.method.epochs))
    steps = -(-total_examples // config.method.batch_size)
    train_tokens = int(round(lengths.sum() * config.method.epochs))
    flops = flops_per_token(facts, full, checkpointing, float(lengths.mean()))

    calibrated = present and config.hardware.calibration_steps > 0
    if calibrated:
        seconds_per_token = measure_seconds_per_token(config, model_dir, rows, micro, checkpointing)
    else:
        seconds_per_token = flops / (_peak_flops(target) * ASSUMED_MFU)
        notes.append(f"throughput assumed at {ASSUMED_MFU:.0%} MFU of {target.name}'s peak, not measured")
    # Evaluation runs the forward pass only (2N of the training FLOPs) for the base and the trained model.
    eval_seconds = 2 * validation_tokens * seconds_per_token * (2 * facts.parameters) / flops
    train_seconds = train_tokens * seconds_per_token
    total_seconds = train_seconds + eval_seconds
    price = config.hardware.price_per_gpu_hour or target.price_per_hour
    window = parse_duration_seconds(config.window.max_duration) if config.window.max_duration else None
    fits = None
    if window is not None:
        fits = total_seconds <= window - parse_duration_seconds(config.window.safety_margin)
        if not fits:
            notes.append(f"estimated {total_seconds / 3600:.2f} h does not fit the {config.window.max_duration} window "
                         f"with a {config.window.safety_margin} margin")
    return Plan(
        target=config.hardware.target, detected=detected.name, calibrated=calibrated, precision=str(dtype).removeprefix("torch."),
        micro_batch_size=micro, gradient_accumulation=config.method.batch_size // micro,
        gradient_checkpointing=checkpointing, max_seq_length=max_seq_length, trainable_parameters=trainable,
        memory=memory, flops_per_token=flops, tokens_per_second=1.0 / seconds_per_token, steps=steps,
        train_tokens=train_tokens, estimated_train_seconds=train_seconds, estimated_total_seconds=total_seconds,
        estimated_cost_usd=None if price is None else price * config.hardware.num_gpus * total_seconds / 3600,
        window_seconds=window, fits_in_window=fits, notes=notes,
    )


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
    rows = [{"setting": key, "value": str(value)} for key, value in plan.model_dump(exclude={"memory"}).items()]
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
    return "\n".join(lines + [f"note: {note}" for note in plan.notes])


def plan_fingerprint(config: Phase1aConfig, model_fingerprint: str, data: TokenizedData) -> str:
    """Everything a plan depends on, including the hardware it would calibrate on."""
    sections = config.model_dump(mode="json", include={"method", "hardware", "window", "validation"})
    return hash_json({"config": sections, "model": model_fingerprint, "data": data.fingerprint, "device": detect()[1].name})


@task(name="plan", cache_policy=FingerprintCache(), persist_result=True, result_serializer="json")
def plan_task(config: Phase1aConfig, model_dir: str, data: TokenizedData, fingerprint: str) -> Plan:
    return make_plan(config, Path(model_dir), data)
