"""Reading instruction datasets: JSONL or a JSON array, optionally gzipped, in any of the common schemas.

Every record becomes chat messages ending in an assistant turn (or, for plain `text`, one trained text).
A bad record raises `DataError` naming file, line (or array index) and field; the caller decides whether
that fails the run or is skipped and counted.
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any, Iterator

from phase1a.errors import DataError

# (Being turned into a registry: one entry per record shape, read by the config, detection, docs and tests.)
RECORD_FORMATS = {"chat": "messages", "alpaca": "instruction/input/output", "prompt_completion": "prompt/completion",
                  "text": "text"}
SCHEMAS = tuple(RECORD_FORMATS)


def _open_text(path: Path):
    with open(path, "rb") as probe:
        magic = probe.read(2)
    if magic == b"\x1f\x8b":
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def is_json_array(path: Path) -> bool:
    with _open_text(path) as handle:
        for line in handle:
            if line.strip():
                return line.lstrip().startswith("[")
    return False


def location(path: Path, number: int, array: bool) -> str:
    return f"{path}:[{number}]" if array else f"{path}:{number}"


def iter_lines(path: Path) -> Iterator[tuple[int, str | dict]]:
    """(line number, raw JSON line) per JSONL record, or (array index, parsed item) for a JSON array.

    JSONL streams; a JSON array is parsed whole, so very large datasets should be JSONL."""
    if is_json_array(path):
        with _open_text(path) as handle:
            try:
                items = json.load(handle)
            except json.JSONDecodeError as error:
                raise DataError(f"{path}:{error.lineno}: malformed JSON array: {error.msg} at column {error.colno}") from None
        if not isinstance(items, list):
            raise DataError(f"{path}: a JSON file must hold an array of records")
        yield from enumerate(items)
        return
    with _open_text(path) as handle:
        for lineno, line in enumerate(handle, start=1):
            if line.strip():
                yield lineno, line


class RecordError(DataError):
    """One bad record; `reason` is the counter it is skipped under when bad records are skipped."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def parse_record(where: str, raw: str | Any, field_map: dict[str, str]) -> dict[str, Any]:
    record = raw
    if isinstance(raw, str):
        try:
            record = json.loads(raw)
        except json.JSONDecodeError as error:
            raise RecordError(f"{where}: malformed JSON: {error.msg} at column {error.colno}", "malformed_json") from None
    if not isinstance(record, dict):
        raise RecordError(f"{where}: expected a JSON object, got {type(record).__name__}", "not_an_object")
    for source, target in field_map.items():
        if source in record:
            record[target] = record.pop(source)
    return record


def detect_schema(record: dict[str, Any], where: str) -> str:
    if "messages" in record:
        return "chat"
    if "instruction" in record or "output" in record:
        return "alpaca"
    if "prompt" in record or "completion" in record:
        return "prompt_completion"
    if "text" in record:
        return "text"
    fields = ", ".join(sorted(record)) or "none"
    raise RecordError(f"{where}: no 'messages', 'instruction'/'output', 'prompt'/'completion' or 'text' field "
                      f"(fields: {fields}); map other names with data.field_map", "unknown_schema")


def _text(record: dict, field: str, where: str, optional: bool = False) -> str:
    value = record.get(field)
    if optional and value is None:
        return ""
    if not isinstance(value, str):
        got = "missing" if field not in record else type(value).__name__
        raise RecordError(f"{where}: field {field!r} must be a string ({got})", f"bad_field:{field}")
    return value


def to_messages(record: dict[str, Any], schema: str, where: str) -> list[dict[str, str]]:
    """Normalise one record; `text` records become a single assistant message (all of it is trained)."""
    if schema == "auto":
        schema = detect_schema(record, where)
    if schema == "text":
        return [{"role": "assistant", "content": _text(record, "text", where)}]
    if schema == "prompt_completion":
        return [{"role": "user", "content": _text(record, "prompt", where)},
                {"role": "assistant", "content": _text(record, "completion", where)}]
    if schema == "alpaca":
        prompt = _text(record, "instruction", where)
        extra = _text(record, "input", where, optional=True)
        if extra.strip():
            prompt = f"{prompt}\n\n{extra}"
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": _text(record, "output", where)}]

    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RecordError(f"{where}: field 'messages' must be a non-empty list", "bad_field:messages")
    normalised = []
    for index, message in enumerate(messages):
        at = f"{where}: messages[{index}]"
        if not isinstance(message, dict):
            raise RecordError(f"{at}: expected an object with 'role' and 'content'", "bad_field:messages")
        role = _text(message, "role", at)
        if role not in ("system", "user", "assistant"):
            raise RecordError(f"{at}: field 'role' must be system, user or assistant ({role!r})", "bad_field:role")
        normalised.append({"role": role, "content": _text(message, "content", at)})
    if normalised[-1]["role"] != "assistant":
        raise RecordError(f"{where}: the last message must be the assistant's (it is {normalised[-1]['role']!r})",
                          "last_turn_not_assistant")
    return normalised
