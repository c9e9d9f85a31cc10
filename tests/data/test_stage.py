from pathlib import Path

import pytest

from phase1a.core.errors import DataError
from phase1a.data.staging import data_source_fingerprint, stage_dataset


def test_copies_verifies_and_skips_identical(tmp_path, dataset):
    staging = tmp_path / "not" / "yet" / "staging"  # created on first use, parents too
    first = stage_dataset(str(dataset), staging)
    assert first.copied and first.fingerprint == data_source_fingerprint(str(dataset))
    assert open(first.path, "rb").read() == dataset.read_bytes()
    second = stage_dataset(f"file://{dataset}", staging)
    assert not second.copied and second.path == first.path


def test_changed_data_gets_a_new_staged_copy(tmp_path, dataset):
    staging = tmp_path / "staging"
    first = stage_dataset(str(dataset), staging)
    dataset.write_text(dataset.read_text() + '{"instruction": "x", "output": "y"}\n')
    second = stage_dataset(str(dataset), staging)
    assert second.copied and second.fingerprint != first.fingerprint and second.path != first.path


def test_a_corrupted_staged_copy_is_replaced(tmp_path, dataset):
    first = stage_dataset(str(dataset), tmp_path / "staging")
    with open(first.path, "r+b") as handle:
        handle.write(b"X")
    again = stage_dataset(str(dataset), tmp_path / "staging")
    assert again.copied and open(again.path, "rb").read() == dataset.read_bytes()


def test_files_beside_the_shards_that_are_not_data_are_counted_and_named(tmp_path, dataset):
    shards = tmp_path / "shards"
    (shards / "notes").mkdir(parents=True)
    (shards / "part-0.jsonl").write_bytes(dataset.read_bytes())
    ignored = ["NOTES.txt", "checksums.sha256", *(f"notes/{day:02d}.md" for day in range(1, 6))]
    for name in ignored:
        (shards / name).write_text("not data\n")
    staged = stage_dataset(str(shards), tmp_path / "staging")
    assert staged.files_ignored == len(ignored)
    assert staged.ignored_files == [f"{shards}/{name}" for name in sorted(ignored)][: len(staged.ignored_files)]
    assert 0 < len(staged.ignored_files) < len(ignored)  # the first few named, every one counted
    only_data = stage_dataset(str(dataset), tmp_path / "staging")
    assert only_data.files_ignored == 0 and only_data.ignored_files == []


def test_missing_empty_and_unsupported_sources(tmp_path):
    with pytest.raises(DataError, match=r"data.source: no such file: .*nope.jsonl"):
        stage_dataset(str(tmp_path / "nope.jsonl"), tmp_path / "staging")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match=r"empty.jsonl: the file is empty"):
        stage_dataset(str(empty), tmp_path / "staging")
    with pytest.raises(DataError, match="scheme 'gs'"):
        stage_dataset("gs://bucket/key.jsonl", tmp_path / "staging")


def test_the_cache_finds_a_local_staged_copy_from_its_fingerprint(tmp_path, dataset):
    from phase1a.config.schema import Phase1aConfig
    from phase1a.data.staging import staged_location
    from tasks.stage import staged_copy

    staging = tmp_path / "staging"
    fingerprint = data_source_fingerprint(str(dataset))
    config = Phase1aConfig.model_validate({"data": {"source": f"file://{dataset}", "staging_dir": str(staging)}})
    assert not staged_copy(fingerprint, config).exists()
    staged = stage_dataset(str(dataset), staging)
    assert staged.path == str(staged_location(staging, fingerprint, dataset.name))
    assert staged_copy(fingerprint, config).exists()


def test_a_local_model_directory_on_slow_storage_is_copied_once(tmp_path, tiny_model_dir):
    from phase1a.core.fingerprint import sha256_tree
    from phase1a.data.staging import stage_model

    assert stage_model(str(tiny_model_dir), tmp_path / "models") == tiny_model_dir  # default: used in place
    staged = stage_model(str(tiny_model_dir), tmp_path / "models", copy_local=True)
    weights = ("*.json", "*.safetensors")
    assert staged != tiny_model_dir and sha256_tree(staged, weights) == sha256_tree(tiny_model_dir, weights)
    mtime = (staged / "config.json").stat().st_mtime_ns
    assert stage_model(str(tiny_model_dir), tmp_path / "models", copy_local=True) == staged
    assert (staged / "config.json").stat().st_mtime_ns == mtime  # unchanged source: not copied again


def test_a_local_model_is_prepared_in_place_unless_it_is_to_be_staged(tmp_path, tiny_model_dir):
    from phase1a.config.schema import Phase1aConfig
    from phase1a.model.loading import prepare_model

    def prepared(name: str, stage_local: bool = False):
        return prepare_model(Phase1aConfig.model_validate({
            "data": {"source": "unused", "staging_dir": str(tmp_path / "staging")},
            "model": {"name_or_path": name, "stage_local": stage_local}}))

    in_place = prepared(str(tiny_model_dir))
    assert in_place.path == str(tiny_model_dir) and in_place.max_positions == 256
    assert prepared(f"file://{tiny_model_dir}") == in_place  # a file:// URL names the same directory
    staged = prepared(str(tiny_model_dir), stage_local=True)
    assert Path(staged.path).is_relative_to(tmp_path / "staging" / "models")
    assert staged.fingerprint == in_place.fingerprint  # the same weights, copied
