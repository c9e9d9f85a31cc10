"""A bundle: a local directory kept in the store (phase1a/store.py) under a prefix, file by file, that counts only
once its manifest is there.

The manifest (`manifest.json`: every file's size and sha256, who wrote it, the caller's `meta`) is written after
the last file, so a reader never takes a bundle whose upload was cut off for a whole one; it is deleted first, so
a bundle being removed stops counting before its files go. A download lands in a scratch directory and takes
the destination's name only when every file has the size and sha256 the manifest names: a partial, corrupt or
replaced object is `BundleCorrupt`, never used. Tokenized shards, checkpoints, finished adapters and run reports
travel as bundles.

A bundle uploaded with `compress` (tokenized shards: token ids compress several times over; weights hardly do)
keeps its larger files zstd-compressed in the store (`<name>.zst`); the manifest still names the file's own size
and sha256, hashed as it is compressed and again as it is decompressed on the way down, in the same pass.
"""
from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

import pyarrow as pa
from pydantic import BaseModel, Field, ValidationError

from phase1a.atomic import install, remove, scratch_name
from phase1a.fingerprint import READ_CHUNK, sha256_file
from phase1a.locks import holder
from phase1a.store import Store

MANIFEST = "manifest.json"
_THREADS = 8  # files hashed and moved at once: hashing releases the GIL, transfers wait on the network
COMPRESSED_FROM = 64 * 1024  # smaller files go as they are: compressing them saves no time
ZSTD = ".zst"


class BundleFile(BaseModel):
    size: int
    sha256: str
    stored: Literal["whole", "zstd"] = "whole"  # how the store holds it: as it is, or compressed as <name>.zst

    def key(self, prefix: str, name: str) -> str:
        return prefix + name + (ZSTD if self.stored == "zstd" else "")


class Bundle(BaseModel):
    files: dict[str, BundleFile]  # relative path -> size and hash
    writer: dict = Field(default_factory=holder)  # pid, host, flow run, since
    written_at: datetime = Field(default_factory=lambda: datetime.now(timezone.utc))
    meta: dict = {}  # the caller's facts, e.g. a checkpoint's step

    @property
    def size(self) -> int:
        return sum(item.size for item in self.files.values())


class BundleCorrupt(Exception):
    """A bundle in the store that cannot be used as it is: its manifest unreadable, or a file that is not what
    the manifest says. The message names the object and what was wrong."""


def local_files(directory: Path) -> list[str]:
    """A directory's files, relative, in order; scratch files (names starting with a dot) are not part of it."""
    directory = Path(directory)
    return sorted(path.relative_to(directory).as_posix() for path in directory.rglob("*")
                  if path.is_file() and not any(part.startswith(".") for part in path.relative_to(directory).parts))


def upload_bundle(store: Store, directory: Path, prefix: str, meta: dict | None = None,
                  compress: bool = False) -> Bundle:
    """Every file of `directory` under `prefix` (hashed while uploaded; with `compress`, the larger ones
    zstd-compressed), then the manifest."""
    directory = Path(directory)
    names = local_files(directory)

    def one(name: str) -> tuple[str, BundleFile]:
        path = directory / name
        if compress and path.stat().st_size >= COMPRESSED_FROM:
            return name, _put_compressed(store, path, prefix + name + ZSTD)
        described = BundleFile(size=path.stat().st_size, sha256=sha256_file(path))
        store.put_file(path, prefix + name)
        return name, described

    with ThreadPoolExecutor(min(_THREADS, max(1, len(names)))) as pool:
        files = dict(pool.map(one, names))
    bundle = Bundle(files=files, meta=meta or {})
    store.put(prefix + MANIFEST, bundle.model_dump_json(indent=2).encode())
    return bundle


def _put_compressed(store: Store, path: Path, key: str) -> BundleFile:
    """The file zstd-compressed into a scratch file beside it (hashed on the way), uploaded, removed."""
    digest, scratch = hashlib.sha256(), scratch_name(path)
    try:
        with open(path, "rb") as reader, pa.CompressedOutputStream(str(scratch), "zstd") as writer:
            while chunk := reader.read(READ_CHUNK):
                digest.update(chunk)
                writer.write(chunk)
        store.put_file(scratch, key)
    finally:
        remove(scratch)
    return BundleFile(size=path.stat().st_size, sha256=digest.hexdigest(), stored="zstd")


def read_bundle(store: Store, prefix: str) -> Bundle | None:
    """The bundle's manifest, or None when it has none (never uploaded, cut off, or being deleted)."""
    fetched = store.get(prefix + MANIFEST)
    if fetched is None:
        return None
    try:
        return Bundle.model_validate_json(fetched.data)
    except (ValidationError, ValueError) as error:
        raise BundleCorrupt(f"{store.where(prefix + MANIFEST)}: not a readable manifest "
                            f"({type(error).__name__})") from None


@dataclass
class Wanted:
    """One bundle to download: from `prefix` to `destination`, as `bundle` describes it."""

    prefix: str
    destination: Path
    bundle: Bundle


def download_bundles(store: Store, wanted: list[Wanted]) -> list[BundleCorrupt | None]:
    """Each bundle to its destination, verified; per bundle None (it is there) or the BundleCorrupt that kept it
    out. Transfers of all the bundles go together; a failure to reach the store raises."""
    scratches = [scratch_name(item.destination) for item in wanted]
    try:
        for item, scratch in zip(wanted, scratches):
            scratch.mkdir(parents=True)
            for name in item.bundle.files:
                (scratch / name).parent.mkdir(parents=True, exist_ok=True)
        store.get_files([(described.key(item.prefix, name), scratch / (name + ZSTD * (described.stored == "zstd")),
                          described.size)
                         for item, scratch in zip(wanted, scratches) for name, described in item.bundle.files.items()])
        with ThreadPoolExecutor(_THREADS) as pool:
            problems = list(pool.map(lambda pair: _check(store, *pair), zip(wanted, scratches)))
        for item, scratch, problem in zip(wanted, scratches, problems):
            if problem is None:
                install(scratch, item.destination)
        return problems
    finally:
        for scratch in scratches:
            remove(scratch)


def download_bundle(store: Store, prefix: str, destination: Path, bundle: Bundle) -> None:
    """One bundle to `destination`, verified; BundleCorrupt when it is not what its manifest says."""
    problem = download_bundles(store, [Wanted(prefix, Path(destination), bundle)])[0]
    if problem is not None:
        raise problem


def _check(store: Store, item: Wanted, scratch: Path) -> BundleCorrupt | None:
    """Each file as the manifest names it (a compressed one decompressed into place, hashed as it is written)."""
    for name, described in item.bundle.files.items():
        path, where = scratch / name, store.where(described.key(item.prefix, name))
        try:
            sha = _decompressed(path) if described.stored == "zstd" else sha256_file(path)
        except (OSError, pa.ArrowException) as error:
            return BundleCorrupt(f"{where}: not what the manifest says (it does not decompress: {error})")
        size = path.stat().st_size if path.is_file() else None
        if size != described.size:
            return BundleCorrupt(f"{where}: not what the manifest says ({size} bytes, not {described.size})")
        if sha != described.sha256:
            return BundleCorrupt(f"{where}: not what the manifest says (its sha256 differs)")
    return None


def _decompressed(path: Path) -> str:
    """`<path>.zst` decompressed to `path` and removed; the sha256 of what was written."""
    packed, digest = path.with_name(path.name + ZSTD), hashlib.sha256()
    with pa.CompressedInputStream(pa.OSFile(str(packed), "rb"), "zstd") as reader, open(path, "wb") as writer:
        while chunk := reader.read(READ_CHUNK):
            digest.update(chunk)
            writer.write(chunk)
    packed.unlink()
    return digest.hexdigest()


def delete_bundle(store: Store, prefix: str) -> None:
    """The manifest first (the bundle stops counting), then every file under the prefix."""
    store.delete([prefix + MANIFEST])
    store.delete([item.key for item in store.list(prefix)])
