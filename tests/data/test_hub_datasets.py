"""Hub dataset ids, offline: a dataset repository laid out in HF_HOME's cache as huggingface_hub writes it
(conftest sets HF_HUB_OFFLINE=1), resolved, staged and tokenized by the real code."""
from __future__ import annotations

import io
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helpers import date_records, make_tokenizer, read_arrow, write_jsonl
from helpers.hub_cache import cache_repo, unique_repo
from phase1a.config.schema import Phase1aConfig
from phase1a.core.errors import DataError
from phase1a.data.hub import repo_cache_dir
from phase1a.data.staging import StageOptions, data_source_fingerprint, stage_dataset
from phase1a.data.tokenizing import TokenizeOptions, tokenize_dataset
from tasks.stage import staged_copy, staged_fingerprint

README = b"""---
configs:
- config_name: dates
  default: true
  data_files:
  - split: train_sft
    path: data/train_sft-*.parquet
  - split: test_sft
    path: data/test_sft-*.parquet
- config_name: flat
  data_files: flat/*.jsonl
---
# Dates
"""


def parquet(records: list[dict]) -> bytes:
    buffer = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(records), buffer)
    return buffer.getvalue()


@pytest.fixture
def hub_dates():
    records = date_records(30, seed=11)
    repo_id = unique_repo("dates")
    files = {"README.md": README, "data/train_sft-00000-of-00001.parquet": parquet(records[:24]),
             "data/test_sft-00000-of-00001.parquet": parquet(records[24:]),
             "flat/all.jsonl": b"".join(b'{"prompt": "p%d", "completion": "c%d"}\n' % (i, i) for i in range(6))}
    return repo_id, records, files, cache_repo(repo_id, files, repo_type="dataset")


def test_a_hub_dataset_id_stages_from_the_cache_and_tokenizes_like_jsonl(tmp_path, hub_dates):
    repo_id, records, _, commit = hub_dates
    tokenizer, options = make_tokenizer(), TokenizeOptions(split="train_sft", validation_count=4)
    fingerprint = data_source_fingerprint(repo_id)
    staged = stage_dataset(repo_id, tmp_path / "staging")
    assert staged.fingerprint == fingerprint and Path(staged.path).resolve().name == commit
    config = Phase1aConfig.model_validate({"data": {"source": repo_id, "staging_dir": str(tmp_path / "staging")}})
    assert staged_copy(fingerprint, config).exists()

    from_hub = tokenize_dataset(staged, tokenizer, 256, options, tmp_path / "cache" / "hub")
    jsonl = tokenize_dataset(write_jsonl(tmp_path / "d.jsonl", records[:24]), tokenizer, 256, options,
                             tmp_path / "cache" / "jsonl")
    for split in ("train_path", "validation_path"):
        assert read_arrow(getattr(from_hub, split)).to_pylist() == read_arrow(getattr(jsonl, split)).to_pylist()

    held_out = tokenize_dataset(staged, tokenizer, 256, TokenizeOptions(split="train_sft", validation_split="test_sft"),
                                tmp_path / "cache" / "held-out", validation=staged)
    assert (held_out.train_examples, held_out.validation_examples) == (24, 6)

    staged_flat = stage_dataset(repo_id, tmp_path / "staging", options=StageOptions(config="flat"))
    # Another config is other files: another key and another staged copy, so a cached stage of one config is
    # never taken for the other.
    assert staged_flat.fingerprint == data_source_fingerprint(repo_id, config="flat") != fingerprint
    flat_config = Phase1aConfig.model_validate({"data": {"source": repo_id, "config": "flat",
                                                         "staging_dir": str(tmp_path / "staging")}})
    assert staged_fingerprint(flat_config) == staged_flat.fingerprint != staged_fingerprint(config)
    assert staged_copy(staged_flat.fingerprint, flat_config) != staged_copy(fingerprint, config)
    flat = tokenize_dataset(staged_flat, tokenizer, 256, TokenizeOptions(config="flat", validation_count=1),
                            tmp_path / "cache" / "flat")
    assert flat.train_examples + flat.validation_examples == 6


def test_a_moved_branch_is_new_data_and_a_pinned_revision_is_not(tmp_path, hub_dates):
    repo_id, records, files, first = hub_dates
    before = data_source_fingerprint(repo_id)
    assert data_source_fingerprint(repo_id) == before  # an unchanged revision: the caches hit
    second = cache_repo(repo_id, {**files, "data/train_sft-00000-of-00001.parquet": parquet(records[:20])},
                        repo_type="dataset")
    assert (repo_cache_dir(repo_id, "dataset") / "refs" / "main").read_text() == second
    assert data_source_fingerprint(repo_id) != before
    assert data_source_fingerprint(repo_id, revision=first) == before
    pinned = stage_dataset(repo_id, tmp_path / "staging", options=StageOptions(revision=first))
    assert pinned.fingerprint == before

    # Each revision's files by their blobs' names: the test split's file is the same blob in both commits, so
    # the new revision tokenizes its changed train file alone.
    options, tokenizer = TokenizeOptions(split="train_sft", validation_split="test_sft"), make_tokenizer()
    tokenize_dataset(pinned, tokenizer, 256, options, tmp_path / "cache" / "first", validation=pinned)
    moved = stage_dataset(repo_id, tmp_path / "staging")
    again = tokenize_dataset(moved, tokenizer, 256, options, tmp_path / "cache" / "second", validation=moved)
    assert (again.shards_encoded, again.shards_reused, again.train_examples) == (1, 1, 20)


def test_unknown_config_split_and_uncached_repository(tmp_path, hub_dates):
    repo_id = hub_dates[0]
    with pytest.raises(DataError, match=r"data.config: 'nope' is not a config of .*configs: dates, flat"):
        stage_dataset(repo_id, tmp_path / "staging", options=StageOptions(config="nope"))
    staged = stage_dataset(repo_id, tmp_path / "staging")
    with pytest.raises(DataError, match=r"data.split: 'train' is not a split of .*splits: train_sft, test_sft"):
        tokenize_dataset(staged, make_tokenizer(), 256, TokenizeOptions(), tmp_path / "cache" / "bad-split")
    with pytest.raises(DataError, match=r"data.source"):
        data_source_fingerprint("org/never-cached-dataset")
