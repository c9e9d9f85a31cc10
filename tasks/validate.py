"""Validate: the trained model against a baseline on a bounded held-out sample, and a gate.

The sample is the first `validation.max_examples` examples of the validation split. Every model is scored on
it the same way (phase1a/evaluate/metrics.py): eval loss, perplexity, token accuracy on response tokens, and
greedy-generated answers scored by exact match, with their expected calibration error.

The baseline (`validation.baseline`) is the base model (the same weights with the adapter switched off; its
metrics are cached on disk by model, sample and scoring, so they are computed once), a metrics file (e.g.
from a full-precision reference run), or the model the `promoted` pointer names (the base model on a warm
start's first night, nothing promoted yet). The gate (phase1a/evaluate/gate.py) compares each metric that has
a tolerance; only a pass is promoted (tasks/promote.py).

The recipe, `validate`, in named phases:
  1. sample     the held-out sample and its fingerprint; the baseline's source is read before any model loads
                (a missing file or pointer fails in seconds)
  2. score      the base (adapter off) and the candidate
  3. baseline   the base, the file, or the promoted model (scored here when its metrics are of another sample)
  4. gate       each metric with a tolerance, candidate against baseline
"""
from __future__ import annotations

import json
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import cached_property, partial
from pathlib import Path
from typing import Callable, TypeVar

import numpy as np
import torch
from pydantic import BaseModel

from phase1a.config.schema import Phase1aConfig, ValidationConfig
from phase1a.core import layout
from phase1a.core.atomic import write_atomically
from phase1a.core.fingerprint import hash_json, sha256_file, sha256_tree
from phase1a.core.hardware import training_device, training_dtype
from phase1a.data.staging import fetch_adapter
from phase1a.data.tokenized import TokenizedData
from phase1a.evaluate.benchmarks import Benchmark, load_benchmark, score_benchmark, validation_key
from phase1a.evaluate.during_training import DURING_TRAINING_FIELDS
from phase1a.evaluate.gate import Baseline, BaselineError, gate, read_baseline_file, write_baseline_file
from phase1a.evaluate.metrics import BenchmarkScore, Metrics, evaluate, metric_settings_key, sample_fingerprint
from phase1a.evaluate.result import ValidationResult
from phase1a.evaluate.serving import check_vllm_adapter
from phase1a.model.loading import ResolvedModel, for_scoring, is_adapter, load_for_eval, load_tokenizer
from phase1a.run_report import ValidationSection
from phase1a.store.promoted import PromotedPointer, read_pointer
from phase1a.train.packing import TokenRows
from phase1a.train.result import TrainResult
from tasks.caching import StageCache, task

T = TypeVar("T", bound=BaseModel)
ADAPTER_FILES = ("*.safetensors", "*.json")  # what identifies an adapter (or a full fine-tune's weights)


@dataclass
class Scoring:
    """One sample and one way of scoring it: every model of a validation is scored alike, and its metrics are
    cached on disk by model, weights, sample and scoring."""

    tokenizer: object
    rows: TokenRows
    indices: np.ndarray
    settings: ValidationConfig
    cache_dir: Path  # metrics cache
    model_fingerprint: str  # the base model
    benchmarks: list[Benchmark] = field(default_factory=list)  # validation.benchmarks, loaded

    @cached_property
    def sample(self) -> str:  # hashes every token of the sample: once
        return sample_fingerprint(self.rows, self.indices)

    def key(self, device: torch.device) -> str:
        return metric_settings_key(self.settings, device, training_dtype(device))

    def cache_path(self, weights: str, device: torch.device) -> Path:
        """Where one model's metrics are kept; `weights` is "base" or an adapter hash."""
        key = hash_json({"model": self.model_fingerprint, "weights": weights, "sample": self.sample,
                         "settings": self.key(device)})
        return Path(self.cache_dir) / "metrics" / f"{key[:32]}.json"

    def precision(self, device: torch.device) -> str:
        return f"{device.type}/{training_dtype(device)}"

    def evaluate(self, model, name: str) -> Metrics:
        """`name` ("base", "candidate", "promoted v3") labels the model's progress: `validate candidate, loss`."""
        return evaluate(model, self.tokenizer, self.rows, self.indices, self.settings, label=f"validate {name}")

    def missing(self, metrics: Metrics, device: torch.device) -> list[Benchmark]:
        """The benchmarks `metrics` has no comparable score of."""
        precision = self.precision(device)
        return [b for b in self.benchmarks if b.key not in metrics.benchmarks
                or metrics.benchmarks[b.key].identity != b.identity(precision)]

    def with_benchmarks(self, metrics: Metrics, model, weights: str | None) -> Metrics:
        """`metrics` with every benchmark's score: those it has (comparable), else cached by model, `weights`
        ("base" or an adapter hash; None: not cached) and benchmark, else scored on `model`."""
        device = next(model.parameters()).device
        precision, scores = self.precision(device), dict(metrics.benchmarks)
        for benchmark in self.missing(metrics, device):
            compute = partial(score_benchmark, model, self.tokenizer, benchmark, self.settings.batch_size, precision)
            if weights is None:
                scores[benchmark.key] = compute()
                continue
            key = hash_json({"model": self.model_fingerprint, "weights": weights,
                             "benchmark": benchmark.identity(precision)})
            path = Path(self.cache_dir) / "benchmarks" / f"{key[:32]}.json"
            scores[benchmark.key], _ = cached(path, BenchmarkScore, compute)
        return metrics.model_copy(update={"benchmarks": {b.key: scores[b.key] for b in self.benchmarks}})


def cached(path: Path, kind: type[T], compute: Callable[[], T]) -> tuple[T, bool]:
    """The record stored at `path`, or computed and stored there (tmp + rename). Returns (record, from_cache)."""
    if path.is_file():
        try:
            return kind.model_validate_json(path.read_text()), True
        except ValueError:  # a damaged record: compute again and overwrite it
            pass
    record = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, record.model_dump_json(indent=2) + "\n")
    return record, False

def base_model_metrics(model, scoring: Scoring) -> tuple[Metrics, bool]:
    """The base model's metrics, computed with a peft model's adapter switched off (or on a plain base model),
    once per model fingerprint, sample fingerprint and metric settings."""
    from peft import PeftModel

    path = scoring.cache_path("base", next(model.parameters()).device)
    with model.disable_adapter() if isinstance(model, PeftModel) else nullcontext():
        metrics, from_cache = cached(path, Metrics, lambda: scoring.evaluate(model, "base"))
        return scoring.with_benchmarks(metrics, model, "base"), from_cache


@dataclass
class PromotedSource:
    """Where the promoted model's weights can be fetched from, and how it is loaded."""

    model_dir: Path
    staging_dir: Path  # an S3 adapter is staged under it
    endpoint_url: str | None = None
    trust_remote_code: bool = False

    def fetch(self, pointer: PromotedPointer) -> Path:
        return fetch_adapter(pointer, self.staging_dir, self.endpoint_url)


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
    model = for_scoring(load_for_eval(source.model_dir, source.fetch(pointer), device, source.trust_remote_code))
    metrics = stored or cached(scoring.cache_path(pointer.adapter_sha256, device), Metrics,
                               lambda: scoring.evaluate(model, "promoted"))[0]
    metrics = scoring.with_benchmarks(metrics, model, pointer.adapter_sha256)
    where = "its benchmarks scored here" if stored else "scored on this sample"
    return Baseline.of(f"{name} ({where})", metrics, scoring.sample)


def _promoted_pointer(config: Phase1aConfig) -> PromotedPointer | None:
    """The pointer the gate compares with; None on a warm start's first night (nothing promoted yet), which is
    gated against the base model: the nightly job needs no special first run."""
    where = config.promotion.to
    pointer = read_pointer(where, config.endpoint_for(where))
    if pointer is None and config.method.init_from == "base":
        raise BaselineError(f"validation.baseline promoted: nothing is promoted at {where} (no "
                            "promoted.json); promote a model first (e.g. a run with baseline: base) or choose "
                            "baseline: base or file")
    return pointer


def validate(config: Phase1aConfig, model: ResolvedModel, validation_path: Path, adapter_dir: Path) -> ValidationResult:
    settings, endpoint = config.validation, config.endpoint_for(config.promotion.to)
    device, trust = training_device(), config.model.trust_remote_code
    # 1. sample; the baseline read before any model loads
    rows = TokenRows.load(validation_path)
    scoring = Scoring(load_tokenizer(Path(model.path), trust), rows, np.arange(min(len(rows), settings.max_examples)),
                      settings, config.cache_dir, model.fingerprint, [load_benchmark(b) for b in settings.benchmarks])
    file_baseline = read_baseline_file(settings.baseline_file, scoring.sample) if settings.baseline == "file" else None
    pointer = _promoted_pointer(config) if settings.baseline == "promoted" else None
    # 2. score
    base, base_cached, candidate = _score(scoring, Path(model.path), Path(adapter_dir), trust)
    # 3. baseline
    if file_baseline is not None:
        baseline = file_baseline
    elif pointer is not None:
        source = PromotedSource(Path(model.path), config.data.staging_dir, endpoint, trust)
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


def _score(scoring: Scoring, model_dir: Path, adapter_dir: Path,
           trust_remote_code: bool) -> tuple[Metrics, bool, Metrics]:
    """(base metrics, whether they came from the cache, candidate metrics)."""
    device = training_device()
    if is_adapter(adapter_dir):
        model = load_for_eval(model_dir, adapter_dir, device, trust_remote_code)
        base, base_cached = base_model_metrics(model, scoring)
    else:  # a full fine-tune: the base is another set of weights
        base_model = load_for_eval(model_dir, None, device, trust_remote_code)
        base, base_cached = base_model_metrics(base_model, scoring)
        del base_model
        model = load_for_eval(model_dir, adapter_dir, device, trust_remote_code)
    model = for_scoring(model)
    return base, base_cached, scoring.with_benchmarks(scoring.evaluate(model, "candidate"), model, None)


# ---- reading a verdict ---------------------------------------------------------------------------------------

def format_table(verdict: ValidationResult) -> str:
    rows = ValidationSection.of(verdict).table()
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    verdict_text = "PASS" if verdict.passed else "FAIL: " + "; ".join(verdict.reasons)
    return "\n".join(lines + [f"baseline: {verdict.baseline.source}; examples: {verdict.candidate.examples}, "
                              f"tokens: {verdict.candidate.tokens}; gate: {verdict_text}"])


def present_validation(verdict: ValidationResult, run_dir: Path) -> None:
    """What a run shows of its verdict, cached or not: candidate_metrics.json and the table artifact, and the
    table printed."""
    publish_validation(verdict, run_dir)
    print(format_table(verdict))


def publish_validation(verdict: ValidationResult, run_dir: Path) -> Path:
    """candidate_metrics.json in the run directory (usable as another run's baseline_file) and a table artifact."""
    path = write_baseline_file(Path(run_dir) / layout.CANDIDATE_METRICS, verdict.candidate, verdict.sample_fingerprint,
                               source=f"run {Path(run_dir).name}")
    try:
        from prefect.artifacts import create_table_artifact
    except ImportError:
        return path
    table = [{"metric": name, **{k: "-" if v is None else f"{v:.4f}" for k, v in row.model_dump().items()}}
             for name, row in ValidationSection.of(verdict).metrics.items()]
    create_table_artifact(key="validation", table=table,
                          description=f"phase1a validation against {verdict.baseline.source}: "
                                      + ("PASS" if verdict.passed else "FAIL: " + "; ".join(verdict.reasons)))
    return path


# ---- the task ------------------------------------------------------------------------------------------------

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


def verdict_fingerprint(config: Phase1aConfig, model: ResolvedModel, data: TokenizedData, trained: TrainResult) -> str:
    """The validate stage's key, from its own inputs: the same weights on the same held-out examples against
    the same baseline give the same verdict."""
    # Evaluation during training changes the verdict only through the weights (early stopping): the adapter.
    # No path enters (validation_key): the verdict is found from any checkout or host.
    settings = validation_key(config.validation, exclude=DURING_TRAINING_FIELDS)
    return hash_json({"model": model.fingerprint, "adapter": sha256_tree(Path(trained.adapter_dir), ADAPTER_FILES),
                      "data": data.fingerprint, "settings": settings,
                      "baseline": baseline_identity(config)})


@task(name="validate", cache_policy=StageCache(fingerprint=verdict_fingerprint), persist_result=True,
      result_serializer="json")
def validate_task(config: Phase1aConfig, model: ResolvedModel, data: TokenizedData,
                  trained: TrainResult) -> ValidationResult:
    return validate(config, model, Path(data.validation_path), Path(trained.adapter_dir))
