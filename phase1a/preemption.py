"""Preemption: SIGTERM (a spot instance reclaimed, `kill`, a Prefect cancellation) or SIGINT (Ctrl-C) asks the
training loop to stop. The loop finishes the optimizer step it is in, writes a checkpoint and raises
`Preempted`; the next run of the same job resumes from that step. A second signal while the checkpoint is
being written takes the old, immediate behaviour: someone really wants the process gone.
"""
from __future__ import annotations

import signal
import threading


class Preempted(RuntimeError):
    def __init__(self, signal_name: str, step: int, checkpoint: str):
        super().__init__(f"stopped by {signal_name} after step {step}; checkpoint {checkpoint} written, "
                         f"the next run of this job resumes from it")
        self.signal_name, self.step, self.checkpoint = signal_name, step, checkpoint


class StopSignals:
    """Within the block, SIGTERM and SIGINT set `requested` instead of killing the process."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.requested: str | None = None
        self._previous: dict[int, object] = {}

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
        if self.requested is not None:  # the second signal: stop waiting for the checkpoint
            signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))
            signal.raise_signal(signum)
            return
        self.requested = signal.Signals(signum).name
