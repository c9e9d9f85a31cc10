"""What a name says before anything is read: a data file's format by its suffix, and whether a source is a
Hugging Face Hub repository id. No imports of the project: the config, the data sources and the Hub code all
read these."""
from __future__ import annotations

import re
from pathlib import Path

# The one home of data file formats: suffix -> reader. Text formats may carry a compression suffix too.
DATA_FILE_FORMATS = {".jsonl": "json", ".ndjson": "json", ".json": "json", ".parquet": "parquet",
                     ".csv": "csv", ".tsv": "tsv", ".arrow": "arrow"}
COMPRESSION_SUFFIXES = (".gz", ".bz2", ".xz", ".zst")
_TEXT_FORMATS = ("json", "csv", "tsv")
# `org/name` as the Hub spells repository ids; a bare `name` (a few canonical repos) is not accepted, so that
# a local directory name is never mistaken for a repository.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def file_format(path: Path | str) -> str | None:
    """The reader for a file name, or None when it is not a data file (a README, a lock, a checksum...)."""
    name = Path(path).name.lower()
    for suffix in COMPRESSION_SUFFIXES:
        if name.endswith(suffix):
            stem = name[: -len(suffix)]
            kind = DATA_FILE_FORMATS.get(Path(stem).suffix)
            return kind if kind in _TEXT_FORMATS else None
    return DATA_FILE_FORMATS.get(Path(name).suffix)


def is_data_file(path: Path | str) -> bool:
    return file_format(path) is not None


def looks_like_hub_id(value: str, base: Path | None = None) -> bool:
    """`org/name` that is not an existing path relative to `base` (transformers' rule: a local directory wins)."""
    if not _HUB_ID.match(value) or is_data_file(value):
        return False
    return not (Path(base or Path.cwd()) / value).exists()
