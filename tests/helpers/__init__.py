"""What the tests build for themselves, never fetched: a BPE tokenizer trained here, a tiny Llama, chat datasets.

Fixtures live in conftest.py; everything a test imports lives here (`from helpers import ...`), and in
helpers.servers (moto, ports), helpers.hub_cache (a Hugging Face cache laid out by hand),
helpers.prefect_stack (a real Prefect server and workers), helpers.postgres (a throwaway PostgreSQL server)
and helpers.metadata (a fake AWS and GCE instance metadata service).
"""
from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pyarrow as pa

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
WORDS = "the a date rewrite write in us format long form european answer with only month day year".split()


def _facts_8b():
    from phase1a.model.cost_model import ModelFacts

    return ModelFacts(parameters=8_030_000_000, layers=32, hidden=4096, intermediate=14336, vocab=128256,
                      max_positions=8192, heads=32, kv_heads=8, head_dim=128)


FACTS_8B = _facts_8b()  # Llama-3-8B's shape: the memory model's textbook case


def peak_tensor_bytes(fn) -> int:
    """The most tensor memory alive at once while `fn` runs: the profiler's allocation and free events in time
    order (each event's own bytes, so an allocation inside a custom autograd function counts where it happens)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [event for event in prof.profiler.kineto_results.events() if event.name() == "[memory]"]
    live = peak = 0
    for event in sorted(events, key=lambda event: event.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak


def whole_logits_loss(model, batch):
    """The loss before phase1a/model/chunked_loss.py, the reference it is measured against: the row's whole logits from
    the model's own forward, upcast, then cross_entropy."""
    import torch

    from phase1a.core.labels import IGNORE_INDEX

    logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
    logits = logits[:, :-1].float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), batch.labels[:, 1:].reshape(-1),
                                             ignore_index=IGNORE_INDEX, reduction="sum")


def without_session_server(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (by default this process's) for a command that starts its own temporary Prefect server, as a machine
    without a server does: the session's server (tests/conftest.py) left out."""
    return {key: value for key, value in (env if env is not None else os.environ).items() if key != "PREFECT_API_URL"}


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


def read_arrow(path: str | Path) -> pa.Table:
    """A tokenized split (its view, cut to max_length), or a plain Arrow file, as one table."""
    from phase1a.data.tokenized import read_mapped, split_table

    return split_table(path) if str(path).endswith(".json") else read_mapped(path)


# The stages a flow run checks every time, never from Prefect's cache: the model and where training starts.
PREPARED = {"model": "Completed", "start": "Completed"}


def resolved(config):
    """The run's model as the flow prepares it (a local directory: nothing is downloaded)."""
    from phase1a.model.loading import prepare_model

    return prepare_model(config)


def _not_on_a_gpu_host() -> tuple[str, ...]:
    """The modules of the project's dependencies that a GPU host's stock PyTorch image lacks and the GPU check does
    not carry as wheels (benchmarks/gpu_check.py: ON_THE_HOST, the carried groups), with what the tests bring.
    Derived from pyproject.toml, so a new dependency the GPU parts import fails the dry run here, not there."""
    import re
    import sys
    import tomllib

    root = Path(__file__).resolve().parents[2]
    if str(root / "benchmarks") not in sys.path:
        sys.path.insert(0, str(root / "benchmarks"))
    import gpu_check

    dependencies = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[\[<>=!~; ]", spec, maxsplit=1)[0].lower() for spec in dependencies}
    there = {*gpu_check.ON_THE_HOST, *gpu_check.FROM_LOCK, *gpu_check.LOCKED, *gpu_check.LOCKED_DEPENDENCIES,
             *gpu_check.OPTIONAL}
    return tuple(sorted({name.replace("-", "_") for name in names - there} | {"moto"}))


_HIDING = '''"""Installed by the tests: the packages a bare GPU host lacks cannot be found, as there."""
import importlib.machinery
import sys

HIDDEN = {hidden!r}


class _Hidden(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            return None
        return super().find_spec(name, path, target)


sys.meta_path[sys.meta_path.index(importlib.machinery.PathFinder)] = _Hidden
'''


def bare_gpu_host_env(directory: Path) -> dict[str, str]:
    """The environment of a process that sees only what a bare GPU host has: a sitecustomize on PYTHONPATH hides
    what it lacks (`_not_on_a_gpu_host`) from every import (and from `importlib.util.find_spec`, which libraries
    probe)."""
    import os

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(_HIDING.format(hidden=set(_not_on_a_gpu_host())))
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(directory), os.environ.get("PYTHONPATH", "")])}
