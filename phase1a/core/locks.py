"""An exclusive lock between processes on one host: flock(2) on a file beside the thing it guards (readers
skip it: what they read is written atomically, phase1a/core/atomic.py).

The kernel releases a flock when its holder dies, kill -9 included, so a crashed run never leaves a stale
lock behind. The lock file records its last holder (pid, host, flow run) so that a waiting run can say whom
it waits for. flock is per host: on a shared network file system two hosts must not train into the same
directory (each host has its own work_dir in the deployments).
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

from phase1a.core.logs import run_logger


def holder() -> dict:
    """Who this process is: pid, host, Prefect flow run (when in one), since when; lock files and leases record it."""
    flow_run = None
    try:
        from prefect.runtime import flow_run as runtime

        flow_run = {"id": runtime.get_id(), "name": runtime.get_name()} if runtime.get_id() else None
    except Exception:
        pass
    return {"pid": os.getpid(), "host": socket.gethostname(), "flow_run": flow_run,
            "since": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def describe_holder(record: dict) -> str:
    """A holder as a message says it: flow run, pid, host and since when."""
    run = record.get("flow_run") or {}
    who = f"flow run {run.get('name')} ({run.get('id')})" if run else "a process"
    return f"{who}, pid {record.get('pid')} on {record.get('host')} since {record.get('since')}"


def _describe(raw: bytes) -> str:
    try:
        return describe_holder(json.loads(raw))
    except (ValueError, AttributeError):
        return "another process"


@contextmanager
def exclusive(lock_path: Path, what: str) -> Iterator[float]:
    """Hold the lock for the body; wait (and say so) while another process holds it. Yields the seconds waited."""
    lock_path = Path(lock_path)
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)  # never O_TRUNC: the holder's record is in it
    try:
        waited = 0.0
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log = run_logger()
            log.warning("%s is in use by %s; waiting for it to finish", what, _describe(os.pread(fd, 4096, 0)))
            started = time.monotonic()
            fcntl.flock(fd, fcntl.LOCK_EX)
            waited = time.monotonic() - started
            log.warning("%s: the other run finished after %.0f s of waiting; going on", what, waited)
        record = json.dumps(holder()).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, record, 0)
        yield waited
    finally:
        os.close(fd)  # releases the lock
