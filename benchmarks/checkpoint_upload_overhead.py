"""Checkpoint upload overhead: training throughput with the store (checkpoints uploaded in the background) against
without it, the same run alternated and repeated.

    uv run python benchmarks/checkpoint_upload_overhead.py [--model smollm2|tiny] [--steps 20]
        [--interval 5steps] [--repeat 3] [--out FILE]

The run: the train stage's own code (phase1a/train/: `TrainSettings`, then `run` without a store, or
`run_with_store` as `train_task` calls it with `store:` set: a lease, the pull, `CheckpointMirror` uploading each
checkpoint while training goes on, the final adapter), on SmolLM2-135M-Instruct (the demo's model, its real
weights) or `--model tiny` (benchmarks/train_throughput.py's 4-layer Llama with the test suite's tokenizer: the
small check), LoRA r16 alpha 32 on every projection, batch 16, packed rows of `--micro` examples' budget,
generated chat examples (benchmarks/tokenize_throughput.py's), `--steps` optimizer steps with a checkpoint every
`--interval`. The store is a moto S3 server over HTTP (tests/helpers/servers.py), a fresh prefix per run. Each run
is its own process; after `--warmup` unmeasured runs, the two modes alternate (ABBA) `--repeat` times.

Measured per run: tokens/s as the result reports it (`TrainResult.tokens_per_second`: checkpoint writes
included) and steady tokens/s (train tokens over wall - checkpoint_seconds - eval_seconds: the steps alone, where
an upload competes for the cores); the upload seconds per checkpoint (`TrainResult.store`), the checkpoint's
bytes; CPU seconds while training ran: the training process split into its main thread, torch's compute pool
(threads no Python code started) and the rest (the store's threads: uploads, hashing, the lease), and the moto
server's process. moto serves every byte in Python on the same cores as training, which a real S3 does not: the
result says so (`store_server`) and estimates what its CPU and the upload threads' cost the training wall
(their CPU seconds over the cores, as a share of the wall of the fastest run with the store, the one the neighbours'
load diluted least: `overhead_estimated_from_cpu`, steadier than the wall's own difference on a shared VM; a lower
bound where a preempted OpenMP thread stalls its peers).

Goal (the issue's): at most 1 % lower tokens/s with the store (the uploads overlap compute). Prints one JSON line
per run, then a summary; `--out` writes everything (date, machine, cpus, command, every run).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from benchmarks.tokenize_throughput import _in_process  # noqa: E402

BUCKET = "bench-upload-overhead"
GLOBAL_BATCH = 16
MODES = ("without_store", "with_store")


class _Cpu:
    """CPU seconds over a span: this process (every thread, ended ones included), its main thread, torch's compute
    pool (threads that no Python code started: OpenMP's), the rest (Python threads besides the main one: the
    store's uploads, hashing and lease), and another process (the moto server)."""

    def __init__(self, other_pid: int | None) -> None:
        import psutil

        self.me, self.other = psutil.Process(), psutil.Process(other_pid) if other_pid else None

    def _read(self) -> dict:
        python = {thread.native_id for thread in threading.enumerate()}
        pool = {t.id: t.user_time + t.system_time for t in self.me.threads() if t.id not in python}
        times = self.me.cpu_times()
        other = self.other.cpu_times() if self.other else None
        return {"process": times.user + times.system, "main": time.thread_time(), "pool": pool,
                "other": other.user + other.system if other else 0.0}

    def __enter__(self) -> "_Cpu":
        self.start = self._read()
        return self

    def __exit__(self, *exc) -> None:
        end, start = self._read(), self.start
        pool = sum(seconds - start["pool"].get(tid, 0.0) for tid, seconds in end["pool"].items())
        process, main = end["process"] - start["process"], end["main"] - start["main"]
        self.seconds = {"process": round(process, 3), "main_thread": round(main, 3), "compute_pool": round(pool, 3),
                        "other_threads": round(process - main - pool, 3),
                        "store_server": round(end["other"] - start["other"], 3)}


def measure(settings_json: str, store: dict | None, moto_pid: int | None, queue) -> None:
    """One training run, without a store (`run`) or with one (`run_with_store`); its figures and CPU split."""
    from phase1a.config.schema import Phase1aConfig
    from phase1a.config.stores import open_store
    from phase1a.train.runner import run
    from phase1a.train.settings import TrainSettings
    from phase1a.train.store_run import run_with_store

    settings = TrainSettings.model_validate_json(settings_json)
    with _Cpu(moto_pid) as cpu:
        if store is None:
            result = run(settings)
        else:
            config = Phase1aConfig.model_validate({
                "name": "overhead", "work_dir": str(Path(settings.output_dir).parent), "data": {"source": "unused"},
                "model": {"name_or_path": settings.model_dir}, "store": store,
                "checkpoint": {"interval": settings.checkpoint_interval, "keep_last": settings.keep_last}})
            result = run_with_store(settings, open_store(config.store), config)
    queue.put(figures(result, cpu.seconds, Path(settings.output_dir)))


def figures(result, cpu: dict, output_dir: Path) -> dict:
    """What a run measured: its throughput (as reported, and over the steps alone), its checkpoints and uploads."""
    steady_wall = result.wall_seconds - result.checkpoint_seconds - result.eval_seconds
    checkpoints = sorted((output_dir / "checkpoints").glob("step-*"))
    out = {"steps": result.steps, "train_tokens": result.train_tokens, "wall_seconds": result.wall_seconds,
           "tokens_per_second": result.tokens_per_second,
           "steady_tokens_per_second": round(result.train_tokens / steady_wall, 2),
           "checkpoints_written": result.checkpoints_written, "checkpoint_seconds": result.checkpoint_seconds,
           "checkpoint_bytes": sum(p.stat().st_size for p in checkpoints[-1].rglob("*") if p.is_file())
           if checkpoints else 0, "cpu_seconds": cpu}
    if result.store is not None:
        store = result.store
        out.update(checkpoint_uploads=store.checkpoint_uploads, upload_seconds=store.checkpoint_upload_seconds,
                   upload_seconds_per_checkpoint=round(store.checkpoint_upload_seconds
                                                       / max(store.checkpoint_uploads, 1), 3),
                   uploaded_step=store.uploaded_step, upload_failures=store.upload_failures)
    return out


def prepare(args: argparse.Namespace) -> tuple[str, object]:
    """The model directory and the tokenized data (made once under `--work`, reused by later invocations)."""
    from benchmarks.train_throughput import model_and_data
    from phase1a.data.tokenizing import TokenizeOptions, tokenize_dataset
    from phase1a.model.loading import load_tokenizer

    model_dir, data_path = model_and_data(args.model, args.work, args.examples, args.max_answer_words)
    data = tokenize_dataset(data_path, load_tokenizer(Path(model_dir)), 8192, TokenizeOptions(),
                            args.work / "cache" / f"{args.model}-{data_path.stem}")
    if data.train_examples < GLOBAL_BATCH:
        raise SystemExit(f"--examples {args.examples}: {data.train_examples} training examples, fewer than a batch")
    return str(model_dir), data


def settings_for(args: argparse.Namespace, model_dir: str, data, output_dir: Path) -> str:
    """The train stage's settings for `--steps` steps of LoRA r16 (the epochs are what that many steps take)."""
    from phase1a.config.schema import MethodConfig
    from phase1a.train.settings import TrainSettings

    method = MethodConfig(lora={"r": 16, "alpha": 32}, batch_size=GLOBAL_BATCH,
                          epochs=args.steps * GLOBAL_BATCH / data.train_examples)
    return TrainSettings(model_dir=model_dir, train_path=data.train_path, output_dir=str(output_dir), method=method,
                         micro_batch_size=args.micro, gradient_checkpointing=False,
                         checkpoint_interval=args.interval, keep_last=2, show_progress=False).model_dump_json()


def spread(values: list[float]) -> dict:
    middle = statistics.median(values)
    return {"median": round(middle, 3), "min": round(min(values), 3), "max": round(max(values), 3),
            "spread": round((max(values) - min(values)) / middle, 4), "values": values}


def summarise(runs: list[dict], cores: int) -> dict:
    """Per mode the spread of both throughputs; the overhead of the store (of medians, and per ABBA pair); where
    the store's CPU went and what it would cost the training wall were the cores busy with training."""
    by_mode = {mode: [run for run in runs if run["mode"] == mode] for mode in MODES}
    out: dict = {}
    for key in ("tokens_per_second", "steady_tokens_per_second"):
        values = {mode: spread([run[key] for run in by_mode[mode]]) for mode in MODES}
        pairs = [1 - store[key] / plain[key] for plain, store in zip(*by_mode.values())]
        out[key] = {**values, "overhead": round(1 - values["with_store"]["median"] / values["without_store"]["median"],
                                                4), "overhead_per_pair": [round(p, 4) for p in pairs]}
    stored = by_mode["with_store"]
    median = lambda values: round(statistics.median(values), 3)  # noqa: E731
    measured = out["tokens_per_second"]
    out["goal_at_most_1_percent"] = measured["overhead"] <= 0.01
    # Below the spread of the runs without the store, the measured overhead is this VM's noise, not a result.
    out["overhead_above_noise"] = (abs(measured["overhead"]) > measured["without_store"]["spread"]
                                   if len(by_mode["without_store"]) > 1 else None)
    out["upload_seconds_per_checkpoint"] = median([run["upload_seconds_per_checkpoint"] for run in stored])
    out["checkpoint_bytes"] = {mode: int(median([run["checkpoint_bytes"] for run in by_mode[mode]])) for mode in MODES}
    out["wall_seconds_added"] = median([s["wall_seconds"] - p["wall_seconds"] for p, s in zip(*by_mode.values())])
    plain_other = median([run["cpu_seconds"]["other_threads"] for run in by_mode["without_store"]])
    out["store_cpu_seconds"] = {"moto_server": median([run["cpu_seconds"]["store_server"] for run in stored]),
                                "upload_threads": median([run["cpu_seconds"]["other_threads"] for run in stored]),
                                "upload_threads_without_store": plain_other}
    estimates = [cpu_estimate(run, plain_other, cores) for run in stored]
    # The least loaded run (the fastest) is diluted least by the neighbours' load: its share is the estimate.
    out["overhead_estimated_from_cpu"] = min(estimates, key=lambda estimate: estimate["wall_seconds"])
    out["overhead_estimated_from_cpu_per_run"] = estimates
    out["goal_at_most_1_percent_by_cpu"] = out["overhead_estimated_from_cpu"]["total"] <= 0.01
    return out


def cpu_estimate(run: dict, plain_other: float, cores: int) -> dict:
    """What the store's CPU would cost a run's training wall were the cores busy with training: its CPU seconds
    over the cores, as a share of the run's wall (moto's, and our threads' beyond a run without the store)."""
    moto = run["cpu_seconds"]["store_server"] / cores
    threads = max(0.0, run["cpu_seconds"]["other_threads"] - plain_other) / cores
    wall = run["wall_seconds"]
    return {"wall_seconds": wall, "moto_server_seconds": round(moto, 3), "upload_threads_seconds": round(threads, 3),
            "moto_server": round(moto / wall, 4), "upload_threads": round(threads / wall, 4),
            "total": round((moto + threads) / wall, 4)}


def print_summary(summary: dict) -> None:
    result = summary["summary"]
    for key in ("tokens_per_second", "steady_tokens_per_second"):
        item = result[key]
        line = ", ".join(f"{mode} {item[mode]['median']} ({item[mode]['min']}-{item[mode]['max']}, spread "
                         f"{100 * item[mode]['spread']:.1f} %)" for mode in MODES)
        pairs = ", ".join(f"{100 * p:+.2f} %" for p in item["overhead_per_pair"])
        print(f"{key}: {line}; overhead {100 * item['overhead']:+.2f} % (per pair {pairs})")
    met = {True: "met", False: "NOT met"}
    noise = {True: "", False: " (within the runs' own spread: noise)", None: " (one pair: no spread to judge it by)"}[
        result["overhead_above_noise"]]
    print(f"goal <= 1 %: measured {met[result['goal_at_most_1_percent']]}{noise}, by the CPU estimate "
          f"{met[result['goal_at_most_1_percent_by_cpu']]}; upload "
          f"{result['upload_seconds_per_checkpoint']} s per checkpoint of {result['checkpoint_bytes']['with_store']:,}"
          f" bytes ({result['checkpoint_bytes']['without_store']:,} without the store's run files)")
    cpu, share = result["store_cpu_seconds"], result["overhead_estimated_from_cpu"]
    print(f"per run with the store (medians): moto {cpu['moto_server']} CPU s, upload threads "
          f"{cpu['upload_threads']} CPU s (without the store {cpu['upload_threads_without_store']})")
    moto, threads = (f"{share[part + '_seconds']} s ({100 * share[part]:.2f} %)" for part in ("moto_server",
                                                                                              "upload_threads"))
    print(f"in the fastest run with the store ({share['wall_seconds']} s), at {summary['cpus']} cores: moto {moto}, "
          f"upload threads {threads} of training wall; measured wall difference (median of pairs) "
          f"{result['wall_seconds_added']} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps of 16 examples per run")
    parser.add_argument("--interval", default="5steps", help="checkpoint.interval")
    parser.add_argument("--micro", type=int, default=8, help="a packed row's token budget, in examples")
    parser.add_argument("--repeat", type=int, default=3, help="pairs of runs (without, with), alternating ABBA")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured runs first (without the store)")
    parser.add_argument("--examples", type=int, default=2000)
    parser.add_argument("--max-answer-words", type=int, default=300)
    parser.add_argument("--work", type=Path, default=Path("/tmp/phase1a-bench-upload-overhead"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    import pytest

    from helpers.servers import isolate_aws, s3_client, start_moto, stop
    from phase1a.core.hardware import usable_cores

    args.work.mkdir(parents=True, exist_ok=True)
    model_dir, data = prepare(args)
    root = args.work / f"run-{time.time_ns()}"
    summary = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.node(),
               "cpus": usable_cores(), "command": " ".join(sys.argv), "model": args.model, "steps": args.steps,
               "checkpoint_interval": args.interval, "micro_batch_size": args.micro, "runs": [],
               "store_server": "moto over HTTP on 127.0.0.1, on the same cores as training (its CPU counts)"}
    with pytest.MonkeyPatch.context() as patch:
        isolate_aws(patch, args.work)  # dummy credentials only, never the machine's AWS configuration
        moto, endpoint = start_moto(args.work / "moto.log")
        try:
            s3_client(endpoint).create_bucket(Bucket=BUCKET)
            for number in range(args.warmup):
                settings = settings_for(args, model_dir, data, root / f"warmup-{number}" / "train")
                summary.setdefault("warmup", []).append(_in_process(measure, settings, None, None))
                print(json.dumps({"warmup": summary["warmup"][-1]}), flush=True)
            for number in range(2 * args.repeat):
                mode = MODES[(number + number // 2) % 2]  # ABBA: without, with, with, without, ...
                store = {"url": f"s3://{BUCKET}/run-{number}/", "endpoint_url": endpoint} if mode == MODES[1] else None
                settings = settings_for(args, model_dir, data, root / f"{number}-{mode}" / "train")
                result = {"mode": mode, **_in_process(measure, settings, store, moto.pid if store else None)}
                summary["runs"].append(result)
                print(json.dumps(result), flush=True)
        finally:
            stop(moto)
    assert all(run["steps"] == args.steps for run in summary["runs"]), "a run trained another number of steps"
    assert all(not run.get("upload_failures") and run.get("checkpoint_uploads", 1) for run in summary["runs"])
    summary["summary"] = summarise(summary["runs"], summary["cpus"])
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
    print_summary(summary)


if __name__ == "__main__":
    main()
