"""Following a training run's files while it runs: training may be other processes (torchrun ranks), so the
flow's process reads what they write, `metrics.jsonl` (one line per optimizer step) and `eval.jsonl` (one line
per evaluation), and hands the new lines on every few seconds, then the rest when training ends. A training
that was reused or resumed is read from the start: the tracker gets the whole curve."""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Callable

from phase1a.core import layout

FOLLOW_SECONDS = 5.0
SOURCES = {"train": layout.METRICS, "eval": layout.EVALUATIONS}  # the source names metric_values knows


class JsonlTail:
    """The complete lines a JSONL file gained since the last read, each step once and in order.

    A resumed run rewrites metrics.jsonl without the steps after its checkpoint (a new file, or a shorter
    one): the file is read again from its start, and steps already handed on are skipped, so a curve never
    goes back. A line still being written (no newline yet) waits for the next read."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.inode, self.last_step = Path(path), 0, None, 0

    def read(self) -> list[dict]:
        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            return []
        if stat.st_ino != self.inode or stat.st_size < self.offset:
            self.offset, self.inode = 0, stat.st_ino
        with open(self.path, "rb") as file:
            file.seek(self.offset)
            chunk = file.read()
        complete = chunk[:chunk.rfind(b"\n") + 1]
        self.offset += len(complete)
        records = []
        for line in complete.splitlines():
            try:
                record = json.loads(line)
            except ValueError:  # not a record (a torn line after a crash): nothing to plot
                continue
            step = record.get("step") if isinstance(record, dict) else None
            if isinstance(step, int) and step > self.last_step:
                records.append(record)
                self.last_step = step
        return records


class Follower:
    """A thread that hands `sink(source, records)` the new lines of a training directory's files every
    `interval` seconds while the `with` block runs, and the remainder when it ends."""

    def __init__(self, output_dir: Path, sink: Callable[[str, list[dict]], None], interval: float = FOLLOW_SECONDS,
                 on_error: Callable[[BaseException], None] | None = None) -> None:
        self.tails = {source: JsonlTail(Path(output_dir) / name) for source, name in SOURCES.items()}
        self.sink, self.interval, self.on_error = sink, interval, on_error
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="phase1a-tracking-follower", daemon=True)

    def poll(self) -> None:
        for source, tail in self.tails.items():
            records = tail.read()
            if records:
                self.sink(source, records)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._poll_safely()

    def _poll_safely(self) -> None:
        try:
            self.poll()
        except Exception as error:  # an unreadable file: following never fails the training
            if self.on_error is not None:
                self.on_error(error)

    def __enter__(self) -> "Follower":
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()
        self._poll_safely()
