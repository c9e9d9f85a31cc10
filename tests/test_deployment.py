"""The deployment end to end: a real Prefect server, `prefect deploy` of deployments/prefect.yaml, a process
worker, and two runs of phase1a/cpu; the second must take stage and tokenize from the cache."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefect_stack import PrefectStack, flow_run_id, states

# Seconds per flow run (--watch-timeout). A run of the tiny model on the worker takes ~40 s on 2 cores (most of
# it the flow-run process importing torch/transformers); the total stays under pytest's 900 s timeout.
RUN_TIMEOUT = 240


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
        runs.append(flow_run_id(output))

    first_state, first_tasks = states(stack, runs[0])
    second_state, second_tasks = states(stack, runs[1])
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
