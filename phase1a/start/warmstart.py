"""Where a run's trainable weights start (`method.init_from`), resolved once a run before any stage, as the model
is: the base weights, the promoted version's adapter, or a LoRA adapter directory (local, file:// or s3://,
staged to local disk like a promoted baseline). Its settings are checked here, so a mismatched adapter fails
in seconds, not after tokenizing.

A first night (`init_from: promoted`, nothing promoted yet) starts from the base weights, with a warning and
a note in the report's lineage: the nightly job needs no special first run.
"""
from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

from phase1a.config.schema import Phase1aConfig
from phase1a.core.logs import run_logger
from phase1a.model.adapters import AdapterError, adapter_fingerprint, check_adapter
from phase1a.model.result import ResolvedModel
from phase1a.start.result import StartPoint


def resolve_start(config: Phase1aConfig, model: ResolvedModel) -> StartPoint:
    init_from, base = config.method.init_from, config.model.name_or_path
    if init_from == "base":
        return StartPoint(init_from=init_from, kind="base", base_model=base)
    if init_from == "promoted":
        return _promoted(config, model)
    adapter_dir = _local_copy(init_from, config)
    check_adapter(adapter_dir, config.method.lora)
    return StartPoint(init_from=init_from, kind="adapter", base_model=base, path=init_from,
                      adapter_dir=str(adapter_dir), fingerprint=adapter_fingerprint(adapter_dir))


def _promoted(config: Phase1aConfig, model: ResolvedModel) -> StartPoint:
    # Imported here: boto3 comes with them, and a base or local start on a bare GPU host has none.
    from phase1a.data.staging import fetch_adapter
    from phase1a.store.promoted import read_pointer

    where, base = config.promotion.to, config.model.name_or_path
    pointer = read_pointer(where, config.endpoint_for(where))  # in the store's bucket: the store's endpoint
    if pointer is None:
        note = f"nothing promoted yet at {where}: started from the base model"
        run_logger().warning("method.init_from promoted: %s", note)
        return StartPoint(init_from="promoted", kind="base", base_model=base, note=note)
    if pointer.base_model_fingerprint != model.fingerprint:
        raise AdapterError(f"method.init_from promoted: version {pointer.version} at {where} was trained on another "
                           f"base model ({pointer.base_model_fingerprint[:12]}) than model.name_or_path {base} "
                           f"({model.fingerprint[:12]})")
    adapter_dir = fetch_adapter(pointer, config.data.staging_dir, config.endpoint_for(pointer.artifacts.get("adapter")))
    check_adapter(adapter_dir, config.method.lora)
    return StartPoint(init_from="promoted", kind="promoted", base_model=base, version=pointer.version,
                      path=pointer.artifacts["adapter"], adapter_dir=str(adapter_dir),
                      fingerprint=adapter_fingerprint(adapter_dir))


def _local_copy(location: str, config: Phase1aConfig) -> Path:
    parsed = urlparse(location)
    if parsed.scheme == "s3":
        from phase1a.data.staging import stage_model

        return stage_model(location, config.data.staging_dir / "adapters", config.endpoint_for(location))
    path = Path(parsed.path) if parsed.scheme == "file" else Path(location)
    if not path.is_dir():
        raise AdapterError(f"method.init_from: {location} is not a directory (an adapter directory, base or "
                           "promoted)")
    return path
