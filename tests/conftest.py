"""Shared fixtures: a tiny Llama and a BPE tokenizer trained here (never a hub), isolated Prefect and HF homes."""
from __future__ import annotations

import json
import os
import random
import tempfile
from pathlib import Path

import pytest

# Isolate every cache before Prefect or transformers are imported by any test module.
_HOME = Path(tempfile.mkdtemp(prefix="phase1a-tests-"))
os.environ["PREFECT_HOME"] = str(_HOME / "prefect")
os.environ["HF_HOME"] = str(_HOME / "hf")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = "180"  # a fresh database migrates slowly on 2 cores
os.environ.pop("PREFECT_API_URL", None)

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
WORDS = "the a date rewrite write in us format long form european answer with only month day year".split()


def make_tokenizer(chat_template: str | None = CHATML):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    rng = random.Random(0)
    corpus = [" ".join(rng.choice(WORDS) for _ in range(12)) + f" {rng.randint(0, 9999)}-{rng.randint(1, 12):02d}"
              for _ in range(500)]
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>",
                                   unk_token="<unk>", pad_token="</s>")
    if chat_template:
        fast.chat_template = chat_template
    return fast


def make_tiny_model_dir(target: Path, chat_template: str | None = CHATML, seed: int = 0, **shape) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = make_tokenizer(chat_template)
    torch.manual_seed(seed)
    sizes = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, **shape}
    config = LlamaConfig(vocab_size=len(tokenizer), **sizes,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def date_records(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        y, m, d = rng.randint(1950, 2049), rng.randint(1, 12), rng.randint(1, 28)
        out.append({"messages": [
            {"role": "system", "content": "Rewrite dates."},
            {"role": "user", "content": f"Write {y}-{m:02d}-{d:02d} in US format."},
            {"role": "assistant", "content": f"{m:02d}/{d:02d}/{y}"},
        ]})
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def dataset(tmp_path) -> Path:
    return write_jsonl(tmp_path / "dates.jsonl", date_records(64))


@pytest.fixture
def config_tree(tmp_path, tiny_model_dir, dataset) -> dict:
    """A complete config for the tiny model; tests override what they exercise."""
    return {
        "name": "tiny",
        "work_dir": str(tmp_path / "runs"),
        "cache_dir": str(tmp_path / "cache"),
        "data": {"source": str(dataset), "staging_dir": str(tmp_path / "staging"), "validation_fraction": 0.2},
        "model": {"name_or_path": str(tiny_model_dir)},
        "method": {"learning_rate": 5e-3, "batch_size": 8, "epochs": 1, "lora": {"r": 4, "alpha": 8}},
        "hardware": {"target": "cpu", "calibration_steps": 1},
        "checkpoint": {"interval": "3steps", "keep_last": 2},
        "validation": {"max_examples": 16, "tolerances": {"loss": 0.05}},
    }
