"""tests/helpers/prefect_stack.py's `signal_group`: a test's cleanup signals its own process groups, never a group
that took a reaped leader's pid (pids wrap within a suite run here; a killed Prefect server of another test was the
result)."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

from helpers.prefect_stack import signal_group

# A leader that starts a member of its group and exits: the member lives on in the group.
LEADER_LEAVES_A_MEMBER = ("import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'import time; "
                          "time.sleep(60)']); print(p.pid, flush=True)")


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _gone(pid: int, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


def test_a_live_leaders_group_is_signalled():
    proc = _sleeper()
    assert signal_group(proc, signal.SIGKILL)
    assert proc.wait(10) == -signal.SIGKILL


def test_a_reaped_leaders_pid_taken_by_another_group_is_left_alone():
    gone, other = _sleeper(), _sleeper()
    gone.kill()
    gone.wait()
    gone.pid = other.pid  # what a wrapped pid counter does: the number now leads someone else's group
    try:
        assert not signal_group(gone, signal.SIGKILL)
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()


def test_a_reaped_leaders_surviving_members_are_signalled():
    leader = subprocess.Popen([sys.executable, "-c", LEADER_LEAVES_A_MEMBER], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    member = int(leader.stdout.readline())
    assert leader.wait(30) == 0  # reaped: no process has its pid, its group lives on in the member
    assert signal_group(leader, signal.SIGKILL)
    assert _gone(member)


def test_a_group_with_no_process_left_is_not_signalled():
    proc = _sleeper()
    proc.kill()
    proc.wait()
    assert not signal_group(proc, signal.SIGTERM)
