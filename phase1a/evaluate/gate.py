"""The gate: the candidate against a baseline, metric by metric, each within its configured tolerance.

A metric with a tolerance is gated; one without (None) is only reported. A gated metric missing on either
side is an error, never a silent pass: a gate that cannot compare must not let a model through.
"""
from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ValidationError

from phase1a.config.schema import ValidationConfig
from phase1a.core.atomic import write_atomically
from phase1a.evaluate.result import HIGHER_IS_BETTER, Baseline, GateCheck, Metrics

# Float noise in `baseline - tolerance` (0.51 - 0.01 is 0.5000000000000001) must not fail an exact tie.
_EPSILON = 1e-12


class BaselineError(ValueError):
    """No usable baseline: a missing file or pointer, a gated metric without a value, another sample."""


class BaselineFile(BaseModel):
    """What `validation.baseline_file` holds; every run writes its candidate's as candidate_metrics.json."""

    source: str = ""
    sample_fingerprint: str | None = None  # when present it must match this run's sample
    metrics: dict[str, float | None]


def gate(candidate: Metrics, baseline: Baseline, settings: ValidationConfig) -> list[GateCheck]:
    """Each metric with a tolerance: the held-out sample's (`tolerances`), then each benchmark's."""
    checks = []
    for metric, tolerance, setting in _tolerances(settings, candidate):
        ours, theirs = candidate.value(metric), baseline.metrics.get(metric)
        if ours is None:
            why = candidate.unavailable.get(metric, "not computed")
            raise BaselineError(f"gate metric {metric}: no value for the candidate ({why}); set "
                                f"{setting}: null to leave it out of the gate")
        if theirs is None:
            why = baseline.unavailable.get(metric, "no value recorded")
            raise BaselineError(f"gate metric {metric}: the baseline ({baseline.source}) has no value for it "
                                f"({why}); set {setting}: null to leave it out of the gate")
        higher = candidate.higher_is_better(metric)
        # Written so that NaN on either side fails: every comparison with NaN is False.
        passed = ours >= theirs - tolerance - _EPSILON if higher else ours <= theirs + tolerance + _EPSILON
        checks.append(GateCheck(metric=metric, candidate=ours, baseline=theirs, tolerance=tolerance,
                                higher_is_better=higher, passed=bool(passed)))
    return checks


def _tolerances(settings: ValidationConfig, candidate: Metrics) -> list[tuple[str, float, str]]:
    """(metric, tolerance, the setting that holds it) for each gated metric; a benchmark's row is named by its
    task's name, which a task YAML holds, so it is found among the candidate's scores by what was configured."""
    gated = [(metric, tolerance, f"validation.tolerances.{metric}")
             for metric, tolerance in settings.tolerances.model_dump().items() if tolerance is not None]
    for i, benchmark in enumerate(settings.benchmarks):
        if benchmark.tolerance is None:
            continue
        keys = [key for key, score in candidate.benchmarks.items()
                if (score.source, score.metric) == (benchmark.task, benchmark.metric)]
        gated.append((keys[0] if keys else f"{benchmark.task}/{benchmark.metric}", benchmark.tolerance,
                      f"validation.benchmarks[{i}].tolerance"))
    return gated


def read_baseline_file(path: Path, sample_fingerprint: str) -> Baseline:
    path = Path(path)
    if not path.is_file():
        raise BaselineError(f"validation.baseline_file: no such file: {path}")
    try:
        record = BaselineFile.model_validate(json.loads(path.read_text()))
    except (ValueError, ValidationError) as error:
        raise BaselineError(f"validation.baseline_file {path}: not a baseline metrics file "
                            f"({{\"metrics\": {{\"exact_match\": ..., \"loss\": ...}}}}): {error}") from None
    unknown = sorted(name for name in set(record.metrics) - set(HIGHER_IS_BETTER) if "/" not in name)
    if unknown:
        raise BaselineError(f"validation.baseline_file {path}: unknown metrics {unknown} "
                            f"(known: {', '.join(HIGHER_IS_BETTER)}, and benchmarks as task/metric)")
    if record.sample_fingerprint not in (None, sample_fingerprint):
        raise BaselineError(f"validation.baseline_file {path}: computed on another held-out sample "
                            f"({record.sample_fingerprint[:12]}, this run's is {sample_fingerprint[:12]}); "
                            "its numbers are not comparable")
    return Baseline(source=f"file {path}" + (f" ({record.source})" if record.source else ""),
                    metrics=record.metrics, sample_fingerprint=record.sample_fingerprint)


def write_baseline_file(path: Path, metrics: Metrics, sample_fingerprint: str, source: str) -> Path:
    record = BaselineFile(source=source, sample_fingerprint=sample_fingerprint,
                          metrics={name: metrics.value(name) for name in metrics.names()})
    write_atomically(Path(path), record.model_dump_json(indent=2) + "\n")  # another run may read it as its baseline
    return Path(path)
