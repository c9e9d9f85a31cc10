"""Train: LoRA (or full) fine-tuning on packed batches, sparse time-based checkpoints, resume from the latest.

Imports without Prefect, so the same loop runs on a bare GPU host.
"""
from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path

import torch
from pydantic import BaseModel

from phase1a.checkpoints import TrainingState, list_checkpoints, load_checkpoint, save_checkpoint
from phase1a.config import MethodConfig
from phase1a.fingerprint import hash_json
from phase1a.hardware import training_device, training_dtype
from phase1a.models import load_model
from phase1a.packing import StepBatches, TokenRows, example_stream, step_loader, summed_loss
from phase1a.units import parse_interval
from tasks.caching import task


class TrainSettings(BaseModel):
    model_dir: str
    train_path: str
    output_dir: str
    method: MethodConfig
    micro_batch_size: int
    gradient_checkpointing: bool
    compile: bool = False
    dataloader_workers: int = 0
    max_seq_length: int | None = None  # the plan's truncation, when it is shorter than the tokenized data
    checkpoint_interval: str = "30m"
    keep_last: int = 2
    trust_remote_code: bool = False
    show_progress: bool = True


class TrainResult(BaseModel):
    adapter_dir: str
    output_dir: str
    steps: int
    resumed_from_step: int | None
    reused_completed_run: bool
    wall_seconds: float
    train_tokens: int
    tokens_per_second: float
    final_loss: float | None
    checkpoints_written: int
    checkpoint_seconds: float
    startup_seconds: float = 0.0  # model load, adapter, optimizer, resume: before the first step


def training_key(tokenized_fingerprint: str, model_fingerprint: str, method: MethodConfig, max_seq_length: int) -> str:
    """What makes two runs the same run: same data, weights and training semantics (not micro-batching)."""
    return hash_json({"data": tokenized_fingerprint, "model": model_fingerprint, "method": method.model_dump(),
                      "max_seq_length": max_seq_length})[:16]


def build_model(model_dir: Path, method: MethodConfig, gradient_checkpointing: bool, trust_remote_code: bool = False,
                compile: bool = False):
    device = training_device()
    dtype = training_dtype(device)
    quantization = _nf4_config(dtype, device) if method.base_precision == "4bit" else None
    model = load_model(model_dir, dtype, trust_remote_code, quantization)
    if quantization is None:
        model = model.to(device)
    model.config.use_cache = False  # packed rows are only isolated from each other with the cache off
    if quantization is not None:
        from peft import prepare_model_for_kbit_training

        # fp32 norms and input gradients for the frozen NF4 base, as QLoRA trains it.
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing)
    if method.kind == "lora":
        from peft import LoraConfig, get_peft_model

        lora = method.lora
        model = get_peft_model(
            model,
            LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                       target_modules=lora.target_modules, task_type="CAUSAL_LM"),
        )
    set_gradient_checkpointing(model, gradient_checkpointing)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if compile:
        # In place, so state-dict keys (checkpoints, the saved adapter) stay those of the eager model; dynamic
        # because every packed row has its own length.
        model.compile(dynamic=True)
    return model


def set_gradient_checkpointing(model, enabled: bool) -> None:
    if not enabled:
        model.gradient_checkpointing_disable()
        return
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if any(not p.requires_grad for p in model.get_input_embeddings().parameters()):
        model.enable_input_require_grads()  # frozen embeddings would otherwise cut the graph


def _nf4_config(dtype: torch.dtype, device: torch.device):
    """QLoRA's base: NF4 weights with double-quantised scales, computing in the training dtype."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise RuntimeError("method.base_precision 4bit needs bitsandbytes: `uv pip install bitsandbytes`") from None
    if device.type != "cuda":
        raise RuntimeError("method.base_precision 4bit needs a CUDA GPU; this machine has none")
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=dtype)


def make_optimizer(model: torch.nn.Module, method: MethodConfig) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if method.optimizer == "adamw_8bit":
        try:
            from bitsandbytes.optim import AdamW8bit
        except ImportError:
            raise RuntimeError("method.optimizer adamw_8bit needs bitsandbytes: `uv pip install bitsandbytes`") from None
        return AdamW8bit(params, lr=method.learning_rate, weight_decay=method.weight_decay)
    fused = method.optimizer == "adamw_fused"
    return torch.optim.AdamW(params, lr=method.learning_rate, weight_decay=method.weight_decay, fused=fused,
                             foreach=None if fused else True)


def make_scheduler(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int):
    """Linear warm-up, then cosine decay to zero."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def train_step(model, micro_batches: list[dict[str, torch.Tensor]], supervised: int) -> tuple[float, int]:
    """Forward and backward over one optimizer step's micro-batches; the loss is normalised over the whole
    step's supervised tokens, so accumulation gives the same gradient as one big batch. Returns (loss, tokens)."""
    device = next(model.parameters()).device
    supervised = max(1, supervised)
    total_loss, tokens = 0.0, 0
    for micro in micro_batches:
        batch = {k: v.to(device, non_blocking=True) for k, v in micro.items()}
        loss, _, _ = summed_loss(model, batch)
        (loss / supervised).backward()
        total_loss += loss.item()
        tokens += batch["input_ids"].numel()
    return total_loss / supervised, tokens


def optimizer_step(model, optimizer, step_batch: dict) -> tuple[float, int, float]:
    """One whole optimizer step as training runs it, shared with calibration so both time the same work."""
    loss, tokens = train_step(model, step_batch["micro_batches"], step_batch["supervised"])
    grad_norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss, tokens, float(grad_norm)


def train(settings: TrainSettings) -> TrainResult:
    output_dir = Path(settings.output_dir)
    final_dir = output_dir / "final"
    if (final_dir / "COMPLETE").is_file():  # this exact run already finished: nothing to redo
        summary = TrainResult.model_validate_json((final_dir / "result.json").read_text())
        return summary.model_copy(update={"reused_completed_run": True})

    method = settings.method
    began = time.perf_counter()
    torch.manual_seed(method.seed)
    rows = TokenRows.from_arrow(settings.train_path, settings.max_seq_length)
    order, total_examples = example_stream(len(rows), method.epochs, method.seed)
    batches = StepBatches(settings.train_path, settings.max_seq_length, order, method.batch_size, total_examples,
                          settings.micro_batch_size)
    total_steps = len(batches)
    model = build_model(Path(settings.model_dir), method, settings.gradient_checkpointing, settings.trust_remote_code,
                        settings.compile)
    optimizer = make_optimizer(model, method)
    scheduler = make_scheduler(optimizer, round(method.warmup_fraction * total_steps), total_steps)

    checkpoint_root = output_dir / "checkpoints"
    start_step, resumed_from = 0, None
    if existing := list_checkpoints(checkpoint_root):
        state = load_checkpoint(existing[-1], model)
        optimizer.load_state_dict(state.optimizer)
        scheduler.load_state_dict(state.scheduler)
        torch.set_rng_state(state.torch_rng)
        if state.cuda_rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state.cuda_rng)
        start_step = resumed_from = state.step

    interval = parse_interval(settings.checkpoint_interval)
    metrics_path = output_dir / "metrics.jsonl"
    output_dir.mkdir(parents=True, exist_ok=True)
    progress = _progress_bar(settings.show_progress, total_steps, start_step)
    model.train()
    started = last_save = time.perf_counter()
    startup = started - began
    last_save_step, checkpoints, checkpoint_seconds, tokens_done, loss = start_step, 0, 0.0, 0, None
    with open(metrics_path, "a") as metrics:
        loader = step_loader(batches, range(start_step, total_steps), settings.dataloader_workers,
                             pin_memory=torch.cuda.is_available())
        for step, step_batch in zip(range(start_step, total_steps), loader):
            loss, tokens, grad_norm = optimizer_step(model, optimizer, step_batch)
            scheduler.step()
            tokens_done += tokens
            elapsed = time.perf_counter() - started
            record = {"step": step + 1, "loss": round(loss, 6), "lr": scheduler.get_last_lr()[0],
                      "grad_norm": float(grad_norm), "tokens": tokens, "elapsed_s": round(elapsed, 3),
                      "tokens_per_s": round(tokens_done / max(elapsed, 1e-9), 1)}
            metrics.write(json.dumps(record) + "\n")
            progress.update(1)
            progress.set_postfix(loss=f"{loss:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")
            now = time.perf_counter()
            if step + 1 < total_steps and interval.due(now - last_save, step + 1 - last_save_step):
                save_checkpoint(checkpoint_root, model, _state(step + 1, optimizer, scheduler), settings.keep_last)
                checkpoints += 1
                checkpoint_seconds += time.perf_counter() - now
                last_save, last_save_step = time.perf_counter(), step + 1
    progress.close()
    wall = time.perf_counter() - started

    result = TrainResult(
        adapter_dir=str(final_dir), output_dir=str(output_dir), steps=total_steps, resumed_from_step=resumed_from,
        reused_completed_run=False, wall_seconds=round(wall, 3), train_tokens=tokens_done,
        tokens_per_second=round(tokens_done / max(wall, 1e-9), 2), final_loss=loss,
        checkpoints_written=checkpoints, checkpoint_seconds=round(checkpoint_seconds, 3), startup_seconds=round(startup, 3),
    )
    _save_final(model, final_dir, result)
    return result


def _state(step: int, optimizer, scheduler) -> TrainingState:
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return TrainingState(step, optimizer.state_dict(), scheduler.state_dict(), torch.get_rng_state(), cuda_rng)


def _save_final(model, final_dir: Path, result: TrainResult) -> None:
    """The adapter in peft's own format (PeftModel.from_pretrained loads it), marked complete last."""
    partial = final_dir.with_name("final.partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    (partial / "result.json").write_text(result.model_dump_json(indent=2))
    (partial / "COMPLETE").write_text("ok\n")
    shutil.rmtree(final_dir, ignore_errors=True)
    partial.rename(final_dir)


def _progress_bar(enabled: bool, total: int, initial: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc="train", unit="step", disable=not enabled, dynamic_ncols=True)


def record_run(history: Path, plan, result: TrainResult, model_fingerprint: str, config) -> "RunRecord":
    """Measured against estimated, appended to the history that the next plan of this model reads."""
    from phase1a.history import RunRecord, append_run

    record = RunRecord(
        model_fingerprint=model_fingerprint, model_name=config.model.name_or_path, hardware=config.hardware.target,
        device_name=plan.detected, precision=plan.precision, method_kind=config.method.kind,
        micro_batch_size=plan.micro_batch_size, gradient_checkpointing=plan.gradient_checkpointing,
        compile=plan.compile, dataloader_workers=plan.dataloader_workers, max_seq_length=plan.max_seq_length,
        # Steady speed: checkpoint writes are estimated separately, from their own measured cost.
        tokens_per_second=result.train_tokens / max(result.wall_seconds - result.checkpoint_seconds, 1e-9),
        startup_seconds=result.startup_seconds,
        checkpoint_seconds_each=result.checkpoint_seconds / result.checkpoints_written if result.checkpoints_written else None,
        estimated_train_seconds=plan.estimated_train_seconds, actual_train_seconds=result.wall_seconds,
    )
    append_run(history, record)
    return record


@task(name="train")
def train_task(settings: TrainSettings) -> TrainResult:
    return train(settings)
