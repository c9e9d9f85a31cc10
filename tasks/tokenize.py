"""Tokenize: a dataset (its shards, in any format `phase1a.datasource` reads) to Arrow with loss masks, a
held-out split and length analysis, once per content.

The recipe, `tokenize_dataset`, in four phases that keep memory flat:
  1. encode    records -> token ids and labels, streamed to a temporary Arrow file, plus a few scalars per
               example (length, content hash, shard and line or row); in worker processes where the input
               is large (`phase1a.encoding`)
  2. decide    over those scalars only: max_seq_length, overlong and duplicate examples, the held-out split,
               outliers
  3. split     truncate, drop and split batch by batch with Arrow compute into train.arrow and validation.arrow
  4. describe  lengths, the histogram and every count (skipped, duplicates, truncated, dropped)
The held-out split is either a stable content-hash share of the source, or every record of
`data.validation_source`.
"""
from __future__ import annotations

import shutil
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel

from phase1a.atomic import atomic_path
from phase1a.config import Phase1aConfig
from phase1a.datasource import DataLocation, Shard, describe, iter_records, resolve_shards
from phase1a.encoding import SHOWN_SKIPS, ChunkEncoder, EncodeSettings, auto_workers, encode_chunks
from phase1a.errors import DataError
from phase1a.fingerprint import code_fingerprint, hash_json
from phase1a.labels import IGNORE_INDEX
from phase1a.lengths import (
    Outliers,
    describe_outliers,
    find_outliers,
    length_stats,
    right_size,
    save_histogram,
    waste_table,
)
from phase1a.locks import exclusive
from phase1a.logs import run_logger
from phase1a.models import ResolvedModel, load_tokenizer
from phase1a.templates import apply_chat_template_setting, template_fingerprint
from phase1a.tokenized import TokenizedData
from tasks.caching import StageCache, task

if TYPE_CHECKING:  # staging imports boto3, which a bare GPU host (that tokenizes local files) lacks
    from phase1a.staging import StagedData


class TokenizeOptions(BaseModel):
    """The `data` settings tokenizing reads (and `model.max_seq_length`): its key's settings part."""

    format: str = "auto"  # a key of phase1a.records.RECORD_FORMATS, or auto
    field_map: dict[str, str] = {}
    role_map: dict[str, str] = {}
    chat_template: str | None = None  # a name in phase1a.templates.CHAT_TEMPLATES or a Jinja file's path
    train_on_inputs: bool = False
    bad_records: Literal["fail", "skip"] = "fail"
    overlong: Literal["truncate", "drop", "fail"] = "truncate"
    drop_duplicates: bool = False
    length_percentile: float = 100.0
    validation_fraction: float = 0.1
    validation_count: int | None = None
    max_seq_length: int | None = None  # a user cap; None means right-size from the data
    config: str | None = None  # which files of a dataset repository: data.config, data.split
    split: str = "train"
    validation_split: str | None = None
    tokenize_workers: int | None = None  # processes for pass 1; None: phase1a.encoding.auto_workers

    @classmethod
    def from_config(cls, config: Phase1aConfig) -> "TokenizeOptions":
        return cls(**config.data.model_dump(include=set(cls.model_fields)), max_seq_length=config.model.max_seq_length)


def tokenize_fingerprint(data: str | list[str], tokenizer_fp: str, model_max_length: int,
                         options: TokenizeOptions) -> str:
    """The tokenized dataset's identity (its directory's name): `data` is the content fingerprint of the source
    (and of the validation source, when there is one); the code is this module's and all it imports."""
    # The worker count is left out: any count writes the same bytes (tests/test_encoding.py checks).
    return hash_json({"data": data, "tokenizer": tokenizer_fp, "model_max_length": model_max_length,
                      "options": options.model_dump(exclude={"tokenize_workers"}),
                      "chat_template": template_fingerprint(options.chat_template), "code": code_fingerprint(__name__)})


def dataset_dir(cache_dir: Path, fingerprint: str) -> Path:
    return Path(cache_dir) / "tokenized" / fingerprint


def tokenize_dataset(data: DataLocation | Path, tokenizer, model_max_length: int, options: TokenizeOptions,
                     out_dir: Path, validation: DataLocation | None = None) -> TokenizedData:
    """Tokenize `data` (a staged location, or a plain path) into `out_dir` (named by its fingerprint), reusing
    a complete earlier result. With `validation`, that source is the held-out set and `data` is all training."""
    sources = _Sources.resolve(data, validation, options)
    out_dir = Path(out_dir)
    # Two runs on one fingerprint: the first computes, the second waits here and then reuses its output.
    with exclusive(out_dir.with_name(out_dir.name + ".lock"), f"tokenized data {out_dir}"):
        if (out_dir / "manifest.json").is_file():
            return TokenizedData.model_validate_json((out_dir / "manifest.json").read_text())
        with atomic_path(out_dir) as work:
            work.mkdir()
            encoded = _encode(work / "all.arrow", sources, tokenizer, options)
            decided = _decide(encoded, sources, model_max_length, options)
            split = _split(work, encoded, decided)
            (work / "all.arrow").unlink()
            result = _describe(work, out_dir, _Described(sources, tokenizer, model_max_length, options, encoded,
                                                         decided, split))
            (work / "manifest.json").write_text(result.model_dump_json(indent=2))
        return result


@dataclass
class _Sources:
    """The shards to read, training source first; those from `first_validation` on are the held-out set."""

    shards: list[Shard]
    first_validation: int | None  # None: hold out a content-hash share of every shard

    @classmethod
    def resolve(cls, data: DataLocation | Path, validation: DataLocation | None,
                options: TokenizeOptions) -> "_Sources":
        train = resolve_shards(data if isinstance(data, DataLocation) else DataLocation(path=str(data)),
                               options.config, options.split)
        if validation is None:
            return cls(train, None)
        held_out = resolve_shards(validation, options.config, options.validation_split or options.split,
                                  field="data.validation_source")
        return cls(train + held_out, len(train))

    def name(self) -> str:
        first = self.shards[0].path
        return str(first) if len(self.shards) == 1 else f"{len(self.shards)} shards ({first}, ...)"

    def where(self, place: np.ndarray) -> str:
        """file:line (or row) of an example, from its (shard, line) place."""
        return describe(self.shards, *map(int, place))


# ---- 1. encode ---------------------------------------------------------------------------------------------

_SCHEMA = pa.schema([("input_ids", pa.list_(pa.int32())), ("labels", pa.list_(pa.int32()))])


@dataclass
class _Encoded:
    """Pass 1's output: token ids in an Arrow file, and per-example scalars in RAM."""

    path: Path
    places: np.ndarray  # (n, 2): shard and line/row
    keys: np.ndarray  # content hashes
    lengths: np.ndarray
    skipped: Counter[str]
    shown: list[str]  # the first few skipped records' messages
    workers: int


def _encode(path: Path, sources: _Sources, tokenizer, options: TokenizeOptions) -> _Encoded:
    settings = EncodeSettings(**{f.name: getattr(options, f.name) for f in fields(EncodeSettings)})
    encoder = ChunkEncoder(tokenizer, sources.shards, settings)
    skipped: Counter[str] = Counter()
    shown: list[str] = []
    places, keys, lengths = [], [], []
    workers = auto_workers(sources.shards, options.tokenize_workers)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, _SCHEMA) as writer:
        for chunk in encode_chunks(iter_records(sources.shards), encoder, workers):
            skipped.update(chunk.skipped)
            shown += chunk.shown[: SHOWN_SKIPS - len(shown)]
            if chunk.tokens is None:
                continue
            offsets = chunk.tokens.offsets
            columns = [pa.ListArray.from_arrays(offsets, chunk.tokens.input_ids),
                       pa.ListArray.from_arrays(offsets, chunk.tokens.labels)]
            writer.write_batch(pa.record_batch(columns, schema=_SCHEMA))
            places.append(chunk.places)
            keys.append(chunk.keys)
            lengths.append(np.diff(offsets))
    if not lengths:
        detail = f" ({sum(skipped.values())} bad records skipped: {dict(skipped)})" if skipped else ""
        raise DataError(f"{sources.name()}: no usable records{detail}")
    return _Encoded(path, np.concatenate(places), np.concatenate(keys), np.concatenate(lengths), skipped, shown,
                    workers)


# ---- 2. decide ---------------------------------------------------------------------------------------------

@dataclass
class _Decisions:
    max_seq_length: int
    overlong: np.ndarray  # longer than max_seq_length
    first_seen: np.ndarray  # not a duplicate of an earlier example
    keep: np.ndarray  # after the overlong and duplicate policies
    validation: np.ndarray  # held out
    outliers: Outliers | None


def _decide(encoded: _Encoded, sources: _Sources, model_max_length: int, options: TokenizeOptions) -> _Decisions:
    lengths = encoded.lengths
    outliers = find_outliers(lengths, lambda index: sources.where(encoded.places[index]))
    if outliers:
        run_logger().warning("%s", describe_outliers(outliers))
    max_seq_length = right_size(lengths, options.length_percentile, model_max_length, options.max_seq_length)
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
    validation = (_validation_mask(encoded.keys, options) if sources.first_validation is None
                  else encoded.places[:, 0] >= sources.first_validation)
    return _Decisions(max_seq_length, overlong, first_seen, keep, validation, outliers)


def _validation_mask(keys: np.ndarray, options: TokenizeOptions) -> np.ndarray:
    """Held-out by content hash: a fraction keeps its members as the data grows; a count takes the lowest hashes."""
    if keys.size < 2:
        raise DataError(f"need at least 2 examples for a train and a validation split, got {keys.size}")
    unit = keys.astype(np.float64) / 2.0**64
    if options.validation_count is None:
        mask = unit < options.validation_fraction
    else:
        mask = np.zeros(keys.size, dtype=bool)
        mask[np.argsort(keys, kind="stable")[: options.validation_count]] = True
    if not mask.any():  # a tiny dataset: hold out the lowest hash rather than nothing
        mask[np.argmin(keys)] = True
    if mask.all():
        mask[np.argmax(keys)] = False
    return mask


# ---- 3. split ----------------------------------------------------------------------------------------------

_OUTPUT_SCHEMA = pa.schema([("input_ids", pa.list_(pa.int32())), ("labels", pa.list_(pa.int32())),
                            ("length", pa.int32())])


@dataclass
class _Split:
    counts: dict[str, int]  # examples written to train and validation
    kept_lengths: np.ndarray  # of every example written, truncated
    supervised: int  # trained tokens of those
    without_labels: int  # dropped: nothing left to train on after truncation


def _split(work: Path, encoded: _Encoded, decided: _Decisions) -> _Split:
    # Plain reads, not a memory map: one batch at a time in RAM, so peak RSS does not grow with the data.
    source = pa.ipc.open_file(pa.OSFile(str(encoded.path), "rb"))
    limit = decided.max_seq_length
    kept_lengths, supervised, without_labels, start = [], 0, 0, 0
    counts = {"train": 0, "validation": 0}
    with _writer(work / "train.arrow") as train_out, _writer(work / "validation.arrow") as validation_out:
        for index in range(source.num_record_batches):
            batch = source.get_batch(index)
            rows = slice(start, start + batch.num_rows)
            start += batch.num_rows
            ids, labels = pc.list_slice(batch.column(0), 0, limit), pc.list_slice(batch.column(1), 0, limit)
            label_counts = _labelled_per_row(labels)
            without_labels += int((decided.keep[rows] & (label_counts == 0)).sum())
            row_keep = decided.keep[rows] & (label_counts > 0)
            table = pa.table({"input_ids": ids, "labels": labels, "length": pc.list_value_length(ids)})
            for name, out, mask in (("train", train_out, row_keep & ~decided.validation[rows]),
                                    ("validation", validation_out, row_keep & decided.validation[rows])):
                out.write_table(table.filter(pa.array(mask)))
                counts[name] += int(mask.sum())
            kept_lengths.append(np.minimum(encoded.lengths[rows], limit)[row_keep])
            supervised += int(label_counts[row_keep].sum())
    return _Split(counts, np.concatenate(kept_lengths), supervised, without_labels)


@contextmanager
def _writer(path: Path):
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, _OUTPUT_SCHEMA) as writer:
        yield writer


def _labelled_per_row(labels: pa.ListArray) -> np.ndarray:
    """Supervised tokens per row, excluding each row's first token (it is never predicted)."""
    values = labels.flatten().to_numpy(zero_copy_only=False)
    offsets = labels.offsets.to_numpy() - labels.offsets[0].as_py()
    labelled = np.concatenate([[0], np.cumsum(values != IGNORE_INDEX)])
    first = np.zeros(len(labels), dtype=np.int64)
    nonempty = offsets[1:] > offsets[:-1]
    first[nonempty] = values[offsets[:-1][nonempty]] != IGNORE_INDEX
    return labelled[offsets[1:]] - labelled[offsets[:-1]] - first


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
    histogram = save_histogram(lengths, stats, decided.max_seq_length, work / "lengths.png")
    duplicates = int((~decided.first_seen).sum())
    return TokenizedData(
        fingerprint=out_dir.name, dir=str(out_dir), train_path=str(out_dir / "train.arrow"),
        validation_path=str(out_dir / "validation.arrow"), histogram_path=str(out_dir / histogram.name),
        train_examples=counts["train"], validation_examples=counts["validation"], shards=len(run.sources.shards),
        workers=run.encoded.workers,
        template="chat_template" if getattr(run.tokenizer, "chat_template", None) else "fallback",
        lengths=stats, outliers=decided.outliers, max_seq_length=decided.max_seq_length,
        model_max_length=run.model_max_length,
        waste=waste_table(run.encoded.lengths, options.max_seq_length or run.model_max_length, decided.max_seq_length),
        skipped=dict(run.encoded.skipped), skipped_examples=run.encoded.shown, duplicates=duplicates,
        duplicates_dropped=duplicates if options.drop_duplicates else 0,
        truncated_examples=int((decided.overlong & decided.keep).sum()) if options.overlong == "truncate" else 0,
        dropped_overlong=int(decided.overlong.sum()) if options.overlong == "drop" else 0,
        dropped_without_labels=run.split.without_labels,
    )


# ---- the task ----------------------------------------------------------------------------------------------

def publish_length_report(data: TokenizedData, run_dir: Path) -> None:
    """Copy the histogram into the run directory and summarise lengths and waste as a Prefect artifact."""
    shutil.copyfile(data.histogram_path, Path(run_dir) / "lengths.png")
    try:
        from prefect.artifacts import create_markdown_artifact
    except ImportError:
        return
    s = data.lengths
    rows = "\n".join(f"| {w.batching} | {w.sequence_length or '-'} | {w.computed_tokens} | {w.waste_fraction:.1%} |"
                     for w in data.waste)
    create_markdown_artifact(key="lengths", description="Token lengths and padding waste", markdown=(
        f"**{s.count} examples, {s.total_tokens} tokens ({s.supervised_tokens} supervised)**; "
        f"min {s.min}, p50 {s.p50:g}, p90 {s.p90:g}, p99 {s.p99:g}, p99.9 {s.p99_9:g}, max {s.max}; "
        f"max_seq_length {data.max_seq_length}\n\n"
        "| batching | length | tokens computed | padding |\n|---|---|---|---|\n"
        f"{rows}\n\nskipped: {data.skipped or 'none'}; duplicates: {data.duplicates}; "
        f"truncated: {data.truncated_examples}; dropped overlong: {data.dropped_overlong}"))


def tokenized_fingerprint(config: Phase1aConfig, model: ResolvedModel, staged: StagedData,
                          held_out: StagedData | None = None) -> str:
    """The tokenize stage's key, from its own inputs: the staged content, the tokenizer, the data settings."""
    return tokenize_fingerprint([item.fingerprint for item in (staged, held_out) if item], model.tokenizer_fingerprint,
                                model.max_positions, TokenizeOptions.from_config(config))


def _tokenized_manifest(fingerprint: str, config: Phase1aConfig, **_) -> Path:
    return dataset_dir(config.cache_dir, fingerprint) / "manifest.json"  # written last: the dataset is whole


@task(name="tokenize", cache_policy=StageCache(fingerprint=tokenized_fingerprint, output=_tokenized_manifest),
      persist_result=True, result_serializer="json")
def tokenize_task(config: Phase1aConfig, model: ResolvedModel, staged: StagedData,
             held_out: StagedData | None = None) -> TokenizedData:
    options = TokenizeOptions.from_config(config)
    tokenizer = apply_chat_template_setting(load_tokenizer(Path(model.path), config.model.trust_remote_code),
                                            options.chat_template)
    out_dir = dataset_dir(config.cache_dir, tokenized_fingerprint(config, model, staged, held_out))
    return tokenize_dataset(staged, tokenizer, model.max_positions, options, out_dir, held_out)
