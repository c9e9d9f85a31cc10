"""The plan against the clock: calibrate on this machine, estimate, train for a window of minutes, validate, and
compare each stage's estimate (and its stated range) with what the stage took.

    uv run python benchmarks/plan_accuracy.py [--model test|tiny|smollm2|llama3-8b] [--minutes 3] [--repeats 1]
                                              [--out FILE]

The job is the flow's own plan, train and validate stages on a randomly initialised model of `--model`'s shape
(LoRA r=16 on every projection) and generated chat data, more than the window can hold: `window.max_duration` makes
the plan cut the epochs to fit (`phase1a/plan/window.py`), so the estimate is the plan's real one, start-up and
checkpoints included. Startup, train and validate are compared separately, as the run report does (`record_run`,
flows/phase1a.py). Each repeat is a fresh run: calibration measures again, nothing is cached between runs.
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

from estimate_accuracy import compared
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
    parser.add_argument("--validation-examples", type=int, default=16, help="validation.max_examples")
    parser.add_argument("--max-new-tokens", type=int, default=64,
                        help="validation.max_new_tokens (a random model's answers run to it)")
    parser.add_argument("--repeats", type=int, default=1, help="fresh runs, one after another")
    parser.add_argument("--budget", type=float, default=float("inf"),
                        help="seconds: no repeat starts unless the last run's length is left")
    parser.add_argument("--out", type=Path, help="{'runs': [...]}, written after every run")
    args = parser.parse_args()
    began = time.monotonic()  # the budget counts the data's generation and tokenizing too

    from phase1a.config.schema import ModelConfig
    from phase1a.data.tokenizing import TokenizeOptions, tokenize_dataset
    from phase1a.model.loading import load_tokenizer, resolve_model

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

    runs: list[dict] = []
    for repeat in range(args.repeats):
        left = args.budget - (time.monotonic() - began)
        if not another_fits(runs, left):
            print(f"repeat {repeat + 1} of {args.repeats} not started: {left:.0f} s of --budget left, the last run "
                  f"took {runs[-1]['run_seconds']:.0f} s", flush=True)
            break
        runs.append(one_run(args, model_dir, data_path, data))
        if args.out:  # after every run: a run cut by the caller's timeout keeps the ones before it
            write_json(args.out, {"runs": runs})
        print(json.dumps({k: v for k, v in runs[-1].items() if k != "calibration"}, indent=2), flush=True)


def another_fits(runs: list[dict], left: float) -> bool:
    """Whether a fresh run may start with `left` seconds of the budget: the last run's length and a tenth, not a
    guess (the first always starts)."""
    return not runs or left >= 1.1 * runs[-1]["run_seconds"]


def one_run(args: argparse.Namespace, model_dir: Path, data_path: Path, data) -> dict:
    """A fresh run (its own work and cache directory: no history, no cached base-model scores): calibrate, plan,
    train the window, validate; each stage's estimate (and its stated range) against its seconds."""
    import torch

    from phase1a.config.schema import Phase1aConfig
    from phase1a.core.hardware import detect
    from phase1a.evaluate.validation import validate
    from phase1a.model.loading import prepare_model
    from phase1a.plan.planner import make_plan
    from phase1a.plan.present import format_plan
    from phase1a.plan.training import record_run, train_settings
    from phase1a.start.warmstart import resolve_start
    from phase1a.train.history import history_path
    from phase1a.train.loop import train

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
        "promotion": {"to": str(run_dir / "promoted")},
        "validation": {"max_examples": args.validation_examples, "max_new_tokens": args.max_new_tokens}})
    began = time.perf_counter()
    model = prepare_model(config)
    plan = make_plan(config, model, data)
    plan_seconds = time.perf_counter() - began
    print(format_plan(plan), flush=True)
    settings = train_settings(config, plan, data, model, resolve_start(config, model)).model_copy(
        update={"show_progress": False})
    result = train(settings)
    record = record_run(history_path(config.cache_dir), config, model, plan, result)
    validating = time.perf_counter()
    verdict = validate(config, model, Path(data.validation_path), Path(result.adapter_dir))
    validate_seconds = time.perf_counter() - validating  # the flow's validate stage: this call (flows/phase1a.py)

    estimate = plan.estimate
    evaluation, evaluation_range = estimate.evaluation_for(verdict.base_cached)
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": detect()[1].name,
        "machine": platform.node(), "torch": torch.__version__, "command": " ".join(sys.argv), "model": args.model,
        "window_seconds": plan.window_seconds, "plan_seconds": round(plan_seconds, 1),
        "run_seconds": round(time.perf_counter() - began, 1),
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
        # Each stage as the run report states it: estimated, its range, actual (flows/phase1a.py, flows/report.py).
        "train": compared(estimate.train_seconds, result.wall_seconds, estimate.train_range()),
        "validate": {**compared(evaluation, validate_seconds, evaluation_range),
                     "base_cached": verdict.base_cached},
        "training_footing": estimate.footing and estimate.footing.words,
        "evaluation_footing": estimate.evaluation_footing and estimate.evaluation_footing.words,
        "calibration": plan.calibration.model_dump(mode="json") if plan.calibration else None,
    }


if __name__ == "__main__":
    main()
