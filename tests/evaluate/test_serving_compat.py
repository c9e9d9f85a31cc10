"""The vLLM multi-LoRA verdict on real PEFT adapters, saved by peft from tiny random models built here: one that
passes every rule, and one per rule that breaks that rule alone, named in the verdict with the offending value."""
import json
import warnings
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoModelForCausalLM

from helpers import make_tiny_model_dir
from phase1a.evaluate.serving import MAX_LORA_RANKS, ServingVerdict, check_vllm_adapter

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RULES = ["architecture", "target_modules", "vocab_size", "rank", "modules_to_save", "embeddings", "dora", "bias",
         "peft_features"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"))


def tiny_base(kind: str, target: Path) -> Path:
    """A tiny random Qwen2 or GPT-2: architectures whose LoRA modules differ from Llama's."""
    from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    else:
        model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=32, n_layer=1, n_head=2))
    model.save_pretrained(target)
    return target


def save_adapter(base_dir: Path, target: Path, resize: int = 0, peft_config=None, **lora) -> Path:
    """`lora` as LoraConfig's keywords (r=8 on every projection unless given); `resize` adds token rows first,
    saving the embeddings with the adapter as PEFT does for a resized vocabulary."""
    from peft import LoraConfig, get_peft_model

    model = AutoModelForCausalLM.from_pretrained(base_dir)
    if resize:
        model.resize_token_embeddings(model.config.vocab_size + resize, mean_resizing=False)
    config = peft_config or LoraConfig(**{"r": 8, "lora_alpha": 16, "target_modules": PROJECTIONS, **lora})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft's notes on saving embeddings
        get_peft_model(model, config).save_pretrained(target, save_embedding_layers=bool(resize) or "auto")
    return target


def base_config(base_dir: Path) -> dict:
    return json.loads((base_dir / "config.json").read_text())


def failed(verdict: ServingVerdict) -> list[str]:
    return [check.rule for check in verdict.checks if not check.passed]


@pytest.mark.parametrize("lora", [
    {},  # r=8 on every projection
    {"r": 16, "lora_alpha": 8, "use_rslora": True, "target_modules": ["q_proj", "v_proj", "embed_tokens", "lm_head"]},
], ids=["projections", "embeddings-and-rslora"])
def test_a_plain_lora_adapter_passes_every_rule(llama, tmp_path, lora):
    adapter = save_adapter(llama, tmp_path / "adapter", **lora)
    verdict = check_vllm_adapter(adapter, AutoConfig.from_pretrained(llama))  # a PretrainedConfig, or its dict
    assert verdict == check_vllm_adapter(adapter, base_config(llama))
    assert [check.rule for check in verdict.checks] == RULES and not failed(verdict), verdict.describe()
    assert verdict.compatible and verdict.describe() == "vLLM multi-LoRA: compatible"
    rank = lora.get("r", 8)
    assert verdict.max_lora_rank == rank and f"max_lora_rank={rank}" in verdict.checks[RULES.index("rank")].detail
    assert "LlamaForCausalLM" in verdict.checks[0].detail and "qkv_proj from q_proj/k_proj/v_proj" in \
        verdict.checks[1].detail


def test_the_rank_to_pass_is_the_smallest_vllm_choice_that_holds_it(llama, tmp_path):
    verdict = check_vllm_adapter(save_adapter(llama, tmp_path / "adapter", r=12), base_config(llama))
    assert verdict.compatible and verdict.max_lora_rank == 16 and 16 in MAX_LORA_RANKS
    assert "rank 12: start vLLM with max_lora_rank=16" in verdict.checks[RULES.index("rank")].detail


BROKEN = {  # rule -> (LoraConfig keywords, what the detail must name)
    "rank": ({"r": 1024, "lora_alpha": 16}, "rank 1024 is above vLLM's largest max_lora_rank 512"),
    "modules_to_save": ({"modules_to_save": ["lm_head"]}, "modules_to_save ['lm_head']"),
    "dora": ({"use_dora": True}, "use_dora True"),
    "bias": ({"bias": "lora_only"}, "bias 'lora_only'"),
    "lora_bias": ({"lora_bias": True}, "lora_bias True"),
    "rank_pattern": ({"rank_pattern": {"q_proj": 4}}, "rank_pattern {'q_proj': 4}"),
    "olora": ({"init_lora_weights": "olora"}, "init_lora_weights 'olora'"),
}
RULE_OF = {"lora_bias": "bias", "rank_pattern": "peft_features", "olora": "peft_features"}


@pytest.mark.parametrize("case", list(BROKEN))
def test_each_broken_rule_is_named_with_its_value(llama, tmp_path, case):
    lora, expected = BROKEN[case]
    verdict = check_vllm_adapter(save_adapter(llama, tmp_path / "adapter", **lora), base_config(llama))
    rule = RULE_OF.get(case, case)
    assert failed(verdict) == [rule] and not verdict.compatible and verdict.max_lora_rank is None
    detail = next(check.detail for check in verdict.checks if check.rule == rule)
    assert expected in detail, detail
    assert verdict.describe().startswith(f"vLLM multi-LoRA: incompatible: {rule}: ")


def test_resized_embeddings_are_named_with_their_rows(llama, tmp_path):
    vocab = base_config(llama)["vocab_size"]
    verdict = check_vllm_adapter(save_adapter(llama, tmp_path / "adapter", resize=8), base_config(llama))
    assert failed(verdict) == ["embeddings"]
    detail = verdict.checks[RULES.index("embeddings")].detail
    assert f"embed_tokens.weight ({vocab + 8} rows)" in detail and f"base vocabulary of {vocab}" in detail


def test_a_vocabulary_above_vllms_lora_limit(llama, tmp_path):
    """The limit is the base model's (vLLM wraps the logits whatever the adapter trains): the adapter is real, its
    base config names a Gemma-3-sized vocabulary."""
    gemma_sized = {**base_config(llama), "vocab_size": 262144}
    verdict = check_vllm_adapter(save_adapter(llama, tmp_path / "adapter"), gemma_sized)
    assert failed(verdict) == ["vocab_size"]
    assert "base vocabulary of 262144 tokens: vLLM's LoRA logits processor takes at most 258048" in \
        verdict.checks[RULES.index("vocab_size")].detail


def test_lora_on_a_module_the_architecture_does_not_serve(tmp_path):
    qwen2 = tiny_base("qwen2", tmp_path / "qwen2")  # vLLM's Qwen2 has no LoRA on its embeddings
    verdict = check_vllm_adapter(save_adapter(qwen2, tmp_path / "adapter", target_modules=["q_proj", "lm_head"]),
                                 base_config(qwen2))
    assert failed(verdict) == ["target_modules"]
    assert "adapter has LoRA on lm_head, unsupported; vLLM's Qwen2ForCausalLM accepts LoRA on q_proj" in \
        verdict.checks[1].detail


def test_an_architecture_without_known_lora_modules(tmp_path):
    gpt2 = tiny_base("gpt2", tmp_path / "gpt2")
    verdict = check_vllm_adapter(save_adapter(gpt2, tmp_path / "adapter", target_modules=["c_attn"]),
                                 base_config(gpt2))
    assert failed(verdict) == ["architecture"] and "target_modules" not in [c.rule for c in verdict.checks]
    assert "base architecture GPT2LMHeadModel is not one this check has" in verdict.checks[0].detail


def test_an_adapter_of_another_peft_type(llama, tmp_path):
    from peft import LoHaConfig

    adapter = save_adapter(llama, tmp_path / "adapter", peft_config=LoHaConfig(r=8, target_modules=["q_proj"]))
    verdict = check_vllm_adapter(adapter, base_config(llama))
    assert failed(verdict) == ["peft_type"] and "peft_type LOHA" in verdict.checks[0].detail


def test_a_full_fine_tune_is_a_verdict_not_a_crash(llama):
    verdict = check_vllm_adapter(llama, base_config(llama))  # model weights, no adapter_config.json
    assert not verdict.compatible and failed(verdict) == ["adapter"]
    assert "not an adapter: serve the merged model" in verdict.describe()


def test_a_pickled_adapter_is_read_as_vllm_reads_it(llama, tmp_path):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(llama), LoraConfig(r=8, target_modules=["q_proj"]))
    model.save_pretrained(tmp_path / "adapter", safe_serialization=False)  # adapter_model.bin
    assert (tmp_path / "adapter" / "adapter_model.bin").is_file()
    verdict = check_vllm_adapter(tmp_path / "adapter", base_config(llama))
    assert verdict.compatible and "adapter has LoRA on q_proj;" in verdict.checks[1].detail
