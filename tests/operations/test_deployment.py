"""The deployments end to end: one real Prefect server and process worker for the module, `prefect deploy` of
deployments/prefect.yaml. phase1a/cpu runs twice with a whole config (the second takes stage and tokenize from
the cache); phase1a/h100, as the file defines it, runs a job from a config file with an override, and fails a
bad override naming the field."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from helpers.prefect_stack import PrefectStack, flow_run_id, migrated_database, states, wait_for
from phase1a.config.schema import load_config

pytestmark = [pytest.mark.slow, pytest.mark.prefect_server]

# Seconds per flow run (--watch-timeout). A run of the tiny model on the worker takes ~40 s on 2 cores (most of
# it the flow-run process importing torch/transformers); the total stays under pytest's 900 s timeout.
RUN_TIMEOUT = 240


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """A server, the phase1a-cpu pool with phase1a/cpu deployed, and a worker on it, shared by the tests."""
    stack = PrefectStack(tmp_path_factory.mktemp("deployment") / "prefect-home",
                         extra_env={"PHASE1A_TZ": "UTC"})  # `make deploy` sets it for the nightly schedule
    migrated_database(stack.home / "prefect.db")
    try:
        stack.wait_healthy(stack.start("server", ["server", "start", "--host", "127.0.0.1",
                                                   "--port", str(stack.port)]))
        stack.cli("work-pool", "create", "phase1a-cpu", "--type", "process")
        stack.cli("deploy", "--prefect-file", "deployments/prefect.yaml", "--name", "cpu", timeout=180)
        stack.start("worker", ["worker", "start", "--pool", "phase1a-cpu"])
        yield stack
    finally:
        stack.stop()


def test_deployment_runs_on_a_worker_and_reuses_the_cache(stack, config_tree):
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


def _flatten(tree: dict, prefix: str = "") -> dict[str, object]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def test_h100_deployment_runs_a_config_file_with_overrides(stack, config_tree, tmp_path):
    # The tiny job as a user writes one: a YAML file whose relative paths are relative to the file.
    (tmp_path / "job").mkdir()
    job = tmp_path / "job" / "tiny.yaml"
    job.write_text(yaml.safe_dump({**config_tree, "name": "tiny-h100", "work_dir": "../runs",
                                   "data": {**config_tree["data"], "source": "../dates.jsonl"}}))
    # phase1a/h100 as deployments/prefect.yaml defines it (config_file and overrides parameters, schedule,
    # concurrency limit), on the CPU pool and with this job instead of configs/h100.yaml.
    stack.cli("deploy", "--prefect-file", "deployments/prefect.yaml", "--name", "h100", "--pool", "phase1a-cpu",
              "--param", f"config_file={job}", timeout=180)
    stack.cli("deployment", "schedule", "pause", "--all")  # a nightly run must not start on this worker meanwhile

    # What a user types: `--param` parses the value as JSON, so this is a list of one override.
    output = stack.cli("deployment", "run", "phase1a/h100", "--param", 'overrides=["method.epochs=2"]', "--watch",
                       "--watch-timeout", str(RUN_TIMEOUT), timeout=RUN_TIMEOUT + 30)
    run = flow_run_id(output)
    state, tasks = states(stack, run)
    assert state == "Completed", (state, tasks)
    with stack.client() as client:
        flow_run = client.read_flow_run(run)
    assert flow_run.parameters == {"config_file": str(job), "overrides": ["method.epochs=2"]}
    [report_path] = (tmp_path / "runs" / "tiny-h100").glob(f"*-{flow_run.name}/report.json")
    report = json.loads(report_path.read_text())
    assert report["status"] == "passed"
    ran, planned = _flatten(report["config"]), _flatten(load_config(job).model_dump(mode="json"))
    assert {key: (planned[key], ran[key]) for key in ran if ran[key] != planned[key]} == {"method.epochs": (1.0, 2.0)}
    assert ran["data.source"] == str(tmp_path / "dates.jsonl")  # relative to the file, not the worker's directory

    # A bad override fails the run before any stage, and the state's message names the field.
    output = stack.cli("deployment", "run", "phase1a/h100", "--param", 'overrides=["method.epochs=0"]')
    bad = flow_run_id(output)
    with stack.client() as client:
        final = wait_for(lambda: (s := client.read_flow_run(bad).state).is_final() and s, RUN_TIMEOUT,
                         "the run with a bad override to finish", interval=2, logs=stack.logs())
    assert final.name == "Failed", final
    assert "ConfigError" in final.message and "method.epochs: Input should be greater than 0" in final.message
    assert states(stack, bad)[1] == {}  # no task ran
    assert len(list((tmp_path / "runs" / "tiny-h100").glob("*/report.json"))) == 1  # and no report was started
