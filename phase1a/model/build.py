"""The model and optimizer a run trains: transformers + peft, with the plan's precision, checkpointing and
compilation. Shared by training and calibration, so calibration times exactly what training runs.

On a GPU in bf16 the LoRA adapters keep float32 weights (the optimizer's master copy) but compute in bf16: peft
would cast every adapted projection's activations to float32 and back, three activation-sized copies per
projection per pass; instead its input cast is off and the forward runs under bf16 autocast, which casts the small
adapter weights once per forward. Compilation is per decoder layer, whole-graph (`fullgraph=True`) on the static
shapes of the packer's rows, optionally captured as CUDA graphs; its cache lives under the run's cache directory,
so the train stage finds what the plan's calibration compiled.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from phase1a.config.schema import MethodConfig
from phase1a.core.hardware import training_device, training_dtype
from phase1a.model import chunked_loss, liger
from phase1a.model.adapters import load_adapter_weights
from phase1a.model.attention import NAME as VARLEN  # importing it registers it: transformers finds it by name
from phase1a.model.loading import adapters_compute_in_input_dtype, load_model, peft_wrapping

# Set before this process first compiles; where the user set it, theirs stands.
_USER_COMPILE_CACHE = os.environ.get("TORCHINDUCTOR_CACHE_DIR")


@dataclass(frozen=True)
class Compilation:
    """How a model's layers are compiled (`compile_layers`): also captured as CUDA graphs, and where compiled code
    is kept between stages and runs (None: torch's default)."""

    cuda_graphs: bool = False
    cache: Path | None = None


def build_model(model_dir: Path, method: MethodConfig, gradient_checkpointing: bool, trust_remote_code: bool = False,
                compile: Compilation | None = None, init_adapter: Path | None = None):
    """`compile`: each decoder layer compiled whole (`compile_layers`), None: eager. `init_adapter`: a LoRA adapter
    whose weights the trainable adapter starts from (a warm start) instead of peft's fresh initialisation."""
    device = training_device()
    dtype = training_dtype(device)
    quantization = _nf4_config(dtype, device) if method.base_precision == "4bit" else None
    attention = attention_implementation(method, device, dtype)
    model = load_model(model_dir, dtype, trust_remote_code, quantization, attention)
    if quantization is None:
        model = model.to(device)
    model.config.use_cache = False  # packed rows are only isolated from each other with the cache off
    adapter_autocast = dtype if method.kind == "lora" and dtype != torch.float32 else None
    kernels = device.type == "cuda" and method.liger != "off" and _apply_liger(model, required=method.liger == "on")
    # Liger's fused loss reads the device once a call (a host sync a micro-batch): only when asked for by name.
    chunked_loss.install(model, liger=kernels and method.liger == "on", autocast=adapter_autocast)
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
        if adapter_autocast is not None:
            adapters_compute_in_input_dtype(model)  # chunked_loss.install above gave the forward its autocast
    elif init_adapter is not None:
        raise ValueError(f"{init_adapter}: a warm start continues a LoRA adapter; method.kind is {method.kind}")
    set_gradient_checkpointing(model, gradient_checkpointing)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    set_compiled(model, compile)
    return model


def compile_layers(model, compilation: Compilation = Compilation()) -> None:
    """Each decoder layer compiled in place (state-dict keys stay the eager model's), as one graph
    (`fullgraph=True`: a graph break is an error, not a silent fall back to Python) on static shapes (the packer's
    few row lengths: a graph a length, never a recompilation a step). Layers share their code, so one compilation
    serves them all. With `cuda_graphs` each compiled layer is also replayed as a CUDA graph (`reduce-overhead`)."""
    cache = compilation.cache
    if cache is not None and _USER_COMPILE_CACHE is None:
        cache.mkdir(parents=True, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    for layer in decoder_layers(model):
        layer.compile(fullgraph=True, dynamic=False, mode="reduce-overhead" if compilation.cuda_graphs else None)


def set_compiled(model, compilation: Compilation | None) -> None:
    """Compiled layers as asked (`compile_layers`), or eager ones (None): what calibration's candidates switch
    between."""
    state = None if compilation is None else compilation.cuda_graphs
    if getattr(model, "_phase1a_compiled", None) == state:
        return
    liger.enable(model, on=compilation is None)  # Liger's kernels in eager layers only (phase1a/model/liger.py)
    if compilation is not None:
        compile_layers(model, compilation)
    else:
        for layer in decoder_layers(model):
            layer._compiled_call_impl = None
    model._phase1a_compiled = state


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder's layers of a causal LM, wrapped by peft or not."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = getattr(base.get_decoder(), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise TypeError(f"{type(base).__name__}: no decoder layers to compile (get_decoder().layers)")
    return layers


def attention_implementation(method: MethodConfig, device: torch.device, dtype: torch.dtype) -> str:
    """Packed rows need attention that stops at example boundaries. `varlen` (auto): one call a layer over the
    packer's boundaries (phase1a/model/attention.py), FlashAttention 2's varlen kernel on a GPU; it costs the sum
    of the examples' squared lengths. `flash_attention_2` (flash-attn's own kernel) and `sdpa` or `eager` (a dense
    block-diagonal mask over the row, the square of the row's length) only when asked for."""
    if method.attention in ("auto", "sdpa_packed"):
        return VARLEN
    return method.attention  # an explicit flash_attention_2 without flash-attn fails in transformers, by name


def _apply_liger(model, required: bool) -> bool:
    """Liger's Triton kernels (RMSNorm, SwiGLU) in this model's eager layers, when the package is installed
    (phase1a/model/liger.py). Its fused linear cross-entropy is called by the loss (phase1a/model/chunked_loss.py),
    not by a patched forward."""
    if not liger.installed():
        if required:
            raise RuntimeError("method.liger on needs liger-kernel: `uv pip install liger-kernel`")
        return False
    liger.apply(model)  # False for a family Liger has no kernels for: the loss's kernel still applies
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
