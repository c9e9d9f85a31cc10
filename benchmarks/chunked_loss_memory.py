"""The chunked loss against whole logits: the peak memory of one LoRA training step on a packed row, and the
largest micro-batch that fits a memory cap, measured and as the plan's memory model bills it, one run.

    uv run python benchmarks/chunked_loss_memory.py [--tokens 1024 3072] [--cap-gib 4] [--example-tokens 512]
                                                     [--out FILE]

SmolLM2-135M-Instruct (its real weights, fp32, on this CPU), LoRA r=16 on every projection, per-example attention
(`varlen`; the committed result was measured with its predecessor, `sdpa_packed`), with and without gradient
checkpointing. "whole" is the loss before phase1a/model/chunked_loss.py: the model's own forward returns the row's
logits, upcast to fp32, and cross_entropy reads them. The peak is the most tensor memory alive at once during forward
and backward (the profiler's allocation and free events, as tests/helpers measures it; weights and optimizer state
are allocated before and stay aside). It is linear in the row's tokens (per-example attention has no quadratic
term), so the longest row under `--cap-gib` is solved from the two measured lengths, and a micro-batch is
that row over `--example-tokens`.
The memory model's bill for the same step (activations + logits + the LoRA gradients) is solved the same way; for
"whole" it bills the logits as the plan did before, t*V*8, in place of the chunk.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_throughput import write_json

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from helpers import peak_tensor_bytes, whole_logits_loss  # noqa: E402 - the test suite's measure and reference
from phase1a.core.units import GIB


def step_peak(model, tokens: int, loss_name: str) -> int:
    import torch

    from phase1a.train.packing import PackedRow, summed_loss

    generator = torch.Generator().manual_seed(tokens)
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=generator)
    half = tokens // 2
    batch = PackedRow(input_ids=ids, labels=ids,  # two examples
                      position_ids=torch.cat([torch.arange(half), torch.arange(tokens - half)])[None],
                      cu_seqlens=torch.tensor([0, half, tokens], dtype=torch.int32), max_seqlen=tokens - half,
                      tokens=tokens, supervised=tokens - 1)

    def step():
        loss = summed_loss(model, batch)[0] if loss_name == "chunked" else whole_logits_loss(model, batch)
        loss.backward()

    step()  # lazy initialisation stays out of the measurement
    model.zero_grad(set_to_none=True)
    peak = peak_tensor_bytes(step)
    model.zero_grad(set_to_none=True)
    return peak


def billed(memory_model, tokens: int, checkpointing: bool, loss_name: str) -> float:
    """The plan's bill for the step: activations + logits + the trainable parameters' gradients."""
    estimate = memory_model.estimate(tokens, checkpointing)
    logits = estimate.logits_gib * GIB
    if loss_name == "whole":  # the bill before chunking, and the recompute it bounded under checkpointing
        facts, b = memory_model.facts, memory_model.shape.weight_bytes
        logits = tokens * facts.vocab * 8
        if checkpointing:
            one_layer = tokens * b * (9 * facts.hidden + 4 * facts.intermediate)
            activations = tokens * b * (facts.layers + 4) * facts.hidden + max(0, one_layer - logits)
            return activations + logits + memory_model.trainable * 4
    return estimate.activations_gib * GIB + logits + memory_model.trainable * 4


def longest_row(points: dict[int, float], cap: float) -> int:
    """The row length at which the line through the two (tokens, bytes) points reaches `cap`."""
    (t0, b0), (t1, b1) = sorted(points.items())
    slope = (b1 - b0) / (t1 - t0)
    return int(t0 + (cap - b0) / slope)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs=2, default=[1024, 3072],
                        help="the two row lengths measured: from 1024 up, where the loss's chunk is whole")
    parser.add_argument("--cap-gib", type=float, default=4.0, help="memory for the step (weights aside)")
    parser.add_argument("--example-tokens", type=int, default=512, help="tokens an example, for the micro-batch")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    import torch

    from phase1a.config.schema import MethodConfig, ModelConfig
    from phase1a.model.build import build_model, set_gradient_checkpointing
    from phase1a.model.cost_model import MemoryModel, TrainingShape, model_facts
    from phase1a.model.loading import resolve_model

    model_dir = resolve_model(ModelConfig(name_or_path="smollm2-135m-instruct"))
    torch.manual_seed(0)
    model = build_model(model_dir, MethodConfig(lora={"r": 16, "alpha": 32}), gradient_checkpointing=False)
    model.train()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    memory_model = MemoryModel(model_facts(model_dir), TrainingShape(weight_bytes=4), trainable, 0)
    cap = args.cap_gib * GIB
    results = []
    for checkpointing in (False, True):
        set_gradient_checkpointing(model, checkpointing)
        for loss_name in ("whole", "chunked"):
            measured = {t: step_peak(model, t, loss_name) for t in args.tokens}
            modelled = {t: billed(memory_model, t, checkpointing, loss_name) for t in args.tokens}
            rows = {"measured": longest_row(measured, cap), "modelled": longest_row(modelled, cap)}
            results.append({
                "gradient_checkpointing": checkpointing, "loss": loss_name,
                "peak_gib": {t: round(b / GIB, 3) for t, b in measured.items()},
                "billed_gib": {t: round(b / GIB, 3) for t, b in modelled.items()},
                "longest_row_tokens": rows,
                "micro_batch": {k: v // args.example_tokens for k, v in rows.items()},
            })
            print(json.dumps(results[-1]), flush=True)
    ratios = {}
    for checkpointing in (False, True):
        whole, chunked = (next(r for r in results if r["gradient_checkpointing"] == checkpointing and r["loss"] == name)
                          for name in ("whole", "chunked"))
        ratios["checkpointing" if checkpointing else "no_checkpointing"] = {
            kind: round(chunked["longest_row_tokens"][kind] / whole["longest_row_tokens"][kind], 2)
            for kind in ("measured", "modelled")}
    summary = {
        "what": "peak memory of one LoRA step on a packed row and the longest row under a cap, chunked loss "
                "against whole logits (benchmarks/chunked_loss_memory.py's docstring)",
        "device": f"{os.cpu_count()}-core {platform.machine()} CPU VM, torch {torch.__version__}",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": "uv run python benchmarks/chunked_loss_memory.py " + " ".join(sys.argv[1:]),
        "cap_gib": args.cap_gib, "example_tokens": args.example_tokens, "results": results,
        "chunked_over_whole_longest_row": ratios,
    }
    print(json.dumps(ratios, indent=1))
    if args.out:
        write_json(args.out, summary)


if __name__ == "__main__":
    main()
