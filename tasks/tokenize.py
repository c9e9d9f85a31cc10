"""Tokenize: a dataset (its shards, in any format `phase1a.datasource` reads) to Arrow with loss masks, a
held-out split and length analysis, once per content.

Two streaming passes keep memory flat: pass 1 tokenizes chunks of records into a temporary Arrow file
(plus a few scalars per example: length, content hash, shard and line or row), in worker processes where the
input is large (`phase1a.encoding`); pass 2 decides max_seq_length from the lengths, then truncates, drops
and splits batch by batch with Arrow compute.
Per-example scalars are the only whole-dataset arrays held in RAM. The held-out split is either a stable
content-hash share of the source, or every record of `data.validation_source`.
"""
from __future__ import annotations

import os
import shutil
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel

from phase1a.fingerprint import code_version, hash_json
from phase1a.locks import exclusive
from phase1a.lengths import (LengthStats, Outliers, WasteRow, describe_outliers, find_outliers, length_stats,
                             right_size, save_histogram, waste_table)
from phase1a.logs import run_logger
from phase1a.datasource import DataLocation, Shard, describe, iter_records, resolve_shards
from phase1a.encoding import SHOWN_SKIPS, ChunkEncoder, EncodeSettings, auto_workers, encode_chunks
from phase1a.render import IGNORE_INDEX
from phase1a.templates import template_fingerprint
from tasks.caching import FingerprintCache, task
from phase1a.errors import DataError


class TokenizeOptions(BaseModel):
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


class TokenizedData(BaseModel):
    fingerprint: str
    dir: str
    train_path: str
    validation_path: str
    histogram_path: str
    train_examples: int
    validation_examples: int
    shards: int  # data files read, the validation source's included
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
    duplicates_dropped: int
    truncated_examples: int
    dropped_overlong: int
    dropped_without_labels: int


def tokenize_fingerprint(data: str | list[str], tokenizer_fp: str, model_max_length: int, options: TokenizeOptions) -> str:
    """`data`: the content fingerprint of the source (and of the validation source, when there is one)."""
    # The worker count is left out: any count writes the same bytes (tests/test_encoding.py checks).
    return hash_json({"data": data, "tokenizer": tokenizer_fp, "model_max_length": model_max_length,
                      "options": options.model_dump(exclude={"tokenize_workers"}),
                      "chat_template": template_fingerprint(options.chat_template),
                      "code": code_version("tasks/tokenize.py", "phase1a/encoding.py", "phase1a/render.py",
                                           "phase1a/records.py", "phase1a/templates.py", "phase1a/datasource.py")})


def dataset_dir(cache_dir: Path, fingerprint: str) -> Path:
    return Path(cache_dir) / "tokenized" / fingerprint


def read_arrow(path: str | Path) -> pa.Table:
    """Memory-mapped: the dataset is paged in from disk, not copied into RAM."""
    return pa.ipc.open_file(pa.memory_map(str(path), "r")).read_all()


def tokenize_dataset(data: DataLocation | Path, tokenizer, model_max_length: int, options: TokenizeOptions,
                     cache_dir: Path, fingerprint: str, validation: DataLocation | None = None) -> TokenizedData:
    """Tokenize `data` (a staged location, or a plain path) into `cache_dir/tokenized/<fingerprint>/`, reusing
    a complete earlier result. With `validation`, that source is the held-out set and `data` is all training."""
    sources = _Sources.resolve(data, validation, options)
    out_dir = dataset_dir(cache_dir, fingerprint)
    # Two runs on one fingerprint: the first computes, the second waits here and then reuses its output.
    with exclusive(out_dir.with_name(out_dir.name + ".lock"), f"tokenized data {out_dir}"):
        if (out_dir / "manifest.json").is_file():
            return TokenizedData.model_validate_json((out_dir / "manifest.json").read_text())
        partial = out_dir.with_name(f"{out_dir.name}.partial-{os.getpid()}")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        try:
            result = _tokenize_into(partial, out_dir, sources, tokenizer, model_max_length, options)
            (partial / "manifest.json").write_text(result.model_dump_json(indent=2))
            partial.rename(out_dir)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
        return result


@dataclass
class _Sources:
    """The shards to read, training source first; those from `first_validation` on are the held-out set."""

    shards: list[Shard]
    first_validation: int | None  # None: hold out a content-hash share of every shard

    @classmethod
    def resolve(cls, data: DataLocation | Path, validation: DataLocation | None, options: TokenizeOptions) -> "_Sources":
        train = resolve_shards(data if isinstance(data, DataLocation) else DataLocation(path=str(data)),
                               options.config, options.split)
        if validation is None:
            return cls(train, None)
        held_out = resolve_shards(validation, options.config, options.validation_split or options.split,
                                  field="data.validation_source")
        return cls(train + held_out, len(train))

    def name(self) -> str:
        return str(self.shards[0].path) if len(self.shards) == 1 else f"{len(self.shards)} shards ({self.shards[0].path}, ...)"


_SCHEMA = pa.schema([("input_ids", pa.list_(pa.int32())), ("labels", pa.list_(pa.int32()))])


def _tokenize_into(work: Path, out_dir: Path, sources: _Sources, tokenizer, model_max_length: int,
                   options: TokenizeOptions) -> TokenizedData:
    # ---- pass 1: records -> token ids, streamed to a temporary Arrow file --------------------------------
    settings = EncodeSettings(**{f.name: getattr(options, f.name) for f in fields(EncodeSettings)})
    encoder = ChunkEncoder(tokenizer, sources.shards, settings)
    skipped: Counter[str] = Counter()
    shown: list[str] = []
    places, keys, lengths = [], [], []
    workers = auto_workers(sources.shards, options.tokenize_workers)
    with pa.OSFile(str(work / "all.arrow"), "wb") as sink, pa.ipc.new_file(sink, _SCHEMA) as writer:
        for chunk in encode_chunks(iter_records(sources.shards), encoder, workers):
            skipped.update(chunk.skipped)
            shown += chunk.shown[: SHOWN_SKIPS - len(shown)]
            if chunk.tokens is None:
                continue
            offsets = chunk.tokens.offsets
            writer.write_batch(pa.record_batch([pa.ListArray.from_arrays(offsets, chunk.tokens.input_ids),
                                                pa.ListArray.from_arrays(offsets, chunk.tokens.labels)], schema=_SCHEMA))
            places.append(chunk.places)
            keys.append(chunk.keys)
            lengths.append(np.diff(offsets))
    if not lengths:
        detail = f" ({sum(skipped.values())} bad records skipped: {dict(skipped)})" if skipped else ""
        raise DataError(f"{sources.name()}: no usable records{detail}")
    places_all, keys_all, lengths_all = np.concatenate(places), np.concatenate(keys), np.concatenate(lengths)

    # ---- decisions over per-example scalars ---------------------------------------------------------------
    outliers = find_outliers(lengths_all, lambda index: describe(sources.shards, *map(int, places_all[index])))
    if outliers:
        run_logger().warning("%s", describe_outliers(outliers))
    max_seq_length = right_size(lengths_all, options.length_percentile, model_max_length, options.max_seq_length)
    overlong = lengths_all > max_seq_length
    if options.overlong == "fail" and overlong.any():
        first = int(np.argmax(overlong))
        where = describe(sources.shards, *map(int, places_all[first]))
        raise DataError(f"{where}: {int(lengths_all[first])} tokens exceed max_seq_length "
                        f"{max_seq_length} ({int(overlong.sum())} examples do; data.overlong is 'fail')")
    first_seen = np.zeros(keys_all.size, dtype=bool)
    first_seen[np.unique(keys_all, return_index=True)[1]] = True
    keep = ~overlong if options.overlong == "drop" else np.ones(keys_all.size, dtype=bool)
    if options.drop_duplicates:
        keep &= first_seen
    validation = (_validation_mask(keys_all, options) if sources.first_validation is None
                  else places_all[:, 0] >= sources.first_validation)

    # ---- pass 2: truncate, drop, split; batch by batch -------------------------------------------------
    # Plain reads, not a memory map: one batch at a time in RAM, so peak RSS does not grow with the data.
    source = pa.ipc.open_file(pa.OSFile(str(work / "all.arrow"), "rb"))
    kept_lengths, supervised, without_labels, start = [], 0, 0, 0
    counts = {"train": 0, "validation": 0}
    with _writer(work / "train.arrow") as train_out, _writer(work / "validation.arrow") as validation_out:
        for index in range(source.num_record_batches):
            batch = source.get_batch(index)
            rows = slice(start, start + batch.num_rows)
            start += batch.num_rows
            ids = pc.list_slice(batch.column(0), 0, max_seq_length)
            labels = pc.list_slice(batch.column(1), 0, max_seq_length)
            label_counts = _labelled_per_row(labels)
            has_labels = label_counts > 0
            without_labels += int((keep[rows] & ~has_labels).sum())
            row_keep = keep[rows] & has_labels
            table = pa.table({"input_ids": ids, "labels": labels, "length": pc.list_value_length(ids)})
            for name, out, mask in (("train", train_out, row_keep & ~validation[rows]),
                                    ("validation", validation_out, row_keep & validation[rows])):
                out.write_table(table.filter(pa.array(mask)))
                counts[name] += int(mask.sum())
            kept_lengths.append(np.minimum(lengths_all[rows], max_seq_length)[row_keep])
            supervised += int(label_counts[row_keep].sum())
    (work / "all.arrow").unlink()
    if sources.first_validation is not None and not (counts["train"] and counts["validation"]):
        empty = "data.source" if not counts["train"] else "data.validation_source"
        raise DataError(f"{empty}: no usable examples after filtering ({counts['train']} train, "
                        f"{counts['validation']} validation)")
    final_keep = np.concatenate(kept_lengths)
    if final_keep.size < 2:
        raise DataError(f"{sources.name()}: {final_keep.size} usable examples after filtering; need a train and a validation split")
    stats = length_stats(final_keep, supervised)
    histogram = save_histogram(final_keep, stats, max_seq_length, work / "lengths.png")
    duplicates = int((~first_seen).sum())
    return TokenizedData(
        fingerprint=out_dir.name, dir=str(out_dir), train_path=str(out_dir / "train.arrow"),
        validation_path=str(out_dir / "validation.arrow"), histogram_path=str(out_dir / histogram.name),
        train_examples=counts["train"], validation_examples=counts["validation"], shards=len(sources.shards),
        workers=workers,
        template="chat_template" if getattr(tokenizer, "chat_template", None) else "fallback",
        lengths=stats, outliers=outliers, max_seq_length=max_seq_length, model_max_length=model_max_length,
        waste=waste_table(lengths_all, options.max_seq_length or model_max_length, max_seq_length),
        skipped=dict(skipped), skipped_examples=shown, duplicates=duplicates,
        duplicates_dropped=duplicates if options.drop_duplicates else 0,
        truncated_examples=int((overlong & keep).sum()) if options.overlong == "truncate" else 0,
        dropped_overlong=int(overlong.sum()) if options.overlong == "drop" else 0,
        dropped_without_labels=without_labels,
    )


_OUTPUT_SCHEMA = pa.schema([("input_ids", pa.list_(pa.int32())), ("labels", pa.list_(pa.int32())), ("length", pa.int32())])


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
        f"max_seq_length {data.max_seq_length}\n\n| batching | length | tokens computed | padding |\n|---|---|---|---|\n"
        f"{rows}\n\nskipped: {data.skipped or 'none'}; duplicates: {data.duplicates}; "
        f"truncated: {data.truncated_examples}; dropped overlong: {data.dropped_overlong}"))


def _tokenized_present(inputs: dict) -> bool:
    return (dataset_dir(Path(inputs["cache_dir"]), inputs["fingerprint"]) / "manifest.json").is_file()


@task(
    name="tokenize",
    cache_policy=FingerprintCache(output_present=_tokenized_present),
    persist_result=True,
    result_serializer="json",
)
def tokenize(data: DataLocation, model_dir: str, options: TokenizeOptions, cache_dir: str, fingerprint: str,
             validation: DataLocation | None = None, trust_remote_code: bool = False) -> TokenizedData:
    from phase1a.models import load_tokenizer, model_max_positions
    from phase1a.templates import apply_chat_template_setting

    tokenizer = apply_chat_template_setting(load_tokenizer(Path(model_dir), trust_remote_code), options.chat_template)
    return tokenize_dataset(data, tokenizer, model_max_positions(Path(model_dir)), options, Path(cache_dir),
                            fingerprint, validation)
