"""A resume computes with its checkpoint's knobs: a host whose plan picks another micro-batch (another GPU, another
calibration) still ends with the weights of an uninterrupted run, tensor for tensor, and says what it took."""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import date_records, make_tokenizer, write_jsonl
from phase1a.config.schema import MethodConfig
from phase1a.core import layout
from phase1a.core.layout import ARITHMETIC, list_checkpoints
from phase1a.data.tokenizing import TokenizeOptions, tokenize_dataset
from phase1a.train.loop import train
from phase1a.train.settings import TrainSettings


@pytest.fixture(scope="module")
def train_path(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("knobs-data")
    data = write_jsonl(root / "d.jsonl", date_records(48))
    return tokenize_dataset(data, make_tokenizer(), 256, TokenizeOptions(), root / "cache" / "fp").train_path


def settings(tiny_model_dir, train_path, output_dir: Path, micro_batch_size: int) -> TrainSettings:
    # LoRA dropout on: which rows the examples share decides the masks they draw, so the micro-batch shows plainly
    method = MethodConfig(learning_rate=5e-3, batch_size=8, epochs=1, lora={"r": 4, "alpha": 8, "dropout": 0.1})
    return TrainSettings(model_dir=str(tiny_model_dir), train_path=train_path, output_dir=str(output_dir),
                         method=method, micro_batch_size=micro_batch_size, gradient_checkpointing=False,
                         checkpoint_interval="3steps", keep_last=2, show_progress=False)


def weights(result) -> dict[str, torch.Tensor]:
    return load_file(Path(result.adapter_dir) / "adapter_model.safetensors")


def interrupted_at_its_checkpoint(whole: Path, target: Path, keep_knobs: bool = True) -> Path:
    """The run as a host left it when it stopped after its first checkpoint: that checkpoint, the curve up to it."""
    checkpoint = list_checkpoints(whole / "checkpoints")[0]
    shutil.copytree(checkpoint, target / "checkpoints" / checkpoint.name)
    if not keep_knobs:  # as a checkpoint written before the knobs were kept
        (target / "checkpoints" / checkpoint.name / ARITHMETIC).unlink()
    step = int(checkpoint.name.removeprefix("step-"))
    lines = (whole / layout.METRICS).read_text().splitlines()[:step]
    (target / layout.METRICS).write_text("\n".join(lines) + "\n")
    return target


@pytest.mark.slow  # 60 s on two busy cores: three trainings of the tiny model
def test_a_resume_under_another_plans_micro_batch_ends_with_the_uninterrupted_runs_weights(
        tiny_model_dir, train_path, tmp_path, caplog):
    whole = train(settings(tiny_model_dir, train_path, tmp_path / "whole", micro_batch_size=4))
    assert whole.steps > 3 and json.loads((list_checkpoints(tmp_path / "whole" / "checkpoints")[0] / ARITHMETIC)
                                          .read_text()) == {"micro_batch_size": 4, "compile": False, "device": "cpu"}

    # Another host, whose plan says two examples a row, resumes the run from step 3.
    resumed_dir = interrupted_at_its_checkpoint(tmp_path / "whole", tmp_path / "resumed")
    with caplog.at_level(logging.WARNING, logger="phase1a"):
        resumed = train(settings(tiny_model_dir, train_path, resumed_dir, micro_batch_size=2))
    assert resumed.resumed_from_step == 3 and resumed.micro_batch_size == 4
    assert resumed.arithmetic_from_checkpoint == {"micro_batch_size": 4}
    expected, actual = weights(whole), weights(resumed)
    assert expected.keys() == actual.keys() and all(torch.equal(actual[name], expected[name]) for name in expected)
    events = [json.loads(line) for line in (resumed_dir / layout.EVENTS).read_text().splitlines()]
    assert [e["arithmetic_from_checkpoint"] for e in events if e["event"] == "resumed"] == [{"micro_batch_size": 4}]
    assert "micro_batch_size 4 (the plan: 2)" in caplog.text

    # What it would have been: a checkpoint that kept no knobs resumes at the plan's two a row, and ends elsewhere.
    older = interrupted_at_its_checkpoint(tmp_path / "whole", tmp_path / "older", keep_knobs=False)
    replanned = train(settings(tiny_model_dir, train_path, older, micro_batch_size=2))
    assert replanned.resumed_from_step == 3 and replanned.arithmetic_from_checkpoint == {}
    assert not all(torch.equal(weights(replanned)[name], expected[name]) for name in expected)
