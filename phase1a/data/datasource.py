"""Where a dataset's records come from: local files in every common format, read shard by shard.

A source resolves to an ordered list of shards, each a local file of one format:
- a file: itself;
- an explicit list (a glob's matches, an S3 prefix's objects): every file, in order;
- a `save_to_disk` folder: its Arrow files, of `data.split` for a saved DatasetDict;
- any other directory (a dataset repository with a README `configs:` block, a Hub dataset's snapshot, or a
  folder of shards): the files that the `datasets` library resolves for `data.config` and `data.split`, by
  the README or, without one, by its file-name conventions (`train-*.parquet`, `test.jsonl`, ...).

Reading: `datasets` says what a repository, Hub snapshot or saved dataset holds; the files themselves are read
a batch at a time. JSON/JSONL goes through our own line reader, so a bad record is reported as `file:line`
and a malformed line can be skipped and counted (a columnar reader would fail the whole file). Parquet,
CSV/TSV and Arrow go through pyarrow's batch readers, the ones `datasets` builds on, reported as
`file:row N`: on 500k chat rows of Parquet that read 4.5x faster than `datasets`' streaming iterator, in a
third of its memory (1.8 s and 237 MiB against 8.2 s and 743 MiB, 2-core VM). Nothing holds a whole dataset
in memory, and `datasets` is imported only for directories (it costs seconds to import).
"""
from __future__ import annotations

import bz2
import csv
import gzip
import io
import json
import lzma
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, BinaryIO, Iterator, NamedTuple, TextIO

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
from pydantic import BaseModel

from phase1a.core.errors import DataError
from phase1a.core.locators import COMPRESSION_SUFFIXES, DATA_FILE_FORMATS, file_format
from phase1a.core.units import MIB
from phase1a.data.records import UndecodableLine

_BATCH = 4096  # rows per streamed batch of a columnar shard


class DataLocation(BaseModel):
    """A local dataset: `path` is a file or a directory; `files` lists a directory's shards (relative, in
    order) when they were named explicitly, and is empty when the directory itself says what it holds.
    `origin` is what the user calls `path` (their file, directory, glob's base, S3 URL or Hub id) when `path`
    is a staged copy: messages name the user's files, not the copies. `deferred` names the files staging left
    off local disk because the store knew their content (phase1a/data/staging.py), each with its shape (whether a
    JSON file holds one array), which is otherwise read from its first bytes."""

    path: str
    files: list[str] = []
    origin: str | None = None
    deferred: dict[str, bool] = {}


@dataclass(frozen=True)
class Shard:
    path: Path
    format: str
    json_array: bool = False  # a JSON file holding one array: its records are numbered [i], not by line
    name: str = ""  # the user's name for the file (see DataLocation.origin); messages use `label`

    @property
    def label(self) -> str:
        return self.name or str(self.path)


def _shard(path: Path, field: str, json_array: bool | None = None) -> Shard:
    """`json_array`: the shape, when known without reading the file (a deferred file is not on disk)."""
    kind = file_format(path)
    if kind is None:
        known = ", ".join(DATA_FILE_FORMATS)
        raise DataError(f"{field}: {path} is not a data file this reads ({known}, text formats optionally "
                        f"{'/'.join(COMPRESSION_SUFFIXES)})")
    shape = is_json_array(path) if json_array is None and kind == "json" else bool(json_array)
    return Shard(path, kind, kind == "json" and shape)


def resolve_shards(location: DataLocation, config: str | None, split: str, field: str = "data.source") -> list[Shard]:
    """The shards of a staged source, in reading order, each named as the user names it."""
    shards = _resolve_shards(location, config, split, field)
    if location.origin is None:
        return shards
    return [replace(shard, name=_user_name(location, shard.path)) for shard in shards]


def _user_name(location: DataLocation, path: Path) -> str:
    """`origin` for a single file; `origin/<relative path>` for a shard of a directory (a staged S3 prefix, a
    glob's base, a Hub snapshot); the staged path where the shard lies elsewhere."""
    base = Path(location.path)
    if base.is_file():
        return location.origin
    try:  # resolved: a Hub snapshot's staged location is a link into HF_HOME's cache
        relative = Path(path).resolve().relative_to(base.resolve())
    except ValueError:
        return str(path)
    return f"{location.origin.rstrip('/')}/{relative.as_posix()}"


def _resolve_shards(location: DataLocation, config: str | None, split: str, field: str) -> list[Shard]:
    path = Path(location.path)
    if path.is_file():
        return [_shard(path, field)]
    if not path.is_dir():
        raise DataError(f"{field}: no such file or directory: {path}")
    if location.files:
        return [_shard(path / name, field, location.deferred.get(name)) for name in location.files]
    if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
        return _saved_dataset_shards(path, split, field)
    return _repository_shards(path, config, split, field)


def _saved_dataset_shards(path: Path, split: str, field: str) -> list[Shard]:
    from datasets import DatasetDict, load_from_disk

    try:
        saved = load_from_disk(str(path))  # memory-maps the Arrow files; reads no rows
    except (FileNotFoundError, ValueError) as error:
        raise DataError(f"{field}: {path} is not a readable save_to_disk folder: {error}") from None
    if isinstance(saved, DatasetDict):
        if split not in saved:
            raise DataError(f"data.split: {split!r} is not a split of the saved dataset {path} "
                            f"(splits: {', '.join(saved)})")
        saved = saved[split]
    return [Shard(Path(item["filename"]), "arrow") for item in saved.cache_files]


def _repository_shards(path: Path, config: str | None, split: str, field: str) -> list[Shard]:
    """`datasets` resolves a directory the way `load_dataset(path, config, split=...)` would."""
    from datasets import load_dataset_builder

    try:
        builder = load_dataset_builder(str(path), name=config)
    except ValueError as error:  # an unknown or missing config: datasets lists the available ones
        raise DataError(f"data.config: {path}: {' '.join(str(error).split())}") from None
    except FileNotFoundError as error:
        raise DataError(f"{field}: {path}: {error}") from None
    data_files = builder.config.data_files or {}
    splits = {str(name): files for name, files in data_files.items()}
    if split not in splits:
        raise DataError(f"data.split: {split!r} is not a split of {path}"
                        f"{f' (config {config!r})' if config else ''}; splits: {', '.join(splits) or 'none'}")
    return [_shard(Path(name), field) for name in splits[split]]


class SourceRecord(NamedTuple):
    """One raw record: `raw` is a JSON line (str) or an already-parsed record; `index` its line (text) or
    row (columnar) within its shard, for messages. A tuple: one is made per record, on the hot path."""

    shard: int
    index: int
    raw: Any


def describe(shards: list[Shard], shard: int, index: int) -> str:
    """`file:line` for JSONL, `file:[i]` for a JSON array's items, `file:row N` for columnar shards."""
    item = shards[shard]
    if item.format == "json":
        return item.label + (f":[{index}]" if item.json_array else f":{index}")
    return f"{item.label}:row {index}"


def iter_records(shards: list[Shard], offset: int = 0) -> Iterator[SourceRecord]:
    """Every record of every shard, in order; `offset` numbers the shards after those of an earlier source."""
    for number, item in enumerate(shards):
        rows = iter_lines(item) if item.format == "json" else enumerate(_columnar_rows(item))
        for index, raw in rows:
            yield SourceRecord(offset + number, index, raw)


# ---- runs: a shard's records a few thousand at a time, for another process to decode ----------------------
# Reading stays in one process (a shard is one stream, decompressed in order), but a run is cheap to hand over:
# one bytes object or one Arrow buffer, not a Python object per record. The process that encodes it turns it
# into records (`records()`); the run's numbers are the same lines and rows iter_records gives.


class LineRun(NamedTuple):
    """Consecutive records of a JSON Lines shard: their line numbers, and those lines (each with its newline,
    blank lines left out, undecoded) joined into one bytes object."""

    shard: int
    numbers: list[int]
    data: bytes

    def records(self) -> list[SourceRecord]:
        return [SourceRecord(self.shard, number, _decoded(line))
                for number, line in zip(self.numbers, io.BytesIO(self.data))]


class RowRun(NamedTuple):
    """Consecutive rows of a columnar shard (Parquet, Arrow, CSV/TSV), the first numbered `first`, as an Arrow
    IPC stream: only these rows' bytes, where pickling a slice of a batch would copy the whole batch."""

    shard: int
    first: int
    data: pa.Buffer
    source: Shard  # for the message when a row cannot be read

    def records(self) -> list[SourceRecord]:
        try:
            rows = pa.ipc.open_stream(self.data).read_all().to_pylist()
        except _UNREADABLE as error:
            raise _unreadable(self.source, error) from None
        return [SourceRecord(self.shard, self.first + index, row) for index, row in enumerate(rows)]


class ItemRun(NamedTuple):
    """Consecutive items of a JSON array shard (read whole, as it must be), the first numbered `first`."""

    shard: int
    first: int
    items: list

    def records(self) -> list[SourceRecord]:
        return [SourceRecord(self.shard, self.first + index, item) for index, item in enumerate(self.items)]


RecordRun = LineRun | RowRun | ItemRun


def record_runs(shards: list[Shard], numbers: list[int], size: int) -> Iterator[RecordRun]:
    """The records of `shards[number]` for each of `numbers`, in order, in runs of `size` (a shard's last run
    may be shorter); a run never spans two shards."""
    for number in numbers:
        shard = shards[number]
        if shard.format != "json":
            yield from _row_runs(number, shard, size)
        elif shard.json_array:
            items = _json_array(shard)
            yield from (ItemRun(number, first, items[first:first + size]) for first in range(0, len(items), size))
        else:
            yield from _line_runs(number, shard, size)


def _line_runs(number: int, shard: Shard, size: int) -> Iterator[LineRun]:
    numbers: list[int] = []
    lines: list[bytes] = []
    with open_binary(shard.path) as handle:
        for lineno, line in _record_lines(handle):
            numbers.append(lineno)
            lines.append(line)
            if len(lines) == size:
                yield LineRun(number, numbers, b"".join(lines))
                numbers, lines = [], []
    if lines:
        yield LineRun(number, numbers, b"".join(lines))


def _row_runs(number: int, shard: Shard, size: int) -> Iterator[RowRun]:
    first, held, count = 0, [], 0
    for batch in _checked_batches(shard):
        while batch.num_rows:
            taken = batch.slice(0, size - count)
            held.append(taken)
            count += taken.num_rows
            batch = batch.slice(taken.num_rows)
            if count == size:
                yield RowRun(number, first, _ipc_stream(held), shard)
                first, held, count = first + count, [], 0
    if held:
        yield RowRun(number, first, _ipc_stream(held), shard)


def _ipc_stream(batches: list[pa.RecordBatch]) -> pa.Buffer:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batches[0].schema) as writer:
        for batch in batches:
            writer.write_batch(batch)
    return sink.getvalue()


_MAGIC = ((b"\x1f\x8b", gzip.open), (b"BZh", bz2.open), (b"\xfd7zXZ", lzma.open))
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_SAMPLE = 8 * MIB  # bytes of a text shard read to estimate its record count


def estimate_records(shard: Shard) -> int | None:
    """About how many records a shard holds, for progress only (never for a result): Parquet's and Arrow
    files' counts from their metadata; a plain-text JSONL, CSV or TSV file's lines, counted in its first
    8 MiB and scaled by its size (exact when it is smaller); None for a compressed file or a JSON array, and
    for a file it cannot read (reading it proper says what is wrong)."""
    try:
        return _estimate_records(shard)
    except (OSError, ValueError):  # pyarrow's ArrowInvalid is a ValueError; so is an Arrow stream's missing footer
        return None


def _estimate_records(shard: Shard) -> int | None:
    if shard.format == "parquet":
        return pq.ParquetFile(shard.path).metadata.num_rows
    if shard.format == "arrow":
        # Memory-mapped: each batch's row count comes from its header, no column is read (pyarrow < 26 has no
        # RecordBatchFileReader.count_rows).
        reader = pa.ipc.open_file(pa.memory_map(str(shard.path)))
        return sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))
    if shard.json_array:
        return None
    with open(shard.path, "rb") as handle:
        sample = handle.read(_SAMPLE)
    if any(sample.startswith(magic) for magic in (_ZSTD_MAGIC, *(prefix for prefix, _ in _MAGIC))):
        return None
    size = Path(shard.path).stat().st_size
    whole = len(sample) == size
    if shard.format in ("csv", "tsv"):
        return _csv_rows(sample, whole, shard.format, size)
    lines = sample.count(b"\n")
    if whole:  # a last line without its newline counts too
        return lines + (bool(sample) and not sample.endswith(b"\n"))
    return round(lines * size / len(sample))


def _csv_rows(sample: bytes, whole: bool, format: str, size: int) -> int:
    """Rows, not lines: a quoted cell may hold newlines. The sample's rows parsed in blocks (a sample cut inside
    a row ends the count there), scaled by the file's size."""
    rows = 0
    try:
        reader = pacsv.open_csv(io.BytesIO(sample), read_options=pacsv.ReadOptions(block_size=1 << 18),
                                parse_options=pacsv.ParseOptions(delimiter="\t" if format == "tsv" else ",",
                                                                 newlines_in_values=True),
                                convert_options=pacsv.ConvertOptions(column_types={}, strings_can_be_null=False))
        for batch in reader:
            rows += batch.num_rows
    except (ValueError, OSError):  # the cut row, or a file the reading proper will name the fault of
        if not rows:
            return max(0, sample.count(b"\n") - 1)
    return rows if whole else round(rows * size / len(sample))




def open_binary(path: Path) -> BinaryIO:
    """A file's bytes, decompressed by its magic bytes (not its name): gzip, bz2, xz or zstd."""
    with open(path, "rb") as probe:
        magic = probe.read(6)
    if magic.startswith(_ZSTD_MAGIC):
        import zstandard

        # Buffered: zstandard's reader has no readline, and JSONL is read a line at a time.
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True))
    for prefix, opener in _MAGIC:
        if magic.startswith(prefix):
            return opener(path, "rb")
    return open(path, "rb")


def open_text(path: Path) -> TextIO:
    """Decoded as UTF-8; a leading byte-order mark (what spreadsheet exports and Windows tools write) is dropped."""
    return io.TextIOWrapper(open_binary(path), encoding="utf-8-sig")


_BOM = b"\xef\xbb\xbf"


def is_json_array(path: Path) -> bool:
    with open_binary(path) as handle:
        for line in handle:
            if line.strip():
                return line.removeprefix(_BOM).lstrip().startswith(b"[")
    return False


def iter_lines(shard: Shard) -> Iterator[tuple[int, str | Any]]:
    """(line number, raw JSON line) per JSONL record, or (array index, parsed item) for a JSON array. A line
    that is not UTF-8 comes as an `UndecodableLine`, which reading the record turns into its error (or a
    counted skip): one bad byte costs one record, not the file.

    JSONL streams; a JSON array is parsed whole, so very large datasets should be JSONL."""
    if shard.json_array:
        yield from enumerate(_json_array(shard))
        return
    with open_binary(shard.path) as handle:
        for lineno, line in _record_lines(handle):
            yield lineno, _decoded(line)


def _record_lines(handle: BinaryIO) -> Iterator[tuple[int, bytes]]:
    """(line number, line) of every line that holds a record: a blank line holds none; line 1 loses a BOM."""
    for lineno, line in enumerate(handle, start=1):
        if lineno == 1:
            line = line.removeprefix(_BOM)
        if line.strip():
            yield lineno, line


def _decoded(line: bytes) -> str | UndecodableLine:
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as error:
        return UndecodableLine(error.start + 1, line[error.start])


def _json_array(shard: Shard) -> list:
    with open_binary(shard.path) as handle:
        data = handle.read()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        column = error.start - (data.rfind(b"\n", 0, error.start) + 1) + 1
        raise DataError(f"{shard.label}:{line}: invalid UTF-8 at byte {column} of the line "
                        f"(0x{data[error.start]:02x}); a JSON array is read whole, so the file cannot be "
                        "read") from None
    try:
        items = json.loads(text)
    except json.JSONDecodeError as error:
        raise DataError(f"{shard.label}:{error.lineno}: malformed JSON array: {error.msg} at column "
                        f"{error.colno}") from None
    if not isinstance(items, list):
        raise DataError(f"{shard.label}: a JSON file must hold an array of records")
    return items


_UNREADABLE = (ValueError, OSError)  # pyarrow's ArrowInvalid is a ValueError


def _unreadable(shard: Shard, error: Exception) -> DataError:
    if shard.format in ("csv", "tsv") and (isinstance(error, UnicodeDecodeError) or "invalid UTF8" in str(error)):
        place = _first_invalid_utf8(shard)
        if place is not None:
            return DataError(f"{shard.label}:{place}; save the file as UTF-8 (a {shard.format.upper()} file is read "
                             "by columns, so one bad byte stops the whole file)")
    return DataError(f"{shard.label}: cannot read as {shard.format}: {' '.join(str(error).split())[:500]}")


def _first_invalid_utf8(shard: Shard) -> str | None:
    """Where a CSV/TSV file's first byte that is not UTF-8 is, as `row N (line L): invalid UTF-8 at byte B of the
    line (0xXX)` (rows numbered as `describe` numbers them, after the header); None when every byte decodes.
    Two streaming passes, so a bad byte deep in a large file costs reading up to it, not memory."""
    import codecs

    decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
    with open_binary(shard.path) as handle:
        while chunk := handle.read(1 << 20):
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as error:
                offset += error.start
                break
            offset += len(chunk)
        else:
            return None
    with open_binary(shard.path) as handle:
        seen, lineno, prefix = 0, 0, []
        for lineno, line in enumerate(handle, start=1):
            if seen + len(line) > offset:
                column, value = offset - seen, line[offset - seen]
                prefix.append(line[:column].decode("utf-8"))
                break
            prefix.append(line.decode("utf-8"))
            seen += len(line)
    # The last row read is the one the bad byte is in (cut before it; an empty cut is an empty row); the first, the
    # header. A quoted cell's newlines make rows and lines differ: both are named.
    row = sum(1 for _ in csv.reader(prefix, delimiter="\t" if shard.format == "tsv" else ",")) - 2
    where = f"row {row}" if row >= 0 else "the header row"
    return f"{where} (line {lineno}): invalid UTF-8 at byte {column + 1} of the line (0x{value:02x})"


def _columnar_rows(shard: Shard) -> Iterator[dict]:
    try:
        for batch in _record_batches(shard):
            yield from batch.to_pylist()
    except _UNREADABLE as error:
        raise _unreadable(shard, error) from None


def _checked_batches(shard: Shard) -> Iterator[pa.RecordBatch]:
    try:
        yield from _record_batches(shard)
    except _UNREADABLE as error:
        raise _unreadable(shard, error) from None


def _record_batches(shard: Shard) -> Iterator[pa.RecordBatch]:
    """A columnar shard a batch at a time, with plain reads (a memory map's pages would count as resident)."""
    if shard.format == "parquet":
        # One row group at a time: iterating the whole file lets pyarrow hold on to earlier row groups' pages
        # (its allocation grew to 100 MiB over 500k rows; per row group it stays at 7 MiB).
        parquet = pq.ParquetFile(shard.path)
        for group in range(parquet.num_row_groups):
            yield from parquet.iter_batches(batch_size=_BATCH, row_groups=[group])
    elif shard.format == "arrow":  # the IPC file format, or the stream format `save_to_disk` writes
        try:
            reader = pa.ipc.open_file(pa.OSFile(str(shard.path)))
            yield from (reader.get_batch(index) for index in range(reader.num_record_batches))
        except pa.ArrowInvalid:
            yield from pa.ipc.open_stream(pa.OSFile(str(shard.path)))
    else:
        # Every column as text: a CSV answer "42" is an answer to train on, not a number to reject.
        delimiter = "\t" if shard.format == "tsv" else ","
        header = _csv_header(shard)
        yield from pacsv.open_csv(
            open_binary(shard.path), parse_options=pacsv.ParseOptions(delimiter=delimiter, newlines_in_values=True),
            convert_options=pacsv.ConvertOptions(column_types=dict.fromkeys(header, pa.string()),
                                                 strings_can_be_null=False))


def _csv_header(shard: Shard) -> list[str]:
    with open_binary(shard.path) as handle:  # the first line only: a bad byte further on is a row's, not the header's
        first = handle.readline().removeprefix(_BOM).decode("utf-8")
    header = next(csv.reader([first], delimiter="\t" if shard.format == "tsv" else ","), None)
    if not header:
        raise DataError(f"{shard.label}: a {shard.format.upper()} file needs a header row naming its columns")
    return header


def download_hub_dataset(repo_id: str, revision: str | None, config: str | None):
    """A Hub dataset's files for one config, downloaded into HF_HOME's cache at one commit (a `hub.Snapshot`).

    The README comes first: its `configs:` block says which files each config reads, so a repository with
    many configs downloads one. Without such a block every data file is fetched, and `datasets` later splits
    them by its file-name conventions. The second download is pinned to the README's commit, so a branch
    that moves in between cannot mix two versions."""
    from phase1a.data import hub

    card = hub.snapshot(repo_id, repo_type="dataset", revision=revision, allow_patterns=["README.md"],
                        field="data.source")
    patterns = (_config_patterns(Path(card.path) / "README.md", config)
                or [f"*{suffix}*" for suffix in DATA_FILE_FORMATS])
    return hub.snapshot(repo_id, repo_type="dataset", revision=card.commit, allow_patterns=["README.md", *patterns],
                        field="data.source")


def _config_patterns(readme: Path, config: str | None) -> list[str]:
    """The data-file patterns of `config` (or of the default config) in a dataset card; [] without configs."""
    if not readme.is_file():
        return []
    from datasets.utils.metadata import MetadataConfigs
    from huggingface_hub import DatasetCard

    configs = MetadataConfigs.from_dataset_card_data(DatasetCard.load(readme).data)
    if not configs:
        return []
    name = config or configs.get_default_config_name() or (next(iter(configs)) if len(configs) == 1 else None)
    if name not in configs:
        names = ", ".join(configs)
        raise DataError(f"data.config: {config!r} is not a config of {readme.parent.name}; configs: {names}"
                        if config else f"data.config: the dataset has several configs, name one: {names}")
    files = configs[name].get("data_files", [])
    entries = files if isinstance(files, list) else [files]
    patterns: list[str] = []
    for entry in entries:
        paths = entry.get("path", []) if isinstance(entry, dict) else entry
        patterns += paths if isinstance(paths, list) else [paths]
    # The card's patterns are globs relative to the repository; the Hub's filter matches them with fnmatch.
    return [pattern.replace("**/", "*") for pattern in patterns]
