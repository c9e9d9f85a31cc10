"""A training run's directory in the store (`jobs/<name>/train-<key>/`), so that a fresh host resumes it:

    lease.json                 who trains it now (phase1a/store/lease.py)
    checkpoints/step-N/        complete local checkpoints, each a bundle (phase1a/store/bundles.py), uploaded in the
                               background while training goes on; the run's curves and its best weights so far
                               travel inside (`run/`), so a resume on another host has the same bookkeeping
    latest.json                the newest checkpoint whose upload finished and was verified, written last and
                               only over the pointer this host last wrote: a torn upload is never the one taken
    final/                     the finished adapter (a bundle): another host reuses it as it would a local one

`pull` brings to an empty local directory what the store has (the final adapter, or the latest checkpoint,
verified; a corrupt one makes way for the one before it); `CheckpointMirror` uploads what training writes.
"""
from __future__ import annotations

import json
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import BaseModel

from phase1a.core import layout
from phase1a.core.atomic import remove
from phase1a.core.logs import run_logger
from phase1a.store.base import Store, StoreConflict
from phase1a.store.bundles import BundleCorrupt, delete_bundle, download_bundle, read_bundle, upload_bundle
from phase1a.store.lease import Lease
from phase1a.train import run_files
from phase1a.train.checkpoints import MARKER, RUN_FILES, checkpoint_step, list_checkpoints


class Pulled(BaseModel):
    """What a training run took from the store before it trained (phase1a/train/train_store.py)."""

    what: Literal["final", "checkpoint", "nothing"]
    step: int | None = None  # the checkpoint's
    corrupt: list[str] = []  # what was found unusable and passed over
    bytes: int = 0
    seconds: float = 0.0


POINTER = "latest.json"


def job_prefix(name: str) -> str:
    """A job's place in the store, as `work_dir/<name>/` is its place on local disk."""
    return f"jobs/{name}/"


class RemoteRun:
    def __init__(self, store: Store, prefix: str) -> None:
        self.store, self.prefix = store, prefix.rstrip("/") + "/"
        self.pointer_etag: str | None = None  # the version of latest.json this host last read or wrote

    @property
    def location(self) -> str:
        return self.store.where(self.prefix)

    def lease(self, ttl: float, wait: float | None, output_dir: Path) -> Lease:
        return Lease(self.store, self.prefix + "lease.json", ttl, wait,
                     progress=lambda: run_files.last_step(Path(output_dir) / layout.METRICS))

    # ---- pull ----------------------------------------------------------------------------------------------

    def pull(self, output_dir: Path) -> Pulled:
        """The final adapter when the store has it; else the latest checkpoint when it is newer than the local
        one (with its curves and best weights); else nothing."""
        output_dir, started = Path(output_dir), time.perf_counter()
        if (output_dir / layout.FINAL / MARKER).is_file():
            return Pulled(what="nothing")
        corrupt: list[str] = []
        final = self._usable(f"{self.prefix}{layout.FINAL}/", output_dir / layout.FINAL, corrupt)
        if final is not None:
            return Pulled(what="final", corrupt=corrupt, bytes=final, seconds=time.perf_counter() - started)
        local = list_checkpoints(output_dir / "checkpoints")
        newer_than = checkpoint_step(local[-1]) if local else -1
        for step in self._remote_steps():
            if step <= newer_than:
                break
            checkpoint = output_dir / "checkpoints" / f"step-{step:08d}"
            size = self._usable(f"{self.prefix}checkpoints/step-{step:08d}/", checkpoint, corrupt)
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

    def _remote_steps(self) -> list[int]:
        """The checkpoints the store may hold, newest first: the pointer's, then any other with a manifest."""
        pointer = self.store.get(self.prefix + POINTER)
        steps = set()
        if pointer is not None:
            self.pointer_etag = pointer.etag
            try:
                steps.add(int(json.loads(pointer.data)["step"]))
            except (ValueError, KeyError, TypeError):
                pass
        steps |= {step for step, complete in self._listed().items() if complete}
        return sorted(steps, reverse=True)

    def _listed(self) -> dict[int, bool]:
        """Every checkpoint step under `checkpoints/`, and whether it has its manifest."""
        found: dict[int, bool] = {}
        for item in self.store.list(self.prefix + "checkpoints/"):
            directory, _, name = item.key.removeprefix(self.prefix + "checkpoints/").partition("/")
            if directory.startswith("step-") and directory[5:].isdigit():
                step = int(directory[5:])
                found[step] = found.get(step, False) or name == "manifest.json"
        return found

    # ---- push ----------------------------------------------------------------------------------------------

    def push_checkpoint(self, snapshot: Path, step: int, keep_last: int) -> None:
        """A checkpoint's files, then its manifest, then the pointer (only over the version this host last
        saw), then the checkpoints beyond `keep_last` go, the oldest first."""
        upload_bundle(self.store, snapshot, f"{self.prefix}checkpoints/step-{step:08d}/", meta={"step": step})
        body = json.dumps({"step": step, "checkpoint": f"checkpoints/step-{step:08d}/"}).encode()
        self.pointer_etag = self.store.put(self.prefix + POINTER, body, if_absent=self.pointer_etag is None,
                                           if_match=self.pointer_etag)
        listed = self._listed()
        complete = sorted(s for s, has_manifest in listed.items() if has_manifest)
        stale = [s for s in listed if s < step and (s not in complete or s not in complete[-keep_last:])]
        for old in sorted(stale):
            delete_bundle(self.store, f"{self.prefix}checkpoints/step-{old:08d}/")

    def push_final(self, final_dir: Path) -> bool:
        """The finished adapter, unless the store has it already (this run came from it, or uploaded it before);
        whether it was uploaded now."""
        if read_bundle(self.store, f"{self.prefix}{layout.FINAL}/") is not None:
            return False
        upload_bundle(self.store, final_dir, f"{self.prefix}{layout.FINAL}/")
        return True


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
    only, when training writes them faster than they upload. Nothing is written once the lease is not valid."""

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
        while time.monotonic() < deadline:
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

    def _upload_newest(self) -> None:
        newest = self._newest()
        if newest is None or checkpoint_step(newest) == self.uploaded_step:
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
        except StoreConflict:
            self._failed(newest, "the pointer was moved by another host")
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
