"""A real Prefect server and workers in subprocesses, and readers of what they recorded (no mocks).

Shared by test_deployment.py (a server started directly), test_operations.py (the Makefile's targets) and the
session's own server (tests/conftest.py: `session_server`).
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Iterator
from uuid import UUID

import pytest

from helpers.servers import free_port

ROOT = Path(__file__).resolve().parents[2]
PREFECT = Path(sys.executable).parent / "prefect"  # the venv's CLI, whatever is on PATH


def migrated_database(target: Path) -> Path:
    """`target` (a fresh PREFECT_HOME's prefect.db) as an empty Prefect database with every migration applied, copied
    from one made once a session, by whichever of its processes (pytest-xdist's workers) asks first: a new server
    finds nothing to migrate (15-20 s on two cores) and is otherwise as new as a fresh host's."""
    shared = Path(os.environ["PHASE1A_TESTS_SHARED"]) / "migrated-prefect"
    template = shared / "prefect.db"
    shared.mkdir(parents=True, exist_ok=True)
    with (shared / "lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other workers wait for the one migrating
        if not template.exists():
            env = {**os.environ, "PREFECT_HOME": str(shared),
                   "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{shared / 'migrating.db'}"}
            subprocess.run([str(PREFECT), "server", "database", "upgrade", "-y"], env=env, check=True,
                           capture_output=True, timeout=300)
            (shared / "migrating.db").rename(template)  # whole or absent
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(template, target)
    return target


def _tail(path: Path, chars: int = 4000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def signal_group(proc: subprocess.Popen, sig: int) -> bool:
    """`sig` to the process group `proc` leads, never to another's; whether a group was signalled.

    Once its leader is reaped (any `poll()`), the leader's pid is free again, and pids wrap fast here (pid_max
    32768, a suite spawns tens of thousands of processes): a new `setsid` process, a Prefect server say, can lead a
    group with that number. Linux hands out no pid still used as a group id, so a reaped leader's group is ours only
    while no live process has its pid."""
    if proc.poll() is not None and Path(f"/proc/{proc.pid}").exists():
        return False
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        return False
    return True


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the process group (a worker passes it on to its flow runs), SIGKILL after 20 s."""
    for sig, grace in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        if not signal_group(proc, sig):
            break
        try:
            proc.wait(timeout=grace)
            break
        except subprocess.TimeoutExpired:
            continue


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (flow-run processes start in their own session, not the worker's
    process group, so a process-group signal would miss them)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def kill9(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def wait_for(condition: Callable[[], Any], timeout: float, what: str, interval: float = 0.5, logs: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout} s waiting for {what}\n{logs}")


class PrefectStack:
    def __init__(self, home: Path, extra_env: dict[str, str] | None = None) -> None:
        self.home = home
        self.port = free_port()
        self.api_url = f"http://127.0.0.1:{self.port}/api"
        self.env = {
            **os.environ,
            "PREFECT_HOME": str(home),
            "PREFECT_API_URL": self.api_url,
            "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{home}/prefect.db",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_SERVER_UI_ENABLED": "false",
            "PREFECT_CLI_PROMPT": "false",
            "PREFECT_WORKER_QUERY_SECONDS": "2",
            "PREFECT_LOGGING_LEVEL": "INFO",
            "PYTHONUNBUFFERED": "1",
            **(extra_env or {}),
        }
        self.procs: list[tuple[subprocess.Popen, Path]] = []
        self.outputs: list[str] = []  # of every command run through run()

    def start(self, name: str, args: list[str], program: str | None = None,
              env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start `prefect ARGS` (or `program ARGS`) in its own process group, output to HOME/<name>.log."""
        log = self.home / f"{name}.log"
        with log.open("w") as handle:
            proc = subprocess.Popen([program or str(PREFECT), *args], cwd=ROOT, env=env or self.env, stdout=handle,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append((proc, log))
        return proc

    def logs(self) -> str:
        """The tail of every log under HOME: the processes started here, and a server started by `make server`."""
        exits = {log: proc.poll() for proc, log in self.procs}
        return "\n".join(f"--- {log.name} (exit {exits.get(log, '?')}) ---\n{_tail(log)}"
                         for log in sorted(self.home.glob("*.log")))

    def run(self, args: list[str], timeout: float = 120) -> str:
        result = subprocess.run(args, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout)
        output = result.stdout + result.stderr
        self.outputs.append(output)
        assert result.returncode == 0, f"{' '.join(args)} exited {result.returncode}:\n{output}\n{self.logs()}"
        return output

    def cli(self, *args: str, timeout: float = 120) -> str:
        return self.run([str(PREFECT), "--no-prompt", *args], timeout)

    def make(self, *args: str, timeout: float = 240) -> str:
        return self.run(["make", "-s", f"PREFECT_PORT={self.port}", *args], timeout)

    def wait_healthy(self, server: subprocess.Popen | None = None, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if server is not None:
                assert server.poll() is None, f"prefect server exited {server.returncode}\n{self.logs()}"
            try:
                with urllib.request.urlopen(f"{self.api_url}/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        pytest.fail(f"prefect server not healthy after {timeout} s\n{self.logs()}")

    def stop(self) -> None:
        for proc, _ in reversed(self.procs):  # workers first, then the server
            stop_group(proc)

    @contextmanager
    def client(self) -> Iterator[Any]:
        """A sync client of this server."""
        from prefect.client.orchestration import get_client
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings({PREFECT_API_URL: self.api_url}), get_client(sync_client=True) as client:
            yield client


def flow_run_id(output: str) -> UUID:
    match = re.search(r"UUID: ([0-9a-f-]{36})", output)
    assert match, f"no flow run id in:\n{output}"
    return UUID(match.group(1))


def states(stack: PrefectStack, flow_run_id: UUID) -> tuple[str, dict[str, list[str]]]:
    """The flow run's state name, and its task runs' state names by task name."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with stack.client() as client:
        flow_run = client.read_flow_run(flow_run_id)
        task_runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    tasks: dict[str, list[str]] = {}
    for task_run in task_runs:
        # A task run is named "<task name>-<3 hex digits>" (stage-04a); task_key uses the function name.
        tasks.setdefault(task_run.name.rsplit("-", 1)[0], []).append(task_run.state.name)
    return flow_run.state.name, tasks


def task_window(stack: PrefectStack, flow_run_id: UUID, task: str) -> tuple[datetime, datetime]:
    """When the flow run's (one) task run of that name started and ended."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with stack.client() as client:
        task_runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    [run] = [task_run for task_run in task_runs if task_run.name.rsplit("-", 1)[0] == task]
    return run.start_time, run.end_time


def flow_run_logs(stack: PrefectStack, flow_run_id: UUID) -> list[str]:
    """Every log line the flow run and its task runs sent to the API."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    lines, offset = [], 0
    with stack.client() as client:
        while True:
            page = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])),
                                    limit=200, offset=offset)
            lines += [log.message for log in page]
            if len(page) < 200:
                return lines
            offset += 200


def all_events(stack: PrefectStack) -> list[dict]:
    """Every event the server stored (state changes, heartbeats, worker and deployment events)."""
    with stack.client() as client:
        page = client._client.post("/events/filter", json={"limit": 50}).json()
        events = list(page["events"])
        while page.get("next_page"):
            page = client._client.get(page["next_page"]).json()
            events += page["events"]
    return events


def dump(value: Any) -> str:
    return json.dumps(value, default=str)


def session_server(home: Path) -> PrefectStack:
    """`prefect server start` on a migrated copy of the database, in `home` (the session's PREFECT_HOME), healthy."""
    migrated_database(home / "prefect.db")
    stack = PrefectStack(home)
    server = stack.start("session-server", ["server", "start", "--host", "127.0.0.1", "--port", str(stack.port)])
    stack.wait_healthy(server)
    return stack
