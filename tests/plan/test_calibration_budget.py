"""Calibration keeps its budget: loading the model, the trials, and the checkpoint and validation timing end
within `plan.calibration_budget` plus one step, on the demo's model and data and on a job of 512-token
examples, beside the suite's other tests (`make test`'s parallel run keeps both cores busy: a loaded host, as a shared
one is). The one test of an unloaded host runs alone."""
import importlib.util
import random
import time
from pathlib import Path

import pytest

from helpers import resolved, write_jsonl
from phase1a.config.schema import Phase1aConfig
from phase1a.data.tokenizing import TokenizeOptions, tokenize_dataset
from phase1a.model.loading import load_tokenizer
from phase1a.plan.planner import make_plan
from phase1a.plan.present import format_plan

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
_WORDS = ("the model reads a long passage about rivers mountains cities trains weather markets music history and "
          "answers with a careful summary of what it found").split()


def demo_records() -> list[dict]:
    spec = importlib.util.spec_from_file_location("make_demo_dataset", ROOT / "data" / "make_demo_dataset.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rng = random.Random(1234)
    return [module.example(rng) for _ in range(480)]


def long_records(count: int = 300, words: int = 380) -> list[dict]:
    """Question-answer chats of about 512 tokens: a long question, a long answer."""
    rng = random.Random(0)
    text = lambda n: " ".join(rng.choice(_WORDS) for _ in range(n))  # noqa: E731
    return [{"messages": [{"role": "user", "content": text(words // 3)},
                          {"role": "assistant", "content": text(words * 2 // 3)}]} for _ in range(count)]


JOBS = {"demo": (demo_records, 72), "512-token": (long_records, 16)}


def job_config(tmp_path: Path, budget: int, validation_examples: int) -> Phase1aConfig:
    """The demo's settings (configs/demo.yaml), the budget under test."""
    return Phase1aConfig.model_validate({
        "name": "budget", "work_dir": str(tmp_path / "runs"), "cache_dir": str(tmp_path / "cache"),
        "data": {"source": "unused"}, "model": {"name_or_path": "smollm2-135m-instruct"},
        "method": {"kind": "lora", "lora": {"r": 16, "alpha": 32}, "learning_rate": 1e-3, "batch_size": 8,
                   "eval_interval": "10steps"},
        "hardware": {"target": "cpu"}, "checkpoint": {"interval": "2m"},
        "plan": {"calibration_budget": f"{budget}s"},
        "validation": {"max_examples": validation_examples,
                       "generation_batch_size": validation_examples, "extractor": "whole"},
    })


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    root = tmp_path_factory.mktemp("budget-data")
    model = resolved(job_config(root, 10, 16))
    tokenizer = load_tokenizer(Path(model.path))
    data = {name: tokenize_dataset(write_jsonl(root / f"{name}.jsonl", make()), tokenizer, model.max_positions,
                                   TokenizeOptions(validation_fraction=0.1), root / "cache" / name)
            for name, (make, _) in JOBS.items()}
    return model, data


@pytest.mark.parametrize("budget", [5, 10, 30])  # 300 s, with room for everything: the alone test below
@pytest.mark.parametrize("name", list(JOBS))
def test_calibration_ends_within_its_budget_and_one_step(tmp_path, jobs, name, budget):
    model, data = jobs
    plan = make_plan(job_config(tmp_path, budget, JOBS[name][1]), model, data[name])
    calibration = plan.calibration
    longest_step = max(trial.longest_step_seconds for trial in calibration.trials)
    assert calibration.budget_seconds == budget
    assert calibration.seconds <= max(budget, calibration.first_step_at_seconds) + longest_step, format_plan(plan)
    assert (calibration.first_step_at_seconds < budget) != any("budget was spent before" in note
                                                              for note in calibration.notes)
    assert f"{calibration.seconds:.0f} s of a {budget} s budget" in format_plan(plan)
    estimate = plan.estimate
    assert estimate.low_total_seconds <= estimate.total_seconds <= estimate.high_total_seconds
    assert estimate.footing.words in format_plan(plan)
    if calibration.needed_seconds is not None:  # cut short: the plan says what a whole measurement needs
        assert calibration.needed_seconds > 0 and "a whole measurement needs" in format_plan(plan)


@pytest.mark.alone  # unloaded: make test runs it after the others, with no other test beside it
def test_a_budget_with_room_measures_whole_steps(tmp_path, jobs):
    """Unloaded, with a budget that holds it, the first candidate is measured on whole steps and validation is
    timed unhurried: the estimate is firm."""
    model, data = jobs
    began = time.perf_counter()
    plan = make_plan(job_config(tmp_path, 300, 16), model, data["demo"])
    assert time.perf_counter() - began < 300
    first = plan.calibration.trials[0]
    assert first.measured_steps == 4 and first.micro_batches == first.step_micro_batches
    assert plan.calibration.validation.source == "measured" and plan.calibration.needed_seconds is None
    assert plan.estimate.footing.firm
