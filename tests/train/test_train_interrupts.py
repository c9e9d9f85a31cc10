"""A training run that is killed, preempted or runs out of memory ends with the weights of one that was not.

The killed and preempted runs are real processes (`python -m phase1a.train.rank SETTINGS.json`), stopped with
SIGKILL and SIGTERM mid-run; the resumed run is compared with an uninterrupted one on the same settings.
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import date_records, make_tiny_model_dir, make_tokenizer, write_jsonl
from phase1a.config.schema import MethodConfig
from phase1a.core.layout import list_checkpoints
from phase1a.data.tokenizing import TokenizeOptions, tokenize_dataset
from phase1a.train.loop import train
from phase1a.train.packing import TokenRows
from phase1a.train.settings import TrainSettings

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("interrupts")
    # Big enough that a step takes tens of milliseconds: the test can stop the run between checkpoints.
    model_dir = make_tiny_model_dir(root / "model", hidden_size=192, intermediate_size=384, num_hidden_layers=3)
    data = tokenize_dataset(write_jsonl(root / "d.jsonl", date_records(96)), make_tokenizer(), 256,
                            TokenizeOptions(), root / "cache" / "fp")
    return {"model_dir": str(model_dir), "train_path": data.train_path, "root": root}


def settings(job: dict, name: str, **changes) -> TrainSettings:
    values = dict(model_dir=job["model_dir"], train_path=job["train_path"], output_dir=str(job["root"] / name),
                  method=MethodConfig(learning_rate=3e-3, batch_size=8, epochs=4, lora={"r": 4, "alpha": 8}),
                  micro_batch_size=4, gradient_checkpointing=False, checkpoint_interval="4steps", keep_last=2,
                  show_progress=False)
    return TrainSettings(**{**values, **changes})


@pytest.fixture(scope="module")
def uninterrupted(job) -> dict[str, torch.Tensor]:
    result = train(settings(job, "uninterrupted"))
    return load_file(Path(result.adapter_dir) / "adapter_model.safetensors")


def assert_same_weights(result, expected: dict[str, torch.Tensor]) -> None:
    actual = load_file(Path(result.adapter_dir) / "adapter_model.safetensors")
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=0, atol=1e-6, msg=name)


def start_training(run: TrainSettings) -> subprocess.Popen:
    Path(run.output_dir).mkdir(parents=True, exist_ok=True)
    path = Path(run.output_dir) / "settings.json"
    path.write_text(run.model_dump_json())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # slower steps, a wider window to stop the run in
    return subprocess.Popen([sys.executable, "-m", "phase1a.train.rank", str(path)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for_checkpoint(process: subprocess.Popen, run: TrainSettings, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not list_checkpoints(Path(run.output_dir) / "checkpoints"):
        assert process.poll() is None, process.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.02)


def metric_steps(run: TrainSettings) -> list[int]:  # the whole lines: a torn last one is no step
    return [json.loads(line)["step"] for line in open(Path(run.output_dir) / "metrics.jsonl") if line.endswith("\n")]


@pytest.mark.slow
def test_kill_9_mid_run_then_resume_matches_the_uninterrupted_run(job, uninterrupted):
    run = settings(job, "killed")
    process = start_training(run)
    wait_for_checkpoint(process, run)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    assert not (Path(run.output_dir) / "final").exists(), "the run finished before it could be killed"
    killed_at = max(metric_steps(run))
    with open(Path(run.output_dir) / "metrics.jsonl", "a") as metrics:
        metrics.write('{"step": ' + str(killed_at + 1) + ', "lo')  # a kill in mid-write: a torn last line

    resumed = train(run)
    assert resumed.resumed_from_step is not None and resumed.resumed_from_step % 4 == 0
    assert resumed.resumed_from_step <= killed_at < resumed.steps
    assert_same_weights(resumed, uninterrupted)
    assert metric_steps(run) == list(range(1, resumed.steps + 1))  # continuous: redone steps are not repeated


@pytest.mark.slow
def test_sigterm_checkpoints_the_current_step_before_exiting(job, uninterrupted):
    run = settings(job, "preempted", checkpoint_interval="1000steps")  # no periodic checkpoint to fall back on
    process = start_training(run)
    deadline = time.monotonic() + 300
    while not (Path(run.output_dir) / "metrics.jsonl").exists() or len(metric_steps(run)) < 3:
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()[0][-3000:]
        time.sleep(0.02)
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=120)
    assert process.returncode != 0 and "Preempted" in output and "checkpoint" in output

    (checkpoint,) = list_checkpoints(Path(run.output_dir) / "checkpoints")
    stopped_at = int(checkpoint.name.removeprefix("step-"))
    assert stopped_at == max(metric_steps(run)) >= 3  # the step in progress finished and was saved
    events = [json.loads(line) for line in open(Path(run.output_dir) / "events.jsonl")]
    assert events[-1]["event"] == "preempted" and events[-1]["signal"] == "SIGTERM"

    resumed = train(run)
    assert resumed.resumed_from_step == stopped_at
    assert_same_weights(resumed, uninterrupted)


def test_out_of_memory_halves_the_row_budget_and_keeps_the_global_batch(job, uninterrupted):
    """A device that cannot hold a row of more than 150 tokens: the run backs off from rows of four examples
    (~180 tokens) to two, and ends where the uninterrupted run (four examples a row) ends."""

    def small_device(model) -> None:
        def check(module, args, kwargs):
            if kwargs["input_ids"].numel() > 150:
                raise torch.OutOfMemoryError("CUDA out of memory (a 150-token device, simulated)")

        model.register_forward_pre_hook(check, with_kwargs=True)

    result = train(settings(job, "small-device"), on_model=small_device)
    assert result.out_of_memory_backoffs >= 1 and result.micro_batch_size <= 2
    lengths = TokenRows.load(job["train_path"]).lengths()
    assert result.train_tokens == 4 * int(lengths.sum())  # four epochs: every example trained once a epoch
    events = [json.loads(line) for line in open(Path(result.output_dir) / "events.jsonl")]
    assert events[0]["event"] == "out_of_memory" and events[0]["step"] == 1
    actual = load_file(Path(result.adapter_dir) / "adapter_model.safetensors")
    for name, value in uninterrupted.items():  # other rows, other summation order: float noise only
        torch.testing.assert_close(actual[name], value, rtol=1e-4, atol=1e-5, msg=name)
