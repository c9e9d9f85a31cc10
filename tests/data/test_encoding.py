"""Tokenize's first pass in a pool of processes: the same bytes, errors and counts as one process, bounded
read-ahead, and the worker count's rule."""
import os
import pickle
from dataclasses import dataclass
from itertools import count
from pathlib import Path

import pytest

from helpers import date_records, write_jsonl
from phase1a.core.errors import DataError
from phase1a.data import encoding
from phase1a.data.datasource import DataLocation, resolve_shards
from phase1a.data.records import RecordError
from phase1a.data.tokenized import split_digest as digest
from phase1a.data.tokenizing import TokenizeOptions, tokenize_dataset, tokenize_fingerprint


def mixed_records(total: int) -> list:
    """Date chats with a bad record every 97 (no assistant reply) and an exact duplicate every 50."""
    records = date_records(total)
    for index in range(0, total, 97):
        records[index] = {"messages": [{"role": "user", "content": f"unanswered {index}"}]}
    for index in range(25, total, 50):
        records[index] = records[index - 1]
    return records


def tokenize_with(workers: int, data: Path, tokenizer, cache: Path, **options):
    options = TokenizeOptions(tokenize_workers=workers, **options)
    return tokenize_dataset(data, tokenizer, 256, options, Path(cache) / "fp")


def test_workers_write_the_same_bytes_and_counts_as_one_process(tmp_path, tokenizer, small_chunks):
    data = write_jsonl(tmp_path / "data.jsonl", mixed_records(700))
    one = tokenize_with(1, data, tokenizer, tmp_path / "one", bad_records="skip", validation_fraction=0.2)
    three = tokenize_with(3, data, tokenizer, tmp_path / "three", bad_records="skip", validation_fraction=0.2)
    assert (one.workers, three.workers) == (1, 3)
    assert digest(one.train_path) == digest(three.train_path)
    assert digest(one.validation_path) == digest(three.validation_path)
    assert one.skipped == three.skipped == {"last_turn_not_assistant": 8}
    assert one.skipped_examples == three.skipped_examples and len(one.skipped_examples) == encoding.SHOWN_SKIPS
    assert f"{data}:98:" in three.skipped_examples[1]  # the user's file and line, from a worker process
    assert one.duplicates == three.duplicates >= 14
    assert one.model_dump(exclude={"workers", "dir", "train_path", "validation_path", "lengths_path"}) == \
        three.model_dump(exclude={"workers", "dir", "train_path", "validation_path", "lengths_path"})


def test_a_bad_record_in_a_worker_fails_with_its_file_and_line(tmp_path, tokenizer, small_chunks):
    records = date_records(400)
    records[300] = {"messages": [{"role": "user", "content": "no reply"}]}
    data = write_jsonl(tmp_path / "data.jsonl", records)
    with pytest.raises(RecordError) as serial:
        tokenize_with(1, data, tokenizer, tmp_path / "one")
    with pytest.raises(RecordError) as pooled:
        tokenize_with(2, data, tokenizer, tmp_path / "two")
    assert str(pooled.value) == str(serial.value) and str(pooled.value).startswith(f"{data}:301:")
    assert pooled.value.reason == serial.value.reason


def _die(run):
    os._exit(9)


def test_a_worker_that_dies_gives_an_error_that_says_what_to_do(tmp_path, tokenizer, small_chunks, monkeypatch):
    """A worker killed (the kernel's OOM killer, say) ends the stage with advice, not a bare BrokenProcessPool."""
    monkeypatch.setattr(encoding, "_run_in_worker", _die)  # forked workers inherit the patched module
    data = write_jsonl(tmp_path / "data.jsonl", date_records(200))
    with pytest.raises(RuntimeError, match=r"a tokenize worker process ended without a result \(of 2; killed for "
                                           r"memory\?\): set data.tokenize_workers lower, or 1"):
        tokenize_with(2, data, tokenizer, tmp_path / "cache")


def test_record_error_keeps_its_reason_across_processes():
    error = pickle.loads(pickle.dumps(RecordError("data.jsonl:3: no assistant reply", "last_turn_not_assistant")))
    assert isinstance(error, DataError) and error.reason == "last_turn_not_assistant"
    assert str(error) == "data.jsonl:3: no assistant reply"


def test_read_ahead_is_bounded_by_the_workers(tmp_path, tokenizer, small_chunks):
    """RAM stays flat: the parent reads at most two chunks per worker ahead of the chunk it hands back."""
    data = write_jsonl(tmp_path / "data.jsonl", date_records(64 * 40))
    shards = resolve_shards(DataLocation(path=str(data)), None, "train")
    read = count()

    def counted():
        for run in encoding.chunk_runs(shards, [0]):
            next(read)
            yield run

    encoder = encoding.ChunkEncoder(tokenizer, shards, encoding.EncodeSettings())
    chunks = encoding.encode_chunks(counted(), _Encode(encoder), workers=2)
    first = next(chunks)
    assert len(first.keys) == 64
    assert next(read) <= 2 * 2 + 1 + 1  # two per worker in flight, plus the one being cut
    assert sum(len(chunk.keys) for chunk in chunks) == 64 * 39
    chunks.close()


@dataclass
class _Encode:
    """The plainest job: a run's records encoded (the stage's own job also writes its part of the shard)."""

    encoder: encoding.ChunkEncoder

    def __call__(self, run):
        return self.encoder(run.records())


def test_auto_workers_follow_the_input_size_up_to_the_cores(tmp_path, monkeypatch):
    data = write_jsonl(tmp_path / "data.jsonl", date_records(200))
    shards = resolve_shards(DataLocation(path=str(data)), None, "train")
    assert encoding.auto_workers(shards, None) == 1  # a small file: no pool
    assert encoding.auto_workers(shards, 5) == 5
    monkeypatch.setattr(encoding, "BYTES_PER_WORKER", data.stat().st_size // 3)
    monkeypatch.setattr(encoding, "usable_cores", lambda: 2)
    assert encoding.auto_workers(shards, None) == 2
    monkeypatch.setattr(encoding, "usable_cores", lambda: 16)
    assert encoding.auto_workers(shards, None) == 3


def test_the_worker_count_is_not_part_of_the_cache_key():
    def key(**options):
        return tokenize_fingerprint("data", "tok", 256, TokenizeOptions(**options))

    assert key(tokenize_workers=1) == key(tokenize_workers=8) == key()
    assert key(train_on_inputs=True) != key()
