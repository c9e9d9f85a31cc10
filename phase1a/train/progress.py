"""Honest progress for a training run: one record per optimizer step, to every sink that is available.

Sinks: `metrics.jsonl` in the run directory (always; appended, so a resumed run continues the curve; events
such as a resume or an out-of-memory back-off go to `events.jsonl`, evaluations during training to
`eval.jsonl`), where a person watches (as the other stages show theirs, phase1a/core/meter.py: a terminal bar with
loss, tokens/s and ETA where stderr is a terminal, else a log line every `progress.interval` through the run's
logger, as a worker's log needs), TensorBoard under `tensorboard/` (when the `tensorboard` package is
installed), and a Prefect progress artifact `train-progress` (inside a Prefect run).

Per step: loss, learning rate, grad norm, tokens, tokens/s over this process's steps, MFU, peak accelerator
memory, GPU utilisation (NVML, when present), elapsed, remaining, and whether the run is on track against the
plan. A step's loss and gradient norm arrive as tensors on the device; they are read in one transfer for all the
steps since the last read, once `READ_EVERY_SECONDS` has passed (and at the first step, before an evaluation,
a checkpoint, the end), so that training never waits for the device a step at a time. Each step still gets its
own record; GPU utilisation is read at each read. MFU counts model FLOPs only: 4N a token for LoRA (6N full)
plus attention, never the 2N that checkpointing recomputes, over the device's peak dense bf16 FLOP/s. `on_track`
compares the projected train time with the plan's estimate: within 10 % is on track.
"""
from __future__ import annotations

import json
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from phase1a.core import layout
from phase1a.core.logs import run_logger
from phase1a.core.meter import ARTIFACT_EVERY_SECONDS, MeterSettings, ProgressArtifact, emit, resolved_display
from phase1a.core.units import GIB, KIB, format_seconds
from phase1a.model.cost_model import mfu
from phase1a.train.history import ESTIMATE_BAND
from phase1a.train.run_files import event_line


@dataclass(frozen=True)
class Yardstick:
    """What a run's progress is measured against; None leaves that measure out."""

    model_flops_per_token: float | None = None  # MFU's numerator, per token
    peak_flops: float | None = None  # MFU's denominator: the device's dense bf16 peak
    planned_seconds: float | None = None  # the plan's train estimate: `on_track`


READ_EVERY_SECONDS = 1.0  # how often the pending steps' numbers are read from the device


@dataclass(frozen=True)
class StepStats:
    """What one optimizer step reports; loss and grad norm may be tensors on the device, read when due."""

    loss: float | torch.Tensor
    lr: float
    grad_norm: float | torch.Tensor
    tokens: int


@dataclass(frozen=True)
class _Pending:
    step: int
    stats: StepStats
    elapsed: float
    prior_seconds: float


class ProgressReporter:
    read_every = READ_EVERY_SECONDS  # seconds between reads of the pending steps' numbers (0: every step)

    def __init__(self, output_dir: Path, total_steps: int, start_step: int, yardstick: Yardstick = Yardstick(), *,
                 display: MeterSettings | None = None, enabled: bool = True):
        """`display`: how progress shows (`current_settings()`, the process's `progress`); None: not at all.
        `enabled` False (ranks other than 0): the numbers are computed, nothing is written or shown."""
        self.total_steps, self.start_step, self.yardstick = total_steps, start_step, yardstick
        self.output_dir, self.enabled = Path(output_dir), enabled
        self.metrics = open(Path(output_dir) / layout.METRICS, "a") if enabled else None
        self.evaluations = None  # eval.jsonl, opened at the first evaluation: a run without any has no file
        self.events = open(Path(output_dir) / layout.EVENTS, "a") if enabled else None
        self.watch = _Watch(display if enabled else None, total_steps, start_step)
        self.tensorboard = _tensorboard(Path(output_dir) / "tensorboard") if enabled else None
        self.artifact = ProgressArtifact.create("train", "phase1a training: optimizer steps done") if enabled else None
        if self.artifact is not None and start_step:
            self.artifact.update(100.0 * start_step / max(total_steps, 1), "resumed")
        self.artifact_at, self.tokens = 0.0, 0
        self.pending: list[_Pending] = []
        self.read_at = time.monotonic()
        self.mfus: list[float] = []  # every step's, for the run's mean

    def step(self, step: int, stats: StepStats, elapsed: float, prior_seconds: float = 0.0) -> list[dict]:
        """`step` counts from 1; `elapsed` is this process's training time, `prior_seconds` what a resumed run
        had already spent before its checkpoint. Returns the records written now (none until a read is due)."""
        self.pending.append(_Pending(step, stats, elapsed, prior_seconds))
        self.watch.advance()
        first = step == self.start_step + 1  # the first step shows at once: training has started
        if first or step == self.total_steps or time.monotonic() - self.read_at >= self.read_every:
            return self.flush()
        return []

    def flush(self) -> list[dict]:
        """The pending steps' numbers, read from the device at once, each written as its step's record."""
        pending, self.pending = self.pending, []
        self.read_at = time.monotonic()
        if not pending:
            return []
        values = _read([value for p in pending for value in (p.stats.loss, p.stats.grad_norm)])
        records = [self._record(p, values[2 * k], values[2 * k + 1]) for k, p in enumerate(pending)]
        last = pending[-1]
        if self.enabled and (gpu := _gpu_utilization()) is not None:
            records[-1]["gpu_utilization"] = gpu
        for record in records:
            self._write(self.metrics, record)
        self._show(records[-1], last.step)
        return records

    def _record(self, pending: _Pending, loss: float, grad_norm: float) -> dict:
        step, stats, elapsed, prior_seconds = pending.step, pending.stats, pending.elapsed, pending.prior_seconds
        tokens, yardstick = stats.tokens, self.yardstick
        self.tokens += tokens
        done = step - self.start_step
        tokens_per_second = self.tokens / max(elapsed, 1e-9)
        remaining = (self.total_steps - step) * elapsed / max(done, 1)
        record = {"step": step, "loss": round(loss, 6), "lr": stats.lr, "grad_norm": round(grad_norm, 6),
                  "tokens": tokens,
                  "tokens_per_s": round(tokens_per_second, 1), "elapsed_s": round(elapsed, 3),
                  "remaining_s": round(remaining, 1), "mfu": None, "peak_memory_gib": round(_peak_memory_gib(), 3),
                  "gpu_utilization": None, "on_track": None}
        if yardstick.model_flops_per_token and yardstick.peak_flops:
            record["mfu"] = mfu(tokens_per_second, yardstick.model_flops_per_token, yardstick.peak_flops)
            self.mfus.append(record["mfu"])
        if yardstick.planned_seconds:
            projected = prior_seconds + elapsed + remaining
            record["projected_s"] = round(projected, 1)
            record["on_track"] = projected <= yardstick.planned_seconds * (1 + ESTIMATE_BAND)
        for key in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_memory_gib"):
            if self.tensorboard is not None and record.get(key) is not None:
                self.tensorboard.add_scalar(f"train/{key}", record[key], step)
        return record

    def _show(self, record: dict, step: int) -> None:
        """The latest record where a person watches: the bar's numbers, a line when one is due, the artifact."""
        if self.tensorboard is not None and record.get("gpu_utilization") is not None:
            self.tensorboard.add_scalar("train/gpu_utilization", record["gpu_utilization"], step)
        line = self.watch.show(step, self.total_steps, record["loss"], record["tokens_per_s"], record["remaining_s"])
        due = time.monotonic() - self.artifact_at > ARTIFACT_EVERY_SECONDS or step == self.total_steps
        if self.artifact is not None and due:
            self.artifact.update(100.0 * step / self.total_steps, line)
            self.artifact_at = time.monotonic()

    def evaluation(self, record: dict) -> None:
        """`eval.jsonl` (phase1a/train/evaluation.py: EvalPoint, one line an evaluation during training),
        TensorBoard `eval/loss` and `eval/token_accuracy`, and a line above the bar."""
        self.flush()
        if not self.enabled:
            return
        if self.evaluations is None:
            self.evaluations = open(self.output_dir / layout.EVALUATIONS, "a")
        self._write(self.evaluations, record)
        if self.tensorboard is not None:
            self.tensorboard.add_scalar("eval/loss", record["eval_loss"], record["step"])
            self.tensorboard.add_scalar("eval/token_accuracy", record["eval_token_accuracy"], record["step"])
        self.watch.say(f"eval at step {record['step']}: loss {record['eval_loss']:.4f}, token accuracy "
                       f"{record['eval_token_accuracy']:.4f} on {record['examples']} examples in "
                       f"{record['seconds']:.1f} s" + (" (best)" if record["best"] else ""))

    def event(self, kind: str, **fields) -> None:
        """`events.jsonl`: a resume, an out-of-memory back-off, a preemption checkpoint, with the time."""
        self.flush()
        self._write(self.events, event_line(kind, **fields))
        if self.events is not None:
            self.watch.say(f"{kind}: " + ", ".join(f"{k}={v}" for k, v in fields.items()))

    def close(self) -> None:
        self.flush()
        self.watch.close()
        for sink in (self.metrics, self.evaluations, self.events, self.tensorboard):
            if sink is not None:
                sink.close()

    @staticmethod
    def _write(sink, record: dict) -> None:
        if sink is not None:
            sink.write(json.dumps(record) + "\n")
            sink.flush()  # a killed run keeps every step it finished


def _read(values: list) -> list[float]:
    """Numbers, some of them tensors on a device: those read in one transfer (one wait for the device). Called
    by `flush` at the reporter's cadence, after a step, never inside one."""
    tensors = [value for value in values if isinstance(value, torch.Tensor)]
    read = iter(torch.stack([t.detach().reshape(()).double() for t in tensors]).tolist() if tensors else [])
    return [next(read) if isinstance(value, torch.Tensor) else float(value) for value in values]


def _peak_memory_gib() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / GIB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * KIB / GIB  # KiB on Linux: the process's peak RSS


def _gpu_utilization() -> int | None:
    if not torch.cuda.is_available():
        return None
    try:
        return int(torch.cuda.utilization())  # NVML: needs nvidia-ml-py
    except Exception:  # no NVML on this host: the field stays empty rather than failing a run
        return None


def _tensorboard(log_dir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # the tensorboard package is optional on bare GPU hosts
        return None
    return SummaryWriter(log_dir=str(log_dir))


class _Watch:
    """Where a person watches training: a tqdm bar (a terminal), a line every `interval` through the run's logger
    (a worker's log; the first step, the last and every evaluation and event always), or nothing (`off`, ranks
    other than 0, no display settings)."""

    def __init__(self, settings: MeterSettings | None, total: int, initial: int) -> None:
        self.mode = resolved_display(settings) if settings is not None else "off"
        self.interval, self.clock = (settings.interval_seconds, settings.clock) if settings else (0.0, time.monotonic)
        self.logger = run_logger() if self.mode == "lines" else None
        self.bar = _progress_bar(self.mode == "bar", total, initial)
        self.line_at: float | None = None

    def advance(self) -> None:
        self.bar.update(1)

    def show(self, step: int, total: int, loss: float, tokens_per_second: float, remaining: float) -> str:
        """The bar's numbers; a line when one is due. Returns the line (the artifact's description)."""
        line = (f"train: step {step} of {total} ({100.0 * step / max(total, 1):.1f} %), loss {loss:.4f}, "
                f"{tokens_per_second:,.0f} tokens/s, {format_seconds(remaining)} left")
        self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_second:.0f}")
        now = self.clock()
        if self.mode == "lines" and (self.line_at is None or now - self.line_at >= self.interval or step == total):
            emit(self.logger, line)
            self.line_at = now
        return line

    def say(self, line: str) -> None:
        if self.mode == "bar":
            self.bar.write(line)
        elif self.mode == "lines":
            emit(self.logger, line)

    def close(self) -> None:
        self.bar.close()


def _progress_bar(enabled: bool, total: int, initial: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc="train", unit="step", disable=not enabled, dynamic_ncols=True)
