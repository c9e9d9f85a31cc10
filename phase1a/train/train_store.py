"""A training run's directory in the store (`jobs/<name>/train-<key>/`), so that a fresh host resumes it:

    lease.json                 who trains it now (phase1a/store/lease.py)
    latest.json                the pointer: the newest committed checkpoint (`step`, `checkpoint`), the finished
                               adapter once there is one (`final`), and the holder that last wrote it (`epoch`,
                               `token`, `holder`)
    eE-T/                      what the holder of lease epoch E (token T...) wrote: names no other holder writes
      checkpoints/step-N/      complete local checkpoints, each a bundle (phase1a/store/bundles.py), uploaded in the
                               background while training goes on; the run's curves and its best weights so far
                               travel inside (`run/`), so a resume on another host has the same bookkeeping
      final/                   the finished adapter (a bundle): another host reuses it as it would a local one

Stores written before fencing have `checkpoints/step-N/` and `final/` at the top; both are still read.

The pointer is where every write of a holder counts, and a holder writes it only over the version it last saw
(If-Match). Right after it acquires the lease a holder *claims* it (rewrites it with its own epoch and token),
so a holder that lost the lease without knowing it (paused past its expiry, or cut off from the store) can no
longer commit: a checkpoint or the final adapter counts once the pointer names it, files are uploaded to names
no other holder writes, and old checkpoints are pruned only after this holder's own commit, never the one the
pointer names, nothing newer and nothing of a later holder. A refused commit whose pointer another holder now
owns is the lease lost, said once, and nothing more is written; any other refusal (a retried PUT that had
landed, a predecessor's late write) refreshes what this host knows and commits again while it holds the lease.

`pull` brings to an empty local directory what the pointer names (the final adapter, or the checkpoint,
verified; a corrupt one makes way for the complete one before it); `CheckpointMirror` uploads what training
writes.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import BaseModel

from phase1a.core import layout
from phase1a.core.atomic import remove
from phase1a.core.layout import MARKER, RUN_FILES, checkpoint_step, list_checkpoints
from phase1a.core.locks import describe_holder
from phase1a.core.logs import run_logger
from phase1a.store.base import Fetched, Store, StoreConflict
from phase1a.store.bundles import BundleCorrupt, delete_bundle, download_bundle, read_bundle, upload_bundle
from phase1a.store.lease import Lease, LeaseLost
from phase1a.train import run_files


class Pulled(BaseModel):
    """What a training run took from the store before it trained (phase1a/train/train_store.py)."""

    what: Literal["final", "checkpoint", "nothing"]
    step: int | None = None  # the checkpoint's
    corrupt: list[str] = []  # what was found unusable and passed over
    bytes: int = 0
    seconds: float = 0.0


POINTER = "latest.json"
_CHECKPOINT = re.compile(r"(?:e(\d+)-([0-9a-f]+)/)?checkpoints/step-(\d+)/(.+)")
_TRIES = 5  # commits of one write after refusals that were not a lost lease: each refreshes what the host knows


class NotCommitted(RuntimeError):
    """A write this host did not make, and may make later: its lease not confirmed lately (the store out of reach
    for a while); the lease may come back."""


@dataclass(frozen=True)
class RemoteCheckpoint:
    directory: str  # relative to the run's prefix, '/' at the end
    step: int
    epoch: int  # its writer's lease epoch; 0 for a name from before fencing (`step-N/`)
    tag: str  # the start of its writer's lease token; '' before fencing
    complete: bool  # its manifest is there


def job_prefix(name: str) -> str:
    """A job's place in the store, as `work_dir/<name>/` is its place on local disk."""
    return f"jobs/{name}/"


class RemoteRun:
    def __init__(self, store: Store, prefix: str) -> None:
        self.store, self.prefix = store, prefix.rstrip("/") + "/"
        self.pointer_etag: str | None = None  # the version of latest.json this host last read or wrote
        self.pointer: dict = {}  # its content, as this host last read or wrote it
        self.held: Lease | None = None  # the lease this host's writes are fenced by (claim)
        self._pointer_read = False
        self._pointer_unreadable = False  # then any complete checkpoint may be the latest, as before the pointer
        self.fenced: str | None = None  # why this host writes nothing more: a commit found the lease lost

    @property
    def location(self) -> str:
        return self.store.where(self.prefix)

    def lease(self, ttl: float, wait: float | None, output_dir: Path) -> Lease:
        return Lease(self.store, self.prefix + "lease.json", ttl, wait,
                     progress=lambda: run_files.last_step(Path(output_dir) / layout.METRICS),
                     floor=lambda: int(_pointer_content(self.store.get(self.prefix + POINTER)).get("epoch") or 0))

    # ---- claim ---------------------------------------------------------------------------------------------

    def claim(self, lease: Lease) -> None:
        """Right after `lease` was acquired: the pointer rewritten with this holder's epoch and token (what it
        names kept), so that a holder that lost the lease cannot commit any more. A pointer that is not there is
        created only by a takeover: a free lease leaves no holder that could still write (a holder loses its
        lease to a takeover, and the taker wrote the pointer)."""
        self.held = lease
        for _ in range(_TRIES):
            fetched, content = self._read_pointer()
            self._fence(content, "its claim of the pointer")
            self._adopt(fetched, content)
            if fetched is None and lease.taken_over is None:
                return
            try:
                self._put_pointer({**self._named(), **self._mine()})
                return
            except StoreConflict:
                continue  # a predecessor's last write landed meanwhile: read again
        raise RuntimeError(f"{self.store.where(self.prefix + POINTER)}: moved {_TRIES} times while this host "
                           "claimed it after acquiring the lease")

    def _named(self) -> dict:
        """What the pointer names, without who wrote it."""
        return {key: self.pointer[key] for key in ("step", "checkpoint", "final") if key in self.pointer}

    def _mine(self) -> dict:
        if self.held is None:
            return {}
        record = self.held.record
        return {"epoch": record.epoch, "token": record.token, "holder": record.holder}

    def _own(self) -> str:
        """This holder's directory in the run's: no other holder writes under it ('' without a lease)."""
        if self.held is None:
            return ""
        return f"e{self.held.record.epoch}-{self.held.record.token[:8]}/"

    def _read_pointer(self) -> tuple[Fetched | None, dict]:
        """The pointer as the store has it now, and its content ({} when there is none or it cannot be read)."""
        fetched = self.store.get(self.prefix + POINTER)
        content = _pointer_content(fetched)
        return fetched, {} if content.get("unreadable") else content

    def _adopt(self, fetched: Fetched | None, content: dict) -> None:
        """What this host knows of the pointer, from a read: only once the read showed no later holder's."""
        self.pointer_etag, self.pointer = (None if fetched is None else fetched.etag), content
        self._pointer_unreadable = fetched is not None and _pointer_content(fetched).get("unreadable", False)
        self._pointer_read = True

    def _put_pointer(self, body: dict) -> None:
        self.pointer_etag = self.store.put(self.prefix + POINTER, _encode(body), if_absent=self.pointer_etag is None,
                                           if_match=self.pointer_etag)
        self.pointer = body

    # ---- commit --------------------------------------------------------------------------------------------

    def _guard(self, what: str) -> None:
        """Before each write: nothing once the lease is lost, nor while it is not confirmed (valid())."""
        if self.fenced is not None:
            raise LeaseLost(f"{self.fenced}; {what} not written")
        if self.held is None:
            return
        if self.held.lost.is_set():
            raise LeaseLost(f"{self.held.lost_why or self.location + ': the lease was lost'}; {what} not written")
        if not self.held.valid():
            raise NotCommitted(f"the lease was not confirmed in the last {self.held.ttl / 2:.0f} s: {what} not "
                               "written")

    def _commit(self, what: str, update: dict) -> None:
        """The pointer to name `update` (a checkpoint, the final adapter), over the version this host last saw.
        Refused, the pointer is read again: another holder's is the lease lost (LeaseLost); this holder's own (a
        retried PUT), a predecessor's or none refresh what this host knows, and the commit is made again."""
        for _ in range(_TRIES):
            self._guard(what)
            body = {**self._named(), **update, **self._mine()}
            try:
                self._put_pointer(body)
                return
            except StoreConflict:
                fetched, content = self._read_pointer()
                if fetched is not None and fetched.data == _encode(body):
                    self._adopt(fetched, content)
                    return  # the write had landed (a retried request): committed
                self._fence(content, what)
                self._adopt(fetched, content)
                run_logger().warning(f"{self.store.where(self.prefix + POINTER)}: not the version this host last "
                                     f"saw (written by {_who(self.pointer)}); read again, {what} committed over it")
        raise NotCommitted(f"{self.store.where(self.prefix + POINTER)}: moved {_TRIES} times: {what} not committed")

    def _fence(self, current: dict, what: str) -> None:
        """LeaseLost when the pointer as read now is another holder's, one that came after this one: a later
        epoch, or the lease in the store not this holder's any more. Then this host writes nothing more."""
        if self.held is None or current.get("token") == self.held.record.token:
            return
        mine = self.held.record
        if int(current.get("epoch") or 0) > mine.epoch:
            who = _who(current)
        else:
            in_store = self.held.in_store()
            if in_store is not None and in_store.token == mine.token:
                return  # still this holder's lease: the pointer was a predecessor's, or deleted
            who = describe_holder(in_store.holder) if in_store is not None else "another host (the lease is not there)"
        self.fenced = f"{self.location}: lease lost to {who}: {what} not committed"
        raise LeaseLost(self.fenced)

    # ---- pull ----------------------------------------------------------------------------------------------

    def pull(self, output_dir: Path) -> Pulled:
        """The final adapter when the pointer names one; else the pointer's checkpoint when it is newer than the
        local one (with its curves and best weights), or the complete one before it when it is corrupt; else
        nothing."""
        output_dir, started = Path(output_dir), time.perf_counter()
        if (output_dir / layout.FINAL / MARKER).is_file():
            return Pulled(what="nothing")
        if not self._pointer_read:
            self._adopt(*self._read_pointer())
        corrupt: list[str] = []
        finals = [self.pointer["final"]] if self.pointer.get("final") else []
        for prefix in [*finals, f"{layout.FINAL}/"]:  # final/: a store written before fencing
            final = self._usable(self.prefix + prefix, output_dir / layout.FINAL, corrupt)
            if final is not None:
                return Pulled(what="final", corrupt=corrupt, bytes=final, seconds=time.perf_counter() - started)
        local = list_checkpoints(output_dir / "checkpoints")
        newer_than = checkpoint_step(local[-1]) if local else -1
        for step, directory in self._candidates():
            if step <= newer_than:
                break
            checkpoint = output_dir / "checkpoints" / f"step-{step:08d}"
            size = self._usable(self.prefix + directory, checkpoint, corrupt)
            if size is not None:
                install_run_files(checkpoint, output_dir)
                return Pulled(what="checkpoint", step=step, corrupt=corrupt, bytes=size,
                              seconds=time.perf_counter() - started)
        return Pulled(what="nothing", corrupt=corrupt)

    def _usable(self, prefix: str, destination: Path, corrupt: list[str]) -> int | None:
        """Download the bundle at `prefix`; its size, or None when there is none or it is corrupt (noted)."""
        try:
            bundle = read_bundle(self.store, prefix)
            if bundle is None:
                return None
            download_bundle(self.store, prefix, destination, bundle)
        except BundleCorrupt as error:
            corrupt.append(str(error))
            run_logger().warning(f"{error}: not used")
            return None
        return bundle.size

    def _candidates(self) -> list[tuple[int, str]]:
        """The checkpoints a resume may take, newest first: the pointer's, then the complete ones before it (a
        checkpoint newer than the pointer was never committed: a cut-off upload, or a holder that had lost the
        lease). With no pointer nothing was committed; with one that cannot be read, every complete one."""
        complete = sorted((item for item in self._listed() if item.complete), key=lambda item: (item.step, item.epoch),
                          reverse=True)
        if self._pointer_unreadable:
            return [(item.step, item.directory) for item in complete]
        step = self.pointer.get("step")
        if not isinstance(step, int):
            return []
        named = self.pointer.get("checkpoint") or f"checkpoints/step-{step:08d}/"
        return [(step, named)] + [(item.step, item.directory) for item in complete
                                  if item.step < step and item.directory != named]

    def _listed(self) -> list[RemoteCheckpoint]:
        """Every checkpoint directory in the run's (each holder's, and the top one of a store from before
        fencing), and whether it has its manifest."""
        found: dict[str, tuple[int, int, str, bool]] = {}
        for item in self.store.list(self.prefix):
            match = _CHECKPOINT.fullmatch(item.key.removeprefix(self.prefix))
            if match:
                directory = item.key.removeprefix(self.prefix)[:-len(match[4])]
                complete = (directory in found and found[directory][3]) or match[4] == "manifest.json"
                found[directory] = (int(match[3]), int(match[1] or 0), match[2] or "", complete)
        return [RemoteCheckpoint(directory, *facts) for directory, facts in found.items()]

    # ---- push ----------------------------------------------------------------------------------------------

    def push_checkpoint(self, snapshot: Path, step: int, keep_last: int) -> None:
        """A checkpoint's files, then its manifest, under this holder's own name; then the commit (the pointer,
        only over the version this host last saw); then a renewal of the lease (the step reached, for a host
        that takes over); then the checkpoints beyond `keep_last` go, the oldest first."""
        what = f"checkpoint step {step}"
        directory = f"{self._own()}checkpoints/step-{step:08d}/"
        upload_bundle(self.store, snapshot, self.prefix + directory, meta={"step": step},
                      guard=lambda: self._guard(what))
        self._commit(what, {"step": step, "checkpoint": directory})
        if self.held is not None:
            self.held.renew()
        self._prune(step, directory, keep_last)

    def _prune(self, step: int, committed: str, keep_last: int) -> None:
        """After this holder's own commit of `step`, under a lease it still holds: the complete checkpoints
        beyond `keep_last` and the incomplete ones before `step` go; never the one committed, nothing at `step`
        or newer, nothing of a later holder (a higher epoch, or this epoch under another token)."""
        if self.held is not None and (self.held.lost.is_set() or not self.held.valid()):
            return
        listed = self._listed()
        complete = sorted((item for item in listed if item.complete and item.step <= step),
                          key=lambda item: (item.step, item.epoch))
        kept = {committed} | {item.directory for item in complete[-keep_last:]}
        mine = self.held.record if self.held is not None else None
        for item in sorted(listed, key=lambda item: (item.step, item.epoch)):
            earlier_holder = mine is None or item.epoch < mine.epoch or (item.epoch == mine.epoch
                                                                          and item.tag == mine.token[:8])
            if item.directory not in kept and item.step < step and earlier_holder:
                delete_bundle(self.store, self.prefix + item.directory)

    def push_final(self, final_dir: Path) -> bool:
        """The finished adapter under this holder's own name, then committed (the pointer names it), unless the
        store has it already (this run came from it, or committed it before); whether it was uploaded now."""
        if self.pointer.get("final") or read_bundle(self.store, f"{self.prefix}{layout.FINAL}/") is not None:
            return False
        what = "the final adapter"
        if self.held is not None:  # a renewal that failed a moment ago (the store out of reach) may succeed next
            deadline = time.monotonic() + self.held.ttl
            while not self.held.valid() and not self.held.lost.is_set() and time.monotonic() < deadline:
                time.sleep(min(1.0, self.held.ttl / 10))
        directory = f"{self._own()}{layout.FINAL}/"
        upload_bundle(self.store, final_dir, self.prefix + directory, guard=lambda: self._guard(what))
        self._commit(what, {"final": directory})
        return True


def _encode(body: dict) -> bytes:
    return json.dumps(body, sort_keys=True).encode()


def _pointer_content(fetched: Fetched | None) -> dict:
    """The pointer's content; {} when there is none, {"unreadable": True} when it cannot be read."""
    if fetched is None:
        return {}
    try:
        content = json.loads(fetched.data)
    except ValueError:
        return {"unreadable": True}
    return content if isinstance(content, dict) else {"unreadable": True}


def _who(pointer: dict) -> str:
    holder = pointer.get("holder")
    return describe_holder(holder) if isinstance(holder, dict) else "a host from before fencing (no holder named)"


def snapshot_of(checkpoint: Path, scratch_root: Path) -> Path:
    """Hard links to a complete checkpoint's files (they never change once written): its upload goes on when
    training deletes the checkpoint to keep `keep_last`."""
    snapshot = scratch_root / checkpoint.name
    remove(snapshot)
    for source in sorted(checkpoint.rglob("*")):
        target = snapshot / source.relative_to(checkpoint)
        if source.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            os.link(source, target)
    return snapshot


def install_run_files(checkpoint: Path, output_dir: Path) -> None:
    """A checkpoint's copy of the run's curves and best weights, put where training keeps them (a resume trims
    the curves back to the checkpoint's step, and keeps the best the checkpoint names)."""
    carried = checkpoint / RUN_FILES
    if not carried.is_dir():
        return
    for source in carried.rglob("*"):
        if source.is_file():
            target = output_dir / source.relative_to(carried)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, target)


@dataclass
class CheckpointMirror:
    """Uploads each new complete local checkpoint in a background thread while training goes on: the newest
    only, when training writes them faster than they upload. Nothing is written while the lease is not valid,
    nor ever again once a commit found it lost."""

    remote: RemoteRun
    output_dir: Path
    keep_last: int
    lease: Lease | None
    poll_seconds: float = 0.2  # a listing of the checkpoints directory: cheap; an upload starts soon after a write
    uploaded_step: int | None = None
    uploads: int = 0
    upload_seconds: float = 0.0
    failures: list[str] = field(default_factory=list)
    _wake: threading.Event = field(default_factory=threading.Event)
    _stop: threading.Event = field(default_factory=threading.Event)
    _idle: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> "CheckpointMirror":
        self._thread = threading.Thread(target=self._loop, name="checkpoint-mirror", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join()
        remove(self._scratch)

    @property
    def _scratch(self) -> Path:
        return self.output_dir / ".mirror"

    def flush(self, timeout: float) -> bool:
        """Upload the newest local checkpoint now; True when it is in the store within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self._lost():
            self._idle.clear()
            self._wake.set()
            if not self._idle.wait(max(0.0, deadline - time.monotonic())):
                return False
            newest = self._newest()
            if newest is None or checkpoint_step(newest) == self.uploaded_step:
                return True
            if self.failures and self.failures[-1].startswith(newest.name):
                return False
        return False

    def _newest(self) -> Path | None:
        checkpoints = list_checkpoints(self.output_dir / "checkpoints")
        return checkpoints[-1] if checkpoints else None

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._upload_newest()
            self._idle.set()
            self._wake.wait(self.poll_seconds)
            self._wake.clear()
        self._idle.set()

    def _lost(self) -> bool:
        return self.lease is not None and self.lease.lost.is_set()

    def _upload_newest(self) -> None:
        newest = self._newest()
        if newest is None or checkpoint_step(newest) == self.uploaded_step or self._lost():
            return
        if self.failures and self.failures[-1].startswith(newest.name):
            return  # tried and failed: the next checkpoint is the next chance
        if self.lease is not None and not self.lease.valid():
            self._failed(newest, "the lease is not held")
            return
        started = time.perf_counter()
        try:
            snapshot = snapshot_of(newest, self._scratch)
            self.remote.push_checkpoint(snapshot, checkpoint_step(newest), self.keep_last)
        except FileNotFoundError:
            return  # training removed it (keep_last) before it could be linked: a newer one is there
        except LeaseLost as lost:  # said once, by the lease; training stops at its next step
            self.failures.append(f"{newest.name}: {lost}")
            if self.lease is not None:
                self.lease.lose(str(lost))
            return
        except NotCommitted as error:
            self._failed(newest, str(error))
            return
        except Exception as error:  # noqa: BLE001 - an upload that failed is retried with the next checkpoint
            self._failed(newest, f"{type(error).__name__}: {error}")
            return
        finally:
            remove(self._scratch)
        self.uploads += 1
        self.upload_seconds += time.perf_counter() - started
        self.uploaded_step = checkpoint_step(newest)

    def _failed(self, checkpoint: Path, why: str) -> None:
        self.failures.append(f"{checkpoint.name}: {why}")
        run_logger().warning(f"{self.remote.location}: checkpoint {checkpoint.name} not uploaded: {why}")
