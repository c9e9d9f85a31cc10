"""Tokenize-stage throughput and peak memory, against tokenizing on the fly inside a training DataLoader.

    uv run python benchmarks/tokenize_throughput.py [--examples 500000 50000] [--onthefly 20000]

Each measurement runs in its own process so its peak RSS is its own. Data: generated chat examples with an
Alpaca-like, long-tailed length spread (lognormal word counts); tokenizer: SmolLM2-135M-Instruct's.
Prints a JSON summary; --out writes it too.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import platform
import random
import resource
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

WORDS = ("the of and to in is was for on that with as by at from this are be or an it which have not has "
         "model data train value result answer question number list write explain describe example first "
         "second time people water energy city system process function language history science").split()


def generate(path: Path, count: int, seed: int = 0, max_answer_words: int = 1500) -> None:
    rng = random.Random(seed)

    def words(mu: float, sigma: float, cap: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(min(cap, max(1, int(rng.lognormvariate(mu, sigma))))))

    with open(path, "w") as handle:
        for _ in range(count):
            handle.write(json.dumps({"messages": [
                {"role": "user", "content": words(2.8, 0.7, 400).capitalize() + "?"},
                {"role": "assistant", "content": words(3.9, 0.9, max_answer_words).capitalize() + "."},
            ]}) + "\n")


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure_stage(data: str, model_dir: str, cache: str, queue) -> None:
    from phase1a.models import load_tokenizer
    from tasks.tokenize import TokenizeOptions, tokenize_dataset

    tokenizer = load_tokenizer(Path(model_dir))
    began = time.perf_counter()
    result = tokenize_dataset(Path(data), tokenizer, 8192, TokenizeOptions(), Path(cache), "bench")
    seconds = time.perf_counter() - began
    queue.put({"examples": result.lengths.count, "tokens": result.lengths.total_tokens, "seconds": seconds,
               "tokens_per_s": result.lengths.total_tokens / seconds, "peak_rss_mib": _peak_rss_mib()})


def measure_on_the_fly(data: str, model_dir: str, limit: int, queue) -> None:
    """The field notes' "before": a Dataset whose __getitem__ templates and tokenizes one example, a padding
    collate, a DataLoader; the work a trainer repeats every epoch before the GPU sees a token."""
    import torch
    from torch.utils.data import DataLoader, Dataset

    from phase1a.models import load_tokenizer

    tokenizer = load_tokenizer(Path(model_dir))
    records = [json.loads(line) for _, line in zip(range(limit), open(data))]

    class OnTheFly(Dataset):
        def __len__(self) -> int:
            return len(records)

        def __getitem__(self, index: int) -> dict:
            text = tokenizer.apply_chat_template(records[index]["messages"], tokenize=False)
            return tokenizer(text, truncation=True, max_length=2048)

    def collate(batch: list[dict]) -> dict:
        return tokenizer.pad(batch, return_tensors="pt")

    began = time.perf_counter()
    tokens = 0
    for batch in DataLoader(OnTheFly(), batch_size=8, collate_fn=collate, num_workers=0):
        tokens += int(batch["attention_mask"].sum())
    seconds = time.perf_counter() - began
    torch.set_num_threads(1)
    queue.put({"examples": len(records), "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
               "peak_rss_mib": _peak_rss_mib()})


def _in_process(target, *args) -> dict:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=target, args=(*args, queue))
    process.start()
    result = queue.get()
    process.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, nargs="+", default=[500_000, 50_000])
    parser.add_argument("--onthefly", type=int, default=20_000, help="examples for the on-the-fly baseline")
    parser.add_argument("--work", type=Path, default=Path("/tmp/phase1a-bench"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    from phase1a.config import ModelConfig
    from phase1a.models import resolve_model

    model_dir = str(resolve_model(ModelConfig(name_or_path="smollm2-135m-instruct")))
    args.work.mkdir(parents=True, exist_ok=True)
    summary = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.node(),
               "cpus": multiprocessing.cpu_count(), "command": " ".join(sys.argv), "stage": {}}
    for count in args.examples:
        data = args.work / f"chat_{count}.jsonl"
        if not data.exists():
            generate(data, count)
        cache = args.work / f"cache_{count}_{time.time_ns()}"
        summary["stage"][str(count)] = _in_process(measure_stage, str(data), model_dir, str(cache))
        print(json.dumps({count: summary["stage"][str(count)]}), flush=True)
    largest = args.work / f"chat_{max(args.examples)}.jsonl"
    summary["on_the_fly"] = _in_process(measure_on_the_fly, str(largest), model_dir, args.onthefly)
    best = summary["stage"][str(max(args.examples))]["tokens_per_s"]
    summary["speedup_vs_on_the_fly"] = best / summary["on_the_fly"]["tokens_per_s"]
    print(json.dumps(summary, indent=2))
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
