"""The attention alone, old against new: the per-example SDPA loop the train step ran before issue 34
(`sdpa_packed`, reimplemented here as it was) and the one custom op a layer that replaced it
(`torch.ops.phase1a.varlen_attention`, phase1a/model/attention.py), forward and backward, on one packed row.

    python3 benchmarks/attention_op.py --out attention-op.json [--tokens 16384] [--dry-run]

The row: 16,384 tokens of examples whose lengths are drawn like chat data (log-uniform, 50 to 1,000 tokens; seeded,
the last one cut to fill the row). Head shapes: SmolLM2-135M (9 query heads, 3 key/value heads, head dim 64) and
Llama-3-8B (32, 8, 128), in bf16 on CUDA. Each side starts from the tensors transformers hands an attention
function (query (1, H, T, D), key and value (1, Hkv, T, D)) and ends with its (1, T, H, D) output, as a layer
calls it:

  old  repeat_kv on key and value, then per example `F.scaled_dot_product_attention(..., is_causal=True)` on its
       slices, kept off cuDNN as it was (`sdpa_kernel([FLASH, EFFICIENT, MATH])`), and one `torch.cat`
  new  the project's `varlen_attention_forward` (one `phase1a::varlen_attention` call); `op` is that op alone on
       (T, H, D) tensors, without the layout changes around it

Timing: CUDA events around `--iterations` forward+backward calls after `--warmup` of them (perf_counter on a CPU);
ms per call is their elapsed time over the count. Parity: the new output and the query, key and value gradients
against the old loop's (the per-example reference), as the max abs difference and that over the reference's max abs
value; and both against the old loop in float32: the new op passes where its error from float32 is within the
tolerance or twice the old loop's own. `--dry-run`: a CPU, float32, 512 tokens of 16 to 128-token examples (the
op's CPU kernel, the same code path up to the CUDA one).
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from step_meter import write_json

from phase1a.core.units import MIB

HEAD_SHAPES = {"smollm2": (9, 3, 64), "llama3-8b": (32, 8, 128)}  # query heads, key/value heads, head dim
LENGTHS = (50, 1000)  # an example's tokens, drawn log-uniformly
DRY_RUN_TOKENS, DRY_RUN_LENGTHS = 512, (16, 128)  # a CPU: seconds, several examples a row
# Relative difference (max abs difference over the reference's max abs value) within which the two agree: bf16
# keeps 8 bits of mantissa (0.4 %), and the two sum in different orders; float32 on a CPU is exact to 1e-5.
TOLERANCE = {"bfloat16": 2e-2, "float32": 1e-4}


def example_lengths(tokens: int, bounds: tuple[int, int] = LENGTHS, seed: int = 0) -> list[int]:
    """Chat-like example lengths that fill `tokens` exactly."""
    import random

    rng, lengths = random.Random(seed), []
    low, high = math.log(bounds[0]), math.log(bounds[1])
    while sum(lengths) < tokens:
        lengths.append(min(int(math.exp(rng.uniform(low, high))), tokens - sum(lengths)))
    return lengths


def old_loop(query, key, value, spans: list[tuple[int, int]], scale: float):
    """`sdpa_packed` as it was before issue 34 (git show bec201d:phase1a/model/attention.py), for one row."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers.integrations.sdpa_attention import repeat_kv

    groups = query.size(1) // key.size(1)
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]  # all but cuDNN's
    try:
        context = sdpa_kernel(backends, set_priority=True)
    except TypeError:  # a torch without set_priority
        context = sdpa_kernel(backends)
    with context:
        parts = [F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], scale=scale,
                                                is_causal=b - a > 1) for a, b in spans]
    output = torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]
    return output.transpose(1, 2).contiguous()


def new_function(query, key, value, cu_seqlens, max_seqlen: int, scale: float):
    """The layer's attention function today: one `phase1a::varlen_attention` call."""
    from types import SimpleNamespace

    from phase1a.model.attention import varlen_attention_forward

    module = SimpleNamespace(num_key_value_groups=query.size(1) // key.size(1), sliding_window=None)
    output, _ = varlen_attention_forward(module, query, key, value, None, scaling=scale, cu_seq_lens_q=cu_seqlens,
                                         max_length_q=max_seqlen)
    return output


def new_op(query, key, value, cu_seqlens, max_seqlen: int, scale: float):
    """The op alone, on (T, H, D) tensors."""
    import torch

    output, _ = torch.ops.phase1a.varlen_attention(query, key, value, cu_seqlens, max_seqlen, scale, 0)
    return output


def time_calls(call, inputs: list, grad, warmup: int, iterations: int) -> dict:
    """ms per forward+backward call, and the peak memory of one call past the inputs (CUDA)."""
    import torch

    def once():
        for tensor in inputs:
            tensor.grad = None
        call().backward(grad)

    on_cuda = inputs[0].is_cuda
    for _ in range(warmup):
        once()
    if on_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iterations):
            once()
        end.record()
        torch.cuda.synchronize()
        return {"ms_per_call": round(start.elapsed_time(end) / iterations, 4), "iterations": iterations,
                "peak_extra_mib": round((torch.cuda.max_memory_allocated() - base) / MIB, 1),
                "clock": "cuda events"}
    began = time.perf_counter()
    for _ in range(iterations):
        once()
    return {"ms_per_call": round((time.perf_counter() - began) * 1e3 / iterations, 4), "iterations": iterations,
            "clock": "perf_counter"}


def parity(reference, other) -> dict:
    """Max abs difference of `other` from `reference`, and relative to the reference's max abs value."""
    difference = (other.float() - reference.float()).abs().max().item()
    scale = reference.float().abs().max().item()
    return {"max_abs_diff": difference, "relative": difference / scale if scale else difference}


def measure(shape: str, tokens: int, dtype_name: str, device: str, warmup: int, iterations: int,
            bounds: tuple[int, int] = LENGTHS) -> dict:
    import torch

    import phase1a.model.attention  # noqa: F401 - registers the op

    heads, kv_heads, dim = HEAD_SHAPES[shape]
    dtype = getattr(torch, dtype_name)
    lengths = example_lengths(tokens, bounds)
    edges = [0]
    for length in lengths:
        edges.append(edges[-1] + length)
    spans = list(zip(edges, edges[1:]))
    cu_seqlens = torch.tensor(edges, dtype=torch.int32, device=device)
    scale = dim ** -0.5
    generator = torch.Generator(device=device).manual_seed(0)

    def leaf(*size):
        return torch.randn(*size, generator=generator, device=device, dtype=dtype).requires_grad_()

    query, key, value = leaf(1, heads, tokens, dim), leaf(1, kv_heads, tokens, dim), leaf(1, kv_heads, tokens, dim)
    grad = torch.randn(1, tokens, heads, dim, generator=generator, device=device, dtype=dtype)
    inputs = [query, key, value]

    def run(call, leaves, upstream):
        for tensor in leaves:
            tensor.grad = None
        out = call()
        out.backward(upstream)
        return [out.detach(), *(t.grad.detach().clone() for t in leaves)]

    old = lambda: old_loop(query, key, value, spans, scale)  # noqa: E731
    new = lambda: new_function(query, key, value, cu_seqlens, max(lengths), scale)  # noqa: E731
    old_values, new_values = run(old, inputs, grad), run(new, inputs, grad)
    # The per-example loop in float32 as well: in bf16 both sides round, in different orders, so the new op's
    # error is judged against the old loop's own error from the float32 result.
    exact = [t.detach().float().requires_grad_() for t in inputs]
    reference = run(lambda: old_loop(*exact, spans, scale), exact, grad.float())
    tolerance = TOLERANCE.get(dtype_name, 2e-2)
    checks = {}
    for name, old_value, new_value, exact_value in zip(("output", "grad_query", "grad_key", "grad_value"),
                                                        old_values, new_values, reference):
        check = {**parity(old_value, new_value), "new_vs_float32": parity(exact_value, new_value)["relative"],
                 "old_vs_float32": parity(exact_value, old_value)["relative"]}
        check["ok"] = check["new_vs_float32"] <= max(tolerance, 2 * check["old_vs_float32"])
        checks[name] = check
    del old_values, new_values, reference

    flat = [t.detach().transpose(1, 2).reshape(tokens, t.size(1), dim).contiguous().requires_grad_()
            for t in (query, key, value)]
    op = lambda: new_op(*flat, cu_seqlens, max(lengths), scale)  # noqa: E731
    timings = {"old": time_calls(old, inputs, grad, warmup, iterations),
               "new": time_calls(new, inputs, grad, warmup, iterations),
               "op": time_calls(op, flat, grad[0], warmup, iterations)}
    return {"shape": shape, "heads": heads, "kv_heads": kv_heads, "head_dim": dim, "tokens": tokens,
            "examples": len(lengths), "longest": max(lengths), "dtype": dtype_name, "device": device,
            **{f"{name}_ms": timing["ms_per_call"] for name, timing in timings.items()},
            "speedup": round(timings["old"]["ms_per_call"] / timings["new"]["ms_per_call"], 3),
            "timings": timings, "parity": checks, "tolerance": tolerance,
            "parity_ok": all(check["ok"] for check in checks.values())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--shapes", nargs="+", choices=sorted(HEAD_SHAPES), default=list(HEAD_SHAPES))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--dry-run", action="store_true", help="a CPU, float32, 512 tokens")
    args = parser.parse_args()
    import torch

    on_cuda = torch.cuda.is_available() and not args.dry_run
    if not on_cuda and not args.dry_run:
        print("no CUDA device: --dry-run runs the CPU path")
        return 2
    device, dtype = ("cuda", "bfloat16") if on_cuda else ("cpu", "float32")
    tokens = args.tokens if on_cuda else min(args.tokens, DRY_RUN_TOKENS)
    bounds = LENGTHS if on_cuda else DRY_RUN_LENGTHS
    warmup, iterations = (args.warmup, args.iterations) if on_cuda else (1, 1)
    if not on_cuda:  # tiny kernels: a second thread only spins, and on a loaded 2-core VM costs 30 times as long
        torch.set_num_threads(1)
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__,
              "device": torch.cuda.get_device_name(0) if on_cuda else f"CPU ({platform.machine()})",
              "command": " ".join(sys.argv), "shapes": []}
    from phase1a.model.attention import cuda_kernel, flash_supports

    for shape in args.shapes:  # written after each: a run cut off keeps the shapes it finished
        measured = measure(shape, tokens, dtype, device, warmup, iterations, bounds)
        probe = torch.empty(1, 1, HEAD_SHAPES[shape][2], device=device, dtype=getattr(torch, dtype))
        measured["new_kernel"] = ("FlashAttention 2 varlen (aten._flash_attention_forward/backward)"
                                  + (", windows" if cuda_kernel().windows else "")
                                  if flash_supports(probe) else "the CPU reference (SDPA's CPU kernel per segment)")
        result["shapes"].append(measured)
        write_json(args.out, result)
        print(json.dumps({k: v for k, v in measured.items() if k not in ("timings", "parity")}), flush=True)
    failed = [s["shape"] for s in result["shapes"] if not s["parity_ok"]]
    if failed:
        result.update(status="failed", reason=f"the new op differs from the per-example loop beyond the "
                                              f"tolerance on {', '.join(failed)}")
        write_json(args.out, result)
        print(result["reason"])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
