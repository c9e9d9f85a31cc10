"""Training throughput: the field notes' "before" and "after" configurations against ours, one run, same data,
same model, same examples measured.

    uv run python benchmarks/train_throughput.py [--model tiny|smollm2|llama3-8b] [--measured 32] [--out FILE]

  before  every example padded to 2048 tokens, micro-batch 2 x accumulation 8, no TF32, no dataloader workers,
          AdamW for-each (Hugging Face Trainer's default)
  after   padded to the right-sized length (p99, at most 2048), TF32, 4 workers, gradient checkpointing,
          micro-batch 2 x 4
  ours    packed rows (no padding), the knobs our plan picks by calibration on this machine, fused AdamW, TF32

Each configuration runs in its own process (its peak memory is its own) on a freshly loaded copy of the same
randomly initialised model (weights do not change speed), LoRA r=16 on every projection. After one warm-up
optimizer step, the same `--measured` examples are timed. Useful tokens are the examples' own (truncated to the
configuration's length); padding waste is the share of computed tokens that were padding. MFU counts model
FLOPs (4N a token for LoRA plus attention) of the useful tokens over the GPU's peak; a CPU has no peak in the
catalogue, so there the achieved TFLOP/s are reported instead. Prints JSON; `--out` writes it too.
"""
from __future__ import annotations

import argparse
import json
import platform
import resource
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tokenize_throughput import _in_process, generate  # noqa: E402  (the same data generator and process runner)

SHAPES = {  # hidden, intermediate, layers, heads, kv heads, vocabulary (None: the tokenizer's)
    "tiny": (256, 688, 4, 4, 2, None),
    "smollm2": (576, 1536, 30, 9, 3, None),
    "llama3-8b": (4096, 14336, 32, 32, 8, 128256),
}
GLOBAL_BATCH = {"before": 16, "after": 8}


def make_model_dir(shape: str, tokenizer_dir: Path | None, target: Path) -> Path:
    """A randomly initialised Llama of `shape`. The tiny shape takes the test suite's 400-token BPE tokenizer
    (built from scratch, no hub): with SmolLM2's 49k vocabulary the logits alone would take this CPU minutes."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if tokenizer_dir is None:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from conftest import make_tokenizer

        tokenizer = make_tokenizer()
    else:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    hidden, intermediate, layers, heads, kv_heads, vocab = SHAPES[shape]
    config = LlamaConfig(vocab_size=vocab or len(tokenizer), hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=8192, tie_word_embeddings=shape != "llama3-8b",
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(config).to(torch.bfloat16 if torch.cuda.is_available() else torch.float32)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


def measure_padded(name: str, model_dir: str, train_path: str, indices: list[int], length: int, micro: int,
                   accumulation: int, checkpointing: bool, workers: int, tf32: bool, queue) -> None:
    """The field notes' trainer: padded batches with an attention mask, the model's own mean loss."""
    import torch
    from torch.utils.data import DataLoader

    from phase1a.config import MethodConfig
    from phase1a.modeling import build_model
    from phase1a.packing import IGNORE_INDEX, TokenRows

    rows = TokenRows.from_arrow(train_path, length)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
    method = MethodConfig(optimizer="adamw", liger="off")
    model = build_model(Path(model_dir), method, checkpointing)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32  # build_model turns it on
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    pad = model.config.pad_token_id or 0
    device = next(model.parameters()).device

    def padded(i: int) -> dict:
        start, end = int(rows.offsets[i]), rows.end(i)
        ids = torch.full((length,), pad, dtype=torch.long)
        labels = torch.full((length,), IGNORE_INDEX, dtype=torch.long)
        ids[: end - start] = torch.from_numpy(rows.input_ids[start:end].astype("int64"))
        labels[: end - start] = torch.from_numpy(rows.labels[start:end].astype("int64"))
        return {"input_ids": ids, "attention_mask": (torch.arange(length) < end - start).long(), "labels": labels}

    warmup = micro  # one micro-batch warms up: padded micro-batches are the slow part here
    loader = DataLoader([padded(i) for i in indices], batch_size=micro, num_workers=workers,
                        pin_memory=torch.cuda.is_available())
    model.train()
    began, computed = None, 0
    for step, batch in enumerate(loader):
        if step * micro == warmup:
            _sync()
            began = time.perf_counter()
            _reset_peak()
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        (model(**batch, use_cache=False).loss / accumulation).backward()
        computed += batch["input_ids"].numel() if began is not None else 0
        if (step + 1) % accumulation == 0:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    _sync()
    useful = int(rows.lengths()[indices[warmup:]].sum())
    queue.put(_summary(name, time.perf_counter() - began, useful, computed, {
        "max_seq_length": length, "micro_batch_size": micro, "accumulation": accumulation,
        "gradient_checkpointing": checkpointing, "dataloader_workers": workers, "tf32": tf32}))


def measure_ours(model_dir: str, data_json: str, indices: list[int], batch_size: int, queue) -> None:
    """Our train stage's step on the knobs our plan picks here (its calibration is not timed)."""
    import numpy as np
    import torch

    from phase1a.config import Phase1aConfig
    from phase1a.hardware import detect
    from phase1a.modeling import build_model, make_optimizer
    from phase1a.packing import StepBatches, step_loader, token_budget
    from tasks.plan import make_plan
    from tasks.tokenize import TokenizedData
    from tasks.train import optimizer_step

    data = TokenizedData.model_validate_json(data_json)
    key = detect()[0]
    config = Phase1aConfig.model_validate({
        "work_dir": tempfile.mkdtemp(), "data": {"source": "unused"}, "model": {"name_or_path": model_dir},
        "method": {"batch_size": batch_size, "lora": {"r": 16, "alpha": 32}},
        "hardware": {"target": key if key in ("cpu", "h100", "h200", "a100-80gb", "a100-40gb") else "cpu"},
        "plan": {"calibration_share": 1.0, "calibration_budget": "60s"}})
    plan = make_plan(config, Path(model_dir), data)
    model = build_model(Path(model_dir), config.method, plan.gradient_checkpointing, compile=plan.compile)
    optimizer = make_optimizer(model, config.method)
    order = np.array(indices)
    batches = StepBatches(data.train_path, plan.max_seq_length, order, batch_size, len(order),
                          token_budget(plan.micro_batch_size, plan.max_seq_length))
    model.train()
    began, computed = None, 0
    for step, step_batch in enumerate(step_loader(batches, range(len(batches)), plan.dataloader_workers,
                                                  pin_memory=torch.cuda.is_available())):
        if step == 1:  # after one warm-up step
            _sync()
            began = time.perf_counter()
            _reset_peak()
        optimizer_step(model, optimizer, step_batch)
        computed += sum(row["input_ids"].numel() for row in step_batch["micro_batches"]) if began is not None else 0
    _sync()
    useful = int(batches.rows.lengths()[order[batch_size:]].sum())
    queue.put(_summary("ours", time.perf_counter() - began, useful, computed, {
        "max_seq_length": plan.max_seq_length, "micro_batch_size": plan.micro_batch_size,
        "accumulation": plan.gradient_accumulation, "gradient_checkpointing": plan.gradient_checkpointing,
        "dataloader_workers": plan.dataloader_workers, "compile": plan.compile, "packed": True,
        "plan_tokens_per_second": round(plan.tokens_per_second, 1)}))


def _summary(name: str, seconds: float, useful: int, computed: int, knobs: dict) -> dict:
    import torch

    peak = (torch.cuda.max_memory_allocated() / 1024**3 if torch.cuda.is_available()
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2)
    return {"config": name, **knobs, "seconds": round(seconds, 3), "useful_tokens": useful, "computed_tokens": computed,
            "useful_tokens_per_s": round(useful / seconds, 1), "padding_waste": round(1 - useful / computed, 4),
            "peak_memory_gib": round(peak, 3)}


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _reset_peak() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--tokenizer", type=Path, help="a tokenizer directory; default: SmolLM2-135M-Instruct's, "
                                                       "or for --model tiny the test suite's small BPE")
    parser.add_argument("--measured", type=int, default=16, help="examples timed (a multiple of 16)")
    parser.add_argument("--examples", type=int, default=2000, help="examples generated (the plan's length analysis)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/phase1a-train-bench"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    import torch

    from phase1a.cost_model import flops_per_token, model_facts
    from phase1a.hardware import detect
    from phase1a.lengths import right_size
    from phase1a.config import ModelConfig
    from phase1a.models import load_tokenizer, resolve_model
    from phase1a.packing import TokenRows
    from tasks.tokenize import TokenizeOptions, tokenize_dataset

    args.work.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = args.tokenizer
    if tokenizer_dir is None and args.model != "tiny":
        tokenizer_dir = resolve_model(ModelConfig(name_or_path="smollm2-135m-instruct"))
    model_dir = make_model_dir(args.model, tokenizer_dir, args.work / f"model-{args.model}")
    data_path = args.work / f"chat_{args.examples}.jsonl"
    generate(data_path, args.examples, seed=1, max_answer_words=300)
    data = tokenize_dataset(data_path, load_tokenizer(model_dir), 8192, TokenizeOptions(), args.work / "cache",
                            f"bench-{args.examples}-{time.time_ns()}")
    indices = list(range(16 + args.measured))  # ours warms up on one step of 16, the padded on one micro-batch
    # "after" right-sizes as the field notes did: to the p99 length (truncating the longest 1 %), within 2048.
    right_sized = min(2048, right_size(TokenRows.from_arrow(data.train_path).lengths(), 99.0, 8192, None))
    runs = [
        (measure_padded, "before", str(model_dir), data.train_path, indices[14:], 2048, 2, 8, False, 0, False),
        (measure_padded, "after", str(model_dir), data.train_path, indices[14:], right_sized, 2, 4, True, 4, True),
        (measure_ours, str(model_dir), data.model_dump_json(), indices, 16),
    ]
    facts = model_facts(model_dir)
    device = detect()[1]
    mean_length = data.lengths.total_tokens / data.lengths.count
    results = []
    for target, *run_args in runs:
        result = _in_process(target, *run_args)
        results.append(result)
        result["model_tflops_per_s"] = round(
            result["useful_tokens_per_s"] * flops_per_token(facts, False, False, mean_length) / 1e12, 4)
        result["mfu"] = round(result["model_tflops_per_s"] * 1e12 / device.peak_flops, 4) if device.peak_flops else None
        print(json.dumps(result), flush=True)
    by_name = {r["config"]: r for r in results}
    summary = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": device.name,
        "machine": platform.node(), "torch": torch.__version__, "command": " ".join(sys.argv), "model": args.model,
        "parameters": facts.parameters, "examples_measured": args.measured,
        "right_sized_max_seq_length": right_sized, "results": results,
        "speedup_vs_before": round(by_name["ours"]["useful_tokens_per_s"] / by_name["before"]["useful_tokens_per_s"], 2),
        "speedup_vs_after": round(by_name["ours"]["useful_tokens_per_s"] / by_name["after"]["useful_tokens_per_s"], 2),
    }
    print(json.dumps(summary, indent=2))
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
