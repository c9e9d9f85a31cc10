"""Reading a verdict: each metric of base, baseline and candidate side by side with its delta (`metric_rows`), the
validation table as text with the gate's checks (`validation_table`: the printed table, report.md and the model
card lay it out), the table printed (`format_table`), candidate_metrics.json in the run directory and the table
as a Prefect artifact where Prefect is installed (`publish_validation`); a run shows both, cached or not
(`present_validation`)."""
from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel

from phase1a.core import layout
from phase1a.evaluate.gate import write_baseline_file
from phase1a.evaluate.result import GateCheck, ValidationResult


class MetricRow(BaseModel):
    base: float | None
    baseline: float | None
    candidate: float | None
    delta: float | None  # candidate - baseline


def metric_rows(verdict: ValidationResult) -> dict[str, MetricRow]:
    """Every metric the candidate has, with the base's and the baseline's value of it."""
    rows = {}
    for name in verdict.candidate.names():
        candidate, baseline = verdict.candidate.value(name), verdict.baseline.metrics.get(name)
        rows[name] = MetricRow(base=verdict.base.value(name), baseline=baseline, candidate=candidate,
                               delta=None if candidate is None or baseline is None else candidate - baseline)
    return rows


def validation_table(metrics: dict[str, MetricRow], checks: list[GateCheck]) -> list[tuple[str, ...]]:
    """The validation table as text, its header first: metric, base, baseline, candidate, delta and gate, for
    each metric some model has a value of."""
    by_metric = {check.metric: check for check in checks}
    cell = lambda value, spec=".4f": "-" if value is None else format(value, spec)  # noqa: E731
    rows = [("metric", "base", "baseline", "candidate", "delta", "gate")]
    for name, row in metrics.items():
        if any(value is not None for value in (row.base, row.baseline, row.candidate)):
            rows.append((name, cell(row.base), cell(row.baseline), cell(row.candidate), cell(row.delta, "+.4f"),
                         _gate_cell(by_metric.get(name))))
    return rows


def _gate_cell(check: GateCheck | None) -> str:
    if check is None:
        return "-"
    bound = ">= baseline -" if check.higher_is_better else "<= baseline +"
    return f"{'pass' if check.passed else 'FAIL'} ({bound} {check.tolerance:g})"


def format_table(verdict: ValidationResult) -> str:
    rows = validation_table(metric_rows(verdict), verdict.checks)
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
             for name, row in metric_rows(verdict).items()]
    create_table_artifact(key="validation", table=table,
                          description=f"phase1a validation against {verdict.baseline.source}: "
                                      + ("PASS" if verdict.passed else "FAIL: " + "; ".join(verdict.reasons)))
    return path
