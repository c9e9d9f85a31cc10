"""Preemption: SIGTERM (a spot instance reclaimed, `kill`, a Prefect cancellation) or SIGINT (Ctrl-C) asks the
training loop to stop; so does another thread of the process, through a `StopRequest` (the store's lease lost, a
spot notice from the instance's metadata service: phase1a/train/spot_notice.py). The loop finishes the optimizer
step it is in, writes a checkpoint and raises `Preempted`; the next run of the same job resumes from that step. A
second signal while the checkpoint is being written takes the old, immediate behaviour: someone really wants the
process gone.
"""
from __future__ import annotations

import signal
import threading
import time


class Preempted(RuntimeError):
    def __init__(self, signal_name: str, step: int, checkpoint: str, signalled_at: float | None = None):
        super().__init__(f"stopped by {signal_name} after step {step}; checkpoint {checkpoint} written, "
                         f"the next run of this job resumes from it")
        self.signal_name, self.step, self.checkpoint = signal_name, step, checkpoint
        self.signalled_at = signalled_at  # time.monotonic() of the signal: the grace period counts from it


class StopRequest:
    """A stop asked by another thread of this process, as a signal asks it. `set(reason)` from any thread; the
    first reason and its time stay. `event`: an event that thread sets itself (the lease's `lost`), whose time
    is then unknown (the grace period counts from when training sees it)."""

    def __init__(self, reason: str = "a request", event: threading.Event | None = None) -> None:
        self.event = event if event is not None else threading.Event()
        self.reason, self.at = reason, None  # at: time.monotonic() of set()
        self._lock = threading.Lock()

    def set(self, reason: str | None = None) -> None:
        with self._lock:
            if self.event.is_set():
                return
            self.reason, self.at = reason or self.reason, time.monotonic()
            self.event.set()

    @property
    def requested(self) -> str | None:
        return self.reason if self.event.is_set() else None


class StopSignals:
    """Within the block, SIGTERM and SIGINT set `requested` instead of killing the process; so does any of
    `requests` once another thread sets it."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, *requests: StopRequest) -> None:
        self.signalled: str | None = None
        self.signalled_at: float | None = None  # time.monotonic() of the first signal
        self._requests = requests
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> str | None:
        """What asked training to stop: a signal's name, a request's reason, or None."""
        if self.signalled is not None:
            return self.signalled
        return next((request.requested for request in self._requests if request.requested), None)

    @property
    def at(self) -> float | None:
        """time.monotonic() of what asked first, where known."""
        if self.signalled is not None:
            return self.signalled_at
        return next((request.at for request in self._requests if request.requested), None)

    def __enter__(self) -> "StopSignals":
        # Handlers can only be installed from the main thread; elsewhere (a worker thread) signals keep
        # their default action and a stop costs the steps since the last periodic checkpoint.
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)

    def _handle(self, signum: int, frame) -> None:
        if self.signalled is not None:  # the second signal: stop waiting for the checkpoint
            signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))
            signal.raise_signal(signum)
            return
        self.signalled, self.signalled_at = signal.Signals(signum).name, time.monotonic()
