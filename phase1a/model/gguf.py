"""GGUF, the one-file model format of llama.cpp and Ollama, in both directions.

`write_gguf` exports a Hugging Face safetensors model (a merged fine-tune) as f16 and q8_0 files, as llama.cpp's
convert_hf_to_gguf.py does for the llama family, with gguf-py's own tables (tensor names, metadata keys,
quantization); an architecture or tokenizer it does not cover is refused before anything is written.
`gguf_to_safetensors` reads a GGUF back into a safetensors directory (the built-in demo model, once).
"""
from __future__ import annotations

import json
import os
from contextlib import ExitStack
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any, Callable, Sequence

import gguf
import numpy as np
from gguf import MODEL_ARCH, GGMLQuantizationType as QType, LlamaFileType, TokenType

from phase1a.core.atomic import atomic_path

GGUF_TYPES = ("f16", "q8_0")
_FILE_TYPES = {"f16": (LlamaFileType.MOSTLY_F16, QType.F16), "q8_0": (LlamaFileType.MOSTLY_Q8_0, QType.Q8_0)}


class GGUFExportError(ValueError):
    """A model this export does not cover (architecture, rope scaling, tokenizer), or a malformed model directory."""


@dataclass(frozen=True)
class _Family:
    arch: MODEL_ARCH
    # llama.cpp's llama rope rotates adjacent pairs, HF's the two halves of a head: Q and K rows are reordered to
    # match (convert_hf_to_gguf.py's LlamaModel.permute); Qwen2 runs llama.cpp's NeoX rope, which needs no reorder.
    permute_qk: bool
    rope_types: tuple[str, ...]  # "llama3": Llama 3.1+'s long-context frequencies, written as rope_freqs.weight


_FAMILIES = {
    "LlamaForCausalLM": _Family(MODEL_ARCH.LLAMA, True, ("default", "llama3")),  # Llama 2/3, SmolLM/SmolLM2...
    "Qwen2ForCausalLM": _Family(MODEL_ARCH.QWEN2, False, ("default",)),
}

# Byte-level BPE pre-tokenizers (their steps, as tokenizers serialises them) -> the `tokenizer.ggml.pre` naming the
# same split in llama.cpp. Upstream recognises them by hashing a sample's token ids; the steps say it directly.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_TOKENIZERS = {
    (("ByteLevel", True),): "gpt-2",  # GPT-2's regex inside ByteLevel
    (("Digits", True), ("ByteLevel", True)): "smollm",  # SmolLM: digits one by one, then GPT-2's regex
    (("Split", _LLAMA3_SPLIT), ("ByteLevel", False)): "llama-bpe",  # Llama 3
    (("Split", _QWEN2_SPLIT), ("ByteLevel", False)): "qwen2",
}


@dataclass
class _Tensor:
    """One tensor of the file: its GGUF name, shape and type, and how to load it (converted, not yet quantized)."""

    name: str
    shape: tuple[int, ...]
    qtype: QType
    load: Callable[[], np.ndarray]  # float32, as the file stores it before quantization


@dataclass
class _Vocab:
    tokens: list[str]
    types: list[int]
    pre: str
    special: Any  # gguf.SpecialVocab: merges, special token ids, add_bos/add_eos, chat template


@dataclass
class _Model:
    directory: Path
    hparams: dict
    family: _Family
    vocab: _Vocab
    sources: dict[str, tuple[Path, tuple[int, ...]]]  # HF tensor name -> (its safetensors file, its shape)


def write_gguf(model_dir: Path, target_dir: Path, types: Sequence[str] = GGUF_TYPES,
               name: str | None = None) -> list[Path]:
    """model_dir: a HF safetensors model directory (config.json, *.safetensors, tokenizer files incl. chat
    template), e.g. the merged model. Writes target_dir/<name>-<type>.gguf per type; returns the paths.

    <name> is `name`, or model_dir's name. Each file is written under a scratch name and renamed when complete;
    what is not covered raises GGUFExportError before any file is started."""
    model_dir, target_dir = Path(model_dir), Path(target_dir)
    unknown = sorted(set(types) - set(_FILE_TYPES))
    if unknown or not types:
        raise GGUFExportError(f"GGUF types {unknown or list(types)}: choose among {', '.join(GGUF_TYPES)}")
    model = _read_model(model_dir)
    written = []
    for kind in dict.fromkeys(types):  # in order, once each
        path = target_dir / f"{name or model_dir.name}-{kind}.gguf"
        _write_file(model, kind, path)
        written.append(path)
    return written


def check_gguf_export(model_dir: Path) -> None:
    """What write_gguf checks before it writes, on the base model before training: a model that cannot be
    exported fails the run in seconds, not after training and validation."""
    _read_model(Path(model_dir))


def _read_model(model_dir: Path) -> _Model:
    """Everything every file shares, checked before any is written."""
    if not (model_dir / "config.json").is_file():
        raise GGUFExportError(f"{model_dir} has no config.json: not a Hugging Face model directory")
    hparams = json.loads((model_dir / "config.json").read_text())
    architecture = (hparams.get("architectures") or [hparams.get("model_type", "unknown")])[0]
    if architecture not in _FAMILIES:
        raise GGUFExportError(f"GGUF export covers {', '.join(_FAMILIES)}; {model_dir} is {architecture!r}")
    _check_support(hparams, architecture)
    vocab = _read_vocab(model_dir, hparams["vocab_size"])
    return _Model(model_dir, hparams, _FAMILIES[architecture], vocab, _safetensors_index(model_dir))


def _rope(hparams: dict) -> dict:
    """Rope settings as transformers 5 writes them (`rope_parameters`) or as older configs did (top-level keys)."""
    params = dict(hparams.get("rope_scaling") or {})
    params.setdefault("rope_theta", hparams.get("rope_theta", 10000.0))
    params.update(hparams.get("rope_parameters") or {})
    return params


def _head_dim(hparams: dict) -> int:
    return hparams.get("head_dim") or hparams["hidden_size"] // hparams["num_attention_heads"]


def _rope_type(hparams: dict) -> str:
    rope = _rope(hparams)
    return rope.get("rope_type", rope.get("type", "default"))


def _check_support(hparams: dict, architecture: str) -> None:
    """Settings llama.cpp would read differently from transformers: refused rather than exported wrong."""
    family = _FAMILIES[architecture]
    if _rope_type(hparams) not in family.rope_types:
        raise GGUFExportError(f"GGUF export of {architecture} covers rope {' and '.join(family.rope_types)}; "
                              f"this model's rope is {_rope_type(hparams)!r}")
    if hparams.get("use_sliding_window"):
        raise GGUFExportError(f"GGUF export of {architecture} does not cover sliding-window attention")


# --- the tokenizer -------------------------------------------------------------------------------------------

def _pre_tokenizer(spec: dict, model_dir: Path) -> str:
    """llama.cpp's name for how this byte-level BPE tokenizer splits text; anything else is refused."""
    model = spec.get("model") or {}
    covered = "byte-level BPE tokenizer.json (GPT-2, SmolLM, Llama 3 and Qwen2 pre-tokenizers)"
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        kind = "sentencepiece-style BPE" if model.get("byte_fallback") else model.get("type")
        raise GGUFExportError(f"GGUF export covers {covered}; {model_dir}'s tokenizer is {kind}")
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    shape = tuple(_step(step) for step in steps)
    if shape not in _PRE_TOKENIZERS:
        raise GGUFExportError(f"GGUF export covers {covered}; {model_dir}'s pre-tokenizer is {shape}")
    return _PRE_TOKENIZERS[shape]


def _step(step: dict) -> tuple:
    kind = step.get("type")
    if kind == "ByteLevel":
        return kind, step.get("use_regex", True)
    if kind == "Digits":
        return kind, step.get("individual_digits", False)
    if kind == "Split" and step.get("behavior") == "Isolated" and not step.get("invert"):
        return kind, (step.get("pattern") or {}).get("Regex")
    return (kind,)


def _read_vocab(model_dir: Path, vocab_size: int) -> _Vocab:
    """The vocabulary as llama.cpp's "gpt2" tokenizer model reads it (convert_hf_to_gguf.py's get_vocab_base)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        raise GGUFExportError(f"GGUF export covers byte-level BPE tokenizers; {model_dir}'s has no tokenizers backend")
    # The tokenizer as loaded, not tokenizer.json: a class such as Qwen2Tokenizer rebuilds its own pre-tokenizer.
    pre = _pre_tokenizer(json.loads(tokenizer.backend_tokenizer.to_str()), model_dir)
    tokens, types = _tokens(tokenizer, vocab_size)
    special = gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=vocab_size)
    if not special.merges:
        raise GGUFExportError(f"{model_dir}: no BPE merges found (tokenizer.json or merges.txt)")
    # What the tokenizer does, not what a config may claim: llama.cpp adds exactly these when it encodes a prompt.
    ids = tokenizer("a")["input_ids"]
    special.add_special_token["bos"] = tokenizer.bos_token_id is not None and ids[0] == tokenizer.bos_token_id
    special.add_special_token["eos"] = tokenizer.eos_token_id is not None and ids[-1] == tokenizer.eos_token_id
    return _Vocab(tokens, types, pre, special)


def _tokens(tokenizer, vocab_size: int) -> tuple[list[str], list[int]]:
    """Every id below vocab_size: its token and type (added special ones CONTROL, other added USER_DEFINED, ids the
    tokenizer lacks padded as UNUSED, since the embedding has rows for them)."""
    by_id = {index: token for token, index in tokenizer.get_vocab().items()}
    if max(by_id) >= vocab_size:
        raise GGUFExportError(f"the tokenizer has id {max(by_id)}, beyond the model's vocab_size {vocab_size}")
    added, decoder = tokenizer.get_added_vocab(), tokenizer.added_tokens_decoder
    tokens, types = [], []
    for index in range(vocab_size):
        token = by_id.get(index)
        if token is None:
            tokens.append(f"[PAD{index}]")
            types.append(TokenType.UNUSED)
        elif token in added:
            looks_special = token.startswith("<|") and token.endswith("|>")
            tokens.append(token)
            types.append(TokenType.CONTROL if decoder[index].special or looks_special else TokenType.USER_DEFINED)
        else:
            tokens.append(token)
            types.append(TokenType.NORMAL)
    return tokens, types


# --- the tensors ---------------------------------------------------------------------------------------------

def _safetensors_index(model_dir: Path) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """Each tensor's file and shape, read from the headers only."""
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise GGUFExportError(f"{model_dir} has no *.safetensors weights")
    index = {}
    for path in files:
        with safe_open(path, framework="pt") as handle:
            for name in handle.keys():
                index[name] = (path, tuple(handle.get_slice(name).get_shape()))
    return index


def _plan_tensors(model: _Model, file_qtype: QType, handles: dict[Path, Any]) -> list[_Tensor]:
    """The file's tensors in order, each with its GGUF name, type and loader (nothing is loaded yet)."""
    hparams = model.hparams
    names = gguf.get_tensor_name_map(model.family.arch, hparams["num_hidden_layers"])
    tied = hparams.get("tie_word_embeddings", False)
    if not tied and "lm_head.weight" not in model.sources:
        raise GGUFExportError(f"{model.directory}: tie_word_embeddings is false but there is no lm_head.weight")
    planned = []
    for source, (path, shape) in model.sources.items():
        if source.endswith("rotary_emb.inv_freq") or (tied and source == "lm_head.weight"):
            continue  # recomputed by llama.cpp; a tied head is the embedding (no output.weight: llama.cpp ties)
        name = names.get_name(source, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise GGUFExportError(f"{model.directory}: tensor {source!r} has no GGUF name for {model.family.arch.name}")
        load = _loader(handles, path, source, _qk_heads(model, name))
        planned.append(_Tensor(name, shape, _tensor_qtype(name, shape, file_qtype), load))
    if _rope_type(hparams) == "llama3":
        factors = _rope_factors(hparams)
        name = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight"
        planned.append(_Tensor(name, factors.shape, QType.F32, lambda: factors))
    return planned


def _rope_factors(hparams: dict) -> np.ndarray:
    """Llama 3.1+'s long-context rope as llama.cpp applies it: each frequency divided by its factor, 1 for the
    high frequencies, `factor` for the low ones, a smooth blend between (LlamaModel.generate_extra_tensors)."""
    rope, dim = _rope(hparams), _head_dim(hparams)
    factor, low, high = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    context = rope.get("original_max_position_embeddings", 8192)
    wavelength = 2 * np.pi * rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    smooth = (context / wavelength - low) / (high - low)
    blended = 1 / ((1 - smooth) / factor + smooth)
    factors = np.where(wavelength < context / high, 1.0, np.where(wavelength > context / low, factor, blended))
    return factors.astype(np.float32)


def _qk_heads(model: _Model, name: str) -> int | None:
    """The head count Q or K rows are grouped by for the rope reorder; None for every other tensor."""
    if not model.family.permute_qk:
        return None
    heads = model.hparams["num_attention_heads"]
    if ".attn_q." in name:
        return heads
    if ".attn_k." in name:
        return model.hparams.get("num_key_value_heads") or heads
    return None


def _tensor_qtype(name: str, shape: tuple[int, ...], file_qtype: QType) -> QType:
    """As convert_hf_to_gguf.py decides: 1-D tensors, norms and biases stay F32 (llama.cpp computes those in f32);
    a row q8_0 cannot split into whole 32-value blocks falls back to F16."""
    if len(shape) <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight"):
        return QType.F32
    block, _ = gguf.GGML_QUANT_SIZES[file_qtype]
    return file_qtype if shape[-1] % block == 0 else QType.F16


def _loader(handles: dict[Path, Any], path: Path, source: str, heads: int | None) -> Callable[[], np.ndarray]:
    import torch

    def load() -> np.ndarray:
        data = handles[path].get_tensor(source).to(torch.float32).numpy()  # bf16 has no numpy type: via float32
        return data if heads is None else _permute(data, heads)
    return load


def _permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """Within each head, rows (x0..x_{d/2-1}, y0..y_{d/2-1}) become (x0, y0, x1, y1, ...): HF's rotate-half rope
    pairs as llama.cpp's adjacent-pair rope (convert_hf_to_gguf.py's LlamaModel.permute; biases too)."""
    return (weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _nbytes(tensor: _Tensor) -> int:
    if tensor.qtype in (QType.F32, QType.F16):
        return prod(tensor.shape) * (4 if tensor.qtype == QType.F32 else 2)
    return prod(gguf.quant_shape_to_byte_shape(tensor.shape, tensor.qtype))


# --- the file ------------------------------------------------------------------------------------------------

def _add_metadata(writer: gguf.GGUFWriter, model: _Model, file_type: LlamaFileType) -> None:
    """The keys convert_hf_to_gguf.py writes for the llama family (TextModel and LlamaModel.set_gguf_parameters)."""
    hp = model.hparams
    heads, head_dim = hp["num_attention_heads"], _head_dim(hp)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(model.directory.name)
    writer.add_block_count(hp["num_hidden_layers"])
    writer.add_context_length(hp["max_position_embeddings"])
    writer.add_embedding_length(hp["hidden_size"])
    writer.add_feed_forward_length(hp["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(hp.get("num_key_value_heads") or heads)
    writer.add_rope_freq_base(float(_rope(hp)["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(hp["rms_norm_eps"]))
    if hp.get("head_dim") is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_file_type(file_type)
    writer.add_vocab_size(hp["vocab_size"])
    writer.add_rope_dimension_count(head_dim)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _add_vocab(writer: gguf.GGUFWriter, vocab: _Vocab) -> None:
    writer.add_tokenizer_model("gpt2")  # llama.cpp's name for byte-level BPE
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    vocab.special.add_to_gguf(writer, quiet=True)


def _write_file(model: _Model, kind: str, final: Path) -> None:
    """One GGUF, tensor by tensor: the header lists every tensor's shape and type first, then each is loaded,
    converted and written in turn, so memory holds one tensor (a few copies of it on the way), never the model."""
    from safetensors import safe_open

    file_type, file_qtype = _FILE_TYPES[kind]
    with ExitStack() as stack:
        handles = {path: stack.enter_context(safe_open(path, framework="pt"))
                   for path in {path for path, _ in model.sources.values()}}
        tensors = _plan_tensors(model, file_qtype, handles)
        writer = gguf.GGUFWriter(path=None, arch=gguf.MODEL_ARCH_NAMES[model.family.arch])
        _add_metadata(writer, model, file_type)
        _add_vocab(writer, model.vocab)
        for tensor in tensors:
            writer.add_tensor_info(tensor.name, tensor.shape, np.dtype(np.float32), _nbytes(tensor), tensor.qtype)
        with atomic_path(final) as scratch:
            try:
                writer.write_header_to_file(path=scratch)
                writer.write_kv_data_to_file()
                writer.write_ti_data_to_file()
                for tensor in tensors:
                    writer.write_tensor_data(gguf.quants.quantize(tensor.load(), tensor.qtype))
            finally:
                writer.close()
            _sync(scratch)


def _sync(path: Path) -> None:
    """On disk before the rename makes it visible: a crash then leaves the old file or the whole new one."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


# --- reading ---------------------------------------------------------------------------------------------------

def gguf_to_safetensors(directory: Path, filename: str, target: Path) -> None:
    """De-quantize the GGUF `directory/filename` and save it, with its tokenizer, as a safetensors model directory
    at `target` (atomically; another process that finished first keeps its identical copy)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=filename)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=filename, dtype=torch.float32)
    # The weights are plain floats now; the GGUF quantizer would refuse to save them.
    del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    with atomic_path(target, existing="keep") as partial:
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        (partial / "CONVERTED_FROM").write_text(f"{directory.name}/{filename}\n")
