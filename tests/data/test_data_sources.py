"""Every local source form tokenizes to exactly the tokens of the same records in one JSONL file.

Sources are written with the libraries users write them with (pyarrow, `datasets`, csv), then staged and
tokenized through the real stage and tokenize code. S3 sources: tests/data/test_stage_s3.py; Hub datasets:
tests/data/test_hub_datasets.py.
"""
from __future__ import annotations

import bz2
import csv
import io
import json
import lzma
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helpers import date_records, read_arrow, write_jsonl
from phase1a.core.errors import DataError
from phase1a.core.fingerprint import hash_json
from phase1a.core.locators import file_format
from phase1a.data.datasource import DataLocation, Shard, estimate_records, iter_records, resolve_shards
from phase1a.data.staging import data_source_fingerprint, stage_dataset
from phase1a.data.tokenizing import TokenizeOptions, tokenize_dataset

RECORDS = date_records(30, seed=7)
FLAT = [{"prompt": r["messages"][1]["content"], "completion": r["messages"][2]["content"]} for r in RECORDS]


def tokenized(tmp_path, tokenizer, source: str, name: str, **options):
    """Stage `source` like the flow does, then tokenize it; rows of train and validation, in order."""
    staged = stage_dataset(source, tmp_path / "staging")
    result = tokenize_dataset(staged, tokenizer, 256, TokenizeOptions(validation_count=4, **options),
                              tmp_path / "cache" / name)
    return result, [read_arrow(result.train_path).to_pylist(), read_arrow(result.validation_path).to_pylist()]


@pytest.fixture
def reference(tmp_path, tokenizer):
    def of(records: list[dict]):
        name = f"reference-{hash_json(records)[:12]}"  # the cache key: one per record list
        return tokenized(tmp_path, tokenizer, str(write_jsonl(tmp_path / f"{name}.jsonl", records)), name)[1]
    return of


def write_parquet(path, records: list[dict]):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(records), path)
    return path


def test_file_formats_are_one_table():
    assert [file_format(name) for name in ("a.jsonl", "a.json.gz", "a.jsonl.zst", "a.parquet", "b.csv.bz2",
                                           "c.tsv", "d.arrow", "README.md", "a.parquet.gz")] == \
        ["json", "json", "json", "parquet", "csv", "tsv", "arrow", None, None]


def test_parquet_file(tmp_path, tokenizer, reference):
    result, rows = tokenized(tmp_path, tokenizer, str(write_parquet(tmp_path / "d.parquet", RECORDS)), "pq")
    assert rows == reference(RECORDS) and result.shards == 1


@pytest.mark.parametrize("delimiter,suffix", [(",", "csv"), ("\t", "tsv")])
def test_csv_and_tsv_read_every_column_as_text(tmp_path, tokenizer, reference, delimiter, suffix):
    records = [dict(r, completion=str(i)) for i, r in enumerate(FLAT)]  # numbers stay text
    path = tmp_path / f"d.{suffix}"
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, ["prompt", "completion"], delimiter=delimiter)
        writer.writeheader()
        writer.writerows(records)
    assert tokenized(tmp_path, tokenizer, str(path), suffix)[1] == reference(records)


def test_arrow_file_and_save_to_disk_folders(tmp_path, tokenizer, reference):
    from datasets import Dataset, DatasetDict

    table = pa.Table.from_pylist(RECORDS)
    with pa.OSFile(str(tmp_path / "d.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    expected = reference(RECORDS)
    assert tokenized(tmp_path, tokenizer, str(tmp_path / "d.arrow"), "arrow")[1] == expected

    Dataset.from_list(RECORDS).save_to_disk(str(tmp_path / "saved"), num_shards=2)
    result, rows = tokenized(tmp_path, tokenizer, str(tmp_path / "saved"), "saved")
    assert rows == expected and result.shards == 2

    DatasetDict({"train": Dataset.from_list(RECORDS), "test": Dataset.from_list(RECORDS[:3])}).save_to_disk(
        str(tmp_path / "saved-dict"))
    assert tokenized(tmp_path, tokenizer, str(tmp_path / "saved-dict"), "dict")[1] == expected
    with pytest.raises(DataError,
                       match=r"data.split: 'validation' is not a split of the saved dataset .*splits: train, test"):
        tokenized(tmp_path, tokenizer, str(tmp_path / "saved-dict"), "dict-bad", split="validation")


def test_sharded_directory_glob_and_compressed_shards(tmp_path, tokenizer, reference):
    shards = tmp_path / "shards"
    write_parquet(shards / "a-part-00000.parquet", RECORDS[:10])
    write_parquet(shards / "b-nested" / "part-00001.parquet", RECORDS[10:20])
    (shards / "README.txt").write_text("not data")
    write_parquet(tmp_path / "z-elsewhere" / "part-00002.parquet", RECORDS[20:])
    expected = reference(RECORDS)

    glob = str(tmp_path / "*" / "**" / "*part-*.parquet")  # shards in path order
    result, rows = tokenized(tmp_path, tokenizer, glob, "glob")
    assert rows == expected and result.shards == 3

    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a.jsonl.bz2").write_bytes(bz2.compress(("".join(json.dumps(r) + "\n" for r in RECORDS[:10])).encode()))
    (mixed / "b.jsonl.xz").write_bytes(lzma.compress(("".join(json.dumps(r) + "\n" for r in RECORDS[10:20])).encode()))
    import zstandard

    (mixed / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(
        ("".join(json.dumps(r) + "\n" for r in RECORDS[20:])).encode()))
    result, rows = tokenized(tmp_path, tokenizer, str(mixed), "mixed")
    assert rows == expected and result.shards == 3


def test_a_directory_with_split_names_reads_its_train_split(tmp_path, tokenizer, reference):
    repo = tmp_path / "by-name"
    repo.mkdir()
    write_jsonl(repo / "train.jsonl", RECORDS)
    write_jsonl(repo / "test.jsonl", RECORDS[:5])
    assert tokenized(tmp_path, tokenizer, str(repo), "names")[1] == reference(RECORDS)
    _, rows = tokenized(tmp_path, tokenizer, str(repo), "names-test", split="test")
    assert sum(len(part) for part in rows) == 5


def test_a_local_dataset_repository_with_two_configs(tmp_path, tokenizer, reference):
    repo = tmp_path / "repo"
    write_parquet(repo / "chat" / "train-00000-of-00001.parquet", RECORDS)
    write_parquet(repo / "chat" / "test-00000-of-00001.parquet", RECORDS[:4])
    write_parquet(repo / "flat" / "train.parquet", FLAT)
    (repo / "README.md").write_text("""---
configs:
- config_name: chat
  default: true
  data_files:
  - split: train
    path: chat/train-*.parquet
  - split: test
    path: chat/test-*.parquet
- config_name: flat
  data_files:
  - split: train
    path: flat/train.parquet
---
# Dates, two ways
""")
    assert tokenized(tmp_path, tokenizer, str(repo), "default")[1] == reference(RECORDS)
    assert tokenized(tmp_path, tokenizer, str(repo), "chat", config="chat")[1] == reference(RECORDS)
    assert tokenized(tmp_path, tokenizer, str(repo), "flat", config="flat")[1] == reference(FLAT)
    with pytest.raises(DataError, match=r"data.config: .*'nope' not found.*chat.*flat"):
        tokenized(tmp_path, tokenizer, str(repo), "nope", config="nope")
    with pytest.raises(DataError, match=r"data.split: 'validation' is not a split of .*config 'flat'.*splits: train"):
        tokenized(tmp_path, tokenizer, str(repo), "flat-v", config="flat", split="validation")


def test_validation_source_is_the_held_out_set(tmp_path, tokenizer):
    train = write_parquet(tmp_path / "train.parquet", RECORDS[:24])
    held_out = write_jsonl(tmp_path / "held-out.jsonl", RECORDS[24:])
    result = tokenize_dataset(stage_dataset(str(train), tmp_path / "s"), tokenizer, 256, TokenizeOptions(),
                              tmp_path / "cache" / "vs", validation=stage_dataset(str(held_out), tmp_path / "s"))
    assert (result.train_examples, result.validation_examples, result.shards) == (24, 6, 2)
    alone = tokenize_dataset(held_out, tokenizer, 256, TokenizeOptions(validation_fraction=0.5), tmp_path / "c" / "h")
    held_out_rows = read_arrow(alone.train_path).to_pylist() + read_arrow(alone.validation_path).to_pylist()
    assert sorted(map(str, read_arrow(result.validation_path).to_pylist())) == sorted(map(str, held_out_rows))


def test_a_bad_row_names_its_shard_and_row(tmp_path, tokenizer):
    records = [dict(r) for r in FLAT]
    records[13]["completion"] = None
    path = write_parquet(tmp_path / "bad.parquet", records)
    with pytest.raises(DataError, match=r"bad.parquet:row 13: field 'completion' is missing"):
        tokenize_dataset(path, tokenizer, 256, TokenizeOptions(), tmp_path / "c1" / "bad")
    skipped = tokenize_dataset(path, tokenizer, 256, TokenizeOptions(bad_records="skip"), tmp_path / "c2" / "skip")
    assert skipped.skipped == {"bad_field:completion": 1} and "bad.parquet:row 13" in skipped.skipped_examples[0]
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match=r"broken.parquet: cannot read as parquet"):
        tokenize_dataset(tmp_path / "broken.parquet", tokenizer, 256, TokenizeOptions(), tmp_path / "c3" / "broken")


def test_the_fingerprint_is_the_content(tmp_path):
    shards = tmp_path / "shards"
    write_parquet(shards / "a.parquet", RECORDS[:10])
    write_parquet(shards / "b.parquet", RECORDS[10:])
    first = data_source_fingerprint(str(shards))
    assert data_source_fingerprint(str(tmp_path / "shards" / "*.parquet")) == first  # same files, same order
    staged = stage_dataset(str(shards), tmp_path / "staging")
    assert staged.fingerprint == first and not stage_dataset(str(shards), tmp_path / "staging").copied
    (shards / "b.parquet").touch()  # a new mtime, the same bytes: still the same data
    assert data_source_fingerprint(str(shards)) == first
    write_parquet(shards / "b.parquet", RECORDS[10:29])
    assert data_source_fingerprint(str(shards)) != first


def test_streaming_reads_a_batch_at_a_time(tmp_path):
    path = write_parquet(tmp_path / "d.parquet", RECORDS * 200)
    records = iter_records(resolve_shards(DataLocation(path=str(path)), None, "train"))
    first = next(records)
    assert (first.shard, first.index) == (0, 0) and first.raw == RECORDS[0]
    assert sum(1 for _ in records) == len(RECORDS) * 200 - 1


def test_byte_order_marks_and_invalid_utf8_in_text_formats(tmp_path, tokenizer):
    """A BOM is read as absent in JSONL, a JSON array and CSV (the same tokens as without); a byte that is not
    UTF-8 costs a JSONL file one line (its file and line named), a JSON array the whole file (it is one value)."""
    _, reference_rows = tokenized(tmp_path / "ref", tokenizer, str(write_jsonl(tmp_path / "r.jsonl", FLAT)), "r")
    bom = b"\xef\xbb\xbf"
    jsonl = tmp_path / "bom.jsonl"
    jsonl.write_bytes(bom + "".join(json.dumps(r) + "\n" for r in FLAT).encode())
    array = tmp_path / "bom.json"
    array.write_bytes(bom + json.dumps(FLAT, indent=1).encode())
    table = tmp_path / "bom.csv"
    with open(table, "w", newline="", encoding="utf-8-sig") as handle:
        writer = csv.DictWriter(handle, fieldnames=["prompt", "completion"])
        writer.writeheader()
        writer.writerows(FLAT)
    for path in (jsonl, array, table):
        _, rows = tokenized(tmp_path / path.suffix[1:], tokenizer, str(path), path.suffix)
        assert rows == reference_rows, path.name

    broken = tmp_path / "broken.json"
    broken.write_bytes(json.dumps(FLAT, indent=1).encode().replace(b'"prompt"', b'"pr\xffompt"', 1))
    with pytest.raises(DataError, match=r"broken.json:3: invalid UTF-8 at byte 6 of the line \(0xff\); a JSON array "
                                        r"is read whole"):
        tokenize_dataset(broken, tokenizer, 256, TokenizeOptions(bad_records="skip"), tmp_path / "c4" / "broken")


def test_a_byte_that_is_not_utf8_in_a_csv_names_its_row_and_line(tmp_path, tokenizer):
    """Rows and lines differ where cells hold newlines: both are named, rows as the reader numbers them (after the
    header, from 0). Read by columns, a CSV cannot lose one row: the file stops, with the place to mend."""
    records = [{"prompt": f"line one {n}\nline two {n}", "completion": f"answer {n}"} for n in range(60)]
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=["prompt", "completion"])
    writer.writeheader()
    writer.writerows(records)
    data = text.getvalue().encode()
    at = data.index(b"answer 37")  # row 37: its prompt's two lines start at line 2 + 2 * 37
    bad = tmp_path / "badutf8.csv"
    bad.write_bytes(data[:at + 3] + b"\xff" + data[at + 3:])
    byte = len('line two 37",ans') + 1
    expected = f"{bad}:row 37 (line 77): invalid UTF-8 at byte {byte} of the line (0xff); save"
    with pytest.raises(DataError, match=re.escape(expected)):
        tokenize_dataset(bad, tokenizer, 256, TokenizeOptions(), tmp_path / "c5" / "bad")
    header = tmp_path / "badheader.csv"
    header.write_bytes(b"pro\xffmpt,completion\n" + data.split(b"\n", 1)[1])
    with pytest.raises(DataError, match=re.escape(f"{header}:the header row (line 1): invalid UTF-8 at byte 4")):
        tokenize_dataset(header, tokenizer, 256, TokenizeOptions(), tmp_path / "c5" / "header")


def test_progress_counts_a_csvs_rows_not_its_lines(tmp_path):
    """The count progress starts from (tokenize's "N examples to do"): cells with newlines are one row each, in a
    small file exactly, in one larger than the sample read within a few percent."""
    def write(path, count, repeat):
        with open(path, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=["prompt", "completion"])
            writer.writeheader()
            writer.writerows({"prompt": f"first line {n}\nsecond line\n" * repeat, "completion": f"answer\n{n}"}
                             for n in range(count))
        return Shard(path, "csv")

    assert estimate_records(write(tmp_path / "small.csv", 60, 1)) == 60
    large = estimate_records(write(tmp_path / "large.csv", 60_000, 8))  # about 20 MiB: beyond the 8 MiB sample
    assert abs(large - 60_000) / 60_000 < 0.05, large
