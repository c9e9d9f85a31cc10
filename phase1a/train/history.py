"""The record of earlier training runs that the next plan reads: one JSON object a line in a JSONL file.

Each run appends a `RunRecord` after training: what it ran on, its measured tokens/s and how long the plan
said training would take against how long it took. The plan can then start from the measured throughput of
the same model on the same hardware instead of an assumed MFU.

    remembered throughput = the upper median tokens/s of the last `RECENT_RUNS` runs with the latest run's
                         knobs: one run slowed by a neighbour (a shared host, a throttled GPU) does not set the
                         next plan; of two runs, the faster, since contention only ever slows a run

    time_accuracy      = estimated_train_seconds / actual_train_seconds   (>1: the plan was pessimistic)

Appends take an exclusive flock and write each line with one write() on an O_APPEND descriptor, then fsync,
so concurrent writers (two runs finishing together) never interleave within a line and a crash loses at most
the line being written. Readers skip and count lines that do not parse, such as that torn last line, rather
than fail: a damaged history must never stop a plan.
"""
from __future__ import annotations

import fcntl
import json
import os
import statistics
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, Field, ValidationError, model_validator

from phase1a.core.logs import run_logger

if TYPE_CHECKING:
    from phase1a.store.base import Store

RECENT_RUNS = 5
ESTIMATE_BAND = 0.10  # an estimate within ±10 % of the measured time is on track (progress, plots, report.md)


def history_path(cache_dir: Path) -> Path:
    """Where a cache directory's runs are recorded: every run that shares `cache_dir` plans from them."""
    return Path(cache_dir) / "history.jsonl"


class RunRecord(BaseModel):
    run_id: str = Field(default_factory=lambda: uuid.uuid4().hex)  # one record's identity: the store's copy is its
    timestamp: datetime = Field(default_factory=lambda: datetime.now(timezone.utc))
    model_fingerprint: str
    model_name: str
    hardware: str  # catalogue key, "cpu", or for target cuda "cuda-<device name>" (core.hardware.history_kind)
    device_name: str
    precision: str
    method_kind: str = "lora"  # records written before this field were all LoRA runs
    world_size: int = 1  # the run's GPUs (ranks) on all its nodes: its tokens/s is theirs together
    micro_batch_size: int
    gradient_checkpointing: bool
    compile: bool = False
    cuda_graphs: bool = False
    dataloader_workers: int = 0
    max_seq_length: int
    tokens_per_second: float  # measured over the training run, checkpoint writes and evaluations excluded
    startup_seconds: float | None = None  # model load to the first step
    checkpoint_seconds_each: float | None = None
    checkpoint_upload_seconds_each: float | None = None  # with a store: one checkpoint's upload, in the background
    estimated_train_seconds: float | None
    actual_train_seconds: float
    # Evaluation's speeds for the next plan of this job (phase1a/plan/planner.py): the plan's (timed in calibration,
    # or remembered), the forward pass's corrected by this run's evaluations during training against their estimate.
    eval_forward_seconds_per_token: float | None = None
    eval_prefill_seconds_per_token: float | None = None
    eval_decode_seconds_per_step: float | None = None
    eval_decode_seconds_per_context_token: float = 0.0  # 0: a record written before steps were priced by context
    eval_training_forward_seconds_per_token: float | None = None  # an evaluation during training's forward pass
    eval_merge_seconds: float | None = None  # the validate stage's fold of an adapter into the weights
    eval_harness_seconds: float | None = None  # lm-eval's own seconds in a benchmark's scoring
    time_accuracy: float | None = None  # estimated / actual; filled in from those two when left out

    @model_validator(mode="after")
    def _fill_accuracy(self) -> RunRecord:
        if self.time_accuracy is None and self.estimated_train_seconds is not None and self.actual_train_seconds > 0:
            self.time_accuracy = self.estimated_train_seconds / self.actual_train_seconds
        return self


def append_run(path: Path, record: RunRecord) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = (record.model_dump_json() + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        # O_APPEND alone keeps one write() whole on local disks; the lock also covers network file systems
        # and the rare short write that would need a second write() call.
        fcntl.flock(fd, fcntl.LOCK_EX)
        written = 0
        while written < len(line):
            written += os.write(fd, line[written:])
        os.fsync(fd)
    finally:
        os.close(fd)  # closing releases the lock


def read_runs(path: Path) -> tuple[list[RunRecord], int]:
    """(records in file order, number of lines skipped as corrupt); a missing file is an empty history."""
    path = Path(path)
    if not path.exists():
        return [], 0
    records, skipped = [], 0
    with path.open("rb") as handle:
        for raw in handle:
            if not raw.strip():
                continue
            try:
                records.append(RunRecord.model_validate(json.loads(raw)))
            except (ValueError, ValidationError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
                skipped += 1
    return records, skipped


def _matching_runs(path: Path, model_fingerprint: str, hardware: str) -> list[RunRecord]:
    """Runs of this model on this hardware, oldest first."""
    records, _ = read_runs(path)
    matches = [(record.timestamp, index, record) for index, record in enumerate(records)
               if record.model_fingerprint == model_fingerprint and record.hardware == hardware]
    # By timestamp, then file order: histories copied between machines need not be in time order.
    return [record for _, _, record in sorted(matches, key=lambda item: (_utc(item[0]), item[1]))]


class Remembered(BaseModel):
    """What a plan takes from the history: the latest run's knobs and costs, the recent runs' throughput."""

    record: RunRecord  # the latest run of the model and method: its knobs, start-up and checkpoint seconds
    tokens_per_second: float  # the upper median over `runs`
    runs: int  # the latest runs with the record's knobs, at most RECENT_RUNS


def remembered(path: Path, model_fingerprint: str, hardware: str, method_kind: str,
               world_size: int = 1) -> Remembered | None:
    """The latest run of this model, method and hardware on as many GPUs (whatever its knobs: a plan may reuse
    them), with the upper median throughput of the recent runs that used the same knobs."""
    matches = [r for r in _matching_runs(path, model_fingerprint, hardware)
               if r.method_kind == method_kind and r.world_size == world_size]
    if not matches:
        return None
    latest = matches[-1]
    same = [r for r in matches if _knobs(r) == _knobs(latest)][-RECENT_RUNS:]
    return Remembered(record=latest, tokens_per_second=statistics.median_high([r.tokens_per_second for r in same]),
                      runs=len(same))


def _knobs(record: RunRecord) -> tuple:
    """What a run's tokens/s depends on beyond the model and hardware: its rows and how they were run."""
    return (record.precision, record.micro_batch_size, record.gradient_checkpointing, record.compile,
            record.cuda_graphs, record.dataloader_workers, record.max_seq_length)


# ---- the store ------------------------------------------------------------------------------------------------
# A host's history.jsonl is lost with the host. With a store every record is also an object of its own under
# `history/<model>/<hardware>/`, and a plan first copies the records of its model and hardware that its local
# file lacks: a fresh host plans from the throughput the last host measured.

def _store_prefix(model_fingerprint: str, hardware: str) -> str:
    return f"history/{model_fingerprint[:16]}/{hardware}/"


def share_record(store: Store, record: RunRecord) -> None:
    """The record into the store; a store that fails here costs the next fresh host a calibration, not the run."""
    name = f"{record.timestamp:%Y%m%dT%H%M%S}-{record.run_id}.json"
    key = _store_prefix(record.model_fingerprint, record.hardware) + name
    try:
        store.put(key, record.model_dump_json().encode())
    except Exception as error:  # noqa: BLE001 - the run itself is done and recorded locally
        run_logger().warning(f"{store.where(key)}: the run's throughput record was not stored ({type(error).__name__})")


def pull_records(store: Store, path: Path, model_fingerprint: str, hardware: str) -> int:
    """Append to the local history the store's records of this model and hardware that it lacks; their count."""
    known = {record.run_id for record in read_runs(path)[0]}
    pulled = 0
    for item in store.list(_store_prefix(model_fingerprint, hardware)):
        if item.key.rsplit("-", 1)[-1].removesuffix(".json") in known:
            continue
        fetched = store.get(item.key)
        try:
            record = RunRecord.model_validate_json(fetched.data) if fetched else None
        except ValidationError:
            record = None
        if record is not None and record.run_id not in known:
            append_run(path, record)
            known.add(record.run_id)
            pulled += 1
    return pulled


def _utc(moment: datetime) -> datetime:
    # Naive timestamps (hand-edited files) are taken as UTC so they compare with aware ones.
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=timezone.utc)
