"""Tokenizing: a dataset (its shards, in any format `phase1a.data.datasource` reads) to Arrow with loss masks, a
held-out split and length analysis, once per content (the tokenize stage, tasks/tokenize.py, runs it).

`tokenize_dataset`, in four phases that keep memory flat:
  1. encode    shard by shard, each once per content (`phase1a.data.shards`): records -> token ids and labels,
               plus a few scalars per example (line or row, content hash, length, supervised positions); in
               worker processes where the input is large (`phase1a.data.encoding`)
  2. decide    over every shard's scalars only (old shards' tokens are not read): max_seq_length, overlong
               and duplicate examples, the held-out split, outliers
  3. split     train.json and validation.json: views over the shards' token files (row numbers, a length to cut
               every example to on reading), no copy of a token
  4. describe  lengths (the run report draws their histogram) and every count (skipped, duplicates, truncated,
               dropped)
The held-out split is either a stable content-hash share of the source, or every record of
`data.validation_source`.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, ConfigDict, Field

from phase1a.core.atomic import atomic_path
from phase1a.core.errors import DataError
from phase1a.core.fingerprint import code_fingerprint, hash_json
from phase1a.core.labels import IGNORE_INDEX
from phase1a.core.locks import exclusive
from phase1a.core.logs import run_logger
from phase1a.data.datasource import DataLocation, Shard, describe, resolve_shards
from phase1a.data.encoding import SHOWN_SKIPS, EncodeSettings
from phase1a.data.lengths import (
    Outliers,
    describe_outliers,
    find_outliers,
    length_stats,
    right_size,
    waste_table,
)
from phase1a.data.records import BadRecords
from phase1a.data.shards import EncodedShard, ShardStore
from phase1a.data.shared_shards import SharedShards
from phase1a.data.templates import template_fingerprint
from phase1a.data.tokenized import SplitView, TokenizedData, read_mapped
from phase1a.store.base import Store


class TokenizeOptions(BaseModel):
    """The `data` settings tokenizing reads: its key's settings part. A config's:
    phase1a/config/tokenizing.py."""

    model_config = ConfigDict(arbitrary_types_allowed=True)  # the store: an open Store, not settings

    format: str = "auto"  # a key of phase1a.data.records.RECORD_FORMATS, or auto
    field_map: dict[str, str] = {}
    role_map: dict[str, str] = {}
    chat_template: str | None = None  # a name in phase1a.data.templates.CHAT_TEMPLATES or a Jinja file's path
    train_on_inputs: bool = False
    bad_records: BadRecords = "skip_empty"
    overlong: Literal["truncate", "drop", "fail"] = "truncate"
    drop_duplicates: bool = False
    length_percentile: float = 100.0
    validation_fraction: float = 0.1
    validation_count: int | None = None
    max_seq_length: int | None = None  # a user cap; None means right-size from the data
    config: str | None = None  # which files of a dataset repository: data.config, data.split
    split: str = "train"
    validation_split: str | None = None
    tokenize_workers: int | None = None  # processes for pass 1; None: phase1a.data.encoding.auto_workers
    # Shards shared with other hosts through this store (phase1a/data/shared_shards.py); none by default.
    store: Store | None = Field(default=None, exclude=True)
    s3_endpoint_url: str | None = None  # where a staged source's deferred files are fetched from


def tokenize_fingerprint(data: str | list[str], tokenizer_fp: str, model_max_length: int,
                         options: TokenizeOptions) -> str:
    """The tokenized dataset's identity (its directory's name): `data` is the content fingerprint of the source
    (and of the validation source, when there is one); the code is this module's and all it imports."""
    # The worker count and the store are left out: any count, and a shard from the store, give the same bytes
    # (tests/data/test_encoding.py, tests/flows/test_resume_anywhere.py check). A chat template enters as its text,
    # not its file's path: this fingerprint is the data's in every later key, and those travel between hosts.
    return hash_json({"data": data, "tokenizer": tokenizer_fp, "model_max_length": model_max_length,
                      "options": options.model_dump(exclude={"tokenize_workers", "store", "s3_endpoint_url",
                                                             "chat_template"}),
                      "chat_template": template_fingerprint(options.chat_template), "code": code_fingerprint(__name__)})


def dataset_dir(cache_dir: Path, fingerprint: str) -> Path:
    return Path(cache_dir) / "tokenized" / fingerprint


def tokenize_dataset(data: DataLocation | Path, tokenizer, model_max_length: int, options: TokenizeOptions,
                     out_dir: Path, validation: DataLocation | None = None) -> TokenizedData:
    """Tokenize `data` (a staged location, or a plain path) into `out_dir` (named by its fingerprint), reusing
    a complete earlier result, and every shard an earlier dataset already tokenized (`out_dir`'s sibling
    `shards/`) or, with a store in `options`, that the store has. With `validation`, that source is the held-out
    set and `data` is all training."""
    sources = _Sources.resolve(data, validation, options)
    out_dir = Path(out_dir)
    # Two runs on one fingerprint: the first computes, the second waits here and then reuses its output.
    with exclusive(out_dir.with_name(out_dir.name + ".lock"), f"tokenized data {out_dir}"):
        if (out_dir / "manifest.json").is_file():
            return TokenizedData.model_validate_json((out_dir / "manifest.json").read_text())
        with atomic_path(out_dir) as work:
            work.mkdir()
            encoded = _encode(sources, tokenizer, options, out_dir.parent / "shards",
                              SharedShards(options.store) if options.store else None)
            run_logger().info("%d shards: %d tokenized now, %d from the shard cache, %d from the store",
                              len(encoded.shards), encoded.count("encoded"), encoded.count("local"),
                              encoded.count("store"))
            decided = _decide(encoded, sources, model_max_length, options)
            split = _split(work, encoded, decided)
            result = _describe(work, out_dir, _Described(sources, tokenizer, model_max_length, options, encoded,
                                                         decided, split))
            (work / "manifest.json").write_text(result.model_dump_json(indent=2))
        return result


@dataclass
class _Sources:
    """The shards to read, training source first; those from `first_validation` on are the held-out set."""

    shards: list[Shard]
    first_validation: int | None  # None: hold out a content-hash share of every shard
    content: dict[str, str]  # shard path -> content hash, as staging recorded it
    locations: list[DataLocation]  # where the shards were staged: a staged S3 prefix may have deferred files

    @classmethod
    def resolve(cls, data: DataLocation | Path, validation: DataLocation | None,
                options: TokenizeOptions) -> "_Sources":
        data = data if isinstance(data, DataLocation) else DataLocation(path=str(data))
        train = resolve_shards(data, options.config, options.split)
        content = _content_hashes(data)
        if validation is None:
            return cls(train, None, content, [data])
        held_out = resolve_shards(validation, options.config, options.validation_split or options.split,
                                  field="data.validation_source")
        return cls(train + held_out, len(train), content | _content_hashes(validation), [data, validation])

    def fetcher(self, endpoint_url: str | None):
        """What brings the shards about to be encoded to local disk, where staging deferred them (the store knew
        their content: phase1a/data/staging.py); None when nothing was deferred."""
        deferred = [location for location in self.locations if getattr(location, "deferred", None)]
        if not deferred:
            return None

        def fetch(shards: list[Shard]) -> None:
            from phase1a.data.staging import fetch_deferred  # boto3: only where a staged S3 prefix deferred a file

            for location in deferred:
                base = Path(location.path)
                names = [Path(shard.path).relative_to(base).as_posix() for shard in shards
                         if Path(shard.path).is_relative_to(base)]
                fetch_deferred(location, names, endpoint_url)

        return fetch

    def name(self) -> str:
        first = self.shards[0].label  # the user's name for it, not the staged copy's
        return first if len(self.shards) == 1 else f"{len(self.shards)} shards ({first}, ...)"

    def where(self, place: np.ndarray) -> str:
        """file:line (or row) of an example, from its (shard, line) place."""
        return describe(self.shards, *map(int, place))


def _content_hashes(location: DataLocation) -> dict[str, str]:
    """The staged files' content hashes by path (staging read them already), so no shard is hashed twice."""
    recorded = getattr(location, "file_sha256", {}) or {}
    path = Path(location.path)
    if path.is_file():
        fingerprint = getattr(location, "fingerprint", None)
        return {str(path.resolve()): fingerprint} if fingerprint else {}
    return {str((path / name).resolve()): sha for name, sha in recorded.items()}


# ---- 1. encode ---------------------------------------------------------------------------------------------

@dataclass
class _Encoded:
    """Every shard's cached encoding (phase1a/data/shards.py), and their examples' scalars concatenated in order."""

    shards: list[EncodedShard]
    places: np.ndarray  # (n, 2): shard and line/row
    keys: np.ndarray  # content hashes
    lengths: np.ndarray
    first_label: np.ndarray  # first supervised position (NO_LABEL: none)
    supervised: np.ndarray  # supervised tokens, untruncated
    skipped: Counter[str]
    shown: list[str]  # the first few skipped records' messages
    workers: int
    shared: dict  # with a store: TokenizedData's shards_corrupt and shards_uploaded

    def count(self, origin: str) -> int:
        """Shards encoded now, from the local cache or from the store."""
        return sum(shard.origin == origin for shard in self.shards)


def _encode(sources: _Sources, tokenizer, options: TokenizeOptions, root: Path,
            shared: SharedShards | None) -> _Encoded:
    settings = EncodeSettings(**{f.name: getattr(options, f.name) for f in fields(EncodeSettings)})
    store = ShardStore(root, tokenizer, settings, options.tokenize_workers, sources.content, shared,
                       fetch=sources.fetcher(options.s3_endpoint_url))
    shards = store.encode(sources.shards)
    skipped: Counter[str] = Counter()
    shown: list[str] = []
    for shard in shards:
        skipped.update(shard.skipped)
        shown += shard.shown[: SHOWN_SKIPS - len(shown)]
    if not sum(shard.count for shard in shards):
        detail = f" ({sum(skipped.values())} bad records skipped: {dict(skipped)})" if skipped else ""
        raise DataError(f"{sources.name()}: no usable records{detail}")
    if options.bad_records == "skip_empty" and skipped:  # skipped by default: said once, never silently
        run_logger().warning("%d record(s) with nothing to train skipped (%s), e.g. %s; data.bad_records: fail makes "
                             "them errors", sum(skipped.values()), ", ".join(f"{r}: {n}" for r, n in skipped.items()),
                             "; ".join(shown[:3]))
    column = lambda name: np.concatenate([shard.examples[name] for shard in shards])  # noqa: E731
    places = np.column_stack([np.repeat(np.arange(len(shards)), [shard.count for shard in shards]), column("line")])
    return _Encoded(shards, places, column("key"), column("length"), column("first_label"), column("supervised"),
                    skipped, shown, store.workers,
                    {"shards_corrupt": shared.corrupt, "shards_uploaded": shared.uploaded} if shared else {})


# ---- 2. decide ---------------------------------------------------------------------------------------------

@dataclass
class _Decisions:
    max_seq_length: int
    overlong: np.ndarray  # longer than max_seq_length
    first_seen: np.ndarray  # not a duplicate of an earlier example
    keep: np.ndarray  # after the overlong and duplicate policies
    kept: np.ndarray  # of those, the ones with something to train on once truncated: written
    without_labels: int  # dropped: nothing left to train on after truncation
    validation: np.ndarray  # held out
    outliers: Outliers | None


def _decide(encoded: _Encoded, sources: _Sources, model_max_length: int, options: TokenizeOptions) -> _Decisions:
    lengths = encoded.lengths

    def size_for(some: np.ndarray) -> int:
        return right_size(some, options.length_percentile, model_max_length, options.max_seq_length)

    # Found over every example, sized for all of them here: the plan's profile decides whether outliers size the
    # run (quality) or are cut to what the others size (balanced, fast), on this one tokenized dataset.
    outliers = find_outliers(lengths, lambda index: sources.where(encoded.places[index]), size_for)
    if outliers:
        run_logger().warning("%s", describe_outliers(outliers))
    max_seq_length = size_for(lengths)
    overlong = lengths > max_seq_length
    if options.overlong == "fail" and overlong.any():
        first = int(np.argmax(overlong))
        raise DataError(f"{sources.where(encoded.places[first])}: {int(lengths[first])} tokens exceed max_seq_length "
                        f"{max_seq_length} ({int(overlong.sum())} examples do; data.overlong is 'fail')")
    first_seen = np.zeros(encoded.keys.size, dtype=bool)
    first_seen[np.unique(encoded.keys, return_index=True)[1]] = True
    keep = ~overlong if options.overlong == "drop" else np.ones(encoded.keys.size, dtype=bool)
    if options.drop_duplicates:
        keep &= first_seen
    labelled = encoded.first_label < max_seq_length  # a label survives truncation
    validation = (_validation_mask(encoded.keys, options, sources.name()) if sources.first_validation is None
                  else encoded.places[:, 0] >= sources.first_validation)
    return _Decisions(max_seq_length, overlong, first_seen, keep, keep & labelled, int((keep & ~labelled).sum()),
                      validation, outliers)


def _validation_mask(keys: np.ndarray, options: TokenizeOptions, name: str) -> np.ndarray:
    """Held-out by content hash, decided per distinct content, so exact duplicates are all on one side (else a
    held-out example would also be trained on). A fraction keeps each example on its side as the data grows (its
    hash alone decides); a count takes the lowest hashes, as many whole groups of duplicates as fit, so new data
    can move the boundary."""
    distinct, group, sizes = np.unique(keys, return_inverse=True, return_counts=True)  # ascending hashes
    if distinct.size < 2:
        what = f"all {keys.size} examples are the same" if keys.size > 1 else f"{keys.size} example"
        raise DataError(f"{name}: {what}: nothing distinct to hold out for validation; add distinct examples or give "
                        "data.validation_source")
    if options.validation_count is None:
        held = distinct.astype(np.float64) / 2.0**64 < options.validation_fraction
    else:
        held = np.cumsum(sizes) <= options.validation_count
    if not held.any():  # a tiny dataset: hold out the lowest hash rather than nothing
        held[0] = True
    if held.all():
        held[-1] = False
    return held[group.reshape(-1)]


# ---- 3. split ----------------------------------------------------------------------------------------------

@dataclass
class _Split:
    counts: dict[str, int]  # examples in train and validation
    kept_lengths: np.ndarray  # of every example kept, truncated
    supervised: int  # trained tokens of those


def _split(work: Path, encoded: _Encoded, decided: _Decisions) -> _Split:
    """Each split as a view over the shards' token files: row numbers, no copy of a token."""
    parts = [str(shard.tokens_path) for shard in encoded.shards]
    counts = {}
    held_out = decided.validation
    for name, mask in (("train", decided.kept & ~held_out), ("validation", decided.kept & held_out)):
        SplitView(parts=parts, rows=f"{name}.rows.npy", max_length=decided.max_seq_length).write(
            work / f"{name}.json", np.flatnonzero(mask))
        counts[name] = int(mask.sum())
    kept_lengths = np.minimum(encoded.lengths, decided.max_seq_length)[decided.kept]
    return _Split(counts, kept_lengths, _supervised_after_truncation(encoded, decided))


def _supervised_after_truncation(encoded: _Encoded, decided: _Decisions) -> int:
    """Trained tokens of the kept examples: the stored counts, recounted from the tokens for the few that are cut."""
    total = int(encoded.supervised[decided.kept & ~decided.overlong].sum())
    cut = np.flatnonzero(decided.kept & decided.overlong)
    if cut.size:
        starts = np.concatenate([[0], np.cumsum([shard.count for shard in encoded.shards])])
        for number, shard in enumerate(encoded.shards):
            rows = cut[(cut >= starts[number]) & (cut < starts[number + 1])] - starts[number]
            if rows.size:
                table = read_mapped(shard.tokens_path).take(pa.array(rows))
                labels = pc.list_slice(table.column("labels"), 1, decided.max_seq_length).combine_chunks()
                total += int(np.count_nonzero(labels.values.to_numpy(zero_copy_only=False) != IGNORE_INDEX))
    return total


# ---- 4. describe -------------------------------------------------------------------------------------------

@dataclass
class _Described:
    """Everything the result is read from."""

    sources: _Sources
    tokenizer: object
    model_max_length: int
    options: TokenizeOptions
    encoded: _Encoded
    decided: _Decisions
    split: _Split


def _describe(work: Path, out_dir: Path, run: _Described) -> TokenizedData:
    counts, decided, options = run.split.counts, run.decided, run.options
    if run.sources.first_validation is not None and not (counts["train"] and counts["validation"]):
        empty = "data.source" if not counts["train"] else "data.validation_source"
        raise DataError(f"{empty}: no usable examples after filtering ({counts['train']} train, "
                        f"{counts['validation']} validation)")
    lengths = run.split.kept_lengths
    if lengths.size < 2:
        raise DataError(f"{run.sources.name()}: {lengths.size} usable examples after filtering; need a train and a "
                        "validation split")
    stats = length_stats(lengths, run.split.supervised)
    np.save(work / "lengths.npy", lengths.astype(np.int32), allow_pickle=False)  # the run report draws them
    duplicates = int((~decided.first_seen).sum())
    overlap = _overlap(run.encoded.keys, decided)
    if overlap:
        run_logger().warning("%d held-out example(s) are also in the training data (the same content): validation "
                             "scores them as seen examples", overlap)
    return TokenizedData(
        fingerprint=out_dir.name, dir=str(out_dir), train_path=str(out_dir / "train.json"),
        validation_path=str(out_dir / "validation.json"), lengths_path=str(out_dir / "lengths.npy"),
        train_examples=counts["train"], validation_examples=counts["validation"], shards=len(run.sources.shards),
        shards_encoded=run.encoded.count("encoded"), shards_reused=run.encoded.count("local"),
        shards_downloaded=run.encoded.count("store"), **run.encoded.shared,
        workers=run.encoded.workers,
        template="chat_template" if getattr(run.tokenizer, "chat_template", None) else "fallback",
        lengths=stats, outliers=decided.outliers, max_seq_length=decided.max_seq_length,
        model_max_length=run.model_max_length,
        waste=waste_table(run.encoded.lengths, options.max_seq_length or run.model_max_length, decided.max_seq_length),
        skipped=dict(run.encoded.skipped), skipped_examples=run.encoded.shown, duplicates=duplicates,
        validation_overlap=overlap,
        duplicates_dropped=duplicates if options.drop_duplicates else 0,
        truncated_examples=int((decided.overlong & decided.keep).sum()) if options.overlong == "truncate" else 0,
        dropped_overlong=int(decided.overlong.sum()) if options.overlong == "drop" else 0,
        dropped_without_labels=decided.without_labels,
    )


def _overlap(keys: np.ndarray, decided: _Decisions) -> int:
    """Held-out examples whose exact content (content hash) is also trained on: none from a split of one source
    (duplicates stay on one side), possible with a validation_source that shares examples with the source."""
    held_out = decided.kept & decided.validation
    return int(np.isin(keys[held_out], keys[decided.kept & ~decided.validation]).sum())
