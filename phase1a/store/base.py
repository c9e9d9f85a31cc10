"""The store: where what must outlive a host goes (config `store`), an S3 prefix or a directory on a network mount.

Both kinds offer the same few operations on keys relative to the store's root: whole files up and down (an
upload is checked by the size the store reports, a download lands under a scratch name and is renamed when
whole), small objects read with their version (`etag`) and written only if absent or only over the version
the writer read (S3's conditional writes, `If-None-Match: *` and `If-Match`; a lock and a content hash on a
mount), a listing, deletes, and the store's own clock (leases age by it, not by a host's).

What goes where (the callers own their prefixes): `shards/<key>/` tokenized shards (phase1a/data/shards.py),
`jobs/<name>/train-<key>/` a training run's lease, checkpoints and final adapter (phase1a/train/train_store.py),
`jobs/<name>/runs/<run>/` run reports, `history/` the throughput history, `prefect/` task cache records.
Credentials come only from boto3's standard chain; messages name keys and URLs, never request details.
"""
from __future__ import annotations

import email.utils
import fcntl
import hashlib
import os
import shutil
from abc import ABC, abstractmethod
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from phase1a.core.atomic import atomic_path, write_atomically


class StoreConflict(Exception):
    """A conditional write lost: the object exists (if-absent) or is not the version the writer read (if-match)."""


@dataclass(frozen=True)
class Fetched:
    """A small object as read: its bytes, its version, when it was last written and the store's time of the read
    (both by the store's clock)."""

    data: bytes
    etag: str
    modified: datetime
    store_time: datetime

    @property
    def age_seconds(self) -> float:
        return (self.store_time - self.modified).total_seconds()


@dataclass(frozen=True)
class Listed:
    key: str  # relative to the store's root
    size: int


class Store(ABC):
    """Keys are '/'-separated, relative to the store's root; `where(key)` is the full location for messages."""

    url: str

    def where(self, key: str) -> str:
        return self.url + key

    @abstractmethod
    def probe(self) -> None:
        """Fail now, naming the store and what is wrong, when it cannot be used (no such bucket, no access, a
        directory that cannot be written)."""

    @abstractmethod
    def put_file(self, path: Path, key: str) -> None:
        """Upload a local file whole; the stored size is checked against the file's."""

    @abstractmethod
    def get_files(self, items: list[tuple[str, Path, int]]) -> None:
        """Download (key, destination, expected size) items, in parallel where the store allows; each lands
        whole under its destination's name, or not at all."""

    @abstractmethod
    def get(self, key: str) -> Fetched | None:
        """A small object with its version, or None when there is none."""

    @abstractmethod
    def put(self, key: str, data: bytes, *, if_absent: bool = False, if_match: str | None = None) -> str:
        """Write a small object, conditionally when asked; returns its new version. StoreConflict when the
        condition does not hold."""

    @abstractmethod
    def list(self, prefix: str) -> list[Listed]:
        """Every object under `prefix`, in key order."""

    @abstractmethod
    def delete(self, keys: list[str]) -> None:
        """Remove the objects; a missing one is not an error."""


def content_version(data: bytes) -> str:
    return hashlib.md5(data, usedforsecurity=False).hexdigest()


class LocalStore(Store):
    """A directory, typically a network mount that every host mounts at its own path. Files are written under a
    scratch name and renamed; a conditional write holds an flock on a lock file beside the object (NFSv4 and
    most network file systems honour it) while it compares versions, an object's version being its content's
    MD5 as S3's is for a single-part upload."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.url = str(self.root).rstrip("/") + "/"

    def _path(self, key: str) -> Path:
        path = (self.root / key).resolve()
        if not path.is_relative_to(self.root.resolve()):
            raise ValueError(f"{key!r} is outside the store {self.root}")
        return path

    def probe(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise OSError(f"store {self.url}: cannot be created ({error.strerror})") from None
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise OSError(f"store {self.url}: not writable by this user")

    def put_file(self, path: Path, key: str) -> None:
        target = self._path(key)
        with atomic_path(target) as scratch:
            shutil.copyfile(path, scratch)
            with open(scratch, "rb+") as handle:
                os.fsync(handle.fileno())
        if target.stat().st_size != Path(path).stat().st_size:
            raise OSError(f"{self.where(key)}: {target.stat().st_size} bytes stored, {path} has "
                          f"{Path(path).stat().st_size}")

    def get_files(self, items: list[tuple[str, Path, int]]) -> None:
        for key, destination, _ in items:
            with atomic_path(Path(destination)) as scratch:
                shutil.copyfile(self._path(key), scratch)

    def get(self, key: str) -> Fetched | None:
        path = self._path(key)
        try:
            with open(path, "rb") as handle:
                data, modified = handle.read(), os.fstat(handle.fileno()).st_mtime
        except FileNotFoundError:
            return None
        return Fetched(data, content_version(data), _utc(modified), datetime.now(timezone.utc))

    def put(self, key: str, data: bytes, *, if_absent: bool = False, if_match: str | None = None) -> str:
        path = self._path(key)
        if not (if_absent or if_match):
            write_atomically(path, data)
            return content_version(data)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path.with_name(f".{path.name}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            current = self.get(key)
            if if_absent and current is not None:
                raise StoreConflict(f"{self.where(key)} exists")
            if if_match and (current is None or current.etag != if_match):
                raise StoreConflict(f"{self.where(key)} is not the version {if_match} any more")
            write_atomically(path, data)
        finally:
            os.close(fd)
        return content_version(data)

    def list(self, prefix: str) -> list[Listed]:
        base = self._path(prefix) if prefix else self.root
        top = base if base.is_dir() else base.parent
        if not top.is_dir():
            return []
        found = []
        for path in top.rglob("*"):
            relative = path.relative_to(self.root).as_posix()
            if path.is_file() and relative.startswith(prefix) and not path.name.startswith("."):
                found.append(Listed(relative, path.stat().st_size))
        return sorted(found, key=lambda item: item.key.encode())

    def delete(self, keys: list[str]) -> None:
        for key in keys:
            self._path(key).unlink(missing_ok=True)


def _utc(timestamp: float) -> datetime:
    return datetime.fromtimestamp(timestamp, timezone.utc)


def http_date(headers: dict[str, Any]) -> datetime:
    """The `Date` of an HTTP answer (the server's clock), else this host's."""
    raw = headers.get("date")
    try:
        return email.utils.parsedate_to_datetime(raw) if raw else datetime.now(timezone.utc)
    except (TypeError, ValueError):
        return datetime.now(timezone.utc)
