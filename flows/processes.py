"""Every process `phase1a run|plan` starts is gone once it exits, however it ends: the flow's end, an error,
SIGTERM or SIGINT.

Why: Prefect's embedded server is a uvicorn child that only an `atexit` hook stops. On SIGTERM, Prefect's flow
engine raises an exception, lets the flow run crash, then sends the signal again to the process with its former
action, the default one: the CLI died without running that hook, and the server lived on, holding its port and
memory. A child whose parent dies first (torchrun's ranks, a DataLoader worker under its fork server) is
re-parented to init, out of sight. So, from `own_processes()` on:
- the CLI is a child subreaper (Linux): an orphaned descendant is re-parented to it, and stays findable;
- SIGTERM raises `Terminated` where nothing else handles it, as SIGINT raises KeyboardInterrupt, so that the CLI
  runs to its end (training and Prefect's flow engine install their own handlers while they run);
- at exit, after Prefect's and multiprocessing's own exit hooks, the embedded server is stopped if it still
  runs, then every descendant left: SIGTERM, a grace period, SIGKILL, each one reaped.
"""
from __future__ import annotations

import atexit
import ctypes
import multiprocessing.util
import os
import signal
import sys
import time
from pathlib import Path

import psutil

PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>
GRACE_SECONDS = 5.0  # for a descendant to end after SIGTERM, before SIGKILL


class Terminated(BaseException):
    """SIGTERM, raised like SIGINT's KeyboardInterrupt: not an error, so no `except Exception` swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signal = signum  # as Prefect's TerminationSignal has it


def own_processes() -> None:
    """From here on, every descendant of this process ends with it (see the module's docstring)."""
    become_subreaper()
    signal.signal(signal.SIGTERM, _raise_terminated)
    # Exit hooks run last-registered first. This one runs after Prefect's, registered when it starts its server
    # (which it stops once its log and event workers have drained into it), and after multiprocessing's, whose
    # finalizers still write to its resource tracker, one of the descendants: re-registered, as multiprocessing
    # itself does (multiprocessing.util.get_logger).
    atexit.register(stop_descendants)
    atexit.unregister(multiprocessing.util._exit_function)
    atexit.register(multiprocessing.util._exit_function)


def become_subreaper() -> bool:
    """Orphaned descendants are re-parented to this process instead of init (Linux 3.4+); False elsewhere."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def stop_descendants(grace: float = GRACE_SECONDS) -> None:
    """Prefect's embedded server, then every descendant still alive: SIGTERM, up to `grace` seconds, SIGKILL
    (at once for one that ignores SIGTERM, as multiprocessing's resource tracker does); all reaped. A signal
    meanwhile only ends the wait."""
    hurry: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, _frame: hurry.append(signum))
                for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        _stop_prefect_servers()
        left = _signal_all([p for p in psutil.Process().children(recursive=True) if not _ignores_sigterm(p)],
                           signal.SIGTERM)
        deadline = time.monotonic() + grace
        while left and not hurry and time.monotonic() < deadline:
            _, left = psutil.wait_procs(left, timeout=0.1)
        for _ in range(3):  # SIGKILL what is left, and what was orphaned meanwhile (re-parented here)
            left = _signal_all(psutil.Process().children(recursive=True), signal.SIGKILL)
            if not left:
                break
            psutil.wait_procs(left, timeout=1)
        _reap()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _raise_terminated(signum: int, _frame) -> None:
    raise Terminated(signum)


def _stop_prefect_servers() -> None:
    """Prefect's own stop (SIGTERM, 5 s, SIGKILL). Its exit hook has done it already, unless a second signal cut
    that hook short."""
    server_module = sys.modules.get("prefect.server.api.server")  # imported only where one was started
    if server_module is not None:
        for server in list(server_module.SubprocessASGIServer._instances.values()):
            server.stop()


def _signal_all(processes: list[psutil.Process], signum: int) -> list[psutil.Process]:
    """The processes that were still there to receive it."""
    reached = []
    for process in processes:
        try:
            process.send_signal(signum)
            reached.append(process)
        except psutil.NoSuchProcess:
            pass
    return reached


def _ignores_sigterm(process: psutil.Process) -> bool:
    try:
        status = Path(f"/proc/{process.pid}/status").read_text()
    except OSError:
        return False
    ignored = next((int(line.split()[1], 16) for line in status.splitlines() if line.startswith("SigIgn:")), 0)
    return bool(ignored >> (signal.SIGTERM - 1) & 1)


def _reap() -> None:
    """Collect the exit status of every child that has ended (an orphan re-parented here is one)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
