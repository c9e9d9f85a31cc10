"""The start stage's result: where a run's trainable weights start (what phase1a/start/warmstart.py
`resolve_start` makes and the train stage reads)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel


class StartPoint(BaseModel):
    """Where a run's trainable weights start (`method.init_from`, phase1a/start/warmstart.py): fresh adapters on
    the base model (or the base itself, full fine-tuning), a promoted version's adapter, or a given adapter."""

    init_from: str  # as configured: base, promoted, or the adapter's location
    kind: Literal["base", "promoted", "adapter"]  # what it resolved to
    base_model: str  # model.name_or_path
    version: str | None = None  # the promoted version it continues
    path: str | None = None  # where that adapter lives: the version's adapter, or the location given
    adapter_dir: str | None = None  # its local copy, which training loads
    fingerprint: str | None = None  # the adapter's content (phase1a/model/adapters.py): part of the training key
    note: str | None = None  # why it is not what init_from asked for (nothing promoted yet)

    def describe(self) -> str:
        if self.kind == "base":
            return f"base model {self.base_model}"
        named = f"promoted {self.version}" if self.kind == "promoted" else "adapter"
        return f"{named} at {self.path} (sha256 {(self.fingerprint or '')[:12]})"
