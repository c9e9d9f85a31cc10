"""Cache keys that travel: the same job on two hosts, whose checkouts, work directories and HOMEs differ, keys its
stages alike, so the second host takes the plan the first one calibrated (minutes of a GPU), finds its verdict,
and resumes its training directory. Where a file counts, its bytes do, never its path."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from helpers import CHATML, date_records, write_jsonl
from helpers.benchmarks import write_date_tasks
from phase1a.config.schema import load_config
from phase1a.model.loading import prepare_model
from phase1a.plan.planner import make_plan
from phase1a.plan.training import training_dir
from phase1a.start.warmstart import resolve_start
from phase1a.train.result import TrainResult
from tasks.plan import plan_fingerprint, plan_task
from tasks.stage import stage_task, staged_copy, staged_fingerprint
from tasks.tokenize import tokenize_task, tokenized_fingerprint
from tasks.validate import validate_task

JOB = {  # every path relative to the job's YAML, as a job kept in a repository writes them
    "name": "nightly",
    "work_dir": "runs",  # cache_dir left at ~/.cache/phase1a: each host's HOME
    "data": {"source": "dates.jsonl", "staging_dir": "staging", "validation_fraction": 0.2,
             "chat_template": "chatml.jinja"},
    "model": {"name_or_path": "./model"},
    "method": {"learning_rate": 5e-3, "batch_size": 8, "epochs": 1, "init_from": "start-adapter",
               "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}},
    "hardware": {"target": "h100"},  # not here: the plan models its speed, no trial runs
    "checkpoint": {"interval": "3steps"},
    "validation": {"max_examples": 16, "baseline": "file", "baseline_file": "baseline.json",
                   "benchmarks": [{"task": "bench/dates_choice.yaml", "metric": "acc", "limit": 8}]},
    "promotion": {"to": "../promoted"},
}


@pytest.fixture(scope="module")
def job(tmp_path_factory, tiny_model_dir) -> Path:
    """The job as it is committed: its YAML, data, model, warm-start adapter, benchmark and baseline file."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("job") / "jobs" / "nightly"
    root.mkdir(parents=True)
    (root / "job.yaml").write_text(yaml.safe_dump(JOB))
    records = date_records(64)
    write_jsonl(root / "dates.jsonl", records)
    (root / "chatml.jinja").write_text(CHATML)
    shutil.copytree(tiny_model_dir, root / "model")
    torch.manual_seed(1)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), lora).save_pretrained(root / "start-adapter")
    write_date_tasks(root / "bench", records[:16])
    (root / "baseline.json").write_text(json.dumps({"loss": 1.5, "token_accuracy": 0.4}))
    return root


def on_host(job: Path, host: Path, monkeypatch) -> dict[str, str]:
    """The job checked out under `host` (another depth, another HOME), its stages run as far as their keys need,
    and every stage's key: the stages' fingerprints and the Prefect cache keys of the plan and the verdict."""
    checkout = host / "checkout" / "jobs" / "nightly"
    if not checkout.exists():
        shutil.copytree(job, checkout)
    monkeypatch.setenv("HOME", str(host / "home"))
    config = load_config(checkout / "job.yaml")
    assert config.cache_dir.is_relative_to(host / "home") and config.work_dir.is_relative_to(host)
    model = prepare_model(config)
    staged = stage_task.fn(config)
    assert Path(staged.path).is_relative_to(host)  # the copies are each host's own
    data = tokenize_task.fn(config, model, staged)
    plan = make_plan(config, model, data)
    start = resolve_start(config, model)
    candidate = TrainResult(adapter_dir=str(checkout / "start-adapter"), output_dir=str(host), steps=0,
                            resumed_from_step=None, reused_completed_run=False, wall_seconds=0.0, train_tokens=0,
                            tokens_per_second=0.0, final_loss=None, checkpoints_written=0, checkpoint_seconds=0.0)
    return {
        "stage": staged_fingerprint(config), "tokenize": tokenized_fingerprint(config, model, staged),
        "plan": cache_key(plan_task, config=config, model=model, data=data),
        "plan_fingerprint": plan_fingerprint(config, model, data),
        "train": training_dir(config, plan, data, model, start).name,
        "validate": cache_key(validate_task, config=config, model=model, data=data, trained=candidate),
        "staged_copy": str(staged_copy(staged_fingerprint(config), config)),
    }


def cache_key(stage, **inputs) -> str:
    """The key Prefect records the stage's result under (tasks/caching.py StageCache), for these inputs."""
    return stage.cache_policy.compute_key(SimpleNamespace(task=stage, result_store=None), inputs, {})


def test_every_stage_keys_alike_on_two_hosts_and_a_files_content_changes_its_key(job, tmp_path, monkeypatch):
    a = on_host(job, tmp_path / "a", monkeypatch)
    b = on_host(job, tmp_path / "b" / "elsewhere" / "deeper", monkeypatch)
    travelling = ("stage", "tokenize", "plan", "plan_fingerprint", "train", "validate")
    assert {name: a[name] for name in travelling} == {name: b[name] for name in travelling}
    # Stage's key also names where its copy lies, on each host its own: a record of a copy counts only where it is.
    assert a["staged_copy"] != b["staged_copy"]

    checkout = tmp_path / "b" / "elsewhere" / "deeper" / "checkout" / "jobs" / "nightly"
    docs = checkout / "bench" / "dates.jsonl"
    docs.write_text(docs.read_text().replace("/", "-", 1))  # one character of one benchmark document
    edited = on_host(job, tmp_path / "b" / "elsewhere" / "deeper", monkeypatch)
    assert edited["plan"] != a["plan"] and edited["validate"] != a["validate"]
    assert edited["train"] == a["train"]  # what training reads is unchanged

    (checkout / "baseline.json").write_text(json.dumps({"loss": 1.4, "token_accuracy": 0.4}))
    baseline = on_host(job, tmp_path / "b" / "elsewhere" / "deeper", monkeypatch)
    assert baseline["validate"] != edited["validate"] and baseline["plan"] == edited["plan"]
