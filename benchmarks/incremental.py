"""Nightly growth: stage + tokenize of a dataset in shards, then of the same dataset with one new shard a night.

    uv run python benchmarks/incremental.py [--shards 50] [--per-shard 10000] [--nights 3] [--out FILE]

Night 1 stages and tokenizes `--shards` shards of `--per-shard` generated chat examples (a local directory,
SmolLM2-135M-Instruct's tokenizer, the records of benchmarks/tokenize_throughput.py). Each later night adds one
shard of the same size and does what the flow's stage and tokenize tasks do: the source's fingerprint (the
stage's cache key), the stage and the tokenize. The goal: a night costs in proportion to its new data, at most
1/20 of night 1 with 50 shards. Then the last night's dataset is tokenized again from nothing, in a new cache,
and must be the same bytes. Each night runs in its own process, as a nightly run does.
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

from benchmarks.tokenize_throughput import _in_process, generate  # noqa: E402


def night(shards: str, work: str, model_dir: str, queue) -> None:
    """One night's stage and tokenize, timed as the flow runs them (fingerprint, stage, tokenize)."""
    from phase1a.data.staging import data_source_fingerprint, file_hashes, stage_dataset
    from phase1a.data.tokenized import split_digest
    from phase1a.data.tokenizing import TokenizeOptions, dataset_dir, tokenize_dataset, tokenize_fingerprint
    from phase1a.model.loading import load_tokenizer

    tokenizer, options, staging = load_tokenizer(Path(model_dir)), TokenizeOptions(), Path(work) / "staging"
    began = time.perf_counter()
    fingerprint = data_source_fingerprint(shards, hashes=file_hashes(staging))
    staged = stage_dataset(shards, staging)
    stage_seconds = time.perf_counter() - began
    out = dataset_dir(Path(work) / "cache", tokenize_fingerprint([fingerprint], "smollm2", 8192, options))
    data = tokenize_dataset(staged, tokenizer, 8192, options, out)
    seconds = time.perf_counter() - began
    queue.put({"seconds": seconds, "stage_seconds": stage_seconds, "tokenize_seconds": seconds - stage_seconds,
               "shards": data.shards, "shards_encoded": data.shards_encoded, "shards_reused": data.shards_reused,
               "files_copied": staged.files_copied, "files_reused": staged.files_reused,
               "examples": data.lengths.count, "tokens": data.lengths.total_tokens, "workers": data.workers,
               "train_digest": split_digest(data.train_path), "validation_digest": split_digest(data.validation_path)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=50)
    parser.add_argument("--per-shard", type=int, default=10_000)
    parser.add_argument("--nights", type=int, default=3, help="nights after the first, one new shard each")
    parser.add_argument("--work", type=Path, default=Path("/tmp/phase1a-bench-incremental"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    from phase1a.config.schema import ModelConfig
    from phase1a.core.hardware import usable_cores
    from phase1a.model.loading import resolve_model

    model_dir = str(resolve_model(ModelConfig(name_or_path="smollm2-135m-instruct")))
    run = args.work / f"run-{time.time_ns()}"
    shards = run / "shards"
    shards.mkdir(parents=True)
    for number in range(args.shards):
        generate(shards / f"part-{number:04d}.jsonl", args.per_shard, seed=number)
    summary = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.node(),
               "cpus": usable_cores(), "command": " ".join(sys.argv), "nights": []}
    for number in range(args.nights + 1):
        if number:
            generate(shards / f"part-{args.shards + number - 1:04d}.jsonl", args.per_shard, seed=10_000 + number)
        result = _in_process(night, str(shards), str(run / "nightly"), model_dir)
        summary["nights"].append(result)
        print(json.dumps({f"night_{number + 1}": result}), flush=True)
    first, later = summary["nights"][0], summary["nights"][1:]
    summary["later_over_first"] = [round(item["seconds"] / first["seconds"], 4) for item in later]
    summary["new_data_share"] = [round(1 / item["shards"], 4) for item in later]

    scratch = _in_process(night, str(shards), str(run / "scratch"), model_dir)
    summary["scratch_of_last_night"] = scratch
    last = summary["nights"][-1]
    summary["last_night_equals_scratch"] = all(last[key] == scratch[key] for key in ("train_digest",
                                                                                      "validation_digest"))
    print(json.dumps(summary, indent=2))
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
    assert summary["last_night_equals_scratch"], "the incremental dataset differs from a tokenize from nothing"


if __name__ == "__main__":
    main()
