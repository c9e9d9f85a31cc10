"""What the tokenize stage hands the plan, train and validate stages: where the tokenized dataset is and what it
holds. Its own module, light on imports: tokenize's cache key covers the code it imports (phase1a/core/fingerprint.py),
and a dataset should not be tokenized again because the plan's or validation's code changed."""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel

from phase1a.core.atomic import atomic_path, write_atomically
from phase1a.data.lengths import LengthStats, Outliers, WasteRow


class TokenizedData(BaseModel):
    fingerprint: str
    dir: str
    train_path: str  # a SplitView (train.json); TokenRows.load and split_table read it
    validation_path: str
    lengths_path: str  # the kept examples' lengths (.npy), for the run report's histogram
    train_examples: int
    validation_examples: int
    shards: int  # data files read, the validation source's included
    shards_encoded: int = 0  # of those, tokenized by this run
    shards_reused: int = 0  # taken from the per-shard cache (phase1a/data/shards.py): unchanged since an earlier run
    shards_downloaded: int = 0  # taken from the store's shards (phase1a/data/shared_shards.py), verified
    shards_corrupt: list[str] = []  # store shards that were not what their manifest says: encoded again instead
    shards_uploaded: int = 0  # encoded here and put in the store for other hosts
    workers: int = 1  # processes that encoded the records
    template: Literal["chat_template", "fallback"]
    lengths: LengthStats
    outliers: Outliers | None = None  # examples far longer than the rest, named by file and line
    max_seq_length: int
    model_max_length: int
    waste: list[WasteRow]
    skipped: dict[str, int]
    skipped_examples: list[str]
    duplicates: int
    validation_overlap: int = 0  # held-out examples whose exact content is also in train (a shared validation_source)
    duplicates_dropped: int
    truncated_examples: int
    dropped_overlong: int
    dropped_without_labels: int
    replay: dict[str, float] | None = None  # a warm start's mix of new and replayed examples (phase1a/start/replay.py)


def read_mapped(path: str | Path) -> pa.Table:
    """An Arrow IPC file as a table over its memory map: no copy, pages read as they are touched."""
    return pa.ipc.open_file(pa.memory_map(str(path), "r")).read_all()


class SplitView(BaseModel):
    """A split of the tokenized dataset without a copy of its tokens: the shards' token files in order (their
    rows numbered through as one table), the rows of this split (a .npy beside the view), and the length every
    example is cut to on reading. Adding a shard writes a new view, and the old shards' files stay as they are."""

    parts: list[str]
    rows: str  # file name, in the view's directory
    max_length: int

    def write(self, path: Path, rows: np.ndarray) -> None:
        """The rows, then the view that names them: each whole or not there, for a reader in another run."""
        with atomic_path(Path(path).with_name(self.rows)) as scratch, open(scratch, "wb") as handle:
            np.save(handle, rows.astype(np.int64), allow_pickle=False)
        write_atomically(Path(path), self.model_dump_json(indent=2))

    @classmethod
    def read(cls, path: str | Path) -> "SplitView":
        return cls.model_validate_json(Path(path).read_text())

    def row_indices(self, path: str | Path) -> np.ndarray:
        return np.load(Path(path).with_name(self.rows), allow_pickle=False)

    def table(self, path: str | Path) -> pa.Table:
        """input_ids and labels of the split's rows, in order, full length: memory-mapped parts, one take."""
        parts = [read_mapped(part) for part in self.parts]
        return pa.concat_tables(parts).take(pa.array(self.row_indices(path)))


def split_table(path: str | Path) -> pa.Table:
    """A split as one table, cut to its max_length: input_ids, labels and length (what tests and tools read)."""
    view = SplitView.read(path)
    table = view.table(path)
    ids = pc.list_slice(table.column("input_ids"), 0, view.max_length)
    labels = pc.list_slice(table.column("labels"), 0, view.max_length)
    return pa.table({"input_ids": ids, "labels": labels, "length": pc.list_value_length(ids)})


def split_digest(path: str | Path) -> str:
    """A split's identity by its bytes: its shards' token files and its rows (equal splits, equal digests)."""
    view, digest = SplitView.read(path), hashlib.sha256()
    for part in view.parts:
        with open(part, "rb") as handle:
            while block := handle.read(1 << 24):
                digest.update(block)
    digest.update(view.row_indices(path).tobytes())
    digest.update(str(view.max_length).encode())
    return digest.hexdigest()
