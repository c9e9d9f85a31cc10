"""The progress reporter's numbers and sinks: JSONL, events, TensorBoard."""
import json

import pytest
import torch

from phase1a.core.meter import MeterSettings
from phase1a.train.progress import ProgressReporter, StepStats, Yardstick


def test_records_mfu_remaining_and_on_track_and_writes_every_sink(tmp_path):
    yardstick = Yardstick(model_flops_per_token=1e9, peak_flops=1e12, planned_seconds=100.0)
    reporter = ProgressReporter(tmp_path, total_steps=10, start_step=2, yardstick=yardstick)
    reporter.read_every = 0
    (first,) = reporter.step(3, StepStats(loss=2.0, lr=1e-3, grad_norm=0.5, tokens=1000), elapsed=4.0,
                             prior_seconds=50.0)
    # 1000 tokens in 4 s: 250 tokens/s x 1 GFLOP = 0.25 TFLOP/s of a 1 TFLOP/s peak.
    assert first["mfu"] == pytest.approx(0.25) and first["tokens_per_s"] == pytest.approx(250.0)
    assert first["remaining_s"] == pytest.approx(7 * 4.0)  # seven steps left at four seconds a step
    assert first["projected_s"] == pytest.approx(50 + 4 + 28) and first["on_track"] is True
    (late,) = reporter.step(4, StepStats(loss=1.5, lr=1e-3, grad_norm=0.4, tokens=1000), elapsed=40.0,
                            prior_seconds=50.0)
    assert late["on_track"] is False  # 90 s projected past the plan's 100 s + 10 %
    reporter.event("out_of_memory", step=5, micro_batch_size=2)
    reporter.close()

    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [3, 4] and lines[0]["peak_memory_gib"] > 0
    (event,) = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert event["event"] == "out_of_memory" and event["micro_batch_size"] == 2
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(tmp_path / "tensorboard"))
    board.Reload()
    assert [s.value for s in board.Scalars("train/loss")] == [2.0, 1.5]
    assert "train/mfu" in board.Tags()["scalars"]


def test_other_ranks_write_nothing(tmp_path):
    reporter = ProgressReporter(tmp_path, 4, 0, display=MeterSettings(), enabled=False)
    reporter.read_every = 0
    (record,) = reporter.step(1, StepStats(loss=1.0, lr=0.1, grad_norm=1.0, tokens=10), elapsed=1.0)
    reporter.event("resumed", from_step=0)
    reporter.close()
    assert record["mfu"] is None and record["on_track"] is None and list(tmp_path.iterdir()) == []


def test_without_a_terminal_training_logs_lines_not_bar_frames(tmp_path, capsys):
    """A worker's log gets a line every `progress.interval` (the first step's and the last's always) and each
    evaluation's and event's, never a tqdm frame."""
    now = [0.0]
    display = MeterSettings(display="lines", interval_seconds=8.0, clock=lambda: now[0])
    reporter = ProgressReporter(tmp_path, total_steps=4, start_step=0, display=display)
    reporter.read_every = 0
    for step in range(1, 5):
        now[0] = 4.0 * step  # steps 1 (the first), 3 (8 s after it) and 4 (the last) are due
        reporter.step(step, StepStats(loss=1.0 / step, lr=1e-3, grad_norm=0.5, tokens=100), elapsed=2.0 * step)
    reporter.evaluation({"step": 4, "eval_loss": 0.5, "eval_token_accuracy": 0.75, "examples": 8, "tokens": 40,
                         "seconds": 0.2, "best": True})
    reporter.event("resumed", from_step=2)
    reporter.close()
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "train: step 1 of 4 (25.0 %), loss 1.0000, 50 tokens/s, 6.0 s left",
        "train: step 3 of 4 (75.0 %), loss 0.3333, 50 tokens/s, 2.0 s left",
        "train: step 4 of 4 (100.0 %), loss 0.2500, 50 tokens/s, 0.0 s left",
        "eval at step 4: loss 0.5000, token accuracy 0.7500 on 8 examples in 0.2 s (best)",
        "resumed: from_step=2",
    ]


def test_device_numbers_are_read_once_per_read_not_once_per_step(tmp_path, monkeypatch):
    """Steps hand their loss and grad norm over as tensors; nothing is read (nor written) until a read is due, then
    every pending step's numbers come back in one transfer, each step keeping its own record."""
    import phase1a.train.progress as progress

    reads = []
    plain = progress._read
    monkeypatch.setattr(progress, "_read", lambda values: reads.append(len(values)) or plain(values))
    reporter = ProgressReporter(tmp_path, total_steps=5, start_step=0)
    reporter.read_every = 3600.0
    first = reporter.step(1, StepStats(loss=torch.tensor(1.0), lr=1e-3, grad_norm=torch.tensor(0.5), tokens=10),
                          elapsed=1.0)
    assert [r["step"] for r in first] == [1] and reads == [2]  # the first step shows at once
    reads.clear()
    for step in range(2, 5):
        written = reporter.step(step, StepStats(loss=torch.tensor(1.0 / step), lr=1e-3,
                                                grad_norm=torch.tensor(0.5), tokens=10), elapsed=float(step))
        assert written == []
    assert reads == [] and len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 1
    last = reporter.step(5, StepStats(loss=torch.tensor(0.2), lr=1e-3, grad_norm=torch.tensor(0.5), tokens=10),
                         elapsed=5.0)  # the last step reads
    assert reads == [8] and [r["step"] for r in last] == [2, 3, 4, 5]
    assert [r["loss"] for r in last] == pytest.approx([0.5, 1 / 3, 0.25, 0.2])
    reporter.close()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 5
