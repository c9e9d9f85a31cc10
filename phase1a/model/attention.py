"""Attention over packed rows in one call per layer: `varlen`.

A packed row holds several examples (and, in a static row, padding segments), laid out by the packer's
`cu_seqlens` (int32, the cumulative boundaries, phase1a/train/packing.py). Each example attends causally to
itself only, so attention costs the sum of the examples' squared lengths, never the square of the row.

The work is one custom op per layer, `phase1a::varlen_attention` (a `torch.library` op with a fake implementation
and its own backward op), so the dispatcher, the profiler and torch.compile see one attention call whatever the
number of examples, and no host read of the boundaries happens outside it:
- on CUDA, FlashAttention 2's varlen kernel as torch ships it (`aten._flash_attention_forward/backward`, the kernels
  `torch.nn.attention.varlen.varlen_attn` wraps): native GQA, sliding windows, never cuDNN, whose attention builds
  a graph per new shape and whose choice inside `varlen_attn` changes between torch releases; the op's schema is
  the same from torch 2.9 to 2.13 (probed once, `cuda_kernel()`);
- elsewhere, the exact reference: SDPA's own CPU kernel once per segment, its backward writing each segment's
  gradient into one gradient tensor allocated once (no zero-filled row per example).

Registered with transformers' `AttentionInterface` under `varlen`; a model loaded with `attn_implementation="varlen"`
takes the boundaries from the forward's keyword arguments (`cu_seq_lens_q`, `max_length_q`: the names
transformers' FlashAttention path reads, so `flash_attention_2` consumes the same rows). A forward without them
(generation, a padded batch) falls back to transformers' SDPA with its mask. `AttentionMaskInterface` gets a mask
function that builds no mask inside `packed_forward()`: transformers would otherwise scan position_ids for packed
sequences, a host read every forward.
"""
from __future__ import annotations

import contextvars
import functools
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "varlen"
OLD_NAME = "sdpa_packed"  # the name of the per-example loop this op replaced; configs that name it get this op
OP = "phase1a::varlen_attention"

# ---- the op --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """A packed row's segments and how they attend: the op's arguments besides the tensors it reads."""

    cu_seqlens: torch.Tensor
    max_seqlen: int
    scale: float
    window: int


@dataclass(frozen=True)
class Saved:
    """What a backward reads of its forward (for the whole row, or one segment's slices)."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor


@torch.library.custom_op(OP, mutates_args=())
def varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                     max_seqlen: int, scale: float, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of each segment of a packed row to itself. query (T, H, D), key and value (T, Hkv, D) with
    Hkv dividing H, `cu_seqlens` (S + 1,) int32 from 0 to T (zero-length segments allowed), `max_seqlen` a bound on
    the longest segment, `window` > 0 a sliding window (a token sees itself and the window - 1 before it), 0 none.
    Returns the output (T, H, D) and the log-sum-exp (H, T), float32, which the backward needs."""
    layout = Layout(cu_seqlens, max_seqlen, scale, window)
    if flash_supports(query):
        return cuda_kernel().forward(query, key, value, layout)
    return _reference_forward(query, key, value, layout)


# Outputs and gradients take their input's strides (`empty_like`), as FlashAttention's own allocations do: the
# flattened query is a view of transformers' layout, and the compiler checks the fake's strides against the kernel's.
@varlen_attention.register_fake
def _varlen_attention_fake(query, key, value, cu_seqlens, max_seqlen, scale, window):
    return torch.empty_like(query), query.new_empty((query.size(1), query.size(0)), dtype=torch.float32)


@torch.library.custom_op(OP + "_backward", mutates_args=())
def varlen_attention_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              out: torch.Tensor, lse: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                              scale: float, window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    saved, layout = Saved(query, key, value, out, lse), Layout(cu_seqlens, max_seqlen, scale, window)
    if flash_supports(query):
        return cuda_kernel().backward(grad_out, saved, layout)
    return _reference_backward(grad_out, saved, layout)


@varlen_attention_backward.register_fake
def _varlen_attention_backward_fake(grad_out, query, key, value, out, lse, cu_seqlens, max_seqlen, scale, window):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def _setup_context(ctx, inputs, output):
    query, key, value, cu_seqlens, max_seqlen, scale, window = inputs
    ctx.save_for_backward(query, key, value, output[0], output[1], cu_seqlens)
    ctx.max_seqlen, ctx.scale, ctx.window = max_seqlen, scale, window


def _backward(ctx, grad_out, _grad_lse):
    query, key, value, out, lse, cu_seqlens = ctx.saved_tensors
    grads = torch.ops.phase1a.varlen_attention_backward(grad_out.contiguous(), query, key, value, out, lse, cu_seqlens,
                                                        ctx.max_seqlen, ctx.scale, ctx.window)
    return *grads, None, None, None, None


varlen_attention.register_autograd(_backward, setup_context=_setup_context)


# ---- the CPU reference ---------------------------------------------------------------------------------------


def _segments(cu_seqlens: torch.Tensor, total: int) -> list[tuple[int, int]]:
    """The non-empty (start, end) of each segment, for the kernels that loop over them. A host read: on the CPU
    a read of its own memory; on a GPU only where FlashAttention cannot run (float32, pre-Ampere), whose
    per-segment loop needs the boundaries on the host. The FlashAttention path never reads them."""
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != total or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to the row's {total} tokens; got {bounds}")
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def _heads(tensor: torch.Tensor, groups: int) -> torch.Tensor:
    """(L, Hkv, D) -> (1, H, L, D): each key/value head serves `groups` query heads (GQA)."""
    tensor = tensor.transpose(0, 1)
    return (tensor.repeat_interleave(groups, dim=0) if groups > 1 else tensor)[None]


def _window_mask(length: int, window: int, like: torch.Tensor) -> torch.Tensor | None:
    """The causal band of a sliding window, where it is narrower than the segment, as an additive mask in the
    query's dtype (what SDPA's CPU kernel takes); None: plain causal."""
    if window <= 0 or window >= length:
        return None
    positions = torch.arange(length, device=like.device)
    distance = positions[:, None] - positions[None, :]
    band = (distance >= 0) & (distance < window)
    return torch.zeros(length, length, dtype=like.dtype, device=like.device).masked_fill_(~band, float("-inf"))


def _reference_forward(query, key, value, layout: Layout):
    total, heads, _ = query.shape
    groups = heads // key.size(1)
    out = torch.empty_like(query)
    lse = query.new_empty((heads, total), dtype=torch.float32)
    kernel = _cpu_forward if query.device.type == "cpu" else _math_forward
    for a, b in _segments(layout.cu_seqlens, total):
        mask = _window_mask(b - a, layout.window, query)
        segment_out, segment_lse = kernel(query[a:b].transpose(0, 1)[None], _heads(key[a:b], groups),
                                          _heads(value[a:b], groups), mask, layout.scale)
        out[a:b] = segment_out[0].transpose(0, 1)
        lse[:, a:b] = segment_lse[0]
    return out, lse


def _reference_backward(grad_out, saved: Saved, layout: Layout):
    """Each segment's gradients written into the row's, allocated once (every token is in one segment)."""
    total, heads, dim = saved.query.shape
    kv_heads = saved.key.size(1)
    groups = heads // kv_heads
    grad_query, grad_key, grad_value = (torch.empty_like(t) for t in (saved.query, saved.key, saved.value))
    kernel = _cpu_backward if saved.query.device.type == "cpu" else _math_backward
    for a, b in _segments(layout.cu_seqlens, total):
        mask = _window_mask(b - a, layout.window, saved.query)
        segment = Saved(saved.query[a:b].transpose(0, 1)[None], _heads(saved.key[a:b], groups),
                        _heads(saved.value[a:b], groups), saved.out[a:b].transpose(0, 1)[None],
                        saved.lse[None, :, a:b])
        dq, dk, dv = kernel(grad_out[a:b].transpose(0, 1)[None], segment, mask, layout.scale)
        grad_query[a:b] = dq[0].transpose(0, 1)
        # A key/value head's gradient is the sum over the query heads it served.
        grad_key[a:b] = dk[0].view(kv_heads, groups, b - a, dim).sum(1).transpose(0, 1)
        grad_value[a:b] = dv[0].view(kv_heads, groups, b - a, dim).sum(1).transpose(0, 1)
    return grad_query, grad_key, grad_value


def _cpu_forward(query, key, value, mask, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, is_causal=mask is None,
                                                                      attn_mask=mask, scale=scale)


def _cpu_backward(grad_out, saved: Saved, mask, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, saved.query, saved.key, saved.value, saved.out, saved.lse.contiguous(), 0.0, mask is None,
        attn_mask=mask, scale=scale)


def _math_probabilities(query, key, mask, scale):
    """Scores in float32, masked causally (or by the window's band)."""
    scores = (query.float() @ key.float().transpose(-1, -2)) * scale
    if mask is not None:
        return scores + mask.float()
    length = scores.size(-1)
    causal = torch.ones(length, length, dtype=torch.bool, device=scores.device).tril()
    return scores.masked_fill(~causal, float("-inf"))


def _math_forward(query, key, value, mask, scale):
    """Where neither FlashAttention nor SDPA's CPU kernel applies (float32 on a GPU, an older GPU)."""
    scores = _math_probabilities(query, key, mask, scale)
    lse = scores.logsumexp(-1)
    return ((scores - lse[..., None]).exp() @ value.float()).to(query.dtype), lse


def _math_backward(grad_out, saved: Saved, mask, scale):
    query, key, value = saved.query, saved.key, saved.value
    probabilities = (_math_probabilities(query, key, mask, scale) - saved.lse[..., None]).exp()
    grad_out = grad_out.float()
    grad_value = probabilities.transpose(-1, -2) @ grad_out
    grad_probabilities = grad_out @ value.float().transpose(-1, -2)
    grad_scores = probabilities * (grad_probabilities - (grad_out * saved.out.float()).sum(-1, keepdim=True))
    grad_query = (grad_scores @ key.float()) * scale
    grad_key = (grad_scores.transpose(-1, -2) @ query.float()) * scale
    return grad_query.to(query.dtype), grad_key.to(key.dtype), grad_value.to(value.dtype)


# ---- the CUDA kernel -----------------------------------------------------------------------------------------


class _FlashVarlen:
    """FlashAttention 2's varlen forward and backward as torch ships them. Dropout is 0, so the backward's random
    state arguments are placeholders, as torch's own varlen_attn passes them."""

    def __init__(self) -> None:
        schema = str(torch.ops.aten._flash_attention_forward.default._schema)
        self.windows = "window_size_left" in schema  # torch >= 2.5

    def _window(self, window: int) -> dict:
        if window <= 0:
            return {}
        if not self.windows:
            raise RuntimeError(f"a sliding window of {window} needs torch >= 2.5 ({torch.__version__} here)")
        return {"window_size_left": window - 1, "window_size_right": 0}

    def forward(self, query, key, value, layout: Layout):
        cu, longest = layout.cu_seqlens, layout.max_seqlen
        out, lse, *_ = torch.ops.aten._flash_attention_forward(
            query, key, value, cu, cu, longest, longest, 0.0, True, False, scale=layout.scale,
            **self._window(layout.window))
        return out, lse

    def backward(self, grad_out, saved: Saved, layout: Layout):
        cu, longest, device = layout.cu_seqlens, layout.max_seqlen, saved.query.device
        placeholder = torch.zeros(2, dtype=torch.uint64, device=device)
        unused = torch.empty(0, device=device)
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad_out, saved.query, saved.key, saved.value, saved.out, saved.lse, cu, cu, longest, longest, 0.0, True,
            placeholder, unused, scale=layout.scale, **self._window(layout.window))
        return dq, dk, dv


@functools.cache
def cuda_kernel() -> _FlashVarlen:
    return _FlashVarlen()


def flash_supports(query: torch.Tensor) -> bool:
    """FlashAttention 2 runs on Ampere and newer, in 16-bit, head dimensions up to 256 in multiples of 8."""
    if not query.is_cuda or query.dtype not in (torch.float16, torch.bfloat16):
        return False
    dim = query.size(-1)
    return torch.cuda.get_device_capability(query.device)[0] >= 8 and dim % 8 == 0 and dim <= 256


# ---- transformers --------------------------------------------------------------------------------------------

_PACKED = contextvars.ContextVar("phase1a_packed_forward", default=False)


@contextmanager
def packed_forward():
    """A forward over packed rows: the mask function builds nothing (the boundaries travel as cu_seqlens)."""
    token = _PACKED.set(True)
    try:
        yield
    finally:
        _PACKED.reset(token)


def varlen_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             cu_seq_lens_q: torch.Tensor | None = None, max_length_q: int | None = None,
                             **kwargs) -> tuple[torch.Tensor, None]:
    """query (batch, heads, length, dim), key and value (batch, kv heads, length, dim), as transformers passes
    them; returns (batch, length, heads, dim) like its SDPA function. `cu_seq_lens_q` covers the batch's rows laid
    end to end (the packer makes one row)."""
    if cu_seq_lens_q is None:  # generation, a padded batch: transformers' SDPA with its mask
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if dropout:
        raise ValueError(f"{type(module).__name__}: attention dropout {dropout} is not supported over packed rows; "
                         "set the model config's attention_dropout to 0")
    if kwargs.get("softcap") is not None:
        raise ValueError(f"{type(module).__name__}: attention logit soft-capping is not supported over packed rows; "
                         "set method.attention: eager")
    batch, heads, length, dim = query.shape
    scale = float(scaling) if scaling is not None else dim ** -0.5
    window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None) or 0

    def flat(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.transpose(1, 2).reshape(batch * length, tensor.size(1), dim)

    out, _ = torch.ops.phase1a.varlen_attention(flat(query), flat(key), flat(value), cu_seq_lens_q,
                                                int(max_length_q or length), scale, int(window))
    return out.view(batch, length, heads, dim), None


def varlen_mask(batch_size: int, q_length: int, kv_length: int, *args, attention_mask=None, **kwargs):
    """No mask inside `packed_forward()`; SDPA's own mask otherwise (generation, padded batches)."""
    if _PACKED.get():
        return None
    return sdpa_mask(batch_size, q_length, kv_length, *args, attention_mask=attention_mask, **kwargs)


AttentionInterface.register(NAME, varlen_attention_forward)
AttentionMaskInterface.register(NAME, varlen_mask)
