import pytest
import torch

from phase1a.config import Phase1aConfig
from phase1a.window import WindowError
from tasks.plan import (
    ModelFacts, choose_micro_batch, flops_per_token, lora_parameters, make_plan, memory_estimate, model_facts,
)
from tasks.tokenize import TokenizeOptions, tokenize_dataset
from conftest import date_records, make_tokenizer, write_jsonl

GIB = 1024**3
FACTS_8B = ModelFacts(parameters=8_030_000_000, layers=32, hidden=4096, intermediate=14336, vocab=128256,
                      max_positions=8192, kv_width=1024)


def test_model_facts_count_parameters_without_weights(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    facts = model_facts(tiny_model_dir)
    assert facts.parameters == sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_model_dir).parameters())
    assert (facts.layers, facts.hidden, facts.max_positions, facts.kv_width) == (2, 64, 256, 32)


def test_memory_model_matches_the_textbook_numbers():
    lora = memory_estimate(FACTS_8B, 20_000_000, False, 2, 4096, False, 80 * GIB)
    assert lora.weights_gib == pytest.approx(8.03e9 * 2 / GIB)
    full = memory_estimate(FACTS_8B, FACTS_8B.parameters, True, 2, 4096, False, 80 * GIB)
    assert full.weights_gib + full.trainable_gib == pytest.approx(8.03e9 * 16 / GIB)  # mixed-precision Adam
    checkpointed = memory_estimate(FACTS_8B, 20_000_000, False, 2, 4096, True, 80 * GIB)
    assert checkpointed.activations_gib < lora.activations_gib / 10


def test_micro_batch_choice_prefers_no_checkpointing_then_falls_back():
    micro, checkpointing, estimate = choose_micro_batch(FACTS_8B, 20_000_000, False, 2, 16, 1024, 80 * GIB)
    assert 16 % micro == 0 and not checkpointing and estimate.total_gib <= 80
    bigger = memory_estimate(FACTS_8B, 20_000_000, False, 2, 2 * micro * 1024, False, 80 * GIB)
    assert micro == 16 or bigger.total_gib > 80  # the largest divisor that fits
    micro, checkpointing, _ = choose_micro_batch(FACTS_8B, 20_000_000, False, 2, 16, 4096, 24 * GIB)
    assert checkpointing
    with pytest.raises(MemoryError, match="does not fit"):
        choose_micro_batch(FACTS_8B, FACTS_8B.parameters, True, 2, 16, 8192, 24 * GIB)


def test_lora_parameter_count_matches_peft(tiny_model_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    config = Phase1aConfig.model_validate({"data": {"source": "x"}, "method": {"lora": {"r": 4}}})
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                           LoraConfig(r=4, target_modules=config.method.lora.target_modules))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert lora_parameters(model_facts(tiny_model_dir), config) == trainable


def test_flops_per_token():
    n = FACTS_8B.parameters
    assert flops_per_token(FACTS_8B, False, False, 0) == 4 * n
    assert flops_per_token(FACTS_8B, True, True, 0) == 8 * n


def test_plan_calibrates_on_the_present_cpu_and_fits_the_window(tiny_model_dir, tmp_path, config_tree):
    data = tokenize_dataset(write_jsonl(tmp_path / "d.jsonl", date_records(40)), make_tokenizer(), 256,
                            TokenizeOptions(), tmp_path / "cache", "fp")
    config_tree["window"] = {"max_duration": "1h", "safety_margin": "30m"}
    plan = make_plan(Phase1aConfig.model_validate(config_tree), tiny_model_dir, data)
    assert plan.calibrated and plan.precision == "float32" and plan.notes == []
    assert plan.micro_batch_size * plan.gradient_accumulation == 8
    assert plan.steps == -(-data.train_examples // 8) and plan.train_tokens > 0 and plan.estimated_train_seconds > 0
    assert plan.fits_in_window is True and plan.estimated_cost_usd is None  # no price is known for a CPU

    config_tree["hardware"] = {"target": "h100"}
    config_tree["window"] = {"max_duration": "40m", "safety_margin": "30m"}
    remote = make_plan(Phase1aConfig.model_validate(config_tree), tiny_model_dir, data)
    assert not remote.calibrated and remote.precision == "bfloat16" and any("not present" in n for n in remote.notes)
    assert remote.estimated_cost_usd == pytest.approx(2.50 * remote.estimated_total_seconds / 3600)
    assert remote.fits_in_window is True and remote.throughput_source == "assumed"
    assert [row.label for row in remote.options][:2] == ["1x H100", "1x H200"] and remote.options[0].fits
    assert remote.options[0].hours * 3600 == pytest.approx(remote.estimated_total_seconds, rel=1e-6)

    # A run recorded on the target hardware replaces the assumption for the next plan of the same model.
    from phase1a.history import RunRecord, append_run

    history = tmp_path / "history.jsonl"
    append_run(history, RunRecord(model_fingerprint="fp-model", model_name="tiny", hardware="h100", device_name="H100",
                                  precision="bfloat16", micro_batch_size=remote.micro_batch_size,
                                  gradient_checkpointing=remote.gradient_checkpointing, max_seq_length=64,
                                  tokens_per_second=12345.0, estimated_train_seconds=1.0, actual_train_seconds=1.1))
    learned = make_plan(Phase1aConfig.model_validate(config_tree), tiny_model_dir, data, "fp-model", history)
    assert learned.throughput_source == "history" and learned.tokens_per_second == pytest.approx(12345.0)

    config_tree["window"] = {"max_duration": "30m", "safety_margin": "30m"}
    with pytest.raises(WindowError, match="nothing fits the time window"):
        make_plan(Phase1aConfig.model_validate(config_tree), tiny_model_dir, data)

    config_tree["window"] = {}
    config_tree["plan"] = {"profile": "memory_efficient"}
    lean = make_plan(Phase1aConfig.model_validate(config_tree), tiny_model_dir, data)
    assert (lean.micro_batch_size, lean.gradient_checkpointing, lean.gradient_accumulation) == (1, True, 8)
    config_tree["plan"] = {"profile": "custom", "micro_batch_size": 3, "gradient_checkpointing": False}
    with pytest.raises(ValueError, match="must divide method.batch_size 8"):
        make_plan(Phase1aConfig.model_validate(config_tree), tiny_model_dir, data)
