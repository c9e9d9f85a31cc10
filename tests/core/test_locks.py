"""The lock that keeps two runs from training into one directory: a waiter names the holder, and the kernel
frees the lock of a holder killed with SIGKILL."""
from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time

import pytest

from phase1a.core.locks import exclusive

HOLD = """
import sys, time
from phase1a.core.locks import exclusive
with exclusive(sys.argv[1], "the directory"):
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def _holder(lock, seconds: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(lock), str(seconds)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


@pytest.mark.slow
def test_a_second_holder_waits_for_the_first_and_names_it(tmp_path, caplog):
    lock = tmp_path / "train-abc.lock"
    first = _holder(lock, 6.0)  # longer than importing Prefect for the run logger takes here
    held_at = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="phase1a"), exclusive(lock, "training directory X") as waited:
        assert time.monotonic() - held_at > 5.5  # we got the lock only once the holder had let go
    assert first.wait(10) == 0
    assert waited > 0
    assert f"training directory X is in use by a process, pid {first.pid}" in caplog.text
    assert "the other run finished after" in caplog.text


def test_a_holder_killed_with_sigkill_frees_the_lock(tmp_path):
    lock = tmp_path / "train-abc.lock"
    holder = _holder(lock, 600)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    started = time.monotonic()
    with exclusive(lock, "training directory X") as waited:
        assert waited < 5
    assert time.monotonic() - started < 5
    with exclusive(lock, "training directory X") as waited:  # released on exit, reusable
        assert waited < 1
