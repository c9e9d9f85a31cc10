"""The deployment end to end: a real Prefect server, `prefect deploy` of deployments/prefect.yaml, a process
worker, and two runs of phase1a/cpu; the second must take stage and tokenize from the cache."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from uuid import UUID

import pytest

ROOT = Path(__file__).resolve().parents[1]
PREFECT = Path(sys.executable).parent / "prefect"  # the venv's CLI, whatever is on PATH
# Seconds per flow run (--watch-timeout). A run of the tiny model on the worker takes ~40 s on 2 cores (most of
# it the flow-run process importing torch/transformers); the total stays under pytest's 900 s timeout.
RUN_TIMEOUT = 240


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _tail(path: Path, chars: int = 4000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def _start(args: list[str], env: dict, log: Path) -> subprocess.Popen:
    handle = log.open("w")
    try:
        # Own process group: teardown kills the process and everything it started.
        return subprocess.Popen([str(PREFECT), *args], cwd=ROOT, env=env, stdout=handle,
                                stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        handle.close()


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the process group (a worker passes it on to its flow runs), SIGKILL after 20 s."""
    for sig, grace in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=grace)
            break
        except subprocess.TimeoutExpired:
            continue


class PrefectStack:
    def __init__(self, home: Path) -> None:
        self.home = home
        self.port = _free_port()
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
        }
        self.procs: list[tuple[subprocess.Popen, Path]] = []

    def start(self, name: str, args: list[str]) -> subprocess.Popen:
        log = self.home / f"{name}.log"
        proc = _start(args, self.env, log)
        self.procs.append((proc, log))
        return proc

    def logs(self) -> str:
        return "\n".join(f"--- {log.name} (exit {proc.poll()}) ---\n{_tail(log)}" for proc, log in self.procs)

    def cli(self, *args: str, timeout: float = 120) -> str:
        result = subprocess.run([str(PREFECT), "--no-prompt", *args], cwd=ROOT, env=self.env, capture_output=True,
                                text=True, timeout=timeout)
        output = result.stdout + result.stderr
        assert result.returncode == 0, f"prefect {' '.join(args)} exited {result.returncode}:\n{output}\n{self.logs()}"
        return output

    def wait_healthy(self, server: subprocess.Popen, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
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
        for proc, _ in reversed(self.procs):  # worker first, then the server
            _stop(proc)


@pytest.fixture
def prefect_stack(tmp_path):
    stack = PrefectStack(tmp_path / "prefect-home")
    stack.home.mkdir()
    try:
        stack.wait_healthy(stack.start("server", ["server", "start", "--host", "127.0.0.1",
                                                   "--port", str(stack.port)]))
        yield stack
    finally:
        stack.stop()


def _states(api_url: str, flow_run_id: UUID) -> tuple[str, dict[str, list[str]]]:
    """The flow run's state name, and its task runs' state names by task name."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(flow_run_id)
        task_runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    tasks: dict[str, list[str]] = {}
    for task_run in task_runs:
        # A task run is named "<task name>-<3 hex digits>" (stage-04a); task_key uses the function name.
        tasks.setdefault(task_run.name.rsplit("-", 1)[0], []).append(task_run.state.name)
    return flow_run.state.name, tasks


def test_deployment_runs_on_a_worker_and_reuses_the_cache(prefect_stack, config_tree):
    stack = prefect_stack
    stack.cli("work-pool", "create", "phase1a-cpu", "--type", "process")
    stack.cli("deploy", "--prefect-file", "deployments/prefect.yaml", "--name", "cpu", timeout=180)
    stack.start("worker", ["worker", "start", "--pool", "phase1a-cpu"])

    params = json.dumps({"config": config_tree})
    runs = []
    for attempt in (1, 2):
        output = stack.cli("deployment", "run", "phase1a/cpu", "--params", params, "--watch",
                           "--watch-timeout", str(RUN_TIMEOUT), timeout=RUN_TIMEOUT + 30)
        match = re.search(r"UUID: ([0-9a-f-]{36})", output)
        assert match, f"run {attempt}: no flow run id in:\n{output}"
        runs.append(UUID(match.group(1)))

    first_state, first_tasks = _states(stack.api_url, runs[0])
    second_state, second_tasks = _states(stack.api_url, runs[1])
    assert first_state == "Completed", (first_state, first_tasks)
    assert second_state == "Completed", (second_state, second_tasks)
    for name in ("stage", "tokenize"):
        assert first_tasks.get(name) == ["Completed"], first_tasks
        assert second_tasks.get(name) == ["Cached"], second_tasks

    reports = sorted(Path(config_tree["work_dir"], config_tree["name"]).glob("*/report.json"))
    assert len(reports) == 2, reports
    second = json.loads(reports[-1].read_text())
    assert second["status"] == "passed"
    assert {second["stages"][name]["state"] for name in ("stage", "tokenize")} == {"Cached"}
