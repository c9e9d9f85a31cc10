"""Stage: copy the dataset to fast local disk, verified by sha256, skipped when already identical."""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from urllib.parse import urlparse

from pydantic import BaseModel

from phase1a.fingerprint import sha256_file
from tasks.caching import FingerprintCache, task


class DataError(ValueError):
    """Bad or missing input data; the message names the file (and line and field where there is one)."""


class StagedData(BaseModel):
    source: str
    path: str
    sha256: str
    size_bytes: int
    copied: bool


def local_source_path(source: str) -> Path:
    """A local path or file:// URL as a Path; other schemes are refused with a clear message."""
    parsed = urlparse(source)
    if parsed.scheme == "file":
        path = Path(parsed.path)
    elif parsed.scheme in ("", None) or len(parsed.scheme) == 1:  # len 1: a Windows drive letter
        path = Path(source)
    else:
        raise DataError(f"data.source: scheme {parsed.scheme!r} of {source!r} is not supported (use a local path)")
    path = path.expanduser()
    if not path.exists():
        raise DataError(f"data.source: no such file: {path}")
    if not path.is_file():
        raise DataError(f"data.source: not a regular file: {path}")
    return path


def source_fingerprint(source: str) -> str:
    """The content hash the stage cache keys on: the sha256 of the data's bytes."""
    return sha256_file(local_source_path(source))


def staged_location(staging_dir: Path, sha256: str, name: str) -> Path:
    # Content-addressed, so two different files with the same name never collide.
    return Path(staging_dir) / sha256[:16] / name


def stage_dataset(source: str, staging_dir: Path) -> StagedData:
    """Copy `source` under `staging_dir`; verify the copy's sha256 before it gets its final name."""
    path = local_source_path(source)
    size = path.stat().st_size
    if size == 0:
        raise DataError(f"{path}: the file is empty")
    sha = sha256_file(path)
    target = staged_location(staging_dir, sha, path.name)
    if target.is_file() and target.stat().st_size == size and sha256_file(target) == sha:
        return StagedData(source=source, path=str(target), sha256=sha, size_bytes=size, copied=False)

    target.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(target.parent).free
    if free < size:
        raise DataError(f"staging dir {target.parent}: {free} bytes free, {path} needs {size}")
    partial = target.with_name(f".{target.name}.partial-{os.getpid()}")
    try:
        shutil.copyfile(path, partial)
        copied_sha = sha256_file(partial)
        if copied_sha != sha:
            raise DataError(f"{path}: staged copy failed verification (sha256 {copied_sha} != {sha})")
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return StagedData(source=source, path=str(target), sha256=sha, size_bytes=size, copied=True)


def _staged_copy_present(inputs: dict) -> bool:
    name = local_source_path(inputs["source"]).name
    return staged_location(Path(inputs["staging_dir"]), inputs["fingerprint"], name).is_file()


@task(
    name="stage",
    cache_policy=FingerprintCache(output_present=_staged_copy_present),
    persist_result=True,
    result_serializer="json",
)
def stage(source: str, staging_dir: str, fingerprint: str) -> StagedData:
    return stage_dataset(source, Path(staging_dir))
