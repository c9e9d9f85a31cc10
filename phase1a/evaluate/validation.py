"""A validation: the trained model against a baseline on a bounded held-out sample, and the gate (`validate`).

The sample is the first `validation.max_examples` examples of the validation split. Every model is scored on
it the same way (metrics.py, through scoring.py): eval loss, perplexity, token accuracy on response tokens, and
greedy-generated answers scored by exact match, with their expected calibration error.

The baseline (`validation.baseline`) is the base model (the same weights with the adapter switched off; its
metrics are cached on disk by model, sample and scoring, so they are computed once), a metrics file (e.g.
from a full-precision reference run; gate.py), or the model the `promoted` pointer names (baseline.py; the base
model on a warm start's first night, nothing promoted yet). The gate (gate.py) compares each metric that has a
tolerance; only a pass is promoted (phase1a/promote/).

`validate`, in named phases:
  1. sample     the held-out sample and its fingerprint; the baseline's source is read before any model loads
                (a missing file or pointer fails in seconds)
  2. score      the base (adapter off) and the candidate
  3. baseline   the base, the file, or the promoted model (scored here when its metrics are of another sample)
  4. gate       each metric with a tolerance, candidate against baseline
"""
from __future__ import annotations

import json
from pathlib import Path

from phase1a.config.schema import Phase1aConfig
from phase1a.core.fingerprint import sha256_tree
from phase1a.core.hardware import training_device, training_dtype
from phase1a.evaluate.baseline import PromotedSource, promoted_baseline, promoted_pointer
from phase1a.evaluate.gate import gate, read_baseline_file
from phase1a.evaluate.result import Baseline, Metrics, ValidationResult
from phase1a.evaluate.scoring import Scoring, base_model_metrics
from phase1a.evaluate.serving import check_vllm_adapter
from phase1a.model.build import attention_implementation
from phase1a.model.loading import for_scoring, is_adapter, load_for_eval
from phase1a.model.result import ResolvedModel

ADAPTER_FILES = ("*.safetensors", "*.json")  # what identifies an adapter (or a full fine-tune's weights)


def validate(config: Phase1aConfig, model: ResolvedModel, validation_path: Path, adapter_dir: Path) -> ValidationResult:
    settings, endpoint = config.validation, config.endpoint_for(config.promotion.to)
    device, trust = training_device(), config.model.trust_remote_code
    # Training's attention: packed batches in one call a layer (varlen), as calibration times them. SDPA's dense
    # mask over a packed batch took the demo's loss pass 1.23-1.40x as long on this project's CPU host (3 passes
    # each, alternating, 2026-11-29), for the same loss to 1e-7.
    attention = attention_implementation(config.method, device, training_dtype(device))
    # 1. sample; the baseline read before any model loads
    scoring = Scoring.of(config, model, validation_path)
    file_baseline = read_baseline_file(settings.baseline_file, scoring.sample) if settings.baseline == "file" else None
    pointer = promoted_pointer(config) if settings.baseline == "promoted" else None
    # 2. score
    base, base_cached, candidate = _score(scoring, Path(model.path), Path(adapter_dir), trust, attention)
    # 3. baseline
    if file_baseline is not None:
        baseline = file_baseline
    elif pointer is not None:
        source = PromotedSource(Path(model.path), config.data.staging_dir, endpoint, trust, attention)
        baseline = promoted_baseline(pointer, scoring, source, device)
    else:
        first = " (nothing promoted yet)" if settings.baseline == "promoted" else ""
        baseline = Baseline.of("base model" + first + (" (cached)" if base_cached else ""), base, scoring.sample)
    # 4. gate
    checks = gate(candidate, baseline, settings)
    reasons = [check.describe() for check in checks if not check.passed]
    return ValidationResult(
        base=base, candidate=candidate, baseline=baseline, checks=checks, passed=not reasons, reasons=reasons,
        sample_fingerprint=scoring.sample, metric_settings=scoring.key(device), model_fingerprint=model.fingerprint,
        adapter_sha256=sha256_tree(Path(adapter_dir), ADAPTER_FILES), base_cached=base_cached,
        promoted_seen=pointer.version if pointer else None,
        serving=check_vllm_adapter(Path(adapter_dir), json.loads((Path(model.path) / "config.json").read_text())),
    )


def _score(scoring: Scoring, model_dir: Path, adapter_dir: Path, trust_remote_code: bool,
           attention: str) -> tuple[Metrics, bool, Metrics]:
    """(base metrics, whether they came from the cache, candidate metrics)."""
    device = training_device()
    if is_adapter(adapter_dir):
        model = load_for_eval(model_dir, adapter_dir, device, trust_remote_code, attention)
        base, base_cached = base_model_metrics(model, scoring)
    else:  # a full fine-tune: the base is another set of weights
        base_model = load_for_eval(model_dir, None, device, trust_remote_code, attention)
        base, base_cached = base_model_metrics(base_model, scoring)
        del base_model
        model = load_for_eval(model_dir, adapter_dir, device, trust_remote_code, attention)
    model = for_scoring(model)
    return base, base_cached, scoring.with_benchmarks(scoring.evaluate(model, "candidate"), model, None)
