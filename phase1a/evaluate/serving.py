"""Can vLLM serve this adapter as one of its multi-LoRA adapters on the base model? A verdict of named rules.

vLLM loads a PEFT adapter directory itself (`LLM(model=base, enable_lora=True)`, then `LoRARequest` per
request) and refuses, or worse silently mis-serves, what its LoRA layers do not implement. Each rule below
names the vLLM source it was read from (vllm-project/vllm; the versions are those whose source or API pages
were read). The tensors in adapter_model.safetensors are the evidence, as in vLLM's own loader: PEFT saves only
the modules a pattern matched, and vLLM checks the tensor names, not `target_modules`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from pydantic import BaseModel

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# vllm/config/lora.py, v0.14.0: MaxLoRARanks = Literal[1, 8, 16, 32, 64, 128, 256, 320, 512], default 16;
# peft_helper.py validate_legal: "LoRA rank {r} is greater than max_lora_rank" (every version read, v0.10 on).
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
DEFAULT_MAX_LORA_RANK = 16

_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_EMBEDDINGS = ("embed_tokens", "lm_head")
# The LoRA modules vLLM accepts per architecture, as adapter (Hugging Face) names. vllm/lora/utils.py
# get_supported_lora_modules: every LinearBase suffix of vLLM's model plus its `embedding_modules`; the worker
# (lora/worker_manager.py) expands each packed module through `packed_modules_mapping`, so q/k/v_proj are served
# by vLLM's packed qkv_proj and gate/up_proj by gate_up_proj, while an adapter naming qkv_proj itself is refused.
SUPPORTED_MODULES = {
    # model_executor/models/llama.py: packed {qkv_proj: [q,k,v], gate_up_proj: [gate,up]},
    # embedding_modules {embed_tokens, lm_head}; registry.py maps MistralForCausalLM to it.
    "LlamaForCausalLM": _PROJECTIONS + _EMBEDDINGS,
    "MistralForCausalLM": _PROJECTIONS + _EMBEDDINGS,
    # models/qwen2.py, qwen3.py: the same packing, no embedding_modules (LoRA on Qwen3's embeddings came later,
    # "Support LoRA on Qwen3 Output Embedding"; not assumed here).
    "Qwen2ForCausalLM": _PROJECTIONS,
    "Qwen3ForCausalLM": _PROJECTIONS,
    # models/phi3.py (docs v0.9.0): Phi-3's own fused qkv_proj and gate_up_proj, Llama's embedding_modules.
    "Phi3ForCausalLM": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj") + _EMBEDDINGS,
}
PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# vllm/lora/layers/logits_processor.py (main, 2026): "When using LoRA, vocab size must be <= 258048" (earlier
# releases: 33024, then 128512, then 257024). Raised at engine start for every model whose lm_head takes LoRA
# (lora/models.py wraps the logits processor when it wraps lm_head), whatever the adapter trains.
MAX_LORA_VOCAB = 258048


class RuleCheck(BaseModel):
    rule: str  # a short stable name: target_modules, rank, ...
    passed: bool
    detail: str  # what the adapter has and what vLLM accepts


class ServingVerdict(BaseModel):
    server: str = "vllm"
    compatible: bool
    checks: list[RuleCheck]
    max_lora_rank: int | None = None  # the value to start vLLM with (LLM(max_lora_rank=...), --max-lora-rank)

    def describe(self) -> str:
        if self.compatible:
            return "vLLM multi-LoRA: compatible"
        failed = "; ".join(f"{check.rule}: {check.detail}" for check in self.checks if not check.passed)
        return f"vLLM multi-LoRA: incompatible: {failed}"


class _Adapter(BaseModel):
    """What the rules read: adapter_config.json, every tensor's shape by name, and the files beside them."""

    config: dict[str, Any]
    shapes: dict[str, tuple[int, ...]]
    files: list[str]

    def lora_modules(self) -> dict[str, int]:
        """Module path -> rank, for every module with LoRA A/B weights (lora_A / lora_embedding_A)."""
        ranks = {}
        for name, shape in self.shapes.items():
            if name.endswith(".lora_A.weight"):
                ranks[name.removesuffix(".lora_A.weight")] = shape[0]
            elif name.endswith(".lora_embedding_A"):
                ranks[name.removesuffix(".lora_embedding_A")] = shape[0]
        return ranks


def check_vllm_adapter(adapter_dir: Path, base_config: dict | PretrainedConfig) -> ServingVerdict:
    """Every rule on the PEFT adapter in `adapter_dir` against the base model's config. A directory without
    adapter_config.json (a full fine-tune, a merged model) is a verdict, not an error."""
    adapter_dir = Path(adapter_dir)
    if not (adapter_dir / "adapter_config.json").is_file():
        return _alone("adapter", f"{adapter_dir} has no adapter_config.json, so it is not an adapter: serve the "
                                 "merged model (vLLM LLM(model=<dir>) without enable_lora)")
    adapter = _read(adapter_dir)
    if isinstance(adapter, str):
        return _alone("adapter", adapter)
    peft_type = adapter.config.get("peft_type", "LORA")
    if peft_type != "LORA":  # vllm/lora/peft_helper.py reads LoRA's fields only (r, lora_alpha, target_modules)
        return _alone("peft_type", f"peft_type {peft_type}: vLLM serves LoRA adapters only (peft_type LORA)")
    base = base_config.to_dict() if hasattr(base_config, "to_dict") else dict(base_config)
    checks = _architecture_checks(adapter, base) + [rule(adapter, base) for rule in RULES]
    rank = _rank_to_pass(adapter)
    return ServingVerdict(compatible=all(check.passed for check in checks), checks=checks,
                          max_lora_rank=rank if rank is not None and all(c.passed for c in checks) else None)


def _alone(rule: str, detail: str) -> ServingVerdict:
    return ServingVerdict(compatible=False, checks=[RuleCheck(rule=rule, passed=False, detail=detail)])


def _read(adapter_dir: Path) -> _Adapter | str:
    """The adapter's config and tensor shapes, or why it cannot be read (a string). vLLM reads
    adapter_model.safetensors, else adapter_model.bin / .pt (lora/lora_model.py from_local_checkpoint)."""
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    files = sorted(path.name for path in adapter_dir.iterdir())
    weights = adapter_dir / "adapter_model.safetensors"
    pickled = [path for path in (adapter_dir / "adapter_model.bin", adapter_dir / "adapter_model.pt") if path.is_file()]
    if weights.is_file():
        from safetensors import safe_open

        with safe_open(weights, framework="pt") as handle:
            shapes = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
    elif pickled:
        import torch

        tensors = torch.load(pickled[0], map_location="cpu", weights_only=True)
        shapes = {name: tuple(tensor.shape) for name, tensor in tensors.items()}
    else:
        return f"{adapter_dir} has adapter_config.json but no adapter_model.safetensors (nor .bin/.pt)"
    return _Adapter(config=config, shapes=shapes, files=files)


def _architecture_checks(adapter: _Adapter, base: dict) -> list[RuleCheck]:
    """The architecture rule, then (for a known one) the target-modules and vocabulary-size rules: both depend on
    the architecture, so an unknown one leaves nothing to check them against."""
    architectures = base.get("architectures") or []
    known = next((name for name in architectures if name in SUPPORTED_MODULES), None)
    if known is None:
        return [RuleCheck(rule="architecture", passed=False, detail=(
            f"base architecture {', '.join(architectures) or 'unnamed (no architectures in its config)'} is not "
            f"one this check has vLLM's LoRA modules for ({', '.join(SUPPORTED_MODULES)}); see vLLM's "
            "supported-models page (its LoRA column) before serving"))]
    return [RuleCheck(rule="architecture", passed=True, detail=f"{known}: vLLM supports LoRA on it"),
            _target_modules(adapter, known), _vocab_size_limit(base, known)]


def _vocab_size_limit(base: dict, architecture: str) -> RuleCheck:
    vocab = _vocab_size(base)
    if "lm_head" in SUPPORTED_MODULES[architecture] and vocab is not None and vocab > MAX_LORA_VOCAB:
        return RuleCheck(rule="vocab_size", passed=False, detail=(
            f"base vocabulary of {vocab} tokens: vLLM's LoRA logits processor takes at most {MAX_LORA_VOCAB} "
            f"for {architecture}, whose lm_head takes LoRA"))
    return RuleCheck(rule="vocab_size", passed=True, detail=f"base vocabulary of {vocab} tokens, within vLLM's "
                                                            f"LoRA limit of {MAX_LORA_VOCAB}")


def _target_modules(adapter: _Adapter, architecture: str) -> RuleCheck:
    # vllm/lora/lora_model.py check_unexpected_modules: every LoRA tensor's module suffix must be expected,
    # else "While loading ..., expected target modules in ... but received ...".
    trained = sorted({module.rsplit(".", 1)[-1] for module in adapter.lora_modules()})
    allowed = SUPPORTED_MODULES[architecture]
    unsupported = [name for name in trained if name not in allowed]
    packing = ", ".join(f"{packed} from {'/'.join(parts)}" for packed, parts in PACKED.items()
                        if set(parts) <= set(allowed))
    accepts = f"vLLM's {architecture} accepts LoRA on {', '.join(allowed)}" + (f" (packed: {packing})" if packing
                                                                                 else "")
    if unsupported:
        return RuleCheck(rule="target_modules", passed=False,
                         detail=f"adapter has LoRA on {', '.join(unsupported)}, unsupported; {accepts}")
    return RuleCheck(rule="target_modules", passed=True, detail=f"adapter has LoRA on {', '.join(trained)}; "
                                                                  f"{accepts}")


def _ranks(adapter: _Adapter) -> list[int]:
    """r, rank_pattern's ranks and the tensors' own: the largest is what max_lora_rank must hold."""
    config = adapter.config
    return [int(config.get("r", 0)), *map(int, (config.get("rank_pattern") or {}).values()),
            *adapter.lora_modules().values()]


def _rank_to_pass(adapter: _Adapter) -> int | None:
    largest = max(_ranks(adapter))
    return next((choice for choice in MAX_LORA_RANKS if choice >= largest), None)


def _rank(adapter: _Adapter, base: dict) -> RuleCheck:
    largest, choice = max(_ranks(adapter)), _rank_to_pass(adapter)
    choices = ", ".join(map(str, MAX_LORA_RANKS))
    if choice is None:
        return RuleCheck(rule="rank", passed=False, detail=f"rank {largest} is above vLLM's largest max_lora_rank "
                                                           f"{MAX_LORA_RANKS[-1]} (choices: {choices})")
    default = "" if choice > DEFAULT_MAX_LORA_RANK else f", within the default {DEFAULT_MAX_LORA_RANK}"
    return RuleCheck(rule="rank", passed=True, detail=(
        f"rank {largest}: start vLLM with max_lora_rank={choice} (--max-lora-rank {choice}{default}); it must "
        f"be at least the largest rank of every adapter served together (choices: {choices})"))


def _modules_to_save(adapter: _Adapter, base: dict) -> RuleCheck:
    # vllm/lora/peft_helper.py _validate_features: "vLLM only supports modules_to_save being None." (v0.10.0
    # through docs.vllm.ai/en/latest; vllm-project/vllm@e745baf). A later main also takes ["classifier",
    # "score"], for classification models only: nothing a causal LM's adapter saves.
    saved = adapter.config.get("modules_to_save") or []
    if saved:
        return RuleCheck(rule="modules_to_save", passed=False, detail=(
            f"modules_to_save {saved}: the adapter carries whole trained modules, which vLLM does not load "
            "(it requires modules_to_save null); serve the merged model instead"))
    return RuleCheck(rule="modules_to_save", passed=True, detail="modules_to_save null, as vLLM requires")


def _vocab_size(base: dict) -> int | None:
    return base.get("vocab_size") or (base.get("text_config") or {}).get("vocab_size")


def _embedding_rows(adapter: _Adapter) -> dict[str, int]:
    """Vocabulary rows each embedding-shaped tensor implies, by tensor name: full embed_tokens / lm_head weights
    (PEFT's save_embedding_layers, or base_layer copies), lora_embedding_A's columns, lm_head's lora_B rows."""
    rows = {}
    for name, shape in adapter.shapes.items():
        module = name.split(".lora_")[0].removesuffix(".weight").removesuffix(".base_layer")
        if module.rsplit(".", 1)[-1] not in _EMBEDDINGS:
            continue
        if name.endswith(".lora_embedding_A"):
            rows[name] = shape[1]
        elif name.endswith(".lora_B.weight") and module.endswith("lm_head"):
            rows[name] = shape[0]
        elif ".lora_" not in name and name.endswith(".weight") and len(shape) == 2:
            rows[name] = shape[0]
    return rows


def _embeddings(adapter: _Adapter, base: dict) -> RuleCheck:
    # vllm/lora/lora_model.py from_lora_tensors: "The embedding LoRA size(...) must be consistent with the base
    # model's vocabulary size(...)"; full embedding weights are skipped (utils.is_base_embedding_weights), so
    # tokens added by resizing have no rows when served. Extra vocabularies (new_embeddings.safetensors,
    # lora_extra_vocab_size) were deprecated in v0.11 and removed (vllm PR #28382, "removed in v0.12.0").
    vocab = _vocab_size(base)
    extra = [name for name in adapter.files if name.startswith("new_embeddings.")]
    resized = {name: rows for name, rows in _embedding_rows(adapter).items() if rows != vocab}
    if extra or resized:
        found = [f"{name} ({rows} rows)" for name, rows in resized.items()]
        found += [f"{name} (an extra vocabulary)" for name in extra]
        return RuleCheck(rule="embeddings", passed=False, detail=(
            f"resized embeddings: {', '.join(found)} against the base vocabulary of {vocab}; vLLM serves the "
            "base's vocabulary only (no extra vocabulary since v0.12): serve the merged model instead"))
    shaped = "; its embedding-shaped tensors have" if _embedding_rows(adapter) else "; no embedding tensors,"
    return RuleCheck(rule="embeddings", passed=True, detail=f"no resized embeddings{shaped} the base vocabulary of "
                                                            f"{vocab} rows")


def _dora(adapter: _Adapter, base: dict) -> RuleCheck:
    # vllm/lora/peft_helper.py _validate_features: "vLLM does not yet support DoRA." (every version read).
    magnitudes = [name for name in adapter.shapes if "lora_magnitude_vector" in name]
    if adapter.config.get("use_dora") or magnitudes:
        return RuleCheck(rule="dora", passed=False, detail=(
            f"use_dora {adapter.config.get('use_dora')} ({len(magnitudes)} magnitude vectors): vLLM does not "
            "support DoRA; train with use_dora false or serve the merged model"))
    return RuleCheck(rule="dora", passed=True, detail="use_dora false, as vLLM requires")


def _bias(adapter: _Adapter, base: dict) -> RuleCheck:
    # vllm/lora/peft_helper.py validate_legal: "Adapter bias is not supported." since vllm PR #25807 (2025-09,
    # which removed LoRA bias; before it, only with enable_lora_bias). PEFT's lora_bias (a bias on lora_B)
    # saves lora_B.bias tensors, which lora/utils.py parse_fine_tuned_lora_name then rejects as unsupported.
    bias, lora_bias = adapter.config.get("bias", "none"), bool(adapter.config.get("lora_bias"))
    bias_tensors = [name for name in adapter.shapes if name.endswith(".bias")]
    if bias != "none" or lora_bias or bias_tensors:
        return RuleCheck(rule="bias", passed=False, detail=(
            f"bias {bias!r}, lora_bias {lora_bias} ({len(bias_tensors)} bias tensors): vLLM serves adapters "
            "with bias 'none' and no lora_bias only"))
    return RuleCheck(rule="bias", passed=True, detail="bias 'none' and no lora_bias, as vLLM requires")


# PEFT features that change what the adapter computes and that vLLM does not implement. vLLM up to v0.14's
# PEFTHelper.from_dict keeps only the fields it knows (r, lora_alpha, target_modules, bias, modules_to_save,
# use_rslora, use_dora, ...) and drops the rest, so these are served wrongly rather than refused; a later
# vllm/lora/peft_helper.py (main, 2026; not pinned to a release) refuses lora_bias, layer_replication,
# PiSSA/OLoRA/CorDA/LoftQ inits, aLoRA and QALoRA by name, and applies rank_pattern/alpha_pattern.
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq")  # they rewrite the base weights the adapter needs
_FEATURES: dict[str, Callable[[Any], bool]] = {
    "rank_pattern": bool,  # per-module ranks: vLLM <= v0.14 scales every module by lora_alpha / r
    "alpha_pattern": bool,
    "layer_replication": bool,
    "trainable_token_indices": lambda value: value is not None,  # trained token rows (token_adapter tensors)
    "alora_invocation_tokens": bool,
    "use_qalora": bool,
    "init_lora_weights": lambda value: isinstance(value, str) and value.lower().startswith(_BASE_CHANGING_INITS),
}


def _peft_features(adapter: _Adapter, base: dict) -> RuleCheck:
    used = {key: adapter.config[key] for key, in_use in _FEATURES.items()
            if key in adapter.config and in_use(adapter.config[key])}
    if used:
        listed = ", ".join(f"{key} {value!r}" for key, value in used.items())
        return RuleCheck(rule="peft_features", passed=False, detail=(
            f"{listed}: PEFT features vLLM does not implement (it would ignore or refuse them); serve the "
            "merged model instead"))
    return RuleCheck(rule="peft_features", passed=True, detail=(
        "no PEFT feature vLLM lacks (rank/alpha patterns, layer replication, trainable tokens, aLoRA, QALoRA, "
        "PiSSA/OLoRA/CorDA/LoftQ init)"))


RULES: list[Callable[[_Adapter, dict], RuleCheck]] = [_rank, _modules_to_save, _embeddings, _dora, _bias,
                                                      _peft_features]
