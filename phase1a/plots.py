"""The run's plots, one home for all of them: PNG files a person looks at rather than reads.

    lengths.png             tokens per example, with p50, p99 and max_seq_length (drawn after tokenize)
    loss.png                training loss by step (raw and smoothed) and the evaluations' loss (eval.jsonl)
    throughput.png          tokens/s by step, and the plan's rate as a line
    estimate_vs_actual.png  the history's last runs: the plan's training seconds against the measured ones

matplotlib is imported on the first plot, not with this module: its import takes 1-2 s, and a night that
tokenizes one new shard or a run that only reads reports should not pay for it. Each plot takes paths and
returns the path it wrote, or None when there is nothing to draw (no training yet, an empty history).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from phase1a.data.lengths import LengthStats
from phase1a.train.history import ESTIMATE_BAND, read_runs
from phase1a.train.run_files import read_lines

DPI = 90  # small files: the run report embeds them in a Prefect artifact
SIZE = (8, 4)  # inches
SMOOTHING = 0.9  # the exponential moving average's weight on the past, as TensorBoard's slider
_BLUE, _RED, _GREY, _GREEN = "#4C72B0", "#C44E52", "#8C8C8C", "#55A868"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on training hosts
    import matplotlib.pyplot as plt

    return plt


def _save(figure, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=DPI)
    _pyplot().close(figure)
    return Path(path)


def by_step(lines: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of the lines that have `key`, in step order; a step written twice (a run resumed from a
    checkpoint before it repeats the steps after it) keeps its last value."""
    values = {int(line["step"]): float(line[key]) for line in lines
              if isinstance(line.get("step"), int) and isinstance(line.get(key), (int, float))}
    steps = np.array(sorted(values), dtype=np.int64)
    return steps, np.array([values[step] for step in steps], dtype=np.float64)


def smoothed(values: np.ndarray, weight: float = SMOOTHING) -> np.ndarray:
    """An exponential moving average, debiased so the first points are not pulled towards zero."""
    out, average = np.empty_like(values), 0.0
    for index, value in enumerate(values):
        average = weight * average + (1 - weight) * value
        out[index] = average / (1 - weight ** (index + 1))
    return out


def save_histogram(lengths: np.ndarray, stats: LengthStats, max_seq_length: int, path: Path) -> Path:
    """lengths.png: tokens per example, with p50, p99 and max_seq_length marked."""
    figure, axis = _pyplot().subplots(figsize=SIZE)
    axis.hist(lengths, bins=min(100, max(10, int(np.sqrt(lengths.size)))), color=_BLUE)
    marks = ((stats.p50, "p50", ":"), (stats.p99, "p99", "--"), (max_seq_length, "max_seq_length", "-"))
    for value, label, style in marks:
        axis.axvline(value, color=_RED, linestyle=style, label=f"{label} = {value:g}")
    axis.set_xlabel("tokens per example")
    axis.set_ylabel("examples")
    axis.set_title(f"{stats.count} examples, {stats.total_tokens} tokens")
    axis.legend()
    return _save(figure, path)


def save_loss(metrics_path: Path, eval_path: Path | None, path: Path) -> Path | None:
    """loss.png: training loss by step, its smoothed line, and the evaluations' loss (eval.jsonl, when training
    evaluated), the best evaluation marked. None without a training step."""
    steps, loss = by_step(read_lines(metrics_path), "loss")
    if steps.size == 0:
        return None
    figure, axis = _pyplot().subplots(figsize=SIZE)
    axis.plot(steps, loss, color=_BLUE, alpha=0.35, linewidth=1, label="train loss")
    axis.plot(steps, smoothed(loss), color=_BLUE, linewidth=2, label=f"train loss, smoothed ({SMOOTHING:g})")
    evaluations = read_lines(eval_path)
    eval_steps, eval_loss = by_step(evaluations, "eval_loss")
    if eval_steps.size:
        axis.plot(eval_steps, eval_loss, color=_RED, marker="o", linewidth=1.5, label="eval loss")
        best = [line for line in evaluations if line.get("best") and isinstance(line.get("eval_loss"), (int, float))]
        if best:
            axis.scatter([best[-1]["step"]], [best[-1]["eval_loss"]], s=160, facecolors="none", edgecolors=_RED,
                         linewidths=2, zorder=3, label=f"best eval: step {best[-1]['step']}")
    axis.set_xlabel("optimizer step")
    axis.set_ylabel("loss")
    axis.set_title(f"loss: {loss[0]:.4g} at step {steps[0]}, {loss[-1]:.4g} at step {steps[-1]}")
    axis.grid(alpha=0.3)
    axis.legend()
    return _save(figure, path)


def step_rates(lines: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """(steps, tokens/s of each step) from metrics.jsonl's `tokens` and `elapsed_s`: its `tokens_per_s` is the
    mean since the process started, which hides a slowdown. `elapsed_s` restarts with a resumed process, so a
    step whose elapsed time is below the one before it counts from zero."""
    steps, tokens = by_step(lines, "tokens")
    _, elapsed = by_step(lines, "elapsed_s")
    if steps.size == 0 or elapsed.size != steps.size:
        return np.array([], dtype=np.int64), np.array([])
    took = np.diff(elapsed, prepend=0.0)
    took = np.where(took > 0, took, elapsed)
    keep = took > 0
    return steps[keep], tokens[keep] / took[keep]


def save_throughput(metrics_path: Path, path: Path, planned: float | None = None) -> Path | None:
    """throughput.png: each step's tokens/s, smoothed, the mean since the start, and the plan's rate when known.
    None without a step."""
    lines = read_lines(metrics_path)
    steps, rate = step_rates(lines)
    mean_steps, mean = by_step(lines, "tokens_per_s")
    if steps.size == 0 and mean_steps.size == 0:
        return None
    figure, axis = _pyplot().subplots(figsize=SIZE)
    if steps.size:
        axis.plot(steps, rate, color=_GREEN, alpha=0.35, linewidth=1, label="tokens/s per step")
        axis.plot(steps, smoothed(rate), color=_GREEN, linewidth=2, label="tokens/s per step, smoothed")
    axis.plot(mean_steps, mean, color=_BLUE, linestyle=":", linewidth=1.5, label="mean since the start")
    if planned:
        axis.axhline(planned, color=_GREY, linestyle="--", label=f"planned {planned:,.0f} tokens/s")
    axis.set_xlabel("optimizer step")
    axis.set_ylabel("tokens per second")
    axis.set_ylim(bottom=0)
    shown = rate if steps.size else mean
    axis.set_title(f"throughput: median {np.median(shown):,.0f} tokens/s a step over {shown.size} steps")
    axis.grid(alpha=0.3)
    axis.legend()
    return _save(figure, path)


def save_estimate_vs_actual(history_path: Path, path: Path, last: int = 20) -> Path | None:
    """estimate_vs_actual.png: the last runs of the history (phase1a/train/history.py), the plan's training seconds
    against the measured ones on log axes, the ±10 % band around equality shaded, the newest run ringed.
    None when no run in the history has an estimate."""
    records, _ = read_runs(history_path)
    runs = [r for r in records if r.estimated_train_seconds and r.actual_train_seconds > 0][-last:]
    if not runs:
        return None
    actual = np.array([r.actual_train_seconds for r in runs])
    estimated = np.array([r.estimated_train_seconds for r in runs])
    inside = np.abs(estimated / actual - 1) <= ESTIMATE_BAND
    figure, axis = _pyplot().subplots(figsize=SIZE)
    low, high = min(actual.min(), estimated.min()) / 1.5, max(actual.max(), estimated.max()) * 1.5
    span = np.geomspace(low, high, 50)
    axis.fill_between(span, span * (1 - ESTIMATE_BAND), span * (1 + ESTIMATE_BAND), color=_GREEN, alpha=0.2,
                      label=f"±{ESTIMATE_BAND:.0%}")
    axis.plot(span, span, color=_GREY, linewidth=1, label="estimate = actual")
    axis.scatter(actual[inside], estimated[inside], color=_GREEN, label=f"within ±{ESTIMATE_BAND:.0%}", zorder=3)
    axis.scatter(actual[~inside], estimated[~inside], color=_RED, label="outside", zorder=3)
    axis.scatter(actual[-1:], estimated[-1:], s=160, facecolors="none", edgecolors="black", linewidths=1.5,
                 zorder=4, label=f"newest: {estimated[-1] / actual[-1] - 1:+.0%}")
    from matplotlib.ticker import LogFormatter

    axis.set_xscale("log")
    axis.set_yscale("log")
    for side in (axis.xaxis, axis.yaxis):  # seconds as plain numbers (30, 40), not 3x10^1
        side.set_major_formatter(LogFormatter(labelOnlyBase=False))
        side.set_minor_formatter(LogFormatter(labelOnlyBase=False))
    axis.set_xlim(low, high)
    axis.set_ylim(low, high)
    axis.set_xlabel("actual training seconds")
    axis.set_ylabel("estimated training seconds")
    runs_text = f"the last {len(runs)} runs" if len(runs) > 1 else "one run"
    axis.set_title(f"plan estimate vs actual, {runs_text}: {int(inside.sum())} within ±{ESTIMATE_BAND:.0%}")
    axis.grid(alpha=0.3, which="both")
    axis.legend(loc="best", fontsize="small")
    return _save(figure, path)
