"""The Hugging Face Hub: model and dataset repositories resolved to a commit and downloaded into HF_HOME's cache.

(Skeleton: `looks_like_hub_id` is final; the rest is being built.)
"""
from __future__ import annotations

import re
from pathlib import Path

# `org/name` as the Hub spells repository ids; a bare `name` (a few canonical repos) is not accepted, so that
# a local directory name is never mistaken for a repository.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def looks_like_hub_id(value: str, base: Path | None = None) -> bool:
    """`org/name` that is not an existing path relative to `base` (transformers' rule: a local directory wins)."""
    if not _HUB_ID.match(value) or value.endswith((".jsonl", ".json", ".parquet", ".csv", ".tsv", ".arrow", ".gz")):
        return False
    return not (Path(base or Path.cwd()) / value).exists()
