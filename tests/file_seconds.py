"""Writes tests/file_seconds.json, each test file's seconds (setup, call and teardown summed), from the output of
pytest runs with `--durations=0`: `python tests/file_seconds.py make-test.log [more.log ...]` (a file in several
logs: its largest sum). tests/conftest.py hands the slowest files to pytest-xdist's workers first."""
from __future__ import annotations

import collections
import json
import re
import sys
from pathlib import Path

OUT = Path(__file__).with_name("file_seconds.json")
DURATION = re.compile(r"^([\d.]+)s (?:setup|call|teardown)\s+(tests/\S+?\.py)::", re.MULTILINE)


def file_seconds(logs: list[str]) -> dict[str, int]:
    seconds: collections.Counter[str] = collections.Counter()
    for log in logs:
        these: collections.Counter[str] = collections.Counter()
        for match in DURATION.finditer(log):
            these[match.group(2)] += float(match.group(1))
        seconds |= these  # the larger of the two, file by file
    return {name: round(total) for name, total in seconds.most_common() if round(total) > 0}


if __name__ == "__main__":
    OUT.write_text(json.dumps(file_seconds([Path(path).read_text() for path in sys.argv[1:]]), indent=1) + "\n")
