"""A bundle: a local directory kept in the store (phase1a/store/base.py) under a prefix, file by file, that counts only
once its manifest is there.

The manifest (`manifest.json`: every file's size and sha256, who wrote it, the caller's `meta`) is written after
the last file, so a reader never takes a bundle whose upload was cut off for a whole one; it is deleted first, so
a bundle being removed stops counting before its files go. A download lands in a scratch directory and takes
the destination's name only when every file has the size and sha256 the manifest names: a partial, corrupt or
replaced object is `BundleCorrupt`, never used. Tokenized shards, checkpoints, finished adapters and run reports
travel as bundles.
"""
from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from pydantic import BaseModel, Field, ValidationError

from phase1a.core.atomic import move_into_place, remove, scratch_name
from phase1a.core.fingerprint import sha256_file
from phase1a.core.locks import holder
from phase1a.store.base import Store

MANIFEST = "manifest.json"
_THREADS = 8  # files hashed and moved at once: hashing releases the GIL, transfers wait on the network


class BundleFile(BaseModel):
    size: int
    sha256: str


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
                  guard: Callable[[], None] = lambda: None) -> Bundle:
    """Every file of `directory` under `prefix` (hashed while uploaded), then the manifest. `guard` runs before
    each file and before the manifest, and raises to stop the upload there (a training run's lease no longer
    held: phase1a/train/train_store.py)."""
    directory = Path(directory)
    names = local_files(directory)

    def one(name: str) -> tuple[str, BundleFile]:
        path = directory / name
        described = BundleFile(size=path.stat().st_size, sha256=sha256_file(path))
        guard()
        store.put_file(path, prefix + name)
        return name, described

    with ThreadPoolExecutor(min(_THREADS, max(1, len(names)))) as pool:
        files = dict(pool.map(one, names))
    bundle = Bundle(files=files, meta=meta or {})
    guard()
    store.put(prefix + MANIFEST, bundle.model_dump_json(indent=2).encode())
    return bundle


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
        store.get_files([(item.prefix + name, scratch / name, described.size)
                         for item, scratch in zip(wanted, scratches) for name, described in item.bundle.files.items()])
        with ThreadPoolExecutor(_THREADS) as pool:
            problems = list(pool.map(lambda pair: _check(store, *pair), zip(wanted, scratches)))
        for item, scratch, problem in zip(wanted, scratches, problems):
            if problem is None:
                move_into_place(scratch, item.destination)
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
    for name, described in item.bundle.files.items():
        path, where = scratch / name, store.where(item.prefix + name)
        size = path.stat().st_size if path.is_file() else None
        if size != described.size:
            return BundleCorrupt(f"{where}: not what the manifest says ({size} bytes, not {described.size})")
        if sha256_file(path) != described.sha256:
            return BundleCorrupt(f"{where}: not what the manifest says (its sha256 differs)")
    return None


def delete_bundle(store: Store, prefix: str) -> None:
    """The manifest first (the bundle stops counting), then every file under the prefix."""
    store.delete([prefix + MANIFEST])
    store.delete([item.key for item in store.list(prefix)])
