"""The plan's calibrated estimate of training wall time against the run it planned.

A deterministic workload: a fixed dataset, seed and model, one thread. The plan calibrates on the CPU that then
trains. What the run does is checked exactly: its steps, tokens, checkpoints and evaluations are the ones the
estimate priced, and the estimate is the sum of its parts. Its seconds are checked only against a gross error (a
unit, a part left out or counted twice), part by part: the +-10 % bar is the estimate benchmark's
(benchmarks/estimate_accuracy.py, docs/benchmarks.md), run on a quiet host. A timed bar here fails on the host,
not on the estimator: under CI's load this job's estimate landed at 0.81-1.14 of its run in three attempts
(2026-11-29), its calibration's two measurements of one candidate 17-31 % apart in each.
"""
from pathlib import Path

import pytest
import torch

from helpers import date_records, make_tiny_model_dir, make_tokenizer, resolved, write_jsonl
from phase1a.config.schema import Phase1aConfig
from phase1a.data.tokenizing import TokenizeOptions, tokenize_dataset
from phase1a.plan.planner import make_plan
from phase1a.train.loop import train
from phase1a.train.settings import EvalSettings, TrainSettings


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def plan_and_train(root: Path) -> tuple[dict[str, tuple[float, float]], str]:
    """One deterministic job planned, then trained: its parts' (estimated, measured) seconds, and the calibration."""
    # Large enough that a step (~0.1 s) is mostly arithmetic rather than Python overhead.
    model_dir = make_tiny_model_dir(root / "model", hidden_size=256, intermediate_size=512, num_hidden_layers=4)
    data = tokenize_dataset(write_jsonl(root / "d.jsonl", date_records(400, seed=3)), make_tokenizer(), 256,
                            TokenizeOptions(), root / "cache" / "fp")
    config = Phase1aConfig.model_validate({
        "name": "accuracy", "work_dir": str(root / "runs"), "cache_dir": str(root / "cache"),
        "data": {"source": "unused"},
        "model": {"name_or_path": str(model_dir)},
        # Evaluations during training are in the train stage's wall time, and so in the estimate.
        "method": {"batch_size": 8, "epochs": 1, "learning_rate": 1e-3, "lora": {"r": 8, "alpha": 16},
                   "eval_interval": "10steps"},
        "hardware": {"target": "cpu"},
        # Workers and compile are left out: forking and compiling would dominate a run this short.
        "plan": {"sweep": ["micro_batch", "gradient_checkpointing"], "calibration_share": 1.0, "calibration_steps": 10},
        "checkpoint": {"interval": "20steps"},
    })
    plan = make_plan(config, resolved(config), data)
    assert plan.calibrated and plan.calibration is not None and plan.estimate.checkpoints == (plan.steps - 1) // 20

    result = train(TrainSettings(
        model_dir=str(model_dir), train_path=data.train_path, output_dir=str(root / "run"),
        method=config.method, micro_batch_size=plan.micro_batch_size,
        gradient_checkpointing=plan.gradient_checkpointing, compile=plan.compile,
        dataloader_workers=plan.dataloader_workers, max_seq_length=plan.max_seq_length,
        checkpoint_interval=config.checkpoint.interval, show_progress=False,
        evaluation=EvalSettings.of(config, data.validation_path, data.validation_examples),
    ))
    assert result.train_tokens == plan.train_tokens and result.steps == plan.steps
    assert result.checkpoints_written == plan.estimate.checkpoints
    assert result.evaluations == plan.estimate.evaluations_during_training == (plan.steps - 1) // 10 + 1
    estimate = plan.estimate
    parts = (estimate.steady_seconds, estimate.warmup_seconds, estimate.checkpoint_seconds,
             estimate.eval_during_training_seconds)
    assert estimate.train_seconds == pytest.approx(sum(parts))
    assert estimate.steady_seconds > 0 and estimate.checkpoint_seconds > 0 and estimate.eval_during_training_seconds > 0
    trials = [(t.candidate.label(), t.status, t.tokens_per_second) for t in plan.calibration.trials]
    # The training steps and the evaluations during training, each estimated against the run's (a checkpoint
    # write here takes milliseconds: its count is checked, not its time).
    return {"steps": (estimate.steady_seconds + estimate.warmup_seconds,
                      result.wall_seconds - result.eval_seconds - result.checkpoint_seconds),
            "evaluations": (estimate.eval_during_training_seconds, result.eval_seconds)}, f"calibration: {trials}"


@pytest.mark.slow
@pytest.mark.alone  # one thread's seconds against another's: no other test shares the cores
def test_the_estimate_prices_the_run_it_plans(tmp_path, one_thread):
    parts, calibration = plan_and_train(tmp_path)
    # A gross error moves a part by a factor: a part left out (0), counted twice (2), a unit (1000); the host moved
    # the whole by up to a fifth. Here the steps are about four fifths of the run, the evaluations one fifth.
    gross = {name: (estimated, measured) for name, (estimated, measured) in parts.items()
             if not 2 / 3 <= estimated / measured <= 3 / 2}
    assert not gross, f"estimated against measured seconds: {gross}; {calibration}"
