"""Packed rows against their length: useful tokens/s at row budgets of 1, 2, 4, 8 and 16 examples of
max_seq_length, SDPA's block-diagonal mask over the row (`sdpa`) against one attention call a layer over the
examples' boundaries (`varlen`, `method.attention: auto`), one run.

    uv run python benchmarks/packed_rows.py [--examples 2000] [--batch 16] [--steps 3] [--rounds 1] [--out FILE]

SmolLM2-135M-Instruct (its real weights, fp32), LoRA r=16 on every projection, the train stage's own step
(`optimizer_step`) over the same steps of the same examples for every configuration. Data: the tokenize
benchmark's generated chat examples (long-tailed lengths). A step holds `--batch` examples: at 16 (about 1.7k
tokens) every budget from 2 up packs a step into one row, so the rows only grow with the budget when the batch
is larger (64: about 7k tokens a step, one to seven rows). Each attention warms up on one step; then each round
times `--steps` steps of every budget, both attentions in turn (so a change in the machine's load hits both
alike), the second round in the reverse order of budgets (so a drift does not favour one end).
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tokenize_throughput import generate
from train_throughput import write_json

BUDGETS = (1, 2, 4, 8, 16)
ATTENTIONS = ("sdpa", "varlen")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=16, help="examples per optimizer step")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per configuration and round")
    parser.add_argument("--rounds", type=int, default=1, help="times over every configuration; the spread is reported")
    parser.add_argument("--work", type=Path, default=Path("/tmp/phase1a-packed-rows"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    import numpy as np
    import torch

    from phase1a.config.schema import MethodConfig, ModelConfig
    from phase1a.core.hardware import detect
    from phase1a.data.tokenizing import TokenizeOptions, tokenize_dataset
    from phase1a.model.build import build_model, make_optimizer
    from phase1a.model.loading import load_tokenizer, resolve_model
    from phase1a.train.packing import RowBudget, StepBatches, token_budget
    from phase1a.train.steps import optimizer_step

    args.work.mkdir(parents=True, exist_ok=True)
    model_dir = resolve_model(ModelConfig(name_or_path="smollm2-135m-instruct"))
    data_path = args.work / f"chat_{args.examples}.jsonl"
    if not data_path.is_file():
        generate(data_path, args.examples, seed=1)
    data = tokenize_dataset(data_path, load_tokenizer(model_dir), 8192, TokenizeOptions(),
                            args.work / "cache" / f"packed-rows-{data_path.stem}")
    length = data.max_seq_length
    order = np.arange(args.batch * (args.steps + 1))
    models = {}
    for attention in ATTENTIONS:
        torch.manual_seed(0)
        method = MethodConfig(batch_size=args.batch, lora={"r": 16, "alpha": 32}, attention=attention)
        model = build_model(model_dir, method, gradient_checkpointing=False)
        model.train()
        models[attention] = (model, make_optimizer(model, method))

    packed = {}  # budget -> the timed steps, packed once and run by both attentions in every round
    for micro in BUDGETS:
        batches = StepBatches(data.train_path, length, order, args.batch, RowBudget(token_budget(micro, length)))
        packed[micro] = [batches[step] for step in range(1, args.steps + 1)]
        if micro == BUDGETS[0]:
            for model, optimizer in models.values():
                optimizer_step(model, optimizer, batches[0])  # warm-up
    useful = int(batches.rows.lengths()[order[args.batch:]].sum())

    timings: dict[tuple[str, int], list[float]] = {}
    for round_index in range(args.rounds):
        for micro in BUDGETS if round_index % 2 == 0 else BUDGETS[::-1]:
            for attention, (model, optimizer) in models.items():
                began = time.perf_counter()
                losses = [optimizer_step(model, optimizer, step).loss.item() for step in packed[micro]]
                timings.setdefault((attention, micro), []).append(useful / (time.perf_counter() - began))
                print(json.dumps({"round": round_index + 1, "attention": attention, "row_budget_examples": micro,
                                  "useful_tokens_per_s": round(timings[attention, micro][-1], 1),
                                  "losses": [round(loss, 4) for loss in losses]}), flush=True)
    results = []
    for micro in BUDGETS:
        rows = [row.length for step in packed[micro] for row in step.micro_batches]
        for attention in ATTENTIONS:
            speeds = timings[attention, micro]
            results.append({"attention": attention, "row_budget_examples": micro, "row_budget_tokens": micro * length,
                            "rows": len(rows), "longest_row_tokens": max(rows), "useful_tokens": useful,
                            "useful_tokens_per_s": round(sum(speeds) / len(speeds), 1),
                            "per_round": [round(v, 1) for v in speeds],
                            "spread": round((max(speeds) - min(speeds)) / min(speeds), 3)})

    def per_budget(attention: str) -> list[float]:
        return [r["useful_tokens_per_s"] for r in results if r["attention"] == attention]

    summary = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.node(),
        "device": detect()[1].name,
        "torch": torch.__version__, "command": " ".join(sys.argv), "model": "SmolLM2-135M-Instruct",
        "max_seq_length": length, "examples_per_step": args.batch, "timed_steps": args.steps, "rounds": args.rounds,
        "results": results,
        # Tokens/s at the biggest rows over the best of the smaller ones: 1.0 means no loss from packing more.
        "largest_row_vs_best": {a: round(per_budget(a)[-1] / max(per_budget(a)), 3) for a in ATTENTIONS},
        "varlen_over_sdpa": {str(b): round(p / s, 2) for b, p, s in
                             zip(BUDGETS, per_budget("varlen"), per_budget("sdpa"))},
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "results"}, indent=2))
    if args.out:
        write_json(args.out, summary)


if __name__ == "__main__":
    main()
