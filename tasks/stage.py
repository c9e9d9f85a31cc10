"""Stage: copy the dataset (and, on request, a model directory) to fast local disk, verified, skipped when
already identical.

Sources: a local path, a file:// URL, s3://bucket/key (one object) or s3://bucket/prefix/ (every object under
the prefix, concatenated in key order into one local file, so downstream always sees one dataset file).
Everything lands at `staging_dir/<fingerprint[:16]>/<name>`, where the fingerprint is `source_fingerprint`:
the sha256 of a local file's bytes, or for S3 the hash of its keys, sizes and ETags. So the stage cache can
tell from its inputs alone whether the staged copy still exists, and two sources never share a location.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Any, Iterator
from urllib.parse import urlparse

from boto3.s3.transfer import TransferConfig
from pydantic import BaseModel, ValidationError

from phase1a.errors import DataError
from phase1a.fingerprint import hash_json, sha256_file
from phase1a.s3 import (
    DEFAULT_TRANSFER,
    S3Error,
    S3Object,
    S3Url,
    download_objects,
    is_s3_url,
    list_objects,
    make_client,
    parse_s3_url,
)
from tasks.caching import FingerprintCache, task

_CHUNK = 8 * 1024 * 1024


class StagedData(BaseModel):
    source: str
    path: str
    sha256: str  # of the staged bytes: tokenize keys its cache on this
    size_bytes: int
    copied: bool
    objects: list[S3Object] = []  # S3 sources: the objects staged, with size and ETag


class StageManifest(BaseModel):
    """Written next to a staged S3 copy once it is verified; a re-stage compares it with a fresh listing."""

    source: str
    objects: list[S3Object]
    sha256: str = ""  # dataset: of the staged file
    size_bytes: int = 0
    file_sha256: dict[str, str] = {}  # model directory: relative path -> sha256


@contextmanager
def _data_errors() -> Iterator[None]:
    try:
        yield
    except S3Error as error:
        raise DataError(str(error)) from None


def local_source_path(source: str) -> Path:
    """A local path or file:// URL as a Path; other schemes are refused with a clear message."""
    parsed = urlparse(source)
    if parsed.scheme == "file":
        path = Path(parsed.path)
    elif parsed.scheme in ("", None) or len(parsed.scheme) == 1:  # len 1: a Windows drive letter
        path = Path(source)
    else:
        raise DataError(f"data.source: scheme {parsed.scheme!r} of {source!r} is not supported "
                        "(use a local path, file://, or s3://)")
    path = path.expanduser()
    if not path.exists():
        raise DataError(f"data.source: no such file: {path}")
    if not path.is_file():
        raise DataError(f"data.source: not a regular file: {path}")
    return path


def _s3_fingerprint(url: S3Url, objects: list[S3Object]) -> str:
    return hash_json(["s3", url.bucket, [[item.key, item.size, item.etag] for item in objects]])


def _list(url: S3Url, endpoint_url: str | None, client: Any = None) -> tuple[Any, list[S3Object]]:
    with _data_errors():
        client = client or make_client(endpoint_url)
        return client, list_objects(client, url)


def _parse(source: str) -> S3Url:
    with _data_errors():
        return parse_s3_url(source)


def source_fingerprint(source: str, endpoint_url: str | None = None) -> str:
    """What the stage cache keys on, without downloading anything: the sha256 of a local file's bytes, or for
    S3 the hash of (bucket, keys, sizes, ETags) from one HEAD or listing."""
    if is_s3_url(source):
        url = _parse(source)
        return _s3_fingerprint(url, _list(url, endpoint_url)[1])
    return sha256_file(local_source_path(source))


def staged_name(source: str) -> str:
    """The staged file's name, from the source string alone (the cache's presence check must not list S3).
    A prefix's shards become `<last prefix component>.jsonl`: the data is JSONL, whatever the shards are called."""
    if is_s3_url(source):
        url = _parse(source)
        name = f"{url.key.rstrip('/').rsplit('/', 1)[-1] or url.bucket}.jsonl" if url.is_prefix \
            else url.key.rsplit("/", 1)[-1]
    else:
        parsed = urlparse(source)
        name = Path(parsed.path if parsed.scheme == "file" else source).name
    if name in ("", ".", ".."):
        raise DataError(f"data.source: {source!r} does not name a file")
    return name


def staged_location(staging_dir: Path, fingerprint: str, name: str) -> Path:
    # Content-addressed, so two different sources with the same name never collide.
    return Path(staging_dir) / fingerprint[:16] / name


def _manifest_path(target: Path) -> Path:
    return target.with_name(f"{target.name}.manifest.json")


def _read_manifest(path: Path) -> StageManifest | None:
    try:
        return StageManifest.model_validate_json(path.read_bytes())
    except (OSError, ValidationError, ValueError):  # missing or half-written: stage again
        return None


def _write_manifest(path: Path, manifest: StageManifest) -> None:
    partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
    partial.write_text(json.dumps(manifest.model_dump(mode="json"), indent=2) + "\n")
    os.replace(partial, path)


def _intact(path: Path, size: int, sha256: str) -> bool:
    # The size is the cheap check; the full hash catches a same-size corruption, at local-disk read speed.
    return path.is_file() and path.stat().st_size == size and sha256_file(path) == sha256


def _require_free_space(directory: Path, needed: int, source: str) -> None:
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise DataError(f"staging dir {directory}: {free} bytes free, {source} needs {needed}")


def verify_download(path: Path, expected_size: int, expected_md5: str | None, what: str | None = None) -> str:
    """Check a downloaded file's size and (where the ETag is one) MD5; return its sha256.

    A file that fails is deleted at once, so it can never be mistaken for a staged copy."""
    what = what or str(path)
    size = path.stat().st_size if path.is_file() else -1
    if size != expected_size:
        path.unlink(missing_ok=True)
        raise DataError(f"{what}: download failed verification ({size} bytes, expected {expected_size})")
    sha, md5 = hashlib.sha256(), hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            sha.update(chunk)
            md5.update(chunk)
    if expected_md5 is not None and md5.hexdigest() != expected_md5:
        path.unlink(missing_ok=True)
        raise DataError(f"{what}: download failed verification (md5 {md5.hexdigest()}, ETag {expected_md5})")
    return sha.hexdigest()


def _partial(path: Path, tag: str = "partial") -> Path:
    return path.with_name(f".{path.name}.{tag}-{os.getpid()}")


def _concatenate(parts: list[tuple[Path, str]], target: Path) -> tuple[str, int]:
    """Append the shards (path, s3:// name) into `target`, deleting each once appended (peak disk: total +
    largest shard).

    A plain shard without a final newline gets one, so its last record and the next shard's first stay two
    lines. Gzip shards are appended as they are: concatenated gzip members are one valid gzip stream, and a
    byte between them would break it. A JSON array cannot be joined with anything, so it is refused."""
    digest, size = hashlib.sha256(), 0
    with open(target, "wb") as out:
        for index, (part, what) in enumerate(parts):
            first, last, gzipped = True, b"", False
            with open(part, "rb") as handle:
                while chunk := handle.read(_CHUNK):
                    if first:
                        gzipped = chunk[:2] == b"\x1f\x8b"
                        if not gzipped and chunk.lstrip()[:1] == b"[":
                            raise DataError(f"{what}: a JSON array cannot be concatenated with other shards "
                                            "(use JSONL shards, or name the one file)")
                        first = False
                    out.write(chunk)
                    digest.update(chunk)
                    size += len(chunk)
                    last = chunk[-1:]
            if last not in (b"", b"\n") and not gzipped and index < len(parts) - 1:
                out.write(b"\n")
                digest.update(b"\n")
                size += 1
            part.unlink()
    return digest.hexdigest(), size


def _stage_local(source: str, staging_dir: Path) -> StagedData:
    path = local_source_path(source)
    size = path.stat().st_size
    if size == 0:
        raise DataError(f"{path}: the file is empty")
    sha = sha256_file(path)
    target = staged_location(staging_dir, sha, path.name)
    if target.is_file() and target.stat().st_size == size and sha256_file(target) == sha:
        return StagedData(source=source, path=str(target), sha256=sha, size_bytes=size, copied=False)

    target.parent.mkdir(parents=True, exist_ok=True)
    _require_free_space(target.parent, size, str(path))
    partial = _partial(target)
    try:
        shutil.copyfile(path, partial)
        copied_sha = sha256_file(partial)
        if copied_sha != sha:
            raise DataError(f"{path}: staged copy failed verification (sha256 {copied_sha} != {sha})")
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return StagedData(source=source, path=str(target), sha256=sha, size_bytes=size, copied=True)


def _stage_s3(source: str, staging_dir: Path, endpoint_url: str | None, transfer: TransferConfig) -> StagedData:
    url = _parse(source)
    client, objects = _list(url, endpoint_url)
    if sum(item.size for item in objects) == 0:
        raise DataError(f"{source}: the data is empty")
    target = staged_location(staging_dir, _s3_fingerprint(url, objects), staged_name(source))
    manifest_path = _manifest_path(target)
    recorded = _read_manifest(manifest_path)
    if recorded and recorded.objects == objects and _intact(target, recorded.size_bytes, recorded.sha256):
        return StagedData(source=source, path=str(target), sha256=recorded.sha256, size_bytes=recorded.size_bytes,
                          copied=False, objects=objects)

    target.parent.mkdir(parents=True, exist_ok=True)
    manifest_path.unlink(missing_ok=True)  # the old record must not vouch for a file about to be replaced
    sizes = [item.size for item in objects]
    _require_free_space(target.parent, sum(sizes) + (max(sizes) if len(objects) > 1 else 0), source)
    parts = [_partial(target, f"shard{index:05d}") for index in range(len(objects))]
    partial = _partial(target)
    try:
        with _data_errors():
            md5s = download_objects(client, url.bucket, list(zip(objects, parts)), transfer)
        shas = [verify_download(part, item.size, md5s[item.key], what=f"s3://{url.bucket}/{item.key}")
                for item, part in zip(objects, parts)]
        if len(parts) == 1:
            sha, size = shas[0], sizes[0]
            os.replace(parts[0], partial)
        else:
            sha, size = _concatenate([(part, f"s3://{url.bucket}/{item.key}") for item, part in zip(objects, parts)],
                                     partial)
        os.replace(partial, target)
    finally:
        for leftover in [*parts, partial]:
            leftover.unlink(missing_ok=True)
    _write_manifest(manifest_path, StageManifest(source=source, objects=objects, sha256=sha, size_bytes=size))
    return StagedData(source=source, path=str(target), sha256=sha, size_bytes=size, copied=True, objects=objects)


def stage_dataset(source: str, staging_dir: Path, endpoint_url: str | None = None,
                  transfer: TransferConfig = DEFAULT_TRANSFER) -> StagedData:
    """Copy `source` under `staging_dir`; every copy is verified before it gets its final name."""
    if is_s3_url(source):
        return _stage_s3(source, Path(staging_dir), endpoint_url, transfer)
    return _stage_local(source, Path(staging_dir))


def _relative_file(url: S3Url, key: str) -> PurePosixPath:
    # A key like "model/../../etc/x" must not write outside the staging directory.
    relative = PurePosixPath(key[len(url.key):])
    if relative.is_absolute() or ".." in relative.parts or not relative.parts:
        raise DataError(f"s3://{url.bucket}/{key}: key does not map to a file inside the model directory")
    return relative


def _copy_local_model(directory: Path, staging_dir: Path) -> Path:
    """A model directory on slow storage (a network mount) copied to local disk, each file hashed while it
    is read and again once written, renamed only when both agree. The listing (names, sizes, mtimes) keys
    the copy, so an unchanged model is never read from slow storage twice."""
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    listing = [(p.relative_to(directory).as_posix(), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    target = staged_location(staging_dir, hash_json(listing), directory.name)
    marker = target / ".phase1a-staged"
    if marker.is_file():
        return target
    target.mkdir(parents=True, exist_ok=True)
    _require_free_space(target, sum(size for _, size, _ in listing), str(directory))
    for relative, _, _ in listing:
        destination = target / relative
        destination.parent.mkdir(parents=True, exist_ok=True)
        partial, digest = _partial(destination), hashlib.sha256()
        try:
            with open(directory / relative, "rb") as reader, open(partial, "wb") as writer:
                while chunk := reader.read(_CHUNK):
                    digest.update(chunk)
                    writer.write(chunk)
            if sha256_file(partial) != digest.hexdigest():
                raise DataError(f"{directory / relative}: staged copy failed verification")
            os.replace(partial, destination)
        finally:
            partial.unlink(missing_ok=True)
    marker.write_text(json.dumps(listing) + "\n")
    return target


def stage_model(source: str, staging_dir: Path, endpoint_url: str | None = None,
                transfer: TransferConfig = DEFAULT_TRANSFER, copy_local: bool = False) -> Path:
    """An s3://bucket/prefix/ model directory downloaded to `staging_dir/<fingerprint[:16]>/<name>/` (verified,
    renamed into place file by file, skipped when the manifest matches). A local directory is copied the same
    way when `copy_local` (it lives on slow storage), else returned unchanged; a built-in model name passes
    through to the model resolver."""
    if not is_s3_url(source):
        parsed = urlparse(source)
        path = Path(parsed.path) if parsed.scheme == "file" else Path(source)
        return _copy_local_model(path, Path(staging_dir)) if copy_local and path.is_dir() else path
    url = _parse(source if source.endswith("/") else source + "/")  # a model is always a directory
    client, objects = _list(url, endpoint_url)
    name = url.key.rstrip("/").rsplit("/", 1)[-1] or url.bucket
    target = staged_location(Path(staging_dir), _s3_fingerprint(url, objects), name)
    files = [(item, target / _relative_file(url, item.key)) for item in objects]
    manifest_path = _manifest_path(target)
    recorded = _read_manifest(manifest_path)
    if recorded and recorded.objects == objects:
        damaged = [path for item, path in files
                   if not _intact(path, item.size, recorded.file_sha256.get(item.key, ""))]
        if not damaged:
            return target
        for path in damaged:  # else the size check below would keep a same-size corruption
            path.unlink(missing_ok=True)
    manifest_path.unlink(missing_ok=True)

    # A file already at its final name was verified before it was renamed there, and the directory is keyed
    # on this exact listing: an interrupted stage resumes instead of starting over.
    pending = [(item, path) for item, path in files if not (path.is_file() and path.stat().st_size == item.size)]
    target.mkdir(parents=True, exist_ok=True)
    _require_free_space(target, sum(item.size for item, _ in pending), source)
    partials = [(item, path, _partial(path)) for item, path in pending]
    shas: dict[str, str] = {}
    try:
        for _, path, _part in partials:
            path.parent.mkdir(parents=True, exist_ok=True)
        with _data_errors():
            md5s = download_objects(client, url.bucket, [(item, part) for item, _, part in partials], transfer)
        for item, path, part in partials:
            shas[item.key] = verify_download(part, item.size, md5s[item.key], what=f"s3://{url.bucket}/{item.key}")
            os.replace(part, path)
    finally:
        for _, _, part in partials:
            part.unlink(missing_ok=True)
    shas.update({item.key: sha256_file(path) for item, path in files if item.key not in shas})
    _write_manifest(manifest_path, StageManifest(source=source, objects=objects, file_sha256=shas))
    return target


def _staged_copy_present(inputs: dict) -> bool:
    try:
        name = staged_name(inputs["source"])
    except DataError:  # let the task run and report the bad source itself
        return False
    return staged_location(Path(inputs["staging_dir"]), inputs["fingerprint"], name).is_file()


@task(
    name="stage",
    cache_policy=FingerprintCache(output_present=_staged_copy_present),
    persist_result=True,
    result_serializer="json",
)
def stage(source: str, staging_dir: str, fingerprint: str, endpoint_url: str | None = None) -> StagedData:
    return stage_dataset(source, Path(staging_dir), endpoint_url)
