import pytest

from phase1a.config import MethodConfig, ValidationConfig
from tasks.tokenize import TokenizeOptions, tokenize_dataset
from tasks.train import TrainSettings, train
from tasks.validate import Metrics, format_table, gate, validate
from conftest import date_records, make_tokenizer, write_jsonl


def metrics(loss: float, accuracy: float) -> Metrics:
    return Metrics(examples=10, tokens=100, loss=loss, perplexity=2.0, token_accuracy=accuracy)


def test_gate_passes_within_tolerance_and_names_each_failure():
    settings = ValidationConfig(loss_tolerance=0.02, accuracy_tolerance=0.01)
    assert gate(metrics(1.0, 0.5), metrics(1.02, 0.49), settings) == []
    reasons = gate(metrics(1.0, 0.5), metrics(1.03, 0.48), settings)
    assert len(reasons) == 2 and "eval loss 1.0300 > base 1.0000" in reasons[0] and "token accuracy" in reasons[1]


def test_trained_adapter_beats_the_base_on_held_out_data(tiny_model_dir, tmp_path):
    data = tokenize_dataset(write_jsonl(tmp_path / "d.jsonl", date_records(80)), make_tokenizer(), 256,
                            TokenizeOptions(validation_fraction=0.2), tmp_path / "cache", "fp")
    result = train(TrainSettings(
        model_dir=str(tiny_model_dir), train_path=data.train_path, output_dir=str(tmp_path / "run"),
        method=MethodConfig(learning_rate=1e-2, batch_size=8, epochs=3, lora={"r": 8, "alpha": 16}),
        micro_batch_size=8, gradient_checkpointing=False, show_progress=False,
    ))
    verdict = validate(tiny_model_dir, result.adapter_dir, data.validation_path, ValidationConfig(max_examples=8))
    assert verdict.base.examples == verdict.trained.examples == 8
    assert verdict.trained.loss < verdict.base.loss and verdict.passed
    table = format_table(verdict)
    assert "token_accuracy" in table and "gate: PASS" in table

    strict = validate(tiny_model_dir, result.adapter_dir, data.validation_path, ValidationConfig(max_examples=8))
    assert strict.base == verdict.base  # same examples, same batches: deterministic
