import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import date_records, make_tokenizer, write_jsonl
from phase1a.config.schema import MethodConfig
from phase1a.core.layout import list_checkpoints
from phase1a.data.tokenizing import TokenizeOptions, tokenize_dataset
from phase1a.train.loop import train
from phase1a.train.packing import TokenRows
from phase1a.train.settings import TrainSettings


@pytest.fixture(scope="module")
def train_path(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("train-data")
    data = write_jsonl(root / "d.jsonl", date_records(48))
    return tokenize_dataset(data, make_tokenizer(), 256, TokenizeOptions(), root / "cache" / "fp").train_path


def settings(tiny_model_dir, train_path, output_dir: Path, **overrides) -> TrainSettings:
    values = dict(
        model_dir=str(tiny_model_dir), train_path=train_path, output_dir=str(output_dir),
        method=MethodConfig(learning_rate=5e-3, batch_size=8, epochs=2, lora={"r": 4, "alpha": 8}),
        micro_batch_size=4, gradient_checkpointing=False,
        checkpoint_interval="3steps", keep_last=2, show_progress=False,
    )
    values.update(overrides)
    return TrainSettings(**values)


def adapter_weights(result_dir: str) -> dict[str, torch.Tensor]:
    return load_file(Path(result_dir) / "adapter_model.safetensors")


def test_trains_saves_peft_adapter_and_sparse_checkpoints(tiny_model_dir, train_path, tmp_path):
    result = train(settings(tiny_model_dir, train_path, tmp_path / "run"))
    steps = -(-len(TokenRows.load(train_path)) * 2 // 8)  # two epochs, eight examples a step
    assert 10 <= result.steps == steps <= 12 and result.train_tokens > 0 and result.tokens_per_second > 0
    losses = [json.loads(line)["loss"] for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert len(losses) == steps and sum(losses[-3:]) < sum(losses[:3])
    assert result.checkpoints_written == 3  # steps 3, 6, 9; the final save is not a checkpoint
    assert [p.name for p in list_checkpoints(tmp_path / "run" / "checkpoints")] == ["step-00000006", "step-00000009"]

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert isinstance(PeftModel.from_pretrained(base, result.adapter_dir), PeftModel)

    again = train(settings(tiny_model_dir, train_path, tmp_path / "run"))
    assert again.reused_completed_run and again.adapter_dir == result.adapter_dir


def test_a_checkpoint_every_half_epoch(tiny_model_dir, train_path, tmp_path):
    """`0.5ep`: the same arithmetic the plan counts with (phase1a/core/units.py), in epochs of this data."""
    examples = len(TokenRows.load(train_path))
    result = train(settings(tiny_model_dir, train_path, tmp_path / "run", checkpoint_interval="0.5ep", keep_last=9))
    steps_per_half_epoch = -(-examples // 2 // 8)  # the first whole step at or past half an epoch of examples
    saved = [int(p.name.removeprefix("step-")) for p in list_checkpoints(tmp_path / "run" / "checkpoints")]
    assert saved and saved[0] == steps_per_half_epoch and all(step < result.steps for step in saved)
    assert len(saved) == result.checkpoints_written == 3  # two epochs: at 0.5, 1 and 1.5; the end is the final save


def test_resume_from_checkpoint_matches_an_uninterrupted_run(tiny_model_dir, train_path, tmp_path):
    whole = train(settings(tiny_model_dir, train_path, tmp_path / "whole"))
    interrupted = tmp_path / "interrupted"
    train(settings(tiny_model_dir, train_path, interrupted))
    # Simulate a crash after step 6: the final adapter and the later checkpoint never got written.
    shutil.rmtree(interrupted / "final")
    shutil.rmtree(interrupted / "checkpoints" / "step-00000009")
    lines = open(interrupted / "metrics.jsonl").read().splitlines()[:6]
    (interrupted / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (interrupted / "checkpoints" / ".step-00000009.partial-1").mkdir()  # a half-written one is ignored

    resumed = train(settings(tiny_model_dir, train_path, interrupted))
    assert resumed.resumed_from_step == 6
    expected, actual = adapter_weights(whole.adapter_dir), adapter_weights(resumed.adapter_dir)
    assert expected.keys() == actual.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=0, atol=1e-6)
    steps = [json.loads(line)["step"] for line in open(interrupted / "metrics.jsonl")]
    assert steps == list(range(1, whole.steps + 1))  # a continuous loss curve


def test_accumulation_gives_the_same_update_as_one_big_batch(tiny_model_dir, train_path, tmp_path):
    one = train(settings(tiny_model_dir, train_path, tmp_path / "one", micro_batch_size=8,
                         method=MethodConfig(learning_rate=5e-3, batch_size=8, epochs=0.5, lora={"r": 4, "alpha": 8})))
    four = train(settings(tiny_model_dir, train_path, tmp_path / "four", micro_batch_size=2,
                          method=MethodConfig(learning_rate=5e-3, batch_size=8, epochs=0.5, lora={"r": 4, "alpha": 8})))
    a, b = adapter_weights(one.adapter_dir), adapter_weights(four.adapter_dir)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5)
