"""Validate: the trained model against a baseline (the base model, a metrics file or the promoted version) on a
bounded held-out sample, and the gate; only a pass is promoted (tasks/promote.py). The work:
phase1a/evaluate/validation.py; the verdict read: phase1a/evaluate/present.py.

The recipe, `validate`, in named phases:
  1. sample     the held-out sample and its fingerprint (phase1a/evaluate/scoring.py); the baseline's source is
                read before any model loads (a missing file or pointer fails in seconds)
  2. score      the base (adapter off; its metrics cached on disk) and the candidate
  3. baseline   the base, the file, or the promoted model (phase1a/evaluate/baseline.py: scored here when its
                metrics are of another sample)
  4. gate       each metric with a tolerance, candidate against baseline (phase1a/evaluate/gate.py)

Its key (`verdict_fingerprint`) is the model, the adapter's bytes, the data, the validation settings and the
baseline's identity: the same weights on the same held-out examples against the same baseline.
"""
from __future__ import annotations

from pathlib import Path

from phase1a.config.schema import Phase1aConfig
from phase1a.core.fingerprint import hash_json, sha256_tree
from phase1a.data.tokenized import TokenizedData
from phase1a.evaluate.benchmarks import validation_key
from phase1a.evaluate.result import ValidationResult
from phase1a.model.result import ResolvedModel
from phase1a.train.result import TrainResult
from tasks.caching import StageCache, task


def verdict_fingerprint(config: Phase1aConfig, model: ResolvedModel, data: TokenizedData, trained: TrainResult) -> str:
    """The validate stage's key, from its own inputs: the same weights on the same held-out examples against
    the same baseline give the same verdict."""
    from phase1a.evaluate.baseline import baseline_identity  # torch: imported by the stage (tasks/caching.py)
    from phase1a.evaluate.validation import ADAPTER_FILES

    # Evaluation during training changes the verdict only through the weights (early stopping): the adapter.
    # No path enters (validation_key): the verdict is found from any checkout or host.
    settings = validation_key(config.validation)
    return hash_json({"model": model.fingerprint, "adapter": sha256_tree(Path(trained.adapter_dir), ADAPTER_FILES),
                      "data": data.fingerprint, "settings": settings,
                      "baseline": baseline_identity(config)})


@task(name="validate", cache_policy=StageCache(fingerprint=verdict_fingerprint), persist_result=True,
      result_serializer="json")
def validate_task(config: Phase1aConfig, model: ResolvedModel, data: TokenizedData,
                  trained: TrainResult) -> ValidationResult:
    from phase1a.evaluate.validation import validate

    return validate(config, model, Path(data.validation_path), Path(trained.adapter_dir))  # the four phases
