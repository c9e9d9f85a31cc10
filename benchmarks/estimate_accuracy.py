"""The plan's estimate against the run, through the flow as a user runs it: each job run fresh (its own work and
cache directories: no history, no cached plan, no cached base-model scores), `phase1a run` in its own process, and
the run's report read back. Fresh means Prefect's home too: its result storage keys a stage by content, never
by path, so without it a second run of a job takes the first run's plan (as a user's second run should).

    uv run python benchmarks/estimate_accuracy.py [--jobs demo qa300 chat2000] [--repeats 3] [--out FILE]

Jobs (issue 38): `demo` (configs/demo.yaml: 480 date rewrites, SmolLM2-135M, evaluation every 10 steps, a 40-question
benchmark in the gate), `qa300` (300 question-answer pairs in the alpaca shape of about 180 tokens each,
`plan.calibration_budget: 60s`) and `chat2000` (2,000 generated two-turn chats). For each run: the train stage's
and the validate stage's seconds, estimated (with the plan's own range) against actual, inside or outside; the
evaluations during training planned against made; calibration's seconds against its budget; and every skipped
candidate's note, which must name the limit that stopped it; and the host's speed during the run's steps against
calibration's (`host`: a host that drifts between calibration and the run, or within it, moves the actual whatever
the estimator does). Results are appended to `--out` after every run; `--reread WORK...` summarises earlier runs'
work directories again. A finished run's work directory keeps what `--reread` reads (its reports, metrics and log)
and loses its weights, checkpoints and caches (about 0.5 GB a run) unless `--keep`.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tokenize_throughput import WORDS, generate  # noqa: E402

JOBS = ("demo", "qa300", "chat2000")
LIMITS = ("plan.calibration_budget", "plan.calibration_share")  # what a skipped candidate's note must name


def qa_records(path: Path, count: int, seed: int = 0) -> Path:
    """Question-answer pairs (alpaca: instruction, output) of about 180 SmolLM2 tokens each with the template."""
    rng = random.Random(seed)

    def words(count: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(count))

    with open(path, "w") as handle:
        for _ in range(count):
            handle.write(json.dumps({"instruction": words(rng.randint(15, 35)).capitalize() + "?",
                                     "output": words(rng.randint(70, 110)).capitalize() + "."}) + "\n")
    return path


def job_config(job: str, work: Path) -> tuple[Path, list[str]]:
    """The job's config file and its `--set` overrides, every directory under `work`."""
    fresh = [f"work_dir={work / 'runs'}", f"cache_dir={work / 'cache'}", f"data.staging_dir={work / 'staging'}"]
    if job == "demo":
        demo_data = ROOT / "data" / "demo_dates.jsonl"
        if not demo_data.is_file():
            subprocess.run([sys.executable, str(ROOT / "data" / "make_demo_dataset.py")], check=True, cwd=ROOT)
        return ROOT / "configs" / "demo.yaml", [*fresh, f"promotion.to={work / 'promoted'}",
                                                 f"data.source={demo_data}"]
    data = work / f"{job}.jsonl"
    if job == "qa300":
        qa_records(data, 300, seed=3)
        extra = ["plan.calibration_budget=60s", "validation.max_examples=30", "validation.max_new_tokens=128"]
    else:
        generate(data, 2000, seed=4, max_answer_words=20)
        extra = ["validation.max_examples=64", "validation.max_new_tokens=64"]
    config = work / f"{job}.yaml"
    config.write_text(json.dumps({
        "name": job, "data": {"source": str(data), "validation_fraction": 0.1},
        "model": {"name_or_path": "smollm2-135m-instruct"},
        "method": {"kind": "lora", "lora": {"r": 16, "alpha": 32}, "learning_rate": 1e-3, "epochs": 1,
                   "batch_size": 8, "eval_interval": "0.25ep"},
        "hardware": {"target": "cpu"}, "checkpoint": {"interval": "2m"},
        # Random words: the gate's verdict is not what is measured; its time is.
        "validation": {"baseline": "base", "tolerances": {"loss": 100.0, "token_accuracy": 1.0, "exact_match": 1.0}},
    }))
    return config, [*fresh, *extra]


def run_job(job: str, work: Path) -> dict:
    config, overrides = job_config(job, work)
    command = [sys.executable, "-m", "flows.cli", "run", "--config", str(config)]
    for item in overrides:
        command += ["--set", item]
    began = time.perf_counter()
    log = work / "run.log"
    with open(log, "w") as handle:
        finished = subprocess.run(command, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1",
                                       # Prefect's own home too: its result storage keys the plan stage by content,
                                       # so a second run of the same job would take the first run's plan.
                                       "PREFECT_HOME": str(work / "prefect")})
    wall = time.perf_counter() - began
    reports = sorted((work / "runs").glob("*/*/report.json"))
    if not reports:
        return {"job": job, "status": f"no report (exit {finished.returncode})", "log_tail": log.read_text()[-3000:]}
    return {"job": job, "wall_seconds": round(wall, 1), **summary(json.loads(reports[-1].read_text()))}


REREAD = ("report.json", "metrics.jsonl", "run.log")  # what `reread` and a reader of the run need


def prune(work: Path, keep_below: int = 1 << 20) -> int:
    """Every file of a finished run's work directory of `keep_below` bytes or more removed (weights, checkpoints,
    tokenized shards, caches), then the directories left empty; `REREAD`'s files stay whatever their size.
    The bytes removed."""
    removed = 0
    for path in sorted(work.rglob("*"), reverse=True):  # children before their directories
        if path.is_symlink():
            continue
        if path.is_dir():
            if not any(path.iterdir()):
                path.rmdir()
        elif path.name not in REREAD and (size := path.stat().st_size) >= keep_below:
            removed += size
            path.unlink()
    return removed


def reread(work: Path) -> dict:
    """A run this script made (its work directory, `<job>-<time>`) summarised again from its report, running
    nothing: what this version of the summary says of an earlier run."""
    reports = sorted((work / "runs").glob("*/*/report.json"))
    if not reports:
        raise SystemExit(f"{work}: no runs/*/*/report.json: not a work directory of a finished run")
    return {"job": work.name.rsplit("-", 1)[0], "work": str(work), **summary(json.loads(reports[-1].read_text()))}


def compared(estimated: float, actual: float, stated: tuple[float, float] | None) -> dict:
    """A stage's estimate against its measured seconds: the ratio, within ±10 % or not, and whether the stated
    range holds the actual (benchmarks/plan_accuracy.py compares its stages the same way)."""
    low, high = stated if stated else (None, None)
    return {"estimated": round(estimated, 1), "actual": round(actual, 1), "low": low and round(low, 1),
            "high": high and round(high, 1), "ratio": round(estimated / actual, 3),
            "within_10_percent": abs(estimated / actual - 1) <= 0.10,
            "inside": bool(stated) and low <= actual <= high}


def summary(report: dict) -> dict:
    """What the run's report says of the plan against the run."""
    from phase1a.plan.result import Plan

    plan = Plan.model_validate(report["stages"]["plan"]["result"])
    train = report["stages"]["train"]["result"] or {}
    estimate, trained, validated = plan.estimate, report.get("estimate_vs_actual"), report.get(
        "validation_estimate_vs_actual")

    calibration = plan.calibration
    skipped = [t.note for t in (calibration.trials if calibration else []) if t.status == "skipped"]
    return {
        "status": report.get("status"),
        "train": trained and compared(trained["estimated_train_seconds"], trained["actual_train_seconds"],
                                      estimate.train_range()),
        "validate": validated and compared(validated["estimated_seconds"], validated["actual_seconds"],
                                           (validated.get("low_seconds"), validated.get("high_seconds"))
                                           if validated.get("low_seconds") is not None
                                           else estimate.evaluation_range()),
        "evaluations": {"planned": estimate.evaluations_during_training, "made": train.get("evaluations"),
                        "estimated_seconds": round(estimate.eval_during_training_seconds, 1),
                        "actual_seconds": train.get("eval_seconds") and round(train["eval_seconds"], 1)},
        "footing": estimate.footing and estimate.footing.words,
        "evaluation_footing": estimate.evaluation_footing and estimate.evaluation_footing.words,
        "tokens_per_second": {"planned": round(plan.tokens_per_second, 1), "run": train.get("tokens_per_second")},
        "host": trained and train.get("output_dir") and host_speed(plan.tokens_per_second, trained["tokens_per_second"],
                                                                   Path(train["output_dir"]) / "metrics.jsonl"),
        "calibration": calibration and {"seconds": round(calibration.seconds, 1),
                                        "budget_seconds": calibration.budget_seconds,
                                        "within_budget": calibration.seconds <= calibration.budget_seconds,
                                        "trials": len(calibration.trials), "skipped": skipped,
                                        "skips_name_their_limit": all(any(limit in note for limit in LIMITS)
                                                                      for note in skipped)},
    }


def host_speed(calibrated: float, steady: float, metrics: Path) -> dict | None:
    """How fast the host ran the run's own steps, beside what calibration measured minutes before: the host's
    drift, apart from the estimator's error. `calibration_over_run` is the plan's tokens/s over the run's (its
    history record: evaluations and checkpoint writes left out); `quarters` the median step's tokens/s
    (`phase1a.plots.step_rates`) in each quarter of the run's steps: a step's elapsed seconds hold the evaluations
    since the step before, and the median leaves those steps out."""
    from phase1a.plots import step_rates
    from phase1a.train.run_files import read_lines

    _, rates = step_rates(read_lines(metrics))
    if not rates.size:
        return None
    cuts = [rates.size * part // 4 for part in range(5)]
    quarters = [round(float(np.median(rates[a:b])), 1) for a, b in zip(cuts, cuts[1:]) if b > a]
    return {"calibration_over_run": round(calibrated / steady, 3), "quarters_tokens_per_second": quarters}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", nargs="+", choices=JOBS, default=list(JOBS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work", type=Path, default=Path("/tmp/phase1a-estimate-accuracy"))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "estimate_accuracy_cpu.json")
    parser.add_argument("--reread", nargs="+", type=Path, metavar="WORK",
                        help="print earlier runs' summaries again from their work directories, run nothing")
    parser.add_argument("--keep", action="store_true",
                        help="keep each run's whole work directory (weights, checkpoints, caches: about 0.5 GB a run)")
    args = parser.parse_args()
    if args.reread:
        for work in args.reread:
            print(json.dumps(reread(work)), flush=True)
        return

    results = json.loads(args.out.read_text()) if args.out.is_file() else {
        "machine": platform.node(), "cores": os.cpu_count(), "runs": []}
    results["command"] = " ".join(sys.argv)
    for repeat in range(args.repeats):  # jobs alternate, so a slow spell of the host does not fall on one job
        for job in args.jobs:
            work = args.work / f"{job}-{time.strftime('%Y%m%dT%H%M%S')}"
            work.mkdir(parents=True)
            outcome = run_job(job, work)
            if not args.keep:
                prune(work)
            outcome["date"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
            results["runs"].append(outcome)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=2) + "\n")
            print(json.dumps(outcome), flush=True)


if __name__ == "__main__":
    main()
