"""Replay for warm starts (`method.replay_fraction`): a night that continues an adapter trains on the shards that
adapter has not seen, plus a random share of the old examples, so it learns the new data without drifting from
the old.

What an adapter has seen is written beside its weights by the train stage (`trained_on.json`: the keys of the
tokenized shards of the dataset it was trained from, phase1a/data/shards.py) and travels with it when it is promoted.
A shard's key is its content with the tokenizer and record settings, so "new" means new content, whatever the
file is called. The mix is a view of the same shards' token files with fewer rows (phase1a/data/tokenized.py).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from phase1a.core.errors import DataError
from phase1a.core.fingerprint import hash_json
from phase1a.data.tokenized import SplitView, TokenizedData, read_mapped

if TYPE_CHECKING:
    from phase1a.start.result import StartPoint

TRAINED_ON = "trained_on.json"


def part_key(part: str) -> str:
    """A shard's key: the name of the directory its token file lies in."""
    return Path(part).parent.name


def write_trained_on(adapter_dir: Path, train_path: str) -> None:
    """Record the shards of the dataset an adapter was trained from (all of them: those a replay mix left out
    were seen by the adapter it continued)."""
    if str(train_path).endswith(".json"):
        shards = [part_key(part) for part in SplitView.read(train_path).parts]
        (Path(adapter_dir) / TRAINED_ON).write_text(json.dumps({"shards": shards}, indent=2) + "\n")


def read_trained_on(adapter_dir: Path, what: str) -> set[str]:
    path = Path(adapter_dir) / TRAINED_ON
    if not path.is_file():
        raise DataError(f"method.replay_fraction: {what} has no {TRAINED_ON} (it was not trained by phase1a), so "
                        "which data is new is unknown; leave replay_fraction unset to train on all the data")
    return set(json.loads(path.read_text())["shards"])


def warm_start_data(data: TokenizedData, start: StartPoint, fraction: float | None, seed: int) -> TokenizedData:
    """The training data of a run that starts at `start`: all of `data`, or with `fraction` set and an adapter
    to continue, the mix of what it has not seen and a replay of what it has. A first night (nothing promoted
    yet, so the base) trains on everything."""
    if fraction is None or start.kind == "base" or start.adapter_dir is None:
        return data
    what = start.describe()
    return replay_mix(data, read_trained_on(Path(start.adapter_dir), what), fraction, seed, what)


def replay_mix(data: TokenizedData, seen: set[str], fraction: float, seed: int, what: str) -> TokenizedData:
    """`data` with its training rows cut to the unseen shards' rows plus old rows drawn at random (by `seed`),
    so that old rows are `fraction` of the mix. A new view beside the dataset's own; a new fingerprint, so the
    plan and the training key follow the mix."""
    view = SplitView.read(data.train_path)
    rows = view.row_indices(data.train_path)
    starts = np.cumsum([0] + [_rows(part) for part in view.parts])
    part_of_row = np.searchsorted(starts, rows, side="right") - 1
    old = np.isin(np.array([part_key(part) for part in view.parts])[part_of_row], list(seen))
    fresh, previous = rows[~old], rows[old]
    if not fresh.size:
        raise DataError(f"method.replay_fraction: no training example is new since {what} was trained "
                        f"({len(view.parts)} shards, all seen): nothing to continue on")
    count = min(previous.size, round(fraction / (1 - fraction) * fresh.size))
    replayed = np.random.default_rng(seed).choice(previous, size=count, replace=False)
    mixed = np.sort(np.concatenate([fresh, replayed]))
    fingerprint = hash_json([data.fingerprint, sorted(seen), fraction, seed])[:32]
    path = Path(data.dir) / f"train-replay-{fingerprint[:16]}.json"
    if not path.is_file():  # the same mix is the same file: written once
        view.model_copy(update={"rows": path.with_suffix(".rows.npy").name}).write(path, mixed)
    return data.model_copy(update={"fingerprint": fingerprint, "train_path": str(path),
                                   "train_examples": int(mixed.size), "replay": {
                                       "new_examples": int(fresh.size), "replayed_examples": int(count),
                                       "old_examples": int(previous.size), "fraction": fraction}})


def _rows(part: str) -> int:
    return read_mapped(part).num_rows

