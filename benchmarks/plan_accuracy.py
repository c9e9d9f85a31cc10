"""The plan against the clock: calibrate on this machine, estimate, train for a window of minutes, and compare
the estimate with what the train stage took.

    uv run python benchmarks/plan_accuracy.py [--model test|tiny|smollm2|llama3-8b] [--minutes 3] [--out FILE]

The job is the flow's own plan and train stages on a randomly initialised model of `--model`'s shape (LoRA r=16
on every projection) and generated chat data, more than the window can hold: `window.max_duration` makes the
plan cut the epochs to fit (`phase1a/plan/window.py`), so the estimate is the plan's real one, start-up and
checkpoints included. Startup and train are compared separately, as the run report does (`record_run`).
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
from train_throughput import SHAPES, SMALL_VOCABULARY, config_target, make_model_dir, write_json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--tokenizer", type=Path, help="as in train_throughput.py")
    parser.add_argument("--minutes", type=float, default=3.0, help="the time window the plan must fit")
    parser.add_argument("--examples", type=int, default=200_000, help="generated: more than the window holds")
    parser.add_argument("--max-answer-words", type=int, default=300)
    parser.add_argument("--calibration-budget", default="90s")
    parser.add_argument("--checkpoint-interval", default="60s", help="so the estimate's checkpoints are exercised")
    parser.add_argument("--work", type=Path, default=Path("/tmp/phase1a-plan-bench"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    import torch

    from phase1a.config.schema import ModelConfig, Phase1aConfig
    from phase1a.core.hardware import detect
    from phase1a.data.tokenizing import TokenizeOptions, tokenize_dataset
    from phase1a.model.loading import load_tokenizer, prepare_model, resolve_model
    from phase1a.plan.planner import make_plan
    from phase1a.plan.present import format_plan
    from phase1a.plan.training import record_run, train_settings
    from phase1a.start.warmstart import resolve_start
    from phase1a.train.history import history_path
    from phase1a.train.loop import train

    args.work.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = args.tokenizer
    if tokenizer_dir is None and args.model not in SMALL_VOCABULARY:
        tokenizer_dir = resolve_model(ModelConfig(name_or_path="smollm2-135m-instruct"))
    model_dir = make_model_dir(args.model, tokenizer_dir, args.work / f"model-{args.model}")
    data_path = args.work / f"chat_{args.examples}_{args.max_answer_words}.jsonl"
    if not data_path.is_file():
        generate(data_path, args.examples, seed=2, max_answer_words=args.max_answer_words)
    data = tokenize_dataset(data_path, load_tokenizer(model_dir), 8192, TokenizeOptions(),
                            args.work / "cache" / f"plan-{args.model}-{data_path.stem}")

    run_dir = args.work / f"run-{time.time_ns()}"  # a fresh run: train() reuses a finished one of the same key
    window = f"{round(args.minutes * 60)}s"
    config = Phase1aConfig.model_validate({
        "name": "plan-accuracy", "work_dir": str(run_dir), "cache_dir": str(run_dir),
        "data": {"source": str(data_path)},
        "model": {"name_or_path": str(model_dir)}, "method": {"batch_size": 16, "lora": {"r": 16, "alpha": 32}},
        "hardware": {"target": config_target()},
        "plan": {"calibration_budget": args.calibration_budget, "min_epochs": 1e-6},
        "window": {"max_duration": window, "safety_margin": "0s"},
        "checkpoint": {"interval": args.checkpoint_interval, "keep_last": 1},
        "validation": {"max_examples": 16}})
    began = time.perf_counter()
    model = prepare_model(config)
    plan = make_plan(config, model, data)
    plan_seconds = time.perf_counter() - began
    print(format_plan(plan), flush=True)
    settings = train_settings(config, plan, data, model, resolve_start(config, model)).model_copy(
        update={"show_progress": False})
    result = train(settings)
    record = record_run(history_path(config.cache_dir), config, model, plan, result)

    estimate = plan.estimate
    summary = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": detect()[1].name,
        "machine": platform.node(), "torch": torch.__version__, "command": " ".join(sys.argv), "model": args.model,
        "window_seconds": plan.window_seconds, "plan_seconds": round(plan_seconds, 1),
        "calibrated": plan.calibrated, "throughput_source": plan.throughput_source,
        "knobs": {"micro_batch_size": plan.micro_batch_size, "gradient_checkpointing": plan.gradient_checkpointing,
                  "compile": plan.compile, "dataloader_workers": plan.dataloader_workers,
                  "max_seq_length": plan.max_seq_length, "epochs": plan.epochs, "steps": plan.steps},
        "estimated": {"startup_seconds": round(estimate.startup_seconds, 1),
                      "train_seconds": round(estimate.train_seconds, 1), "checkpoints": estimate.checkpoints,
                      "evaluations": estimate.evaluations_during_training,
                      "eval_seconds": round(estimate.eval_during_training_seconds, 1),
                      "tokens_per_second": round(plan.tokens_per_second, 1)},
        "actual": {"startup_seconds": result.startup_seconds, "train_seconds": result.wall_seconds,
                   "checkpoints": result.checkpoints_written, "evaluations": result.evaluations,
                   "eval_seconds": result.eval_seconds, "tokens_per_second": result.tokens_per_second,
                   "mean_mfu": result.mean_mfu, "final_loss": result.final_loss},
        "train_time_accuracy": round(record.time_accuracy, 3) if record.time_accuracy else None,
        "startup_accuracy": round(estimate.startup_seconds / result.startup_seconds, 3)
        if result.startup_seconds else None,
        "calibration": plan.calibration.model_dump(mode="json") if plan.calibration else None,
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "calibration"}, indent=2))
    if args.out:
        write_json(args.out, summary)


if __name__ == "__main__":
    main()
