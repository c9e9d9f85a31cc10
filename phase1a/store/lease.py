"""A lease in the store (phase1a/store/base.py) on one training run, so that two hosts never train into its directory
at once: the flock of phase1a/core/locks.py holds on one host only.

    acquire   write the lease only if there is none (If-None-Match: *); a lease there that its holder has not
              renewed for `ttl` by the store's clock (its host is gone) is taken over, written only over the
              version read (If-Match), so of two hosts taking over one wins; a live one is waited for (and the
              wait said, naming the holder), at most `wait` seconds, then LeaseHeld names the holder
    renew     every ttl/3 and at each checkpoint the holder commits, only over this holder's own version; the
              record carries the step trained so far, so a host that takes over knows how much work was lost at
              least (what the holder trained after its last renewal, the store cannot know)
    valid     the holder writes to the store only within ttl/2 of its last confirmed renewal (by its own clock,
              from the moment the renewal was sent), while a taker waits a whole ttl since the last write (by the
              store's): the two never write at once, whatever the network did in between, unless the holder is
              paused between its check and its write (SIGSTOP, a frozen VM, a long GC), which no clock sees
    release   the lease is deleted when the run ends, so a waiting host goes on at once (after one last renewal
              confirmed it is still this holder's)
    epoch     each acquisition's number, one more than the lease it took over (or than the store's pointer says,
              on a free lease): the training run names the files it writes by it and fences its commits with a
              conditional write (phase1a/train/train_store.py), so that a paused host that wakes up believing it
              still holds the lease cannot commit over the host that took it
"""
from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable
from datetime import datetime, timezone

from pydantic import BaseModel, Field, ValidationError

from phase1a.core.locks import describe_holder, holder
from phase1a.core.logs import run_logger
from phase1a.store.base import Fetched, Store, StoreConflict


class LeaseRecord(BaseModel):
    token: str = Field(default_factory=lambda: uuid.uuid4().hex)  # one acquisition's
    epoch: int = 0  # one acquisition's number, increasing along the run's holders (0: a lease before epochs)
    holder: dict = Field(default_factory=holder)  # pid, host, flow run, since
    renewed_at: datetime = Field(default_factory=lambda: datetime.now(timezone.utc))  # by the holder's clock
    step: int | None = None  # the last step the holder had trained at its last renewal


class LeaseHeld(RuntimeError):
    """Another host holds the lease and renews it; the message names it."""


class LeaseLost(RuntimeError):
    """This host's lease was taken over (it could not renew it for too long, or another host's commit fenced it
    off); it must not write any more."""


class Lease:
    def __init__(self, store: Store, key: str, ttl: float, wait: float | None,
                 progress: Callable[[], int | None] = lambda: None, floor: Callable[[], int] = lambda: 0) -> None:
        """`floor`: the highest epoch the store knows of besides the lease (a free lease has forgotten its last
        holder's): an acquisition of a free lease takes the next."""
        self.store, self.key, self.ttl, self.wait, self.progress, self.floor = store, key, ttl, wait, progress, floor
        self.record = LeaseRecord()
        self.taken_over: LeaseRecord | None = None  # the stale holder this host took the lease from
        self.taken_over_silent_seconds: float | None = None  # how long its lease had gone unrenewed (store's clock)
        self.waited_seconds = 0.0
        self.lost = threading.Event()
        self.lost_why: str | None = None
        self._etag: str | None = None
        self._confirmed = 0.0  # monotonic time the last successful write was sent
        self._writing = threading.RLock()  # the renewal thread and a commit's renewal write one version at a time
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def where(self) -> str:
        return self.store.where(self.key)

    # ---- acquire -------------------------------------------------------------------------------------------

    def acquire(self) -> "Lease":
        started, said = time.monotonic(), False
        while True:
            current = self.store.get(self.key)
            if current is None:
                self.record.epoch = self.floor() + 1
                if self._write(if_absent=True):
                    break
            if current is not None:
                other, age = _parse(current), current.age_seconds
                if age > self.ttl:
                    self.record.epoch = max(other.epoch if other else 0, self.floor()) + 1
                    if self._write(if_match=current.etag):
                        self.taken_over, self.taken_over_silent_seconds = other, age
                        break
                waited = time.monotonic() - started
                if self.wait is not None and waited >= self.wait:
                    raise LeaseHeld(self._held_message(other, current, f"gave up after {waited:.0f} s "
                                                                       f"(store.lease_wait)"))
                if not said:
                    run_logger().warning(self._held_message(other, current, "waiting for it to finish or to stop "
                                                                            "renewing it"))
                    said = True
            # A waiting host idles its GPU: a GET every 2 s costs nothing beside the seconds it saves.
            time.sleep(max(0.05, min(self.ttl / 3, 2.0)))
        self.waited_seconds = time.monotonic() - started
        if self.taken_over is not None:
            run_logger().warning(f"{self.where}: took the lease over from {describe_holder(self.taken_over.holder)}, "
                                 f"which stopped renewing it (step {self.taken_over.step})")
        return self

    def _held_message(self, other: LeaseRecord | None, current: Fetched, what: str) -> str:
        who = describe_holder(other.holder) if other else "an unreadable lease"
        return (f"training run {self.where.removesuffix('/lease.json')} is held by {who}, renewed "
                f"{current.age_seconds:.0f} s ago (it expires {self.ttl:.0f} s after its last renewal); {what}")

    def _write(self, *, if_absent: bool = False, if_match: str | None = None) -> bool:
        with self._writing:
            sent = time.monotonic()
            self.record.renewed_at, self.record.step = datetime.now(timezone.utc), self.progress()
            try:
                self._etag = self.store.put(self.key, self.record.model_dump_json().encode(), if_absent=if_absent,
                                            if_match=if_match)
            except StoreConflict:
                return False
            self._confirmed = sent
            return True

    def _renew(self) -> bool:
        """A renewal over this holder's own version, read under the write lock (a commit's renewal and the
        thread's never race each other's version). A refusal is a takeover only when the lease in the store is
        another acquisition's (then the lease is lost): a renewal whose answer was lost after it landed left this
        holder's own record there under a version it never saw, which is adopted."""
        with self._writing:
            if self._write(if_match=self._etag):
                return True
            current = self.store.get(self.key)
            record = None if current is None else _parse(current)
            if record is not None and record.token == self.record.token and self._write(if_match=current.etag):
                return True
        self.lose(f"{self.where}: the lease was taken over by another host; this run stops writing to the store")
        return False

    # ---- hold ----------------------------------------------------------------------------------------------

    def __enter__(self) -> "Lease":
        self.acquire()
        self._thread = threading.Thread(target=self._renew_loop, name="lease-renewal", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.valid():
            try:
                # A delete is not conditional: a renewal over this holder's own version first, so that a host
                # paused since its last renewal does not delete the lease another host took meanwhile.
                if self._renew():
                    self.store.delete([self.key])
            except Exception as error:  # noqa: BLE001 - it expires by itself; the run's own outcome matters more
                run_logger().warning(f"{self.where}: the lease was not released ({type(error).__name__}); it "
                                     f"expires {self.ttl:.0f} s after its last renewal")

    def valid(self) -> bool:
        """Whether this host may still write: the lease not lost, and confirmed within ttl/2."""
        return not self.lost.is_set() and time.monotonic() - self._confirmed < self.ttl / 2

    def in_store(self) -> LeaseRecord | None:
        """The lease as the store has it now: None when there is none, or it cannot be read."""
        fetched = self.store.get(self.key)
        return None if fetched is None else _parse(fetched)

    def renew(self) -> None:
        """A renewal now, between the regular ones (a checkpoint was committed: the step it carries is the work a
        host taking over knows was done); a lost lease is noted, a store out of reach is the next renewal's."""
        if self.lost.is_set():
            return
        try:
            self._renew()
        except Exception:  # noqa: BLE001 - the regular renewals go on; valid() runs out if they fail too
            pass

    def lose(self, why: str) -> None:
        """The lease is gone (a renewal or a commit refused): said once, and nothing more is written."""
        with self._writing:
            if self.lost.is_set():
                return
            self.lost_why = why
            self.lost.set()
        run_logger().error(why)

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            if self.lost.is_set():
                return
            try:
                if not self._renew():
                    return
            except Exception as error:  # noqa: BLE001 - the store unreachable for now: valid() runs out meanwhile
                run_logger().warning(f"{self.where}: the lease was not renewed ({type(error).__name__}); trying "
                                     f"again in {self.ttl / 3:.0f} s")


def _parse(fetched: Fetched) -> LeaseRecord | None:
    try:
        return LeaseRecord.model_validate(json.loads(fetched.data))
    except (ValidationError, ValueError):
        return None
