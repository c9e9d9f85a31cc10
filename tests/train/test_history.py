import json
import multiprocessing
import multiprocessing.synchronize
from datetime import datetime, timedelta, timezone

import pytest

from phase1a.train.history import (
    RECENT_RUNS,
    RunRecord,
    append_run,
    read_runs,
    remembered,
)

T0 = datetime(2025, 1, 1, tzinfo=timezone.utc)


def record(**changes) -> RunRecord:
    fields = dict(timestamp=T0, model_fingerprint="m1", model_name="tiny", hardware="h100", device_name="NVIDIA H100",
                  precision="bfloat16", micro_batch_size=4, gradient_checkpointing=False, max_seq_length=1024,
                  tokens_per_second=1000.0, estimated_train_seconds=100.0, actual_train_seconds=100.0)
    return RunRecord(**{**fields, **changes})


def test_round_trip_and_accuracy_filled_in(tmp_path):
    path = tmp_path / "deep" / "dir" / "history.jsonl"  # parents are created
    first = record(estimated_train_seconds=120.0, actual_train_seconds=100.0)
    second = record(hardware="cpu", estimated_train_seconds=None)
    append_run(path, first)
    append_run(path, second)
    records, skipped = read_runs(path)
    assert records == [first, second] and skipped == 0
    assert records[0].time_accuracy == pytest.approx(1.2)
    assert records[1].time_accuracy is None


def test_the_latest_run_gives_the_knobs_and_lora_and_full_are_apart(tmp_path):
    path = tmp_path / "history.jsonl"
    # A line written before the method and knob fields existed still reads, as the LoRA run it was.
    old = record(timestamp=T0).model_dump(mode="json", exclude={"method_kind", "compile", "dataloader_workers"})
    path.write_text(json.dumps(old) + "\n")
    append_run(path, record(timestamp=T0 + timedelta(hours=1), method_kind="full", micro_batch_size=2,
                            compile=True, dataloader_workers=4, startup_seconds=31.5, checkpoint_seconds_each=4.2))
    lora = remembered(path, "m1", "h100", "lora").record
    assert (lora.micro_batch_size, lora.compile, lora.dataloader_workers) == (4, False, 0)
    full = remembered(path, "m1", "h100", "full").record
    assert (full.micro_batch_size, full.compile, full.dataloader_workers) == (2, True, 4)
    assert (full.startup_seconds, full.checkpoint_seconds_each) == (31.5, 4.2)
    assert remembered(path, "m1", "h200", "lora") is None
    assert remembered(path, "m1", "h100", "lora", world_size=8) is None  # one GPU's speed is not eight's
    append_run(path, record(timestamp=T0 + timedelta(hours=2), world_size=8, tokens_per_second=7000.0))
    assert remembered(path, "m1", "h100", "lora", world_size=8).tokens_per_second == 7000.0
    assert remembered(path, "m1", "h100", "lora").record.micro_batch_size == 4  # the one-GPU run's


def test_one_slowed_run_does_not_set_the_remembered_throughput(tmp_path):
    """A run that shared its host ran at 25 tokens/s after runs at ~215: the plan takes the upper median of the
    recent runs with the same knobs, not the latest alone; runs with other knobs do not count."""
    path = tmp_path / "history.jsonl"
    speeds = [50.0, 210.0, 215.0, 220.0, 212.0, 25.0]  # the first falls out of the last RECENT_RUNS
    for hour, speed in enumerate(speeds):
        append_run(path, record(timestamp=T0 + timedelta(hours=hour), tokens_per_second=speed))
    append_run(path, record(timestamp=T0 - timedelta(hours=1), tokens_per_second=9.0, micro_batch_size=8))
    past = remembered(path, "m1", "h100", "lora")
    assert past.runs == RECENT_RUNS == 5 and past.record.tokens_per_second == 25.0  # the knobs: the latest run's
    assert past.tokens_per_second == 212.0  # sorted 25, 210, 212, 215, 220
    append_run(path, record(timestamp=T0 + timedelta(hours=9), tokens_per_second=400.0, max_seq_length=512))
    changed = remembered(path, "m1", "h100", "lora")  # shorter rows: a new series
    assert (changed.runs, changed.tokens_per_second) == (1, 400.0)
    append_run(path, record(timestamp=T0 + timedelta(hours=10), tokens_per_second=100.0, max_seq_length=512))
    assert remembered(path, "m1", "h100", "lora").tokens_per_second == 400.0  # of two, the faster


def test_the_latest_run_by_its_time_of_its_own_model_and_hardware(tmp_path):
    path = tmp_path / "history.jsonl"
    append_run(path, record(timestamp=T0 + timedelta(hours=2), tokens_per_second=2000.0, micro_batch_size=8))
    append_run(path, record(timestamp=T0, tokens_per_second=1000.0))  # older, though written later
    append_run(path, record(timestamp=T0 + timedelta(hours=4), tokens_per_second=9999.0, hardware="a100-80gb"))
    append_run(path, record(timestamp=T0 + timedelta(hours=5), tokens_per_second=7777.0, model_fingerprint="m2"))
    latest = remembered(path, "m1", "h100", "lora")
    assert latest.record.micro_batch_size == 8 and (latest.runs, latest.tokens_per_second) == (1, 2000.0)
    assert remembered(path, "m1", "l4", "lora") is None
    assert remembered(path, "m2", "h100", "lora").tokens_per_second == 7777.0


def test_corrupt_lines_are_skipped_and_counted(tmp_path):
    path = tmp_path / "history.jsonl"
    append_run(path, record(tokens_per_second=1500.0))
    with path.open("a") as handle:
        handle.write("{not json\n")
        handle.write(json.dumps({"model_fingerprint": "m1"}) + "\n")  # valid JSON, not a record
        handle.write("\n")  # blank lines are not corruption
    append_run(path, record(timestamp=T0 + timedelta(seconds=1), tokens_per_second=2500.0))
    with path.open("ab") as handle:
        handle.write(b'{"timestamp": "2025-01-0')  # torn last line of a crashed writer
    records, skipped = read_runs(path)
    assert [r.tokens_per_second for r in records] == [1500.0, 2500.0] and skipped == 3
    assert remembered(path, "m1", "h100", "lora").record.tokens_per_second == 2500.0


def test_missing_file_is_an_empty_history(tmp_path):
    path = tmp_path / "absent.jsonl"
    assert read_runs(path) == ([], 0)
    assert remembered(path, "m1", "h100", "lora") is None


def _append_many(path: str, writer: int, count: int, start: "multiprocessing.synchronize.Barrier") -> None:
    start.wait(60)  # a barrier: both writers begin together, so their appends overlap
    for i in range(count):
        # A long model name makes each line several kB, so a torn or interleaved write would show.
        append_run(path, record(model_name=f"w{writer}-" + "x" * 5000, tokens_per_second=float(writer * 10_000 + i)))


def test_concurrent_appends_from_two_processes_all_land(tmp_path):
    path = tmp_path / "history.jsonl"
    context = multiprocessing.get_context("spawn")
    start = context.Barrier(2)
    writers = [context.Process(target=_append_many, args=(str(path), w, 200, start)) for w in (1, 2)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(timeout=120)
        assert writer.exitcode == 0
    records, skipped = read_runs(path)
    assert skipped == 0 and len(records) == 400
    assert sorted(r.tokens_per_second for r in records) == sorted(
        float(w * 10_000 + i) for w in (1, 2) for i in range(200))
