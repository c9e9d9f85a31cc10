"""A LoRA adapter on disk as a warm start reads it (`method.init_from`): its identity, its settings checked against
the run's `method.lora`, and its weights loaded into the freshly made LoRA model as the trainable adapter.

Only safetensors are read: a pickled `adapter_model.bin` can run code when it is loaded, so it is refused.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from phase1a.config.schema import LoraSettings
from phase1a.core.errors import UserError
from phase1a.core.fingerprint import sha256_tree

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"

# adapter_config.json's name -> the config field that must match it (the shapes and the scaling of the update).
_SETTINGS = {"r": "r", "lora_alpha": "alpha", "target_modules": "target_modules"}
# What this project's LoRA never uses: an adapter that does would compute another function with the same weights.
_PLAIN_LORA: dict[str, Any] = {"use_dora": False, "use_rslora": False, "bias": "none", "modules_to_save": None,
                               "rank_pattern": {}, "alpha_pattern": {}, "layers_to_transform": None}


class AdapterError(UserError, ValueError):
    """An adapter that cannot start this run, worded as `method.init_from: <path>: what is wrong`."""


def adapter_fingerprint(adapter_dir: Path) -> str:
    """The adapter's content (its settings and weights, nothing else in the directory): a training run's key
    includes it, so a run started from other weights is another run."""
    return sha256_tree(Path(adapter_dir), (ADAPTER_CONFIG, ADAPTER_WEIGHTS))


def check_adapter(adapter_dir: Path, lora: LoraSettings) -> None:
    """A LoRA adapter in safetensors whose rank, alpha and target modules are the run's `method.lora`."""
    adapter_dir = Path(adapter_dir)
    where = f"method.init_from: {adapter_dir}"
    if not (adapter_dir / ADAPTER_CONFIG).is_file():
        raise AdapterError(f"{where}: not a LoRA adapter directory (no {ADAPTER_CONFIG})")
    if not (adapter_dir / ADAPTER_WEIGHTS).is_file():
        raise AdapterError(f"{where}: no {ADAPTER_WEIGHTS}; adapters are read from safetensors only (a pickled "
                           "adapter_model.bin can run code when it is loaded)")
    saved = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    if saved.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{where}: a {saved['peft_type']} adapter; a warm start continues a LoRA adapter")
    wrong = [f"{name} is {_comparable(saved.get(name))!r} in {ADAPTER_CONFIG}, method.lora.{field} is "
             f"{_comparable(getattr(lora, field))!r}" for name, field in _SETTINGS.items()
             if _comparable(saved.get(name)) != _comparable(getattr(lora, field))]
    wrong += [f"{name} is {saved[name]!r} in {ADAPTER_CONFIG}; training here uses {plain!r}"
              for name, plain in _PLAIN_LORA.items() if (saved.get(name) or plain) != plain]  # absent or empty: plain
    if wrong:
        raise AdapterError(f"{where}: the adapter does not match this run's LoRA: " + "; ".join(wrong))


def _comparable(value: Any) -> Any:
    """peft stores target_modules as a list in any order (or one regex string)."""
    return sorted(value) if isinstance(value, (list, set, tuple)) else value


def load_adapter_weights(model, adapter_dir: Path, lora: LoraSettings) -> None:
    """The adapter's tensors into the peft model's own (trainable) LoRA weights, after checking that every
    tensor is there with its shape."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file

    check_adapter(adapter_dir, lora)
    path = Path(adapter_dir) / ADAPTER_WEIGHTS
    weights = load_file(path)
    expected = {name: tuple(tensor.shape) for name, tensor in get_peft_model_state_dict(model).items()}
    found = {name: tuple(tensor.shape) for name, tensor in weights.items()}
    if found != expected:
        missing, extra = sorted(expected.keys() - found.keys()), sorted(found.keys() - expected.keys())
        shapes = sorted(name for name in expected.keys() & found.keys() if expected[name] != found[name])
        raise AdapterError(f"method.init_from: {path} does not fit this model's LoRA: missing {missing[:3]}, "
                           f"unexpected {extra[:3]}, other shapes {shapes[:3]}")
    set_peft_model_state_dict(model, weights)
