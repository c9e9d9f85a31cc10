"""Calibration against its budget, and the estimate it gives against the training it estimates.

    uv run python benchmarks/calibration_budget.py [--jobs demo qa300 qa300-512] [--budgets 10m 60s 10s] [--train]
        [--out FILE]

Jobs: `demo` is configs/demo.yaml as it is (480 date-rewriting chats, SmolLM2-135M-Instruct, LoRA r16, batch 8);
`qa300` is the same settings on 300 generated question-answer chats of about 200 tokens, `qa300-512` of about
500. For each job and budget
a fresh plan calibrates (no history): the calibration's wall time over its budget. With `--train`, the plan at
the first budget (the default, 10m) is trained by the train stage itself, and its training estimate is set
against the seconds training took (the run report's `time_accuracy`: estimated / actual).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import random
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from train_throughput import write_json  # noqa: E402

_WORDS = ("river mountain city train weather market music history harbour forest valley engine bridge lantern "
          "orchard meadow signal archive compass garden canyon island").split()


def demo_records() -> list[dict]:
    spec = importlib.util.spec_from_file_location("make_demo_dataset", ROOT / "data" / "make_demo_dataset.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rng = random.Random(1234)  # the demo's own seed and count: the same bytes as data/demo_dates.jsonl
    return [module.example(rng) for _ in range(480)]


def qa_records(count: int = 300, question: int = 50, answer: int = 100, seed: int = 3) -> list[dict]:
    """Question-answer chats: a question of `question` words, an answer of `answer` (with SmolLM2's tokenizer and
    chat template, 50/100 words make ~185-token examples, 150/310 ~510)."""
    rng = random.Random(seed)

    def text(words: int) -> str:
        return " ".join(rng.choice(_WORDS) for _ in range(max(1, int(rng.gauss(words, words / 5)))))

    return [{"messages": [{"role": "user", "content": text(question).capitalize() + "?"},
                          {"role": "assistant", "content": text(answer).capitalize() + "."}]} for _ in range(count)]


_QA_VALIDATION = {"validation.max_examples": 30, "validation.generation_batch_size": 16}
JOBS = {"demo": (demo_records, {}),
        "qa300": (qa_records, _QA_VALIDATION),
        "qa300-512": (lambda: qa_records(question=150, answer=310), _QA_VALIDATION)}


def job_config(name: str, work: Path, budget: str):
    from phase1a.config.schema import load_config

    make, overrides = JOBS[name]
    data = work / f"{name}.jsonl"
    if not data.is_file():
        data.write_text("".join(json.dumps(record) + "\n" for record in make()))
    run = work / f"{name}-{budget}-{time.time_ns()}"  # fresh: no history, no cached plan
    settings = {"data.source": str(data), "work_dir": str(run), "cache_dir": str(run / "cache"),
                "plan.calibration_budget": budget, "promotion.to": "null", **overrides}
    return load_config(ROOT / "configs" / "demo.yaml", [f"{key}={value}" for key, value in settings.items()])


def measure(name: str, budget: str, train: bool, work: Path) -> dict:
    from phase1a.config.tokenizing import tokenize_options
    from phase1a.core.units import parse_duration_seconds
    from phase1a.data.tokenizing import tokenize_dataset
    from phase1a.model.loading import load_tokenizer, prepare_model
    from phase1a.plan.planner import make_plan
    from phase1a.plan.present import format_plan
    from phase1a.plan.training import record_run, train_settings
    from phase1a.start.warmstart import resolve_start
    from phase1a.train.history import history_path
    from phase1a.train.loop import train as train_stage

    config = job_config(name, work, budget)
    model = prepare_model(config)
    data = tokenize_dataset(Path(config.data.source), load_tokenizer(Path(model.path)), model.max_positions,
                            tokenize_options(config), work / "tokenized" / name)
    began = time.perf_counter()
    plan = make_plan(config, model, data)
    wall = time.perf_counter() - began
    print(format_plan(plan), flush=True)
    calibration, estimate = plan.calibration, plan.estimate
    row = {"job": name, "budget_seconds": parse_duration_seconds(budget),
           "calibration_seconds": round(calibration.seconds, 1), "plan_seconds": round(wall, 1),
           "calibration_over_budget": round(calibration.seconds / calibration.budget_seconds, 3),
           "needed_seconds": calibration.needed_seconds, "footing": estimate.footing.words,
           "trials": [f"{t.candidate.label()}: {t.status} {t.note}".strip() for t in calibration.trials],
           "estimated_train_seconds": round(estimate.train_seconds, 1),
           "estimated_range_total_seconds": [round(estimate.low_total_seconds, 1),
                                             round(estimate.high_total_seconds, 1)]}
    if train:
        settings = train_settings(config, plan, data, model, resolve_start(config, model)).model_copy(
            update={"show_progress": False})
        result = train_stage(settings)
        record = record_run(history_path(config.cache_dir), config, model, plan, result)
        row.update(actual_train_seconds=round(result.wall_seconds, 1),
                   estimated_over_actual=round(record.time_accuracy, 3))
    print(json.dumps(row, indent=2), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", nargs="+", choices=sorted(JOBS), default=sorted(JOBS))
    parser.add_argument("--budgets", nargs="+", default=["10m", "60s", "10s"])
    parser.add_argument("--train", action="store_true", help="train the first budget's plan and compare")
    parser.add_argument("--work", type=Path, default=Path("/tmp/phase1a-calibration-budget"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    import torch

    from phase1a.core.hardware import detect

    args.work.mkdir(parents=True, exist_ok=True)
    rows = [measure(name, budget, args.train and index == 0, args.work)
            for name in args.jobs for index, budget in enumerate(args.budgets)]
    summary = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": detect()[1].name,
               "machine": platform.node(), "torch": torch.__version__, "command": " ".join(sys.argv), "rows": rows}
    if args.out:
        write_json(args.out, summary)


if __name__ == "__main__":
    main()
