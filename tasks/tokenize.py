"""Tokenize: JSONL (chat `messages` or Alpaca) to Arrow with loss masks, a held-out split and length analysis.

Masking: every message is rendered with the model's chat template and split at message boundaries; only
assistant turns carry labels (the rest are -100). Without a chat template the documented fallback is
    "### System:\n{system}\n\n" (if any) "### User:\n{user}\n\n### Assistant:\n" {assistant}{eos}"\n\n"
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterator, Literal

import numpy as np
import pyarrow as pa
from pydantic import BaseModel

from phase1a.fingerprint import code_version, hash_json
from tasks.caching import FingerprintCache, task
from tasks.stage import DataError

IGNORE_INDEX = -100
SEQ_MULTIPLE = 64  # right-sized lengths round up to this, a friendly shape for GPU kernels
_BATCH = 1024  # records per fast-tokenizer call


class TokenizeOptions(BaseModel):
    format: Literal["auto", "chat", "alpaca"] = "auto"
    validation_fraction: float = 0.1
    validation_max_examples: int | None = None
    max_seq_length: int | None = None  # a user cap; None means right-size from the data


class LengthStats(BaseModel):
    count: int
    total_tokens: int
    supervised_tokens: int
    min: int
    p50: float
    p90: float
    p99: float
    max: int


class TokenizedData(BaseModel):
    fingerprint: str
    dir: str
    train_path: str
    validation_path: str
    train_examples: int
    validation_examples: int
    template: Literal["chat_template", "fallback"]
    lengths: LengthStats
    max_seq_length: int
    model_max_length: int
    truncated_examples: int
    dropped_examples: int


# ---- reading records -------------------------------------------------------------------------------------


def read_records(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield (line number, record) for each non-blank JSONL line; a bad line is an error naming file and line."""
    with open(path, encoding="utf-8") as handle:
        for lineno, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(f"{path}:{lineno}: malformed JSON: {error.msg} at column {error.colno}") from None
            if not isinstance(record, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
            yield lineno, record


def _require_text(record: dict, field: str, where: str) -> str:
    value = record.get(field)
    if not isinstance(value, str):
        got = "missing" if field not in record else type(value).__name__
        raise DataError(f"{where}: field {field!r} must be a string ({got})")
    return value


def to_messages(record: dict, fmt: str, where: str) -> list[dict[str, str]]:
    """Normalise one record to chat messages ending in an assistant turn."""
    if fmt == "auto":
        if "messages" in record:
            fmt = "chat"
        elif "instruction" in record or "output" in record:
            fmt = "alpaca"
        else:
            fields = ", ".join(sorted(record)) or "none"
            raise DataError(f"{where}: no 'messages' and no 'instruction'/'output' fields (fields: {fields})")
    if fmt == "alpaca":
        prompt = _require_text(record, "instruction", where)
        extra = record.get("input") or ""
        if not isinstance(extra, str):
            raise DataError(f"{where}: field 'input' must be a string ({type(extra).__name__})")
        if extra.strip():
            prompt = f"{prompt}\n\n{extra}"
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": _require_text(record, "output", where)}]

    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: field 'messages' must be a non-empty list")
    normalised = []
    for index, message in enumerate(messages):
        at = f"{where}: messages[{index}]"
        if not isinstance(message, dict):
            raise DataError(f"{at}: expected an object with 'role' and 'content'")
        role = _require_text(message, "role", at)
        if role not in ("system", "user", "assistant"):
            raise DataError(f"{at}: field 'role' must be system, user or assistant ({role!r})")
        normalised.append({"role": role, "content": _require_text(message, "content", at)})
    if normalised[-1]["role"] != "assistant":
        raise DataError(f"{where}: the last message must be the assistant's (it is {normalised[-1]['role']!r})")
    return normalised


# ---- rendering and masking -------------------------------------------------------------------------------


def render_segments(messages: list[dict[str, str]], tokenizer) -> list[tuple[str, bool]]:
    """Split the rendered conversation into (text, trained) pieces; assistant turns are the trained ones."""
    if not getattr(tokenizer, "chat_template", None):
        return _fallback_segments(messages, tokenizer)
    segments: list[tuple[str, bool]] = []
    done = ""
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = tokenizer.apply_chat_template(messages[:index], tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(messages[: index + 1], tokenize=False)
        if not (prompt.startswith(done) and full.startswith(prompt)):
            raise DataError("the chat template does not render conversations incrementally; cannot mask by turn")
        segments += [(prompt[len(done):], False), (full[len(prompt):], True)]
        done = full
    return segments


def _fallback_segments(messages: list[dict[str, str]], tokenizer) -> list[tuple[str, bool]]:
    headers = {"system": "### System:\n", "user": "### User:\n", "assistant": "### Assistant:\n"}
    segments: list[tuple[str, bool]] = [(tokenizer.bos_token or "", False)]
    for message in messages:
        segments.append((headers[message["role"]], False))
        if message["role"] == "assistant":
            segments.append((message["content"] + (tokenizer.eos_token or ""), True))
            segments.append(("\n\n", False))
        else:
            segments.append((message["content"] + "\n\n", False))
    return [segment for segment in segments if segment[0]]


def tokenize_batch(batch: list[list[tuple[str, bool]]], tokenizer) -> list[tuple[list[int], list[int]]]:
    """One fast-tokenizer call for every segment of every record in the batch."""
    texts = [text for segments in batch for text, _ in segments]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    out, cursor = [], 0
    for segments in batch:
        input_ids: list[int] = []
        labels: list[int] = []
        for _, trained in segments:
            piece = ids[cursor]
            cursor += 1
            input_ids += piece
            labels += piece if trained else [IGNORE_INDEX] * len(piece)
        out.append((input_ids, labels))
    return out


# ---- splitting, sizing, writing --------------------------------------------------------------------------


def split_key(messages: list[dict[str, str]]) -> float:
    """Content hash mapped to [0, 1): the split is stable across runs, machines and file order."""
    digest = hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def right_size(max_length: int, model_max_length: int, user_cap: int | None) -> int:
    """Next multiple of SEQ_MULTIPLE at or above the longest example, capped by the model and the user."""
    size = -(-max_length // SEQ_MULTIPLE) * SEQ_MULTIPLE
    cap = min(model_max_length, user_cap or model_max_length)
    return min(size, cap)


def length_stats(lengths: np.ndarray, supervised: int) -> LengthStats:
    p50, p90, p99 = np.percentile(lengths, [50, 90, 99])
    return LengthStats(
        count=int(lengths.size), total_tokens=int(lengths.sum()), supervised_tokens=int(supervised),
        min=int(lengths.min()), p50=float(p50), p90=float(p90), p99=float(p99), max=int(lengths.max()),
    )


def write_arrow(path: Path, rows: list[tuple[list[int], list[int]]]) -> None:
    table = pa.table(
        {
            "input_ids": pa.array([r[0] for r in rows], type=pa.list_(pa.int32())),
            "labels": pa.array([r[1] for r in rows], type=pa.list_(pa.int32())),
            "length": pa.array([len(r[0]) for r in rows], type=pa.int32()),
        }
    )
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)


def read_arrow(path: str | Path) -> pa.Table:
    """Memory-mapped: the dataset is paged in from disk, not copied into RAM."""
    return pa.ipc.open_file(pa.memory_map(str(path), "r")).read_all()


def tokenize_fingerprint(data_sha256: str, tokenizer_fp: str, model_max_length: int, options: TokenizeOptions) -> str:
    return hash_json(
        {
            "data": data_sha256, "tokenizer": tokenizer_fp, "model_max_length": model_max_length,
            "options": options.model_dump(), "code": code_version("tasks/tokenize.py"),
        }
    )


def dataset_dir(cache_dir: Path, fingerprint: str) -> Path:
    return Path(cache_dir) / "tokenized" / fingerprint


def tokenize_dataset(
    data_path: Path, tokenizer, model_max_length: int, options: TokenizeOptions, cache_dir: Path, fingerprint: str
) -> TokenizedData:
    """Tokenize `data_path` into `cache_dir/tokenized/<fingerprint>/`, reusing a complete earlier result."""
    out_dir = dataset_dir(cache_dir, fingerprint)
    manifest_path = out_dir / "manifest.json"
    if manifest_path.is_file():
        return TokenizedData.model_validate_json(manifest_path.read_text())

    rows: list[tuple[list[int], list[int]]] = []
    keys: list[float] = []
    pending: list[list[tuple[str, bool]]] = []
    for lineno, record in read_records(data_path):
        messages = to_messages(record, options.format, f"{data_path}:{lineno}")
        pending.append(render_segments(messages, tokenizer))
        keys.append(split_key(messages))
        if len(pending) == _BATCH:
            rows += tokenize_batch(pending, tokenizer)
            pending = []
    if pending:
        rows += tokenize_batch(pending, tokenizer)
    if not rows:
        raise DataError(f"{data_path}: no records (the file is empty or blank)")

    lengths = np.fromiter((len(ids) for ids, _ in rows), dtype=np.int64, count=len(rows))
    max_seq_length = right_size(int(lengths.max()), model_max_length, options.max_seq_length)
    kept, kept_keys, truncated, dropped = [], [], 0, 0
    for (ids, labels), key in zip(rows, keys):
        if len(ids) > max_seq_length:
            truncated += 1
            ids, labels = ids[:max_seq_length], labels[:max_seq_length]
        if all(label == IGNORE_INDEX for label in labels):
            dropped += 1  # nothing left to learn from: the response was cut off entirely
            continue
        kept.append((ids, labels))
        kept_keys.append(key)
    if not kept:
        raise DataError(f"{data_path}: every example lost its response to truncation at {max_seq_length} tokens")

    validation = _validation_indices(np.asarray(kept_keys), options)
    train_rows = [row for i, row in enumerate(kept) if i not in validation]
    validation_rows = [kept[i] for i in sorted(validation)]
    kept_lengths = np.fromiter((len(ids) for ids, _ in kept), dtype=np.int64, count=len(kept))
    supervised = sum(sum(1 for label in labels if label != IGNORE_INDEX) for _, labels in kept)

    partial = out_dir.with_name(f"{out_dir.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    write_arrow(partial / "train.arrow", train_rows)
    write_arrow(partial / "validation.arrow", validation_rows)
    result = TokenizedData(
        fingerprint=fingerprint, dir=str(out_dir), train_path=str(out_dir / "train.arrow"),
        validation_path=str(out_dir / "validation.arrow"), train_examples=len(train_rows),
        validation_examples=len(validation_rows),
        template="chat_template" if getattr(tokenizer, "chat_template", None) else "fallback",
        lengths=length_stats(kept_lengths, supervised), max_seq_length=max_seq_length,
        model_max_length=model_max_length, truncated_examples=truncated, dropped_examples=dropped,
    )
    (partial / "manifest.json").write_text(result.model_dump_json(indent=2))
    try:
        partial.rename(out_dir)
    except OSError:  # an identical result landed first
        shutil.rmtree(partial, ignore_errors=True)
    return result


def _validation_indices(keys: np.ndarray, options: TokenizeOptions) -> set[int]:
    if keys.size < 2:
        raise DataError(f"need at least 2 usable examples for a train and a validation split, got {keys.size}")
    order = np.argsort(keys, kind="stable")
    count = int((keys < options.validation_fraction).sum())
    if options.validation_max_examples is not None:
        count = min(count, options.validation_max_examples)
    count = min(max(count, 1), keys.size - 1)  # never an empty split on either side
    return set(order[:count].tolist())


def _tokenized_present(inputs: dict) -> bool:
    return (dataset_dir(Path(inputs["cache_dir"]), inputs["fingerprint"]) / "manifest.json").is_file()


@task(
    name="tokenize",
    cache_policy=FingerprintCache(output_present=_tokenized_present),
    persist_result=True,
    result_serializer="json",
)
def tokenize(data_path: str, model_dir: str, options: TokenizeOptions, cache_dir: str, fingerprint: str,
             trust_remote_code: bool = False) -> TokenizedData:
    from phase1a.models import load_tokenizer, model_max_positions

    tokenizer = load_tokenizer(Path(model_dir), trust_remote_code)
    return tokenize_dataset(Path(data_path), tokenizer, model_max_positions(Path(model_dir)), options, Path(cache_dir), fingerprint)
