"""What the validate stage hands promote, and report.json records: the candidate against its baseline on the
held-out sample, the gate's checks and verdict (ValidationResult)."""
from __future__ import annotations

from pydantic import BaseModel

from phase1a.evaluate.gate import Baseline, GateCheck
from phase1a.evaluate.metrics import Metrics
from phase1a.evaluate.serving import ServingVerdict


class ValidationResult(BaseModel):
    base: Metrics
    candidate: Metrics
    baseline: Baseline
    checks: list[GateCheck]
    passed: bool
    reasons: list[str]
    sample_fingerprint: str
    metric_settings: str
    model_fingerprint: str
    adapter_sha256: str
    base_cached: bool
    promoted_seen: str | None = None  # the pointer's version the gate compared against (baseline: promoted)
    serving: ServingVerdict | None = None  # whether vLLM's multi-LoRA serves the adapter (reported, not gated)
