"""Tokenize's first pass: raw records to token ids, labels and per-example scalars, a chunk of records at a
time, in this process or in a pool of worker processes.

Why a pool: per record, parsing the JSON, reading the record's shape, assembling the chat template and
hashing the content are Python. The Rust tokenizer threads by itself, but the Python part holds one core, so
one process cannot fill a 16-core GPU host. Chunks are independent: N worker processes encode N chunks at
once, each with one tokenizer thread, so the stage's wall time is about (CPU per example x examples) / N.

What does not divide is the parent's share, so the parent does as little as it can: it reads each shard as
one stream (it must: a compressed file decompresses in order) and cuts it into runs of CHUNK records, each
one bytes object or Arrow buffer (phase1a/data/datasource.py's record runs), never a Python object per record. A
worker decodes its run, encodes it and readies its part of the shard's output (the job, phase1a/data/shards.py);
the parent takes results in source order, so the output is byte for byte the same for any worker count. At
most two chunks per worker are in flight, so RAM does not grow with the data. Measured: docs/benchmarks.md.
"""
from __future__ import annotations

import gc
import hashlib
import os
import sys
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import TypeVar

import numpy as np

from phase1a.core.hardware import usable_cores
from phase1a.core.units import MIB
from phase1a.data.datasource import RecordRun, Shard, SourceRecord, describe, record_runs
from phase1a.data.records import NOTHING_TO_TRAIN, BadRecords, RecordError, parse_json_record, to_conversation
from phase1a.data.render import Renderer, TokenizedChunk, tokenize_conversations

CHUNK = 4096  # records per batched tokenizer call, per task of a worker, and per record batch of a shard's tokens
SHOWN_SKIPS = 5  # skipped records quoted in the report; every skip is counted
# auto: one worker per 8 MiB of input (~14k chat records, ~3 s of one core's work at the 200 us a record
# measured on 500k): a worker's start-up, its fork and first render of each template (~0.5 s), stays small.
BYTES_PER_WORKER = 8 * MIB
_IN_FLIGHT_PER_WORKER = 2
# Forked on Linux, as datasets.map(num_proc) and torch's DataLoader do: a worker starts in milliseconds and
# inherits the imported tokenizer. Spawned (a fresh interpreter that re-imports the entry point, ~8 s with
# Prefect and transformers) where fork is unsafe or absent (macOS, Windows).
_START = get_context("fork" if sys.platform == "linux" else "spawn")


@dataclass(frozen=True)
class EncodeSettings:
    """What reading and rendering a record needs (a `phase1a.data.records.RecordSettings`), and the bad-record
    policy."""

    format: str = "auto"
    field_map: dict[str, str] = field(default_factory=dict)
    role_map: dict[str, str] = field(default_factory=dict)
    train_on_inputs: bool = False
    bad_records: BadRecords = "skip_empty"


@dataclass
class EncodedChunk:
    shard: int  # a chunk never spans two shards: each shard's encoding is cached on its own (phase1a/data/shards.py)
    tokens: TokenizedChunk | None  # None when every record of the chunk was skipped
    places: np.ndarray  # (n, 2): shard and line/row of each example, for messages that point at the source
    keys: np.ndarray  # uint64 content hash per example: the held-out split and duplicate detection
    skipped: Counter[str]
    shown: list[str]  # the first few skipped records' messages

    @property
    def records(self) -> int:
        """The source records this chunk read: its examples and the bad records it skipped."""
        return len(self.places) + sum(self.skipped.values())

    @property
    def token_count(self) -> int:
        return 0 if self.tokens is None else int(self.tokens.input_ids.size)


class ChunkEncoder:
    """Encodes chunks of records; keeps the renderer's per-shape recipes across chunks."""

    def __init__(self, tokenizer, shards: list[Shard], settings: EncodeSettings) -> None:
        self.tokenizer, self.shards, self.settings = tokenizer, shards, settings
        self.renderer = Renderer(tokenizer, settings.train_on_inputs)

    def __call__(self, records: list[SourceRecord]) -> EncodedChunk:
        skipped: Counter[str] = Counter()
        shown: list[str] = []
        places, keys, segments = [], [], []
        for record in records:
            where = describe(self.shards, record.shard, record.index)
            try:
                conversation = to_conversation(parse_json_record(where, record.raw), where, self.settings)
            except RecordError as error:
                if not skips(self.settings.bad_records, error.reason):
                    raise RecordError(with_remedy(str(error), error.reason), error.reason) from None
                skipped[error.reason] += 1
                if len(shown) < SHOWN_SKIPS:
                    shown.append(str(error))
                continue
            segments.append(self.renderer.segments(conversation.messages, conversation.tools))
            places.append((record.shard, record.index))
            # One content hash serves the split (stable across runs and file order) and duplicate detection.
            digest = hashlib.blake2b(conversation.identity().encode(), digest_size=8).digest()
            keys.append(int.from_bytes(digest, "big"))
        tokens = tokenize_conversations(segments, self.tokenizer) if segments else None
        return EncodedChunk(shard=records[0].shard, tokens=tokens,
                            places=np.array(places, dtype=np.int64).reshape(-1, 2),
                            keys=np.asarray(keys, dtype=np.uint64), skipped=skipped, shown=shown)


def skips(policy: BadRecords, reason: str) -> bool:
    """Whether `data.bad_records: policy` skips a record that is bad for `reason`."""
    return policy == "skip" or (policy == "skip_empty" and reason in NOTHING_TO_TRAIN)


def with_remedy(message: str, reason: str) -> str:
    """A bad record's message and the setting that would skip it, unless the message names one already."""
    if "data.bad_records" in message:
        return message
    if reason in NOTHING_TO_TRAIN:
        return f"{message} (a record with nothing to train; data.bad_records: skip_empty skips and counts these)"
    return f"{message} (data.bad_records: skip skips and counts bad records)"


def auto_workers(shards: list[Shard], requested: int | None) -> int:
    """`requested`, or one worker per BYTES_PER_WORKER of input up to the usable cores (1: in this process)."""
    if requested is not None:
        return requested
    size = sum(Path(shard.path).stat().st_size for shard in shards if Path(shard.path).is_file())
    return max(1, min(usable_cores(), size // BYTES_PER_WORKER))


def chunk_runs(shards: list[Shard], numbers: list[int]) -> Iterator[RecordRun]:
    """The records of each of `shards[number]`, in runs of CHUNK: one chunk each."""
    return record_runs(shards, numbers, CHUNK)


Result = TypeVar("Result")


def encode_chunks(runs: Iterable[RecordRun], job: Callable[[RecordRun], Result], workers: int) -> Iterator[Result]:
    """`job(run)` for every run, in source order, in this process or in `workers` processes; a bad record raises
    its RecordError (unless `bad_records` skips it)."""
    if workers <= 1:
        yield from map(job, runs)
        return
    _import_pandas()
    with _frozen_heap():
        pool = ProcessPoolExecutor(workers, mp_context=_START, initializer=_start_worker, initargs=(job,))
        try:
            pending: deque[Future[Result]] = deque()
            for run in runs:
                pending.append(pool.submit(_run_in_worker, run))
                if len(pending) >= workers * _IN_FLIGHT_PER_WORKER:
                    yield _result(pending.popleft(), workers)
            while pending:
                yield _result(pending.popleft(), workers)
        finally:  # a bad record or a stopped consumer: drop the chunks not started, wait for the rest to end
            pool.shutdown(cancel_futures=True)


def _result(future: Future, workers: int):
    try:
        return future.result()
    except BrokenProcessPool as error:
        raise RuntimeError(f"a tokenize worker process ended without a result (of {workers}; killed for memory?): "
                           "set data.tokenize_workers lower, or 1 to tokenize in this process") from error


def _import_pandas() -> None:
    """pyarrow imports pandas (when installed) the first time it converts a Python list, 0.35 s of CPU: once
    here, before the fork, rather than once in every worker."""
    try:
        import pandas  # noqa: F401
    except ImportError:
        pass


@contextmanager
def _frozen_heap():
    """The parent's objects out of the collector's reach while workers are forked (at the first submit): a
    worker's collections would otherwise write to them and copy their pages (measured on SmolLM2's tokenizer:
    215 MiB PSS a worker without, 115 with)."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


_worker_job: Callable[[RecordRun], object] | None = None


def _start_worker(job: Callable[[RecordRun], object]) -> None:
    global _worker_job
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per process: the processes fill the cores
    _worker_job = job


def _run_in_worker(run: RecordRun):
    assert _worker_job is not None, "the pool's initializer did not run"
    return _worker_job(run)
