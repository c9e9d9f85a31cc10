"""A run kept in the store (phase1a/train/train_store.py) so that any host can go on with it: the lease, what the
store has, each checkpoint uploaded in the background, the last one within the grace period after a signal, the
finished adapter last; what it did, for the report (StoreTraining)."""
from __future__ import annotations

import time
from pathlib import Path

from phase1a.config.schema import Phase1aConfig
from phase1a.core import layout
from phase1a.core.logs import run_logger
from phase1a.core.units import parse_duration_seconds
from phase1a.store.base import Store
from phase1a.store.lease import LeaseLost
from phase1a.train.preemption import Preempted, StopRequest
from phase1a.train.result import StoreTraining, TrainResult
from phase1a.train.run_files import append_event
from phase1a.train.runner import run
from phase1a.train.settings import TrainSettings
from phase1a.train.train_store import CheckpointMirror, RemoteRun, job_prefix


def run_with_store(settings: TrainSettings, store: Store, config: Phase1aConfig,
                   notice: StopRequest | None = None) -> TrainResult:
    """The same run, kept in the store (phase1a/train/train_store.py) so that any host can go on with it: the lease
    first (one host trains it at a time), then what the store has (the finished adapter, or the latest
    checkpoint), then training with each checkpoint uploaded in the background; on a signal, the last checkpoint
    uploaded within the grace period (a lost lease and `notice`, a spot notice, stop it as a signal does); the
    finished adapter last."""
    output_dir, settings = Path(settings.output_dir), settings.model_copy(update={"carry_run_files": True})
    remote = RemoteRun(store, job_prefix(config.name) + output_dir.name)
    wait = config.store.lease_wait
    lease = remote.lease(parse_duration_seconds(config.store.lease_ttl),
                         None if wait is None else parse_duration_seconds(wait), output_dir)
    with lease:
        remote.claim(lease)  # from here on, a host that lost the lease to this one cannot commit (train_store.py)
        silent = lease.taken_over_silent_seconds
        report = StoreTraining(location=remote.location, pulled=remote.pull(output_dir),
                               lease_waited_seconds=round(lease.waited_seconds, 3),
                               taken_over_from=lease.taken_over.model_dump(mode="json") if lease.taken_over else None,
                               taken_over_silent_seconds=None if silent is None else round(silent, 1))
        with CheckpointMirror(remote, output_dir, settings.keep_last, lease) as mirror:
            try:
                lost = StopRequest("the store's lease lost", lease.lost)
                result = run(settings, stops=(lost,) if notice is None else (lost, notice))
            except Preempted as stopped:
                if not lease.lost.is_set():  # a lost lease writes nothing more, not even the stopping checkpoint
                    _upload_within_grace(mirror, stopped, parse_duration_seconds(config.checkpoint.grace_period))
                if lease.lost.is_set():
                    raise LeaseLost(f"{lease.lost_why}; this run stopped at step {stopped.step} and left the store "
                                    "to the host that took it") from stopped
                raise
            finally:
                report.checkpoint_uploads, report.uploaded_step = mirror.uploads, mirror.uploaded_step
                report.checkpoint_upload_seconds = round(mirror.upload_seconds, 3)
                report.upload_failures = mirror.failures
        try:  # committed, or refused: the lease lost, the run fails and records nothing (no throughput record)
            report.final_uploaded = remote.push_final(output_dir / layout.FINAL)
        except LeaseLost as refused:
            lease.lose(str(refused))
            raise
    if lease.taken_over is not None and lease.taken_over.step is not None:
        report.lost_steps = max(0, lease.taken_over.step - (result.resumed_from_step or 0))
    return result.model_copy(update={"store": report})


def _upload_within_grace(mirror: CheckpointMirror, stopped: Preempted, grace: float) -> None:
    """After a signal: the checkpoint training just wrote, into the store before the grace period is over."""
    began = stopped.signalled_at if stopped.signalled_at is not None else time.monotonic()
    uploaded = mirror.flush(max(0.0, grace - (time.monotonic() - began)))
    append_event(mirror.output_dir, "preempted_upload", uploaded=uploaded, step=mirror.uploaded_step,
                 seconds_since_signal=round(time.monotonic() - began, 3), grace_period=grace)
    if not uploaded:
        run_logger().warning(f"{mirror.remote.location}: the checkpoint of step {stopped.step} did not reach the "
                             f"store within the grace period ({grace:.0f} s); the store's latest is step "
                             f"{mirror.uploaded_step}")
