"""Tokenize across processes writes what one process writes: every source format, read in runs by the parent and
decoded, encoded and written in parts by the workers (phase1a/data/encoding.py, phase1a/data/shards.py), gives a shard's
files byte for byte the same for any worker count, and the same bytes as the code before that change."""
import gzip
import hashlib
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from helpers import date_records
from phase1a.data.tokenized import split_digest
from phase1a.data.tokenizing import TokenizeOptions, tokenize_dataset

SHARD_FILES = ("tokens.arrow", "examples.arrow", "summary.json")
# sha256 of tokens.arrow and examples.arrow for these fixtures with chunks of 64 records, written by the code before
# the workers wrote their own parts (commit 0335f92, `tokenize_dataset` with 1 and with 3 workers: the same).
BEFORE = {
    "jsonl": ("c209f037c2f6ffefb04744c11e2bccf85b40846c2b12698adf23056806a9a2bb",
              "8a302045f8d5ab5949a060830e9d2dd3889e65020673b891ac57985c6b012182"),
    "parquet": ("82338ddb3475df00c0db096317232481568772b1a9c2ecfda26e20bffc9eb792",
                "8ba5d14cf6ab61f0f0d40649ef21c0ea8d189b10c6a430d5be1f4ba2138997f6"),
}


def chats(count: int) -> list[dict]:
    """Date chats with some non-ASCII text and an exact duplicate every 40."""
    records = date_records(count)
    for index in range(0, count, 17):
        records[index]["messages"][1]["content"] += " — café ✓"
    for index in range(20, count, 40):
        records[index] = records[index - 1]
    return records


def edge_case_jsonl(path: Path, count: int = 300) -> Path:
    """JSON Lines as found in the wild: a byte-order mark, CRLF endings, blank and whitespace-only lines (one
    right at a chunk's end), a line that is not UTF-8, a malformed line, and no newline after the last line."""
    lines = [json.dumps(record, ensure_ascii=False).encode() + b"\n" for record in chats(count)]
    lines[0] = b"\xef\xbb\xbf" + lines[0]
    for index in range(3, count, 29):
        lines[index] = lines[index].replace(b"\n", b"\r\n")
    lines[100] = b'{"messages": [{"role": "user", "content": "caf\xe9"}]}\n'  # Latin-1, not UTF-8
    lines[150] = b'{"messages": [\n'
    for index, blank in ((64, b"\n"), (65, b"   \t\n"), (130, b"\r\n"), (200, b"\n\n")):
        lines.insert(index, blank)
    lines[-1] = lines[-1].rstrip(b"\n")
    path.write_bytes(b"".join(lines))
    return path


def columnar(path: Path, count: int = 300) -> Path:
    """Prompt/completion rows in the format `path` names: Parquet in row groups of 50 (runs of 64 cross them),
    an Arrow IPC file in batches of 50, or CSV."""
    rows = [{"prompt": r["messages"][1]["content"], "completion": r["messages"][2]["content"]} for r in chats(count)]
    table = pa.Table.from_pylist(rows)
    if path.suffix == ".parquet":
        pq.write_table(table, path, row_group_size=50)
    elif path.suffix == ".arrow":
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            for batch in table.to_batches(max_chunksize=50):
                writer.write_batch(batch)
    else:
        pacsv.write_csv(table, path)
    return path


def sources(tmp_path: Path) -> dict[str, Path]:
    plain = edge_case_jsonl(tmp_path / "chats.jsonl")
    gzipped = tmp_path / "chats.jsonl.gz"
    gzipped.write_bytes(gzip.compress(plain.read_bytes()))
    array = tmp_path / "array.json"
    array.write_text(json.dumps(chats(300)))
    return {"jsonl": plain, "jsonl.gz": gzipped, "json array": array,
            **{kind: columnar(tmp_path / f"rows.{kind}") for kind in ("parquet", "arrow", "csv")}}


def tokenize(source: Path, tokenizer, workers: int, cache: Path):
    options = TokenizeOptions(tokenize_workers=workers, bad_records="skip", validation_fraction=0.2)
    return tokenize_dataset(source, tokenizer, 256, options, cache / "tokenized" / "fp")


def shard_files(cache: Path) -> dict[str, bytes]:
    (shard,) = (cache / "tokenized" / "shards").iterdir()  # one source file, one shard; the workers' parts gone
    return {name: (shard / name).read_bytes() for name in SHARD_FILES}


def test_any_worker_count_writes_the_same_bytes_from_every_format(tmp_path, tokenizer, small_chunks):
    for kind, source in sources(tmp_path).items():
        one = tokenize(source, tokenizer, 1, tmp_path / kind / "one")
        three = tokenize(source, tokenizer, 3, tmp_path / kind / "three")
        assert (one.workers, three.workers) == (1, 3)
        assert shard_files(tmp_path / kind / "one") == shard_files(tmp_path / kind / "three"), kind
        assert (split_digest(one.train_path), split_digest(one.validation_path)) == \
            (split_digest(three.train_path), split_digest(three.validation_path)), kind
        readable = 298 if kind.startswith("jsonl") else 300  # two JSONL lines are bad: skipped and counted
        assert one.train_examples + one.validation_examples == readable, kind
    jsonl_skips = json.loads(shard_files(tmp_path / "jsonl" / "three")["summary.json"])["skipped"]
    assert jsonl_skips == {"invalid_utf8": 1, "malformed_json": 1}
    # The same lines compressed: the same tokens and the same examples, line numbers included (the summary quotes
    # the skipped lines by their file's name).
    plain, gzipped = shard_files(tmp_path / "jsonl" / "three"), shard_files(tmp_path / "jsonl.gz" / "three")
    assert [plain[name] for name in SHARD_FILES[:2]] == [gzipped[name] for name in SHARD_FILES[:2]]


@pytest.mark.parametrize("kind", sorted(BEFORE))
def test_the_bytes_are_those_the_code_before_wrote(tmp_path, tokenizer, small_chunks, kind):
    source = edge_case_jsonl(tmp_path / "chats.jsonl") if kind == "jsonl" else columnar(tmp_path / "rows.parquet")
    for workers in (1, 2):
        tokenize(source, tokenizer, workers, tmp_path / str(workers))
        files = shard_files(tmp_path / str(workers))
        digests = tuple(hashlib.sha256(files[name]).hexdigest() for name in ("tokens.arrow", "examples.arrow"))
        assert digests == BEFORE[kind], (kind, workers)
