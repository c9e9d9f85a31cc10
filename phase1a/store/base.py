"""The store: where what must outlive a host goes (config `store`), an S3 prefix or a directory on a network mount.

Both kinds offer the same few operations on keys relative to the store's root: whole files up and down (an
upload is checked by the size the store reports, a download lands under a scratch name and is renamed when
whole), small objects read with their version (`etag`) and written only if absent or only over the version
the writer read (S3's conditional writes, `If-None-Match: *` and `If-Match`; a lock and a content hash on a
mount), a listing, deletes, and the store's own clock (leases age by it, not by a host's).

What goes where (the callers own their prefixes): `shards/<key>/` tokenized shards (phase1a/data/shards.py),
`jobs/<name>/train-<key>/` a training run's lease, checkpoints and final adapter (phase1a/train/train_store.py),
`jobs/<name>/runs/<run>/` run reports, `history/` the throughput history, `prefect/` task cache records, `probe/`
the objects of the start's check of conditional writes (each deleted by the check that wrote it).

A store is checked before it is trusted (`Store.probe`, at a run's start): reachable and writable, and, unless
the config turns the lease off (`store.lease: off`), honouring the two conditional writes the lease relies on, a
create-if-absent refused when the object is there and a replace-if-match refused on a stale version (some
S3-compatible services ignore the headers or accept If-Match on a missing key), with a clock of its own.
Credentials come only from boto3's standard chain; messages name keys and URLs, never request details.
"""
from __future__ import annotations

import email.utils
import fcntl
import hashlib
import os
import shutil
import socket
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from phase1a.core.atomic import atomic_path, write_atomically
from phase1a.core.logs import run_logger

PROBE_PREFIX = "probe/"


class StoreConflict(Exception):
    """A conditional write lost: the object exists (if-absent) or is not the version the writer read (if-match)."""


class StoreUnsafe(RuntimeError):
    """The store does not honour what the lease relies on (conditional writes, a clock of its own); the message
    says what it did and what to do."""


@dataclass(frozen=True)
class Fetched:
    """A small object as read: its bytes, its version, when it was last written and the store's time of the read
    (both by the store's clock; `store_time` None where the store gave none: an S3 answer without a Date)."""

    data: bytes
    etag: str
    modified: datetime
    store_time: datetime | None

    @property
    def age_seconds(self) -> float:
        """Since the last write, by the store's clock alone: a host's own clock may be skewed against it."""
        if self.store_time is None:
            raise StoreUnsafe("the store sent no time of its own with the object (no Date header), so its age is "
                              "unknown; the start's check of the store (Store.probe) refuses such a store")
        return (self.store_time - self.modified).total_seconds()


@dataclass(frozen=True)
class Listed:
    key: str  # relative to the store's root
    size: int


class Store(ABC):
    """Keys are '/'-separated, relative to the store's root; `where(key)` is the full location for messages."""

    url: str
    # Whether the probe checks what a training run's lease needs (config store.lease).
    lease: bool = True

    def where(self, key: str) -> str:
        return self.url + key

    @property
    @abstractmethod
    def service(self) -> str:
        """What answers for the store, for messages: the S3 endpoint or the file system."""

    def probe(self) -> None:
        """Fail now, naming the store and what is wrong, when it cannot be used (no such bucket, no access, a
        directory that cannot be written) or, with the lease on, cannot keep two hosts out of one training run."""
        self._reachable()
        if not self.lease:
            run_logger().warning(f"store {self.url}: store.lease is off, so the store was not checked for the "
                                 "conditional writes a training run's lease relies on; if it ignores them, nothing "
                                 "keeps two hosts out of one training run (both would write its checkpoints)")
            return
        check_conditional_writes(self)

    @abstractmethod
    def _reachable(self) -> None:
        """The store exists and this host may write to it."""

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


def check_conditional_writes(store: Store) -> None:
    """The writes the lease relies on, tried under `probe/` on objects of this check's own (deleted after): a
    create-if-absent accepted on a new key and refused once it exists; a replace-if-match accepted over the
    version read, refused over a version replaced since and refused on a missing key; and a read that carries
    the store's own time. StoreUnsafe names what the service did instead and what to do."""
    token = uuid.uuid4().hex
    key, missing = f"{PROBE_PREFIX}{token}.json", f"{PROBE_PREFIX}{token}-never-written.json"
    # Every write carries its own bytes: S3Store.put takes a refused write whose bytes are already there as its
    # own (a retried PUT), which would hide a refusal here.
    steps: list[tuple[str, bool, dict]] = [
        ("a create-if-absent (If-None-Match: *) of a new key", True, {"if_absent": True}),
        ("a create-if-absent (If-None-Match: *) over an object that exists", False, {"if_absent": True}),
        ("a replace-if-match (If-Match) over the version just read", True, {"if_match": "current"}),
        ("a replace-if-match (If-Match) over a version replaced since", False, {"if_match": "stale"}),
    ]
    versions: list[str] = []
    try:
        for number, (what, accept, condition) in enumerate(steps):
            if "if_match" in condition:
                condition = {"if_match": versions[-1] if condition["if_match"] == "current" else versions[0]}
            outcome = _attempt(store, key, f"probe {token} write {number}".encode(), condition)
            if isinstance(outcome, str):
                versions.append(outcome)
            _judge(store, what, accept, outcome)
        what = "a replace-if-match (If-Match) on a key that does not exist"
        _judge(store, what, False, _attempt(store, missing, b"never", {"if_match": versions[-1]}))
        read = store.get(key)
        if read is None or read.data != f"probe {token} write 2".encode():
            raise _unsafe(store, "an object written under conditions did not read back as its last accepted write")
        if read.store_time is None:
            raise _unsafe(store, "its answers carry no time of its own (no HTTP Date header), and a lease ages by "
                                 "the store's clock, never a host's")
    finally:
        store.delete([key, missing])


def _attempt(store: Store, key: str, data: bytes, condition: dict) -> str | StoreConflict | Exception:
    try:
        return store.put(key, data, **condition)
    except StoreConflict as refused:
        return refused
    except (OSError, ValueError) as error:  # S3Error is a ValueError: the service refused the request itself
        return error


def _judge(store: Store, what: str, accept: bool, outcome: str | Exception) -> None:
    if accept and not isinstance(outcome, str):
        detail = "refused it as a conflict" if isinstance(outcome, StoreConflict) else f"failed it ({outcome})"
        raise _unsafe(store, f"{what} was to be accepted, and the service {detail}")
    if not accept and not isinstance(outcome, StoreConflict):
        did = "accepted it" if isinstance(outcome, str) else f"failed it otherwise than as a conflict ({outcome})"
        raise _unsafe(store, f"{what} was to be refused, and the service {did}")


def _unsafe(store: Store, behaviour: str) -> StoreUnsafe:
    return StoreUnsafe(
        f"store {store.url}: {store.service} does not honour the conditional writes a training run's lease relies "
        f"on: {behaviour}. With it, two hosts on one training run could both train into it. Use a service that "
        "honours If-None-Match: * and If-Match on PUT (AWS S3 does), or a directory on a network mount that every "
        "host mounts (store: /mnt/...), or set store.lease: off if only one host ever runs a job at a time (then "
        "nothing keeps a second host out: both would write the run's checkpoints)")


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

    @property
    def service(self) -> str:
        return f"the file system at {self.root}"

    def _reachable(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise OSError(f"store {self.url}: cannot be created ({error.strerror})") from None
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise OSError(f"store {self.url}: not writable by this user")

    def probe(self) -> None:
        super().probe()
        if self.lease and (local := local_only_locks(self.root, _read_mounts())):
            raise _unsafe(self, f"it is an NFS mount whose locks stay on each host ({local}), so the lock of a "
                                "conditional write keeps out this host's processes only; mount it without "
                                "nolock or local_lock")

    def now(self) -> datetime:
        """The mount's time: a file of this host's touched and its time read back, which a network file system
        sets by its server's clock. Every host reads one clock so, whatever its own says."""
        path = self.root / f".clock-{socket.gethostname()}-{os.getuid()}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.utime(fd)  # no times given: "now" by the file system (NFS: SET_TO_SERVER_TIME)
            return _utc(os.fstat(fd).st_mtime)
        finally:
            os.close(fd)

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
        return Fetched(data, content_version(data), _utc(modified), self.now())

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


def http_date(headers: dict[str, Any]) -> datetime | None:
    """The `Date` of an HTTP answer (the server's clock); None without one, never this host's clock."""
    raw = headers.get("date")
    try:
        return email.utils.parsedate_to_datetime(raw).astimezone(timezone.utc) if raw else None
    except (TypeError, ValueError):
        return None


def _read_mounts() -> str:
    try:
        return Path("/proc/self/mounts").read_text()
    except OSError:  # not Linux: nothing to say about the mount
        return ""


def local_only_locks(path: Path, mounts: str) -> str | None:
    """The mount option that makes flock local to each host on the NFS mount holding `path` (`nolock`,
    `local_lock=flock` or `local_lock=all`, as /proc/self/mounts lists them), or None."""
    path, best = Path(path).resolve(), None
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        point = Path(fields[1].replace("\\040", " "))
        if path.is_relative_to(point) and (best is None or len(point.parts) > len(best[0].parts)):
            best = (point, fields[2], fields[3].split(","))
    if best is None or not best[1].startswith("nfs"):
        return None
    found = [option for option in best[2] if option in ("nolock", "local_lock=flock", "local_lock=all")]
    return found[0] if found else None
