"""Nightly growth: a dataset of shards gains, changes or loses a shard; stage and tokenize redo only that shard,
the held-out split of every old example stays where it was, and the result equals tokenizing from scratch."""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from helpers import date_records, read_arrow, write_jsonl
from phase1a.core.errors import DataError
from phase1a.core.fingerprint import FileHashes
from phase1a.data.staging import stage_dataset
from phase1a.data.tokenized import SplitView
from phase1a.data.tokenizing import TokenizeOptions, tokenize_dataset, tokenize_fingerprint
from phase1a.start.replay import read_trained_on, replay_mix, write_trained_on

OPTIONS = TokenizeOptions(validation_fraction=0.25)


def write_shard(directory, number: int):
    """Shard `number`: 40 date chats of its own (a seed per shard, so no two shards share records)."""
    directory.mkdir(exist_ok=True)
    return write_jsonl(directory / f"part-{number:03d}.jsonl", date_records(40, seed=100 + number))


def night(tmp_path, tokenizer, source, cache="cache"):
    """What the flow does each night: stage the source, tokenize it under its content fingerprint."""
    staged = stage_dataset(str(source), tmp_path / "staging")
    out = tmp_path / cache / "tokenized" / tokenize_fingerprint([staged.fingerprint], "tok", 256, OPTIONS)
    return staged, tokenize_dataset(staged, tokenizer, 256, OPTIONS, out)


def sides(result) -> dict[tuple, str]:
    """Each example (its token ids) and the side of the split it is on."""
    return {tuple(row): side for side in ("train", "validation")
            for row in read_arrow(getattr(result, f"{side}_path")).column("input_ids").to_pylist()}


def test_a_new_shard_is_the_only_one_staged_and_tokenized(tmp_path, tokenizer):
    shards = tmp_path / "shards"
    for number in range(5):
        write_shard(shards, number)
    staged, first = night(tmp_path, tokenizer, shards)
    assert (staged.files_copied, staged.files_reused, first.shards_encoded, first.shards_reused) == (5, 0, 5, 0)

    write_shard(shards, 5)
    staged, second = night(tmp_path, tokenizer, shards)
    assert (staged.files_copied, staged.files_reused) == (1, 5)  # the old files are links to their staged copies
    assert (second.shards_encoded, second.shards_reused, second.shards) == (1, 5, 6)
    assert second.train_examples + second.validation_examples == 240

    before, after = sides(first), sides(second)
    assert all(after[example] == side for example, side in before.items())  # no old example changed sides
    assert {"train", "validation"} <= set(after.values())

    _, scratch = night(tmp_path / "fresh", tokenizer, shards)  # everything from nothing: the same dataset
    for split in ("train_path", "validation_path"):
        assert read_arrow(getattr(second, split)).equals(read_arrow(getattr(scratch, split)))
    assert second.lengths == scratch.lengths and second.max_seq_length == scratch.max_seq_length


def test_a_changed_shard_is_redone_and_a_removed_one_left_out(tmp_path, tokenizer):
    shards = tmp_path / "shards"
    for number in range(4):
        write_shard(shards, number)
    _, first = night(tmp_path, tokenizer, shards)

    records = date_records(40, seed=102)[:30]  # shard 2 loses ten records
    write_jsonl(shards / "part-002.jsonl", records)
    _, changed = night(tmp_path, tokenizer, shards)
    assert (changed.shards_encoded, changed.shards_reused) == (1, 3)
    assert changed.train_examples + changed.validation_examples == 150

    (shards / "part-001.jsonl").unlink()
    _, removed = night(tmp_path, tokenizer, shards)
    assert (removed.shards_encoded, removed.shards_reused, removed.shards) == (0, 3, 3)
    assert removed.train_examples + removed.validation_examples == 110
    assert set(sides(removed)) < set(sides(changed))


def test_one_shard_cut_shorter_by_a_new_max_seq_length_is_not_tokenized_again(tmp_path, tokenizer):
    """Lengths are decided over the union: a shard's tokens are stored whole and cut on reading."""
    shards = tmp_path / "shards"
    write_shard(shards, 0)
    staged = stage_dataset(str(shards), tmp_path / "staging")
    whole = tokenize_dataset(staged, tokenizer, 256, OPTIONS, tmp_path / "cache" / "a")
    limit = whole.lengths.max - 3  # the longest examples lose their last tokens
    cut = tokenize_dataset(staged, tokenizer, 256, OPTIONS.model_copy(update={"max_seq_length": limit}),
                           tmp_path / "cache" / "b")
    assert (cut.shards_encoded, cut.shards_reused) == (0, 1)
    assert cut.max_seq_length == limit and cut.truncated_examples > 0
    assert max(read_arrow(cut.train_path).column("length").to_pylist()) == limit
    assert 0 < cut.lengths.supervised_tokens < whole.lengths.supervised_tokens
    full, short = read_arrow(whole.train_path), read_arrow(cut.train_path)
    assert [row[:limit] for row in full.column("labels").to_pylist()] == short.column("labels").to_pylist()


def test_file_hashes_are_remembered_and_an_in_place_rewrite_is_seen(tmp_path):
    path = tmp_path / "shard.jsonl"
    path.write_text("one\n")
    old = time.time_ns() - 10**9  # written a second ago: a hash taken now can be trusted
    os.utime(path, ns=(old, old))
    hashes = FileHashes(tmp_path / "hashes.json")
    first = hashes.sha256(path)
    hashes.save()
    remembered = FileHashes(tmp_path / "hashes.json")
    assert remembered.sha256(path) == first and not remembered.changed  # a stat, not a read

    path.write_text("two\n")  # same size, new mtime
    assert remembered.sha256(path) != first
    link = tmp_path / "link.jsonl"
    os.link(path, link)
    assert remembered.sha256(link) == remembered.sha256(path)


def test_a_hash_taken_just_after_a_write_is_not_trusted(tmp_path):
    """Within one tick of the file system's clock a same-size rewrite keeps the mtime: read such a file again."""
    path = tmp_path / "shard.jsonl"
    path.write_text("one\n")
    hashes = FileHashes()
    first = hashes.sha256(path)  # taken right after the write
    stat = path.stat()
    path.write_text("two\n")
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # the rewrite as a coarse clock would stamp it
    assert hashes.sha256(path) != first


def test_staged_blobs_are_shared_by_listings(tmp_path):
    shards = tmp_path / "shards"
    for number in range(3):
        write_shard(shards, number)
    first = stage_dataset(str(shards), tmp_path / "staging")
    write_shard(shards, 3)
    second = stage_dataset(str(shards), tmp_path / "staging")
    assert first.path != second.path
    for name in first.file_sha256:
        assert os.path.samefile(os.path.join(first.path, name), os.path.join(second.path, name))
    shutil.rmtree(first.path)  # an old listing's directory removed: the new one still has every file
    again = stage_dataset(str(shards), tmp_path / "staging")
    assert (again.path, again.files_copied, again.copied) == (second.path, 0, False)
    assert sorted(os.listdir(again.path)) == [f"part-{number:03d}.jsonl" for number in range(4)]


def test_a_warm_start_replays_a_share_of_the_old_examples_beside_the_new_shard(tmp_path, tokenizer):
    shards = tmp_path / "shards"
    for number in range(4):
        write_shard(shards, number)
    _, first = night(tmp_path, tokenizer, shards)
    adapter = tmp_path / "v1"
    adapter.mkdir()
    write_trained_on(adapter, first.train_path)  # what the train stage leaves beside v1's weights
    seen = read_trained_on(adapter, "v1")
    assert len(seen) == 4

    write_shard(shards, 4)
    _, second = night(tmp_path, tokenizer, shards)
    mixed = replay_mix(second, seen, 0.25, seed=0, what="v1")
    replay = mixed.replay
    new_rows = set(map(tuple, read_arrow(second.train_path).column("input_ids").to_pylist())) - \
        set(map(tuple, read_arrow(first.train_path).column("input_ids").to_pylist()))
    assert replay["new_examples"] == len(new_rows) > 0 and replay["old_examples"] == first.train_examples
    assert replay["replayed_examples"] == round(0.25 / 0.75 * replay["new_examples"])
    assert mixed.train_examples == replay["new_examples"] + replay["replayed_examples"]
    rows = set(map(tuple, read_arrow(mixed.train_path).column("input_ids").to_pylist()))
    assert new_rows <= rows and len(rows - new_rows) == replay["replayed_examples"]
    assert mixed.fingerprint != second.fingerprint and mixed.validation_path == second.validation_path
    assert replay_mix(second, seen, 0.25, seed=0, what="v1").train_path == mixed.train_path  # one mix, one file
    assert replay_mix(second, seen, 0.0, seed=0, what="v1").train_examples == replay["new_examples"]

    with pytest.raises(DataError, match="no training example is new since v2 was trained"):
        replay_mix(second, seen | {Path(p).parent.name for p in SplitView.read(second.train_path).parts}, 0.25,
                   seed=0, what="v2")
    with pytest.raises(DataError, match=r"v0 has no trained_on.json \(it was not trained by phase1a\)"):
        read_trained_on(tmp_path, "v0")
