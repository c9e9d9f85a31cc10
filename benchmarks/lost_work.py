"""Lost work after a kill: the training a host had done when it was killed -9 that the store's latest checkpoint
does not hold, against the bound "one checkpoint interval plus the upload time".

    uv run python benchmarks/lost_work.py [--model smollm2|tiny] [--kills 5] [--interval 60s] [--confirm]
        [--out FILE]

For each of `--kills` kills: host A (tests/helpers/hosts.py `Host`: its own HOME, PREFECT_HOME and local
directories) runs the job as `phase1a run --config ...` in a session of its own, with a store on a moto S3 server
over HTTP (tests/helpers/servers.py; a fresh store prefix per kill, so every host A starts from nothing). The job:
generated chat examples (benchmarks/tokenize_throughput.py's) on SmolLM2-135M-Instruct (the demo's model) or
`--model tiny` (benchmarks/train_throughput.py's 4-layer Llama: the small check), LoRA r16, the plan's knobs
fixed (`plan.profile: custom`), a checkpoint every `--interval` of wall time. A watcher polls, every `--poll`
seconds, host A's metrics.jsonl (each step's first sighting), its local checkpoints (each one's) and the store's
`latest.json` (each pointer's), so each checkpoint's upload time is measured: the pointer's sighting minus the
local checkpoint's (the mirror's wait for its next poll included). Once the first checkpoint is in the store, the
host is killed -9 (its whole process group, as a lost machine is lost) after a delay spread over one checkpoint
cycle (the interval plus the longest step so far: a checkpoint is due at the end of the first step past the
interval): kill k of K at (k + u) / K of it, u uniform (`--seed`), so the last kills fall just before the second
checkpoint reaches the store, where the loss is largest.

Lost work of a kill: the training time (metrics.jsonl's `elapsed_s`) of the last step host A finished minus that
of the step the store's latest checkpoint holds (the step a fresh host resumes from: `latest.json`), in seconds
and steps; also the wall time from that step's sighting to the kill (the step in progress included). With
`--confirm` a host B (empty directories) then runs the job until it resumes, and its `resumed` event must name
the same step. The bound: `--interval` plus that run's longest measured upload (the issue's); and the bound with
the granularity the loop has (a checkpoint is due at the end of the first step after the interval, and is written
before it uploads): plus the longest step after the first (a checkpoint write in it) and the longest write.
Prints one JSON line per kill, then a summary with the worst; `--out` writes everything (date, machine, cpus,
command, every kill).
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import shutil
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from benchmarks.train_throughput import model_and_data  # noqa: E402
from helpers.hosts import Host, kill_host, wait_until  # noqa: E402

BUCKET = "bench-lost-work"
JOB = "lost-work"


@dataclass
class BenchHost(Host):
    """The tests' host, with the torch threads it may use (the tests give it one)."""

    threads: int = 1

    def env(self) -> dict[str, str]:
        return {**super().env(), "OMP_NUM_THREADS": str(self.threads)}

    def train_dir(self) -> Path | None:
        found = sorted((self.root / "runs" / JOB).glob("train-*/"))
        return found[0] if found else None


class StorePointer:
    """The store's `latest.json` of the job's training run, read with a plain S3 client."""

    def __init__(self, client, prefix: str) -> None:
        self.client, self.prefix, self.key = client, prefix, None

    def step(self) -> int | None:
        if self.key is None:
            pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=self.prefix)
            found = [item["Key"] for page in pages for item in page.get("Contents", [])
                     if item["Key"].endswith("/latest.json")]
            if not found:
                return None
            self.key = found[0]
        return json.loads(self.client.get_object(Bucket=BUCKET, Key=self.key)["Body"].read())["step"]


@dataclass
class Sightings:
    """When the watcher first saw each step's metrics line, each local checkpoint, each pointer (monotonic s)."""

    steps: dict[int, float] = field(default_factory=dict)
    checkpoints: dict[int, float] = field(default_factory=dict)
    pointers: dict[int, float] = field(default_factory=dict)

    def look(self, host: BenchHost, pointer: StorePointer) -> None:
        from phase1a.core import layout
        from phase1a.core.layout import checkpoint_step, list_checkpoints
        from phase1a.train import run_files

        now, train = time.monotonic(), host.train_dir()
        if train is not None:
            for line in run_files.read_lines(train / layout.METRICS):
                self.steps.setdefault(line["step"], now)
            for path in list_checkpoints(train / "checkpoints"):
                self.checkpoints.setdefault(checkpoint_step(path), now)
        step = pointer.step()
        if step is not None:
            self.pointers.setdefault(step, now)

    def uploads(self) -> dict[int, float]:
        """Each checkpoint's time from its local sighting to its pointer's."""
        return {step: round(seen - self.checkpoints[step], 3) for step, seen in self.pointers.items()
                if step in self.checkpoints}

    def writes(self) -> dict[int, float]:
        """Each checkpoint's time from its step's metrics line to the checkpoint on disk."""
        return {step: round(seen - self.steps[step], 3) for step, seen in self.checkpoints.items()
                if step in self.steps}


def job_tree(args: argparse.Namespace, model_dir: str, data: Path, endpoint: str, number: int) -> dict:
    """The job every host of kill `number` runs (the tests' resume job, at this benchmark's scale)."""
    return {
        "name": JOB,
        "data": {"source": str(data), "validation_fraction": 0.1},
        "model": {"name_or_path": model_dir},
        "method": {"learning_rate": 1e-3, "batch_size": args.batch, "epochs": args.epochs, "seed": 3,
                   "lora": {"r": 16, "alpha": 32}, "eval_interval": "never"},
        "hardware": {"target": "cpu"},
        "plan": {"profile": "custom", "micro_batch_size": args.micro, "gradient_checkpointing": False,
                 "compile": False, "dataloader_workers": 0},
        "checkpoint": {"interval": args.interval, "keep_last": 2},
        "validation": {"max_examples": 8,
                       "tolerances": {"loss": None, "token_accuracy": None, "exact_match": None}},
        "progress": {"display": "lines", "interval": "10s"},
        "store": {"url": f"s3://{BUCKET}/kill-{number}/", "endpoint_url": endpoint, "lease_ttl": args.lease_ttl},
    }


def run_until_killed(host: BenchHost, pointer: StorePointer, share: float, args: argparse.Namespace,
                     interval: float) -> tuple[Sightings, float]:
    """Host A from nothing; killed -9 `share` of a checkpoint cycle after its first checkpoint was seen in the
    store. A cycle: the interval plus the longest step so far (a checkpoint is due at the end of a step), so the
    latest shares fall just before the second checkpoint reaches the store."""
    process, seen = host.start_cli(), Sightings()

    def first_upload():
        seen.look(host, pointer)
        return seen.pointers

    wait_until(first_upload, "host A's first checkpoint in the store", process, host.root / "run.log",
               timeout=3600, every=args.poll)
    times = sorted(seen.steps.values())
    step = max((b - a for a, b in zip(times[1:], times[2:])), default=0.0)  # after the first step's warm-up
    kill_at = min(seen.pointers.values()) + share * (interval + step)
    while time.monotonic() < kill_at:
        if process.poll() is not None:
            raise SystemExit(f"host A ended (exit {process.returncode}) before its kill: raise --epochs\n"
                             + host.log()[-3000:])
        time.sleep(min(args.poll, max(0.0, kill_at - time.monotonic())))
        seen.look(host, pointer)
    killed = time.monotonic()
    kill_host(process)
    return seen, killed


def lost_work(host: BenchHost, pointer: StorePointer, seen: Sightings, killed: float) -> dict:
    """What the kill lost: finished steps' training time past the store's latest checkpoint."""
    from phase1a.core import layout
    from phase1a.train import run_files

    lines = {line["step"]: line for line in run_files.read_lines(host.train_dir() / layout.METRICS)}
    last, stored = max(lines), pointer.step()
    elapsed = [lines[step]["elapsed_s"] for step in sorted(lines)]
    return {"steps_finished": last, "store_step": stored, "lost_steps": last - stored,
            "lost_seconds": round(lines[last]["elapsed_s"] - lines[stored]["elapsed_s"], 3),
            "lost_seconds_at_kill": round(killed - seen.steps[stored], 3),
            "longest_step_seconds": round(max(b - a for a, b in zip(elapsed, elapsed[1:])), 3),  # a write in it
            "uploads_seconds": seen.uploads(), "writes_seconds": seen.writes(),
            "uploads_refused": host.log().count(" not uploaded: "),  # the mirror's warnings (a lease not held...)
            "kill_after_first_upload_seconds": round(killed - min(seen.pointers.values()), 3)}


def bounds(figures: dict, interval: float) -> dict:
    """The issue's bound (interval + the longest upload) and the one with the loop's granularity."""
    upload = max(figures["uploads_seconds"].values())
    write = max(figures["writes_seconds"].values(), default=0.0)
    issue = interval + upload
    granular = issue + figures["longest_step_seconds"] + write
    return {"bound_seconds": round(issue, 3), "within_bound": figures["lost_seconds"] <= issue,
            "granular_bound_seconds": round(granular, 3), "within_granular_bound": figures["lost_seconds"] <= granular}


def confirm(root: Path, tree: dict, threads: int) -> int | None:
    """Host B (empty directories) runs the job until it resumes; the step its `resumed` event names."""
    from phase1a.core import layout
    from phase1a.train import run_files

    host = BenchHost.fresh(root, tree)
    host.threads = threads
    process = host.start_cli()

    def resumed():
        train = host.train_dir()
        events = run_files.read_lines(train / layout.EVENTS) if train else []
        return next((event for event in events if event["event"] == "resumed"), None)

    try:
        event = wait_until(resumed, "host B's resume", process, host.root / "run.log", timeout=900)
    finally:
        if process.poll() is None:
            kill_host(process)
    return event["from_step"]


def one_kill(args: argparse.Namespace, context: dict, number: int, share: float) -> dict:
    tree = job_tree(args, context["model_dir"], context["data"], context["endpoint"], number)
    host = BenchHost.fresh(context["root"] / f"kill-{number}-a", tree)
    host.threads = args.threads
    pointer = StorePointer(context["client"], f"kill-{number}/jobs/{JOB}/")
    seen, killed = run_until_killed(host, pointer, share, args, context["interval"])
    figures = {"kill": number + 1, "cycle_share": round(share, 3), **lost_work(host, pointer, seen, killed)}
    figures.update(bounds(figures, context["interval"]))
    if args.confirm:
        figures["host_b_resumed_from"] = confirm(context["root"] / f"kill-{number}-b", tree, args.threads)
        assert figures["host_b_resumed_from"] == figures["store_step"], figures
    if not args.keep:
        shutil.rmtree(context["root"] / f"kill-{number}-a", ignore_errors=True)
        shutil.rmtree(context["root"] / f"kill-{number}-b", ignore_errors=True)
    return figures


def summarise(kills: list[dict]) -> dict:
    worst = max(kills, key=lambda kill: kill["lost_seconds"])
    return {"worst_lost_seconds": worst["lost_seconds"], "worst_lost_steps": max(k["lost_steps"] for k in kills),
            "worst_kill": worst["kill"], "worst_bound_seconds": worst["bound_seconds"],
            "all_within_bound": all(k["within_bound"] for k in kills),
            "all_within_granular_bound": all(k["within_granular_bound"] for k in kills),
            "longest_upload_seconds": max(max(k["uploads_seconds"].values()) for k in kills)}


def print_summary(summary: dict) -> None:
    for kill in summary["kills"]:
        print(f"kill {kill['kill']} ({kill['kill_after_first_upload_seconds']} s after the first upload): step "
              f"{kill['steps_finished']} finished, the store at step {kill['store_step']}: lost {kill['lost_steps']} "
              f"steps, {kill['lost_seconds']} s of training ({kill['lost_seconds_at_kill']} s of wall at the kill); "
              f"bound {kill['bound_seconds']} s ({'within' if kill['within_bound'] else 'OVER'}), with the loop's "
              f"granularity {kill['granular_bound_seconds']} s")
    result = summary["summary"]
    print(f"worst: {result['worst_lost_seconds']} s ({result['worst_lost_steps']} steps at most) against "
          f"{result['worst_bound_seconds']} s; every kill within the bound: {result['all_within_bound']}, within the "
          f"granular bound: {result['all_within_granular_bound']}; longest upload {result['longest_upload_seconds']} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--interval", default="60s", help="checkpoint.interval: a wall time, e.g. 60s")
    parser.add_argument("--batch", type=int, default=8, help="method.batch_size")
    parser.add_argument("--micro", type=int, default=8, help="plan.micro_batch_size (divides --batch)")
    parser.add_argument("--epochs", type=float, default=5, help="enough that host A is still training at its kill")
    parser.add_argument("--examples", type=int, default=2000)
    parser.add_argument("--max-answer-words", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each host (the tests': 1)")
    parser.add_argument("--lease-ttl", default="60s", help="store.lease_ttl (host B waits this long to take over)")
    parser.add_argument("--poll", type=float, default=0.1, help="the watcher's period, seconds")
    parser.add_argument("--confirm", action="store_true", help="after each kill, host B resumes: the same step?")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", type=Path, default=Path("/tmp/phase1a-bench-lost-work"))
    parser.add_argument("--keep", action="store_true", help="keep the hosts' directories")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    import pytest

    from helpers.servers import isolate_aws, s3_client, start_moto, stop
    from phase1a.core.hardware import usable_cores
    from phase1a.core.units import parse_duration_seconds

    interval = parse_duration_seconds(args.interval)
    args.work.mkdir(parents=True, exist_ok=True)
    model_dir, data = model_and_data(args.model, args.work, args.examples, args.max_answer_words)
    rng = random.Random(args.seed)
    shares = [(number + rng.random()) / args.kills for number in range(args.kills)]
    summary = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.node(),
               "cpus": usable_cores(), "command": " ".join(sys.argv), "model": args.model,
               "checkpoint_interval_seconds": interval, "omp_num_threads": args.threads, "kills": [],
               "store_server": "moto over HTTP on 127.0.0.1, on the same cores as the host (its CPU counts)"}
    with pytest.MonkeyPatch.context() as patch:
        isolate_aws(patch, args.work)  # dummy credentials only, never the machine's AWS configuration
        moto, endpoint = start_moto(args.work / "moto.log")
        try:
            client = s3_client(endpoint)
            client.create_bucket(Bucket=BUCKET)
            context = {"model_dir": model_dir, "data": data, "endpoint": endpoint, "client": client,
                       "root": args.work / f"run-{time.time_ns()}", "interval": interval}
            for number, share in enumerate(shares):
                summary["kills"].append(one_kill(args, context, number, share))
                print(json.dumps(summary["kills"][-1]), flush=True)
        finally:
            stop(moto)
    summary["summary"] = summarise(summary["kills"])
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
    print_summary(summary)


if __name__ == "__main__":
    main()
