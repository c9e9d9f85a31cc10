"""Preemption: SIGTERM (a spot instance reclaimed, `kill`, a Prefect cancellation) or SIGINT (Ctrl-C) asks the
training loop to stop. The loop finishes the optimizer step it is in, writes a checkpoint and raises
`Preempted`; the next run of the same job resumes from that step. A second signal while the checkpoint is
being written takes the old, immediate behaviour: someone really wants the process gone.
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


class StopSignals:
    """Within the block, SIGTERM and SIGINT set `requested` instead of killing the process; so does `stop.set()`
    of an event from another thread of this process (a lost lease in the store: phase1a/store/lease.py)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, stop: threading.Event | None = None, reason: str = "a request") -> None:
        self.signalled: str | None = None
        self.at: float | None = None  # time.monotonic() of the first signal
        self._stop, self._reason = stop, reason
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> str | None:
        """What asked training to stop: a signal's name, the event's reason, or None."""
        if self.signalled is None and self._stop is not None and self._stop.is_set():
            return self._reason
        return self.signalled

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
        self.signalled, self.at = signal.Signals(signum).name, time.monotonic()
