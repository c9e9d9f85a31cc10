"""Tokenize's per-shard cache: each shard's token ids and labels, and a few scalars per example, written once per
content and reused by every dataset that holds the shard.

A nightly dataset grows by a shard or two out of fifty; what depends only on one shard (reading, rendering,
tokenizing) is done once for it, and what depends on them all (max_seq_length, duplicates, the held-out
split) is decided over the scalars, without reading the old shards' tokens again (phase1a/data/tokenizing.py).

A shard's key is its content (a sha256, or the Hub blob's name), its format, the tokenizer (its vocabulary,
merges, special tokens and chat template, hashed from the loaded object), the record settings, and this
module's code with everything it imports. Its directory, `<root>/<key>/`:
  tokens.arrow    input_ids and labels, full length (truncation is decided over the union, applied at read)
  examples.arrow  per example: line (or row), content key, length, first supervised position, supervised tokens
  summary.json    examples written, and the bad records skipped (counted, the first few quoted)
Encoded in worker processes (phase1a/data/encoding.py), a chunk's token batch comes back as a file in a scratch
directory beside the shards (`<root>/.parts-*/`), appended to the shard's tokens.arrow in source order: the bytes
one process writes, for any count.
"""
from __future__ import annotations

import hashlib
import json
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np
import pyarrow as pa

from phase1a.core.atomic import atomic_path
from phase1a.core.fingerprint import code_fingerprint, hash_json, sha256_file
from phase1a.core.labels import IGNORE_INDEX
from phase1a.core.meter import Meter, stage_meter
from phase1a.data.datasource import RecordRun, Shard, estimate_records
from phase1a.data.encoding import (
    SHOWN_SKIPS,
    ChunkEncoder,
    EncodeSettings,
    auto_workers,
    chunk_runs,
    encode_chunks,
)
from phase1a.data.tokenized import read_mapped

if TYPE_CHECKING:  # typing only: how shards travel to and from the store is not part of a shard's key
    from phase1a.data.shared_shards import SharedShards

TOKENS_SCHEMA = pa.schema([("input_ids", pa.list_(pa.int32())), ("labels", pa.list_(pa.int32()))])
EXAMPLES_SCHEMA = pa.schema([("line", pa.int64()), ("key", pa.uint64()), ("length", pa.int32()),
                             ("first_label", pa.int32()), ("supervised", pa.int32())])
NO_LABEL = np.iinfo(np.int32).max  # first_label of an example with nothing to train on


def tokenizer_identity(tokenizer) -> str:
    """What of a loaded tokenizer decides its output: the fast tokenizer's whole definition (vocabulary,
    merges, normalizer, added tokens), the special tokens and the chat template in effect."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    definition = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    return hash_json([type(tokenizer).__name__, hashlib.sha256(definition.encode()).hexdigest(),
                      tokenizer.special_tokens_map, getattr(tokenizer, "chat_template", None)])


def shard_key(content: str, shard: Shard, tokenizer_id: str, settings: EncodeSettings) -> str:
    return hash_json({"content": content, "format": shard.format, "json_array": shard.json_array,
                      "tokenizer": tokenizer_id, "settings": asdict(settings), "code": code_fingerprint(__name__)})


Origin = Literal["encoded", "local", "store"]  # encoded now, from this host's cache, downloaded from the store


@dataclass
class EncodedShard:
    """One shard's cached encoding: its token file, its examples' scalars and its skipped records."""

    dir: Path
    examples: dict[str, np.ndarray]  # EXAMPLES_SCHEMA's columns
    skipped: Counter[str]
    shown: list[str]
    origin: Origin

    @property
    def tokens_path(self) -> Path:
        return self.dir / "tokens.arrow"

    @property
    def count(self) -> int:
        return int(self.examples["length"].size)

    @classmethod
    def read(cls, directory: Path, origin: Origin) -> "EncodedShard":
        table = read_mapped(directory / "examples.arrow")
        summary = json.loads((directory / "summary.json").read_text())
        return cls(directory, {name: table.column(name).to_numpy() for name in EXAMPLES_SCHEMA.names},
                   Counter(summary["skipped"]), summary["shown"], origin)


def label_scalars(labels: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per example (flat labels, offsets): the first position >= 1 with a label (NO_LABEL: none) and how many
    positions >= 1 have one. Position 0 is never predicted, so it never counts."""
    starts, ends = offsets[:-1], offsets[1:]
    labelled = labels != IGNORE_INDEX
    labelled[starts[ends > starts]] = False
    cumulative = np.concatenate([[0], np.cumsum(labelled)])
    supervised = cumulative[ends] - cumulative[starts]
    positions = np.flatnonzero(labelled)
    first = np.full(starts.size, NO_LABEL, dtype=np.int64)
    has = supervised > 0
    first[has] = positions[np.searchsorted(positions, starts[has])] - starts[has]
    return first.astype(np.int32), supervised.astype(np.int32)


def content_id(shard: Shard, known: dict[str, str]) -> str:
    """The shard's content hash: the staged one where staging recorded it (by resolved path: a Hub snapshot's
    files are links to its blobs), else its bytes' sha256."""
    return known.get(str(Path(shard.path).resolve())) or sha256_file(shard.path)


@dataclass
class ShardStore:
    """Encodes the shards not yet in `root`, a chunk at a time, and reads back those that are."""

    root: Path
    tokenizer: object
    settings: EncodeSettings
    requested_workers: int | None  # None: phase1a.data.encoding.auto_workers, from the size of the shards to encode
    content: dict[str, str] = field(default_factory=dict)  # resolved shard path -> content hash, where known
    shared: SharedShards | None = None  # the store's shards: downloaded where missing here, uploaded once encoded
    fetch: Callable[[list[Shard]], None] | None = None  # brings shards staging deferred to disk, before encoding
    workers: int = 1  # processes the last encode used

    def encode(self, shards: list[Shard]) -> list[EncodedShard]:
        tokenizer_id = tokenizer_identity(self.tokenizer)
        dirs = [self.root / shard_key(content_id(shard, self.content), shard, tokenizer_id, self.settings)
                for shard in shards]
        origins: list[Origin] = ["local" if (d / "summary.json").is_file() else "encoded" for d in dirs]
        pending = [number for number, origin in enumerate(origins) if origin == "encoded"]
        if pending and self.shared is not None:
            for position in self.shared.fetch([dirs[number] for number in pending]):
                origins[pending[position]] = "store"
            pending = [number for number in pending if origins[number] == "encoded"]
        if pending and self.fetch is not None:
            self.fetch([shards[number] for number in pending])
        self.workers = auto_workers([shards[number] for number in pending], self.requested_workers)
        if pending:
            self._encode_pending(shards, pending, dirs)
        if self.shared is not None:
            self.shared.finish()
        return [EncodedShard.read(directory, origin) for directory, origin in zip(dirs, origins)]

    def _encode_pending(self, shards: list[Shard], pending: list[int], dirs: list[Path]) -> None:
        writer: _ShardWriter | None = None
        # Progress in the parent, once per chunk of records: examples and tokens, against an estimate of the
        # records that each shard corrects as it ends.
        estimates = {number: estimate_records(shards[number]) for number in pending}
        total = None if None in estimates.values() else sum(estimates.values())
        what = f"{len(pending)} of {len(shards)} shards to encode in {self.workers} process(es)"
        with stage_meter("tokenize", total, "examples", what=what) as meter, self._parts() as parts:
            job = _ChunkJob(ChunkEncoder(self.tokenizer, shards, self.settings), parts)
            try:
                with closing(encode_chunks(chunk_runs(shards, pending), job, self.workers)) as outputs:
                    for output in outputs:
                        if writer is None or writer.number != output.shard:
                            if writer is not None:
                                self._finish(writer, meter, estimates)
                            writer = _ShardWriter(output.shard, dirs[output.shard])
                        writer.add(output)
                        meter.advance(output.records, tokens=output.tokens)
            except BaseException:  # a bad record: the shards finished before it stay cached, this one goes
                if writer is not None:
                    writer.abort()
                raise
            if writer is not None:
                self._finish(writer, meter, estimates)
        for number in pending:  # a shard with no records at all produced no chunk: it is cached empty
            if not (dirs[number] / "summary.json").is_file():
                self._finish(_ShardWriter(number, dirs[number]), None, {})

    def _parts(self):
        """Where workers leave each chunk's tokens for this process to append (closed only after the pool has
        stopped: `encode_chunks` ends inside it); none when the chunks are encoded in this process."""
        if self.workers <= 1:
            return nullcontext(None)
        self.root.mkdir(parents=True, exist_ok=True)
        return _scratch_directory(self.root)

    def _finish(self, writer: "_ShardWriter", meter: Meter | None, estimates: dict[int, int | None]) -> None:
        """Close a shard's output (and share it); its records are now counted, so the meter's total loses that
        shard's guess."""
        writer.finish()
        if self.shared is not None:
            self.shared.share(writer.final)
        estimate = estimates.get(writer.number)
        if meter is not None and meter.total is not None and estimate is not None:
            meter.total += writer.records - estimate


@dataclass
class _ChunkOutput:
    """One chunk's share of its shard's files, as the job leaves it for the process that writes them."""

    shard: int
    records: int  # read from the source: examples and skipped records
    tokens: int
    columns: dict[str, np.ndarray]  # EXAMPLES_SCHEMA's, one value per example
    batch: pa.RecordBatch | Path | None  # TOKENS_SCHEMA's rows, or the file a worker wrote them to; None: no examples
    skipped: Counter[str]
    shown: list[str]


@dataclass
class _ChunkJob:
    """What is done to a chunk where it is encoded (a worker, or this process): its records decoded and
    encoded, its examples' scalars and its token batch made, and, in a worker, that batch written to a file in
    `parts`, so that only the scalars travel back to the parent."""

    encoder: ChunkEncoder
    parts: Path | None

    def __call__(self, run: RecordRun) -> _ChunkOutput:
        chunk = self.encoder(run.records())
        columns: dict[str, np.ndarray] = {}
        batch: pa.RecordBatch | Path | None = None
        if chunk.tokens is not None:
            offsets = chunk.tokens.offsets
            first, supervised = label_scalars(chunk.tokens.labels, offsets)
            columns = {"line": chunk.places[:, 1], "key": chunk.keys, "length": np.diff(offsets),
                       "first_label": first, "supervised": supervised}
            batch = pa.record_batch([pa.ListArray.from_arrays(offsets, chunk.tokens.input_ids),
                                     pa.ListArray.from_arrays(offsets, chunk.tokens.labels)], schema=TOKENS_SCHEMA)
            if self.parts is not None:  # named by the shard and its first example's line or row: one chunk's
                batch = _write_part(self.parts / f"{chunk.shard}-{chunk.places[0, 1]}.arrow", batch)
        return _ChunkOutput(chunk.shard, chunk.records, chunk.token_count, columns, batch, chunk.skipped, chunk.shown)


@contextmanager
def _scratch_directory(parent: Path) -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix=".parts-", dir=parent) as name:
        yield Path(name)


def _write_part(path: Path, batch: pa.RecordBatch) -> Path:
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, TOKENS_SCHEMA) as writer:
        writer.write_batch(batch)
    return path


class _ShardWriter:
    """Streams one shard's chunks into a scratch directory that takes the shard's name when it is whole."""

    def __init__(self, number: int, final: Path) -> None:
        self.number, self.final = number, final
        self._scratch = atomic_path(final, existing="keep")  # a racing run that finished first keeps its copy
        self.work = self._scratch.__enter__()
        self.work.mkdir()
        self._sink = pa.OSFile(str(self.work / "tokens.arrow"), "wb")
        self._tokens = pa.ipc.new_file(self._sink, TOKENS_SCHEMA)
        self.columns: dict[str, list[np.ndarray]] = {name: [] for name in EXAMPLES_SCHEMA.names}
        self.skipped: Counter[str] = Counter()
        self.shown: list[str] = []
        self.records = 0  # read from the source: examples and skipped records

    def add(self, chunk: _ChunkOutput) -> None:
        self.records += chunk.records
        self.skipped.update(chunk.skipped)
        self.shown += chunk.shown[: SHOWN_SKIPS - len(self.shown)]
        if chunk.batch is None:
            return
        if isinstance(chunk.batch, Path):  # a worker's file: its batch appended as it is mapped, then removed
            with pa.memory_map(str(chunk.batch)) as source:
                self._tokens.write_batch(pa.ipc.open_stream(source).read_next_batch())
            chunk.batch.unlink()
        else:
            self._tokens.write_batch(chunk.batch)
        for name, values in chunk.columns.items():
            self.columns[name].append(values)

    def abort(self) -> None:
        self._close()
        self._scratch.__exit__(RuntimeError, RuntimeError("aborted"), None)  # removes the scratch directory

    def _close(self) -> None:
        self._tokens.close()
        self._sink.close()

    def finish(self) -> None:
        self._close()
        columns = [pa.array(np.concatenate(values) if values else np.array([], dtype=kind.to_pandas_dtype()),
                            type=kind) for (values, kind) in zip(self.columns.values(), EXAMPLES_SCHEMA.types)]
        with pa.OSFile(str(self.work / "examples.arrow"), "wb") as sink, \
                pa.ipc.new_file(sink, EXAMPLES_SCHEMA) as writer:
            writer.write_table(pa.table(columns, schema=EXAMPLES_SCHEMA))
        (self.work / "summary.json").write_text(json.dumps(
            {"examples": len(columns[0]), "skipped": dict(self.skipped), "shown": self.shown}))
        self._scratch.__exit__(None, None, None)
