"""The promoted model as the baseline (`validation.baseline: promoted`): the pointer the gate compares with, its
metrics taken from the pointer or scored here (`promoted_baseline`), and what a verdict depends on besides the
candidate (`baseline_identity`, in the validate stage's key). A metrics file as the baseline: gate.py."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from phase1a.config.schema import Phase1aConfig
from phase1a.core.fingerprint import sha256_file
from phase1a.data.staging import fetch_adapter
from phase1a.evaluate.gate import BaselineError
from phase1a.evaluate.result import Baseline, Metrics
from phase1a.evaluate.scoring import Scoring, cached
from phase1a.model.loading import for_scoring, load_for_eval
from phase1a.store.promoted import PromotedPointer, read_pointer


@dataclass
class PromotedSource:
    """Where the promoted model's weights can be fetched from, and how it is loaded."""

    model_dir: Path
    staging_dir: Path  # an S3 adapter is staged under it
    endpoint_url: str | None = None
    trust_remote_code: bool = False
    attention: str = "sdpa"  # as load_for_eval takes it

    def fetch(self, pointer: PromotedPointer) -> Path:
        return fetch_adapter(pointer, self.staging_dir, self.endpoint_url)


def promoted_pointer(config: Phase1aConfig) -> PromotedPointer | None:
    """The pointer the gate compares with; None on a warm start's first night (nothing promoted yet), which is
    gated against the base model: the nightly job needs no special first run."""
    where = config.promotion.to
    pointer = read_pointer(where, config.endpoint_for(where))
    if pointer is None and config.method.init_from == "base":
        raise BaselineError(f"validation.baseline promoted: nothing is promoted at {where} (no "
                            "promoted.json); promote a model first (e.g. a run with baseline: base) or choose "
                            "baseline: base or file")
    return pointer


def promoted_baseline(pointer: PromotedPointer, scoring: Scoring, source: PromotedSource,
                      device: torch.device) -> Baseline:
    """The promoted model's metrics: from its pointer when they were computed on this sample with this
    scoring, else by scoring its weights here (cached like the base model's)."""
    name = f"promoted {pointer.version}"
    same_sample = pointer.sample_fingerprint == scoring.sample and pointer.metric_settings == scoring.key(device)
    stored = Metrics.model_validate(pointer.metrics) if same_sample else None
    if stored is not None and not scoring.missing(stored, device):
        return Baseline.of(name, stored, scoring.sample)
    if pointer.base_model_fingerprint != scoring.model_fingerprint:
        raise BaselineError(f"{name} was trained from another base model ({pointer.base_model_fingerprint[:12]}, "
                            f"this run's is {scoring.model_fingerprint[:12]}) and scored on another sample or "
                            "benchmarks; nothing to compare")
    model = for_scoring(load_for_eval(source.model_dir, source.fetch(pointer), device, source.trust_remote_code,
                                      source.attention))
    metrics = stored or cached(scoring.cache_path(pointer.adapter_sha256, device), Metrics,
                               lambda: scoring.evaluate(model, "promoted"))[0]
    metrics = scoring.with_benchmarks(metrics, model, pointer.adapter_sha256)
    where = "its benchmarks scored here" if stored else "scored on this sample"
    return Baseline.of(f"{name} ({where})", metrics, scoring.sample)


def baseline_identity(config: Phase1aConfig) -> str:
    """What the verdict depends on besides the candidate: the baseline file's bytes or the pointer's version."""
    settings = config.validation
    if settings.baseline == "file":
        path = Path(settings.baseline_file)
        return sha256_file(path) if path.is_file() else "missing"  # the stage runs and names the path
    if settings.baseline == "promoted":
        pointer = read_pointer(config.promotion.to, config.endpoint_for(config.promotion.to))
        # The version and its adapter's bytes, not where the pointer lies: a local promotion.to is another path
        # on another host.
        return f"promoted {pointer.version} {pointer.adapter_sha256}" if pointer else "promoted None"
    return "base"
