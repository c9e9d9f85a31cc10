"""Attention over packed rows that costs what its examples cost: `sdpa_packed`.

A packed row holds several examples, each restarting its position_ids at 0. Handed to SDPA, transformers turns
the restarts into a dense block-diagonal mask over the whole row, so attention computes (and, with a mask,
cannot skip) every pair of tokens in the row: the square of the row's length, where the examples alone need
the sum of their squares. `sdpa_packed` runs causal SDPA once per example instead, over that example's slice of
the row. Same arithmetic, exact (no mask values at all), and no optional package: on CUDA each call takes
SDPA's own flash kernel, since a causal call without a mask qualifies for it. The calls are kept off SDPA's
cuDNN backend, which torch prefers on Hopper: it builds a graph for every new sequence length (hundreds of
milliseconds each), and here every example length is one (benchmarks/results/gpu-check-h200-2026-11-26).

Registered with transformers' `AttentionInterface` (the function) and `AttentionMaskInterface` (no dense mask
for unpadded rows) under the name `sdpa_packed`; `load_model(..., attn_implementation="sdpa_packed")` takes it
after this module is imported. Anything other than an unpadded row attending to itself (padding, a KV cache in
generation) falls back to transformers' own SDPA path with its mask.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "sdpa_packed"
# One forward passes the same position_ids tensor to every layer (and to their recomputation under gradient
# checkpointing): its segments are read once and kept on the tensor, so a CUDA row syncs the host once a
# forward, not once a layer, and they go when the tensor goes.
_CACHE = "_phase1a_segments"
_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]  # all but cuDNN's


def segments(position_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per batch row, the (start, end) of each example: a new one starts wherever the position restarts at 0."""
    cached = getattr(position_ids, _CACHE, None)
    if cached is not None:
        return cached
    rows = []
    for positions in position_ids.detach().cpu().numpy():
        starts = np.flatnonzero(positions == 0).tolist()
        starts = starts if starts and starts[0] == 0 else [0, *starts]
        rows.append(list(zip(starts, [*starts[1:], len(positions)])))
    setattr(position_ids, _CACHE, rows)
    return rows


def sdpa_packed_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                        position_ids: torch.Tensor | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """query (batch, heads, length, dim), key and value (batch, kv heads, length, dim), as transformers passes
    them; returns (batch, length, heads, dim) like its SDPA function."""
    if attention_mask is not None or query.shape[2] != key.shape[2]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      position_ids=position_ids, **kwargs)
    groups = getattr(module, "num_key_value_groups", 1)
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    if position_ids is None:
        position_ids = torch.arange(query.shape[2])[None]
    if position_ids.shape[0] != query.shape[0]:  # one row of positions for a whole batch: generation's prefill
        position_ids = position_ids.expand(query.shape[0], -1)
    rows = []
    with sdpa_kernel(_BACKENDS, set_priority=True):
        for row, spans in enumerate(segments(position_ids)):
            parts = [F.scaled_dot_product_attention(query[row:row + 1, :, a:b], key[row:row + 1, :, a:b],
                                                    value[row:row + 1, :, a:b], dropout_p=dropout, scale=scaling,
                                                    is_causal=b - a > 1) for a, b in spans]
            rows.append(torch.cat(parts, dim=2) if len(parts) > 1 else parts[0])
    output = torch.cat(rows, dim=0) if len(rows) > 1 else rows[0]
    return output.transpose(1, 2).contiguous(), None


def sdpa_packed_mask(batch_size: int, q_length: int, kv_length: int, *args, attention_mask=None, **kwargs):
    """No mask for an unpadded row attending to itself (the forward takes the examples from position_ids);
    SDPA's own mask otherwise."""
    if q_length == kv_length and (attention_mask is None or bool(attention_mask.all())):
        return None
    return sdpa_mask(batch_size, q_length, kv_length, *args, attention_mask=attention_mask, **kwargs)


AttentionInterface.register(NAME, sdpa_packed_forward)
AttentionMaskInterface.register(NAME, sdpa_packed_mask)
