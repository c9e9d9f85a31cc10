"""Atomic writes, one helper for every file or directory a reader must never see half-written.

The body writes under a scratch name beside the target (same directory, so the same file system); on a clean
exit the scratch takes the target's name in one rename, on an error it is removed. Readers need no lock: they
see the old content or the new, never a part. Scratch names carry the pid and a random suffix, so racing
writers never write into each other's scratch.
"""
from __future__ import annotations

import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Literal


def scratch_name(final: Path) -> Path:
    return final.with_name(f".{final.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


@contextmanager
def atomic_path(final: Path, existing: Literal["replace", "keep", "fail"] = "replace") -> Iterator[Path]:
    """Yields the scratch path for the body to create (a file, a directory or a link) that then becomes `final`.

    When `final` exists by then: `replace` it (a file or link in one rename; a directory cannot be renamed over
    a non-empty one, so it is removed first, and readers of such directories check a completion marker),
    `keep` it and drop ours (another writer of the same content finished first), or `fail` (FileExistsError:
    what is there must never be overwritten)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    scratch = scratch_name(final)
    try:
        yield scratch
        if final.exists() and existing != "replace":
            if existing == "fail":
                raise FileExistsError(f"{final} already exists")
            return
        move_into_place(scratch, final)
    finally:
        if scratch.exists() or scratch.is_symlink():
            _remove(scratch)


def move_into_place(scratch: Path, final: Path) -> None:
    """`scratch` takes `final`'s name in one rename; a directory there is removed first (see atomic_path)."""
    if final.is_dir() and not final.is_symlink() and scratch.is_dir():
        shutil.rmtree(final)
    os.replace(scratch, final)


def remove(path: Path) -> None:
    """A file, link or directory, if it is there."""
    if path.exists() or path.is_symlink():
        _remove(path)


def write_atomically(path: Path, data: str | bytes) -> None:
    """A whole file at once, on disk (fsync) before its name points at it."""
    with atomic_path(Path(path)) as scratch, open(scratch, "wb") as handle:
        handle.write(data.encode() if isinstance(data, str) else data)
        handle.flush()
        os.fsync(handle.fileno())
