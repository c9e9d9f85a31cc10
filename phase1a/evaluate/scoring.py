"""Scoring one held-out sample: every model of a validation scored alike (`Scoring`), and each model's metrics and
benchmark scores cached on disk by model, weights, sample and scoring, so a base model or a promoted version is
scored once (`cached`, `base_model_metrics`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property, partial
from pathlib import Path
from typing import Callable, TypeVar

import numpy as np
import torch
from pydantic import BaseModel

from phase1a.config.schema import Phase1aConfig, ValidationConfig
from phase1a.core.atomic import write_atomically
from phase1a.core.fingerprint import hash_json
from phase1a.core.hardware import training_dtype
from phase1a.evaluate.benchmarks import Benchmark, load_benchmark, score_benchmark
from phase1a.evaluate.metrics import evaluate, metric_settings_key, sample_fingerprint
from phase1a.evaluate.result import BenchmarkScore, Metrics
from phase1a.model.loading import adapter_off, load_tokenizer
from phase1a.model.result import ResolvedModel
from phase1a.train.packing import TokenRows

T = TypeVar("T", bound=BaseModel)


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

    @classmethod
    def of(cls, config: Phase1aConfig, model: ResolvedModel, validation_path: Path) -> "Scoring":
        """The validate stage's scoring of this run's held-out sample (its first `validation.max_examples`)."""
        settings, rows = config.validation, TokenRows.load(validation_path)
        return cls(load_tokenizer(Path(model.path), config.model.trust_remote_code), rows,
                   np.arange(min(len(rows), settings.max_examples)), settings, config.cache_dir, model.fingerprint,
                   [load_benchmark(b) for b in settings.benchmarks])

    def base_cached(self, device: torch.device) -> bool:
        """Whether the base model's metrics and each benchmark's score of it are cached: the validate stage then
        scores the candidate only (the plan's estimate counts what it will run)."""
        return self.cache_path("base", device).is_file() and all(
            self.benchmark_path(b, "base", device).is_file() for b in self.benchmarks)

    def benchmark_path(self, benchmark: Benchmark, weights: str, device: torch.device) -> Path:
        key = hash_json({"model": self.model_fingerprint, "weights": weights,
                         "benchmark": benchmark.identity(self.precision(device))})
        return Path(self.cache_dir) / "benchmarks" / f"{key[:32]}.json"

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
            scores[benchmark.key], _ = cached(self.benchmark_path(benchmark, weights, device), BenchmarkScore, compute)
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
    path = scoring.cache_path("base", next(model.parameters()).device)
    with adapter_off(model):
        metrics, from_cache = cached(path, Metrics, lambda: scoring.evaluate(model, "base"))
        return scoring.with_benchmarks(metrics, model, "base"), from_cache
