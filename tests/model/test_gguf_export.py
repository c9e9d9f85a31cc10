"""GGUF export (phase1a/model/gguf.py): each file read back with transformers' own GGUF loader gives the logits of
the safetensors model it came from, and its tokenizer the same ids and chat template; what is not covered is
refused before a file is started, and a failed write leaves nothing under the final name.

Tolerance: the largest |logit difference| over the batch's real tokens, relative to the largest |logit|.
Measured (2026-11-26, CPU): f16 at most 0.0035 on the tiny models (max abs 0.023) and 0.0010 on the demo model
(max abs 0.042); q8_0 at most 0.087 on the tiny models (max abs 0.62) and 0.036 on the demo model (max abs 1.51,
the same top-1 token at 94.7% of positions). The bounds below are about 3x and 2.3x the worst measured; a Q/K
rope-order mistake measures 1.2 and more on the tiny models (initialised large enough for peaked attention).
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import gguf
import pytest
import torch

from helpers import make_tokenizer
from phase1a.model import gguf as export
from phase1a.model.gguf import GGUF_TYPES, GGUFExportError, write_gguf

TOLERANCE = {"f16": 0.01, "q8_0": 0.2}
TEXTS = ["Write 2024-05-01 in US format.", "  two  spaces\n\nand a new line", "café, naïve, 北京 🙂", "12345 + 678"]
CHAT = [{"role": "system", "content": "Rewrite dates."}, {"role": "user", "content": "Write 1999-12-31 as US."},
        {"role": "assistant", "content": "12/31/1999"}]


def tiny_model(target: Path, architecture: str = "llama", tie: bool = True, **config) -> Path:
    """A random 3-layer model with grouped-query attention (4 query heads, 2 key-value heads) and the tests'
    byte-level BPE tokenizer with a ChatML template. initializer_range 0.2, not 0.02: attention is peaked, so a
    wrong rope order moves the logits instead of averaging out."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_class, model_class = {"llama": (LlamaConfig, LlamaForCausalLM),
                                 "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[architecture]
    tokenizer = make_tokenizer()
    torch.manual_seed(0)
    settings = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                    initializer_range=0.2, tie_word_embeddings=tie, bos_token_id=tokenizer.bos_token_id,
                    eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = model_class(config_class(**{**settings, **config}))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(".bias"):  # Qwen2's q/k/v biases start at zero: random, so they count
                parameter.normal_(0, 0.2)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


def logits(model_dir: Path, batch: dict, gguf_file: str | None = None) -> torch.Tensor:
    """The model's logits on the batch: from its safetensors, or from one of its GGUF files (transformers' loader)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=gguf_file, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(**batch).logits


def logit_errors(want: torch.Tensor, gguf_path: Path, batch: dict) -> tuple[float, float, float]:
    """(max abs difference, relative to max |logit|, top-1 agreement) over the batch's real tokens."""
    got = logits(gguf_path.parent, batch, gguf_path.name)
    real = batch["attention_mask"].bool()
    largest = (got - want).abs()[real].max().item()
    agree = (got.argmax(-1) == want.argmax(-1))[real].float().mean().item()
    return largest, largest / want.abs()[real].max().item(), agree


def fixed_batch(tokenizer) -> dict:
    chat = tokenizer.apply_chat_template(CHAT, tokenize=False)
    return dict(tokenizer([chat, *TEXTS], return_tensors="pt", padding=True))


def assert_same_tokenizer(tokenizer, gguf_path: Path) -> None:
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    for text in [*TEXTS, tokenizer.apply_chat_template(CHAT, tokenize=False)]:
        assert loaded(text)["input_ids"] == tokenizer(text)["input_ids"], text
    assert loaded.chat_template == tokenizer.chat_template


def fields(path: Path) -> tuple[dict, dict]:
    """(metadata key -> value, tensor name -> (type name, shape)) of a GGUF file."""
    reader = gguf.GGUFReader(path)
    values = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    return values, {t.name: (t.tensor_type.name, tuple(int(n) for n in t.shape)) for t in reader.tensors}


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_tiny_model_round_trips(tmp_path, architecture, tie):
    from transformers import AutoTokenizer

    model_dir = tiny_model(tmp_path / f"tiny-{architecture}", architecture, tie)
    paths = write_gguf(model_dir, tmp_path / "gguf")
    assert paths == [tmp_path / "gguf" / f"tiny-{architecture}-{kind}.gguf" for kind in GGUF_TYPES]
    assert sorted(p.name for p in (tmp_path / "gguf").iterdir()) == sorted(p.name for p in paths)  # no scratch left
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    batch = fixed_batch(tokenizer)
    want = logits(model_dir, batch)
    for kind, path in zip(GGUF_TYPES, paths):
        largest, relative, _ = logit_errors(want, path, batch)
        print(f"{architecture} tied={tie} {kind}: max abs {largest:.4g}, relative {relative:.4g}")
        assert relative < TOLERANCE[kind], (kind, largest, relative)
        assert ("output.weight" in fields(path)[1]) is not tie  # a tied head is the embedding, as llama.cpp reads it
        assert_same_tokenizer(tokenizer, path)


def test_metadata_and_tensor_types_follow_llama_cpp(tmp_path):
    """The keys convert_hf_to_gguf.py writes, Q and K in llama.cpp's rope order, 1-D tensors kept in F32."""
    model_dir = tiny_model(tmp_path / "tiny", tie=False)
    f16, q8_0 = write_gguf(model_dir, tmp_path / "gguf")
    values, tensors = fields(q8_0)
    assert {key: values[key] for key in (
        "general.architecture", "general.name", "general.file_type", "llama.context_length", "llama.block_count",
        "llama.embedding_length", "llama.feed_forward_length", "llama.attention.head_count",
        "llama.attention.head_count_kv", "llama.rope.dimension_count", "llama.vocab_size", "tokenizer.ggml.model",
        "tokenizer.ggml.pre", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id", "tokenizer.ggml.add_bos_token",
    )} == {"general.architecture": "llama", "general.name": "tiny", "general.file_type": 7,
           "llama.context_length": 256, "llama.block_count": 3, "llama.embedding_length": 64,
           "llama.feed_forward_length": 128, "llama.attention.head_count": 4, "llama.attention.head_count_kv": 2,
           "llama.rope.dimension_count": 16, "llama.vocab_size": 400, "tokenizer.ggml.model": "gpt2",
           "tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 4,
           "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.padding_token_id": 2,
           "tokenizer.ggml.add_bos_token": False}
    assert values["llama.rope.freq_base"] == pytest.approx(10000.0)
    assert values["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)
    assert len(values["tokenizer.ggml.tokens"]) == len(values["tokenizer.ggml.token_type"]) == 400
    assert values["tokenizer.ggml.merges"] and values["tokenizer.chat_template"]
    assert tensors["blk.0.attn_norm.weight"] == ("F32", (64,)) and tensors["output_norm.weight"][0] == "F32"
    assert tensors["blk.0.attn_k.weight"] == ("Q8_0", (64, 32)) and tensors["token_embd.weight"][0] == "Q8_0"
    assert fields(f16)[1]["blk.0.ffn_down.weight"] == ("F16", (128, 64)) and fields(f16)[0]["general.file_type"] == 1

    from safetensors.torch import load_file  # the rope reorder, checked on the tensor itself

    hf_q = load_file(model_dir / "model.safetensors")["model.layers.0.self_attn.q_proj.weight"]
    written = next(t for t in gguf.GGUFReader(f16).tensors if t.name == "blk.0.attn_q.weight")
    head = torch.from_numpy(written.data[:16].astype("float32"))  # head 0: rows x0, y0, x1, y1, ...
    assert torch.allclose(head[0::2], hf_q[:8], atol=1e-3) and torch.allclose(head[1::2], hf_q[8:16], atol=1e-3)


def test_llama3_rope_is_written_as_llama_cpp_frequency_factors(tmp_path):
    """Llama 3.1+ scales its rope frequencies; llama.cpp divides each by rope_freqs.weight. transformers' GGUF loader
    ignores that tensor, so it is checked against transformers' own frequencies instead of through logits."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # head_dim 16: all three bands
    model_dir = tiny_model(tmp_path / "tiny", rope_parameters=rope, max_position_embeddings=32768)
    (path,) = write_gguf(model_dir, tmp_path / "gguf", types=["f16"])
    reader = gguf.GGUFReader(path)
    factors = torch.from_numpy(next(t for t in reader.tensors if t.name == "rope_freqs.weight").data.copy())
    config = AutoConfig.from_pretrained(model_dir)
    plain, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config)
    assert torch.allclose(factors, plain / scaled, rtol=1e-5)
    assert factors.min() == 1.0 and factors.max() == 8.0 and len(set(factors.tolist())) == 3


@pytest.fixture
def cached_tensor_name_map(monkeypatch):
    """transformers' GGUF loader rebuilds gguf-py's tensor-name map for every module of the model (about 400 for
    the demo model, 20 s on two cores); the map depends on the architecture and depth only."""
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))


@pytest.mark.slow
def test_demo_model_round_trips(tmp_path, cached_tensor_name_map):
    """SmolLM2-135M-Instruct, the built-in demo model (converted once to safetensors by phase1a.model.loading)."""
    from transformers import AutoTokenizer

    from phase1a.config.schema import ModelConfig
    from phase1a.model.loading import resolve_model

    torch.set_num_threads(2)
    model_dir = resolve_model(ModelConfig(name_or_path="smollm2-135m-instruct"))
    paths = write_gguf(model_dir, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    batch = fixed_batch(tokenizer)
    want = logits(model_dir, batch)
    for kind, path in zip(GGUF_TYPES, paths):
        largest, relative, agree = logit_errors(want, path, batch)
        print(f"demo {kind}: max abs {largest:.4g}, relative {relative:.4g}, top-1 agreement {agree:.3f}")
        assert relative < TOLERANCE[kind] and agree >= {"f16": 0.99, "q8_0": 0.9}[kind], (kind, relative, agree)
    assert_same_tokenizer(tokenizer, paths[-1])  # one file: both carry the same vocabulary (the tiny tests load both)
    assert paths[-1].stat().st_size < 0.55 * paths[0].stat().st_size  # q8_0: 8.5 bits a weight against 16


def gpt2_model(target: Path) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = make_tokenizer()
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2,
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    GPT2LMHeadModel(config).save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


def with_sentencepiece_tokenizer(target: Path) -> Path:
    """A Llama 2/Mistral-style tokenizer.json: BPE with byte fallback after a Metaspace pre-tokenizer."""
    spec = json.loads((target / "tokenizer.json").read_text())
    spec["model"]["byte_fallback"] = True
    spec["pre_tokenizer"] = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": False}
    (target / "tokenizer.json").write_text(json.dumps(spec))
    return target


REFUSALS = {
    "another architecture": (gpt2_model, r"covers LlamaForCausalLM, Qwen2ForCausalLM; .* is 'GPT2LMHeadModel'"),
    "a sentencepiece tokenizer": (lambda d: with_sentencepiece_tokenizer(tiny_model(d)),
                                  "covers byte-level BPE .* tokenizer is sentencepiece-style BPE"),
    "linear rope scaling": (lambda d: tiny_model(d, rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                     "rope_theta": 10000.0}),
                            "covers rope default and llama3; this model's rope is 'linear'"),
    "a sliding window": (lambda d: tiny_model(d, "qwen2", use_sliding_window=True, sliding_window=64),
                         "does not cover sliding-window attention"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_what_is_not_covered_is_refused_before_writing(tmp_path, case):
    make, message = REFUSALS[case]
    model_dir = make(tmp_path / "model")
    with pytest.raises(GGUFExportError, match=message):
        write_gguf(model_dir, tmp_path / "gguf")
    assert not (tmp_path / "gguf").exists()


def test_an_unknown_type_is_refused(tmp_path):
    with pytest.raises(GGUFExportError, match="q4_k.*choose among f16, q8_0"):
        write_gguf(tiny_model(tmp_path / "tiny"), tmp_path / "gguf", types=["f16", "q4_k"])
    assert not (tmp_path / "gguf").exists()


def test_a_failed_write_leaves_no_file(tmp_path, monkeypatch):
    """A crash halfway through the tensors: no file under the final name, and no scratch file left either."""
    model_dir = tiny_model(tmp_path / "tiny")

    def crash(weights, heads):
        raise OSError("disk full")

    monkeypatch.setattr(export, "_permute", crash)  # at the first Q or K tensor: others are written by then
    with pytest.raises(OSError, match="disk full"):
        write_gguf(model_dir, tmp_path / "gguf")
    assert list((tmp_path / "gguf").iterdir()) == []


def test_a_run_that_cannot_export_fails_at_its_model_stage(tmp_path):
    from phase1a.config.schema import Phase1aConfig
    from tasks.model import model_task

    config = Phase1aConfig.model_validate({"data": {"source": "unused"}, "cache_dir": str(tmp_path / "cache"),
                                          "model": {"name_or_path": str(gpt2_model(tmp_path / "gpt2"))},
                                          "promotion": {"export": ["gguf"], "to": str(tmp_path / "p")}})
    with pytest.raises(GGUFExportError, match="is 'GPT2LMHeadModel'"):
        model_task.fn(config)
    assert model_task.fn(config.model_copy(update={"promotion": config.promotion.model_copy(
        update={"export": []})})).path == str(tmp_path / "gpt2")
