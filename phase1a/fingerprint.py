"""Content fingerprints: what the caches key on, so a changed file never reuses a stale result."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

_CHUNK = 8 * 1024 * 1024
_PACKAGE_ROOT = Path(__file__).resolve().parent.parent


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_tree(root: Path, patterns: tuple[str, ...] = ("*",)) -> str:
    """Hash of every matching file's relative name and bytes, in a stable order."""
    digest = hashlib.sha256()
    files = sorted({p for pattern in patterns for p in root.glob(pattern) if p.is_file()})
    for path in files:
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(sha256_file(path).encode())
    return digest.hexdigest()


def hash_json(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def code_version(*modules: str) -> str:
    """Hash of the named source files (relative to the project root), so a code change invalidates caches."""
    digest = hashlib.sha256()
    for name in modules:
        digest.update(name.encode())
        digest.update((_PACKAGE_ROOT / name).read_bytes())
    return digest.hexdigest()[:16]
