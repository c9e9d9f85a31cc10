"""The curves and events a training run writes in its directory: the trainer writes them (phase1a/train/progress.py),
the launcher of its ranks its events (append_event); a resume trims them (phase1a/train/loop.py); the report, the
plots and the trackers read them."""
from __future__ import annotations

import json
import time
from pathlib import Path

from phase1a.core import layout
from phase1a.core.atomic import write_atomically


def read_lines(path: Path | None) -> list[dict]:
    """The JSON objects of a JSONL file; a missing file is empty, and a line that does not parse (the torn last
    line of a file being written) is skipped."""
    if path is None or not Path(path).is_file():
        return []
    lines = []
    for raw in Path(path).read_text(errors="replace").splitlines():
        try:
            line = json.loads(raw)
        except ValueError:
            continue
        if isinstance(line, dict):
            lines.append(line)
    return lines


def last_step(path: Path) -> int | None:
    """The step of the last whole line of a curve file, read from its end (a file of a long run is large)."""
    try:
        with open(path, "rb") as handle:
            start = max(0, handle.seek(0, 2) - 4096)
            handle.seek(start)
            lines = handle.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    for raw in reversed(lines[1:] if start else lines):  # from the middle of the file, the first line is a part
        try:
            return int(json.loads(raw)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return None


def trim_to_step(path: Path, last_step: int) -> None:
    """Keep the records up to the checkpoint a run resumes from: the curve stays continuous, without repeats. A
    torn line (the crash that made this a resume) is dropped, not a reason to fail every resume after it."""
    if not path.exists():
        return
    kept = [record for record in read_lines(path) if record.get("step", 0) <= last_step]
    write_atomically(path, "".join(json.dumps(record) + "\n" for record in kept))  # a crash here keeps the curve


def append_event(output_dir: Path, kind: str, **fields) -> None:
    """An event from outside a training process (the launcher of its ranks), in the same file and format."""
    with open(Path(output_dir) / layout.EVENTS, "a") as events:
        events.write(json.dumps(event_line(kind, **fields)) + "\n")


def event_line(kind: str, **fields) -> dict:
    return {"event": kind, "time": time.time(), **fields}
