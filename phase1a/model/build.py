"""The model and optimizer a run trains: transformers + peft, with the plan's precision, checkpointing and
compilation. Shared by training and calibration, so calibration times exactly what training runs."""
from __future__ import annotations

import math
from pathlib import Path

import torch

from phase1a.config.schema import MethodConfig
from phase1a.core.hardware import training_device, training_dtype
from phase1a.model import chunked_loss
from phase1a.model.adapters import load_adapter_weights
from phase1a.model.attention import NAME as SDPA_PACKED  # importing it registers it: transformers finds it by name
from phase1a.model.loading import load_model, peft_wrapping


def build_model(model_dir: Path, method: MethodConfig, gradient_checkpointing: bool, trust_remote_code: bool = False,
                compile: bool = False, init_adapter: Path | None = None):
    """`init_adapter`: a LoRA adapter whose weights the trainable adapter starts from (a warm start) instead of
    peft's fresh initialisation."""
    device = training_device()
    dtype = training_dtype(device)
    quantization = _nf4_config(dtype, device) if method.base_precision == "4bit" else None
    attention = attention_implementation(method, device, dtype)
    model = load_model(model_dir, dtype, trust_remote_code, quantization, attention)
    if quantization is None:
        model = model.to(device)
    model.config.use_cache = False  # packed rows are only isolated from each other with the cache off
    if device.type == "cuda" and method.liger != "off" and _apply_liger(model, required=method.liger == "on"):
        chunked_loss.install(model, liger=True)
    if quantization is not None:
        from peft import prepare_model_for_kbit_training

        # fp32 norms and input gradients for the frozen NF4 base, as QLoRA trains it. Checkpointing is left to
        # set_gradient_checkpointing below, which sets it last anyway: peft would turn it on through transformers'
        # deprecated gradient_checkpointing_enable (a FutureWarning) with torch's default use_reentrant.
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    if method.kind == "lora":
        from peft import LoraConfig, get_peft_model

        lora = method.lora
        with peft_wrapping():
            model = get_peft_model(
                model,
                LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                           target_modules=lora.target_modules, task_type="CAUSAL_LM"),
            )
        if init_adapter is not None:  # before compiling: the state-dict keys are the eager model's
            load_adapter_weights(model, Path(init_adapter), lora)
    elif init_adapter is not None:
        raise ValueError(f"{init_adapter}: a warm start continues a LoRA adapter; method.kind is {method.kind}")
    set_gradient_checkpointing(model, gradient_checkpointing)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if compile:
        # In place, so state-dict keys (checkpoints, the saved adapter) stay those of the eager model; dynamic
        # because every packed row has its own length.
        model.compile(dynamic=True)
    return model


def attention_implementation(method: MethodConfig, device: torch.device, dtype: torch.dtype) -> str:
    """Packed rows need attention that stops at example boundaries; every choice takes them from the restarting
    position_ids. FlashAttention 2 (CUDA, 16-bit, flash-attn installed) as cumulative lengths for its varlen
    kernel; else `sdpa_packed`, SDPA once per example. Both cost the sum of the examples' squared lengths.
    `sdpa` (a dense block-diagonal mask over the row, the square of the row's length) only when asked for."""
    if method.attention != "auto":
        return method.attention  # an explicit flash_attention_2 without flash-attn fails in transformers, by name
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and _installed("flash_attn"):
        return "flash_attention_2"
    return SDPA_PACKED


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _apply_liger(model, required: bool) -> bool:
    """Liger's Triton kernels (RMSNorm, RoPE, SwiGLU) in place of the model's own, when the package is installed.
    Its fused linear cross-entropy is called by the loss (phase1a/model/chunked_loss.py), not by a patched forward."""
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
    except ImportError:
        if required:
            raise RuntimeError("method.liger on needs liger-kernel: `uv pip install liger-kernel`") from None
        return False
    _apply_liger_kernel_to_instance(model=model, fused_linear_cross_entropy=False, cross_entropy=False)
    return True


def release_device_memory() -> None:
    """After a model is dropped: its reference cycles collected and the CUDA cache emptied, so the next model
    in this process (the flow plans, then trains, in one process) finds the device memory free."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def set_gradient_checkpointing(model, enabled: bool) -> None:
    """Activation checkpointing on or off, through transformers' activation_checkpointing_* methods (its
    gradient_checkpointing_* aliases are deprecated since 5.23). A PeftModel hands the call to its base model."""
    if not enabled:
        model.activation_checkpointing_disable()
        return
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
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
            raise RuntimeError("method.optimizer adamw_8bit needs bitsandbytes: "
                               "`uv pip install bitsandbytes`") from None
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
