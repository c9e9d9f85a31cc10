"""Tokenize-stage throughput and peak memory from JSONL and Parquet, side by side with two baselines: a plain
batched `datasets.map` that renders the chat template and masks the prompt, and tokenizing on the fly inside a
training DataLoader.

    uv run python benchmarks/tokenize_throughput.py [--examples 500000 50000] [--formats jsonl parquet]
        [--map 500000] [--onthefly 20000] [--out FILE]

Each measurement runs in its own process so its peak RSS is its own. Data: generated chat examples with an
Alpaca-like, long-tailed length spread (lognormal word counts), the same records as JSONL and as Parquet
(row groups of 10k); tokenizer: SmolLM2-135M-Instruct's. Prints a JSON summary; --out writes it too.

A change against the code before it, in the same run (the stage alone, JSONL, the largest --examples):

    git worktree add /tmp/before REV
    uv run python benchmarks/tokenize_throughput.py --examples 500000 --workers 2 --against /tmp/before --rounds 3

runs the stage of /tmp/before's checkout and of this one in turn (the order alternating by round), at each
--workers count, and records each round's ratio of throughputs and that both wrote the same bytes.
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# No project import at the top: a measurement process may import another checkout's code (--against).

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


def to_parquet(jsonl: Path, target: Path) -> None:
    import pyarrow.json as pj
    import pyarrow.parquet as pq

    pq.write_table(pj.read_json(jsonl), target, row_group_size=10_000)


def _peak_rss_mib() -> float:
    """This process's own high-water mark. Not getrusage's ru_maxrss: Linux carries that over from the parent
    across fork and exec, so every spawned measurement would report at least the parent's peak."""
    from phase1a.core.units import KIB, MIB

    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * KIB / MIB  # the kernel counts in KiB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * KIB / MIB


class _TreeMemory:
    """Peak proportional set size (PSS) of this process and its children, sampled: forked workers share pages
    with the parent, so summing their RSS would count those pages once per process. A sample walks every
    process's page tables in the kernel (tens of ms on this VM), so once a second, and the sampling's own CPU
    seconds (`cpu_s`) are kept apart from the stage's."""

    def __init__(self, every: float = 1.0) -> None:
        import threading

        self.peak, self.cpu_s, self._every, self._stop = 0, 0.0, every, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        import psutil

        me = psutil.Process()
        began = time.thread_time()
        while not self._stop.wait(self._every):
            total = 0
            for process in [me, *me.children(recursive=True)]:
                try:
                    total += process.memory_full_info().pss
                except psutil.Error:  # a worker that ended between the listing and the read
                    pass
            self.peak = max(self.peak, total)
            self.cpu_s = time.thread_time() - began

    def __enter__(self) -> "_TreeMemory":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def measure_stage(data: str, model_dir: str, cache: str, workers: int | None, cores: int | None, code: str,
                  queue) -> None:
    """The tokenize stage with `workers` processes (None: its own rule), on the first `cores` cores (None: all),
    with the code of the checkout at `code`. parent_cpu_s is this process's CPU time (less the memory
    sampling's), workers_cpu_s its worker processes' (ended by then, so counted)."""
    import os

    sys.path.insert(0, code)
    import phase1a

    assert phase1a.__file__.startswith(str(Path(code).resolve())), f"imported {phase1a.__file__}, not {code}'s"
    from phase1a.core.units import MIB
    from phase1a.data.tokenized import split_digest
    from phase1a.data.tokenizing import TokenizeOptions, tokenize_dataset
    from phase1a.model.loading import load_tokenizer

    if cores:
        os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:cores]))  # the Rust tokenizer's threads follow
    tokenizer = load_tokenizer(Path(model_dir))
    began, cpu = time.perf_counter(), time.process_time()
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    with _TreeMemory() as tree:
        result = tokenize_dataset(Path(data), tokenizer, 8192, TokenizeOptions(tokenize_workers=workers),
                                  Path(cache) / "bench")
    assert result.skipped == {} and result.lengths.count == result.train_examples + result.validation_examples
    seconds = time.perf_counter() - began
    ended = resource.getrusage(resource.RUSAGE_CHILDREN)
    queue.put({"examples": result.lengths.count, "tokens": result.lengths.total_tokens, "seconds": seconds,
               "tokens_per_s": result.lengths.total_tokens / seconds, "workers": result.workers,
               "cores": cores or len(os.sched_getaffinity(0)), "parent_cpu_s": time.process_time() - cpu - tree.cpu_s,
               "sampling_cpu_s": tree.cpu_s,
               "workers_cpu_s": ended.ru_utime + ended.ru_stime - children.ru_utime - children.ru_stime,
               "peak_rss_mib": _peak_rss_mib(), "peak_tree_pss_mib": tree.peak / MIB,
               "train_sha256": split_digest(result.train_path),
               "validation_sha256": split_digest(result.validation_path)})


def measure_datasets_map(data: str, model_dir: str, cache: str, queue) -> None:
    """The common way: `load_dataset` (JSON or Parquet to an Arrow cache), then one batched `map` that renders
    the template twice per example (the prompt with the generation header, and the whole conversation),
    tokenizes both, and labels the tokens after the prompt's. Counted from the load on, like ours."""
    from datasets import load_dataset

    from phase1a.core.labels import IGNORE_INDEX
    from phase1a.model.loading import load_tokenizer

    tokenizer = load_tokenizer(Path(model_dir))

    def render_and_mask(batch: dict) -> dict:
        prompts = [tokenizer.apply_chat_template(m[:-1], tokenize=False, add_generation_prompt=True)
                   for m in batch["messages"]]
        fulls = [tokenizer.apply_chat_template(m, tokenize=False) for m in batch["messages"]]
        prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
        full_ids = tokenizer(fulls, add_special_tokens=False)["input_ids"]
        labels = [[IGNORE_INDEX] * len(p) + ids[len(p):] for p, ids in zip(prompt_ids, full_ids)]
        return {"input_ids": full_ids, "labels": labels, "length": [len(ids) for ids in full_ids]}

    began = time.perf_counter()
    kind = "parquet" if data.endswith(".parquet") else "json"
    dataset = load_dataset(kind, data_files=data, split="train", cache_dir=cache)
    mapped = dataset.map(render_and_mask, batched=True, batch_size=1000, remove_columns=dataset.column_names)
    seconds = time.perf_counter() - began
    tokens = int(sum(mapped.with_format("numpy")["length"]))
    queue.put({"examples": len(mapped), "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
               "peak_rss_mib": _peak_rss_mib()})


def measure_on_the_fly(data: str, model_dir: str, limit: int, queue) -> None:
    """The field notes' "before": a Dataset whose __getitem__ templates and tokenizes one example, a padding
    collate, a DataLoader; the work a trainer repeats every epoch before the GPU sees a token."""
    import torch
    from torch.utils.data import DataLoader, Dataset

    from phase1a.model.loading import load_tokenizer

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
    """`target(*args, queue)` in a spawned process; its result, or an error when it dies without one."""
    import queue as queues

    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=target, args=(*args, queue))
    process.start()
    while True:
        try:
            result = queue.get(timeout=5)
            break
        except queues.Empty:
            if not process.is_alive():
                raise RuntimeError(f"{target.__name__} exited with code {process.exitcode} and no result") from None
    process.join()
    return result


def measure_scaling(args, kind: str, data: Path, model_dir: str, summary: dict, record) -> None:
    """The stage at each of `--workers` processes (and one process on one core), each output checked to be the
    same bytes as the default run's."""
    largest = f"stage_{kind}_{max(args.examples)}"
    runs = [(workers, None) for workers in args.workers] + ([(1, 1)] if args.one_core else [])
    for workers, cores in runs:
        key = f"{largest}_w{workers}" + (f"_{cores}core" if cores else "")
        cache = args.work / f"cache_{key}_{time.time_ns()}"
        record(key, _in_process(measure_stage, str(data), model_dir, str(cache), workers, cores, str(ROOT)))
        for part in ("train_sha256", "validation_sha256"):
            assert summary[key][part] == summary[largest][part], f"{key}: {part} differs from {largest}'s"
        summary[f"{key}_vs_default"] = summary[key]["tokens_per_s"] / summary[largest]["tokens_per_s"]


def measure_against(args, data: Path, model_dir: str, summary: dict, record) -> None:
    """The stage of `--against`'s checkout ("before") and of this one ("after") at each `--workers` count, in turn,
    `--rounds` times, the order alternating so that a drift in the machine's speed favours neither: each round's
    ratio after/before, and the same bytes from both."""
    summary["against"] = str(args.against)
    for workers in args.workers:
        runs: dict[str, list[dict]] = {"before": [], "after": []}
        for round_number in range(args.rounds):
            order = [("before", args.against), ("after", ROOT)]
            for name, code in order if round_number % 2 == 0 else order[::-1]:
                cache = args.work / f"cache_{name}_w{workers}_{time.time_ns()}"
                result = _in_process(measure_stage, str(data), model_dir, str(cache), workers, None, str(code))
                runs[name].append(result)
                print(json.dumps({f"{name}_w{workers}_round{round_number + 1}": result}), flush=True)
        for before, after in zip(runs["before"], runs["after"]):
            assert (before["train_sha256"], before["validation_sha256"]) == \
                (after["train_sha256"], after["validation_sha256"]), "the two checkouts wrote different bytes"
        ratios = sorted(a["tokens_per_s"] / b["tokens_per_s"] for b, a in zip(runs["before"], runs["after"]))
        record(f"against_w{workers}", {**runs, "ratios": ratios, "median_ratio": ratios[len(ratios) // 2],
                                       "same_bytes": True})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, nargs="+", default=[500_000, 50_000])
    parser.add_argument("--formats", nargs="+", choices=["jsonl", "parquet"], default=["jsonl", "parquet"])
    parser.add_argument("--map", type=int, default=500_000, help="examples for the datasets.map baseline (0: skip)")
    parser.add_argument("--onthefly", type=int, default=20_000, help="examples for the on-the-fly baseline (0: skip)")
    parser.add_argument("--workers", type=int, nargs="*", default=[],
                        help="also measure the stage with these worker-process counts, on the largest set")
    parser.add_argument("--one-core", action="store_true",
                        help="also measure one process pinned to one core: the per-core baseline of the scaling")
    parser.add_argument("--tokenizer", type=Path,
                        help="a folder with SmolLM2's tokenizer files (a GPU host); default: the built-in model's")
    parser.add_argument("--against", type=Path,
                        help="another checkout (a worktree of the code before a change): only the stage, JSONL, at "
                             "each --workers count, it and this checkout in turn")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of --against, the order alternating")
    parser.add_argument("--work", type=Path, default=Path("/tmp/phase1a-bench"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    from phase1a.config.schema import ModelConfig
    from phase1a.core.hardware import usable_cores
    from phase1a.model.loading import resolve_model

    model_dir = str(args.tokenizer or resolve_model(ModelConfig(name_or_path="smollm2-135m-instruct")))
    args.work.mkdir(parents=True, exist_ok=True)
    summary = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.node(),
               "cpus": usable_cores(), "command": " ".join(sys.argv)}

    def data_file(count: int, kind: str) -> Path:
        jsonl = args.work / f"chat_{count}.jsonl"
        if not jsonl.exists():
            generate(jsonl, count)
        if kind == "jsonl":
            return jsonl
        target = jsonl.with_suffix(".parquet")
        if not target.exists():
            to_parquet(jsonl, target)
        return target

    def record(key: str, result: dict) -> None:
        summary[key] = result
        print(json.dumps({key: result}), flush=True)

    if args.against:
        measure_against(args, data_file(max(args.examples), "jsonl"), model_dir, summary, record)
        args.formats, args.map, args.onthefly = [], 0, 0
    for kind in args.formats:
        for count in args.examples:
            cache = args.work / f"cache_{count}_{time.time_ns()}"
            record(f"stage_{kind}_{count}",
                   _in_process(measure_stage, str(data_file(count, kind)), model_dir, str(cache), None, None,
                              str(ROOT)))
        measure_scaling(args, kind, data_file(max(args.examples), kind), model_dir, summary, record)
    if args.map:
        for kind in args.formats:
            cache = args.work / f"hf_cache_{time.time_ns()}"
            record(f"datasets_map_{kind}_{args.map}",
                   _in_process(measure_datasets_map, str(data_file(args.map, kind)), model_dir, str(cache)))
            ours = summary.get(f"stage_{kind}_{args.map}")
            if ours:
                baseline = summary[f"datasets_map_{kind}_{args.map}"]["tokens_per_s"]
                summary[f"speedup_vs_datasets_map_{kind}"] = ours["tokens_per_s"] / baseline
    if args.onthefly:
        largest = data_file(max(args.examples), "jsonl")
        record("on_the_fly", _in_process(measure_on_the_fly, str(largest), model_dir, args.onthefly))
        best = summary[f"stage_jsonl_{max(args.examples)}"]["tokens_per_s"] if "jsonl" in args.formats else None
        if best:
            summary["speedup_vs_on_the_fly"] = best / summary["on_the_fly"]["tokens_per_s"]
    print(json.dumps(summary, indent=2))
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
