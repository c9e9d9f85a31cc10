"""A deployment run that crashes comes back by itself (deployments/ops.py, `retry_automation`): on a real Prefect
server with a real process worker (`make pools`, `make deploy NAME=cpu`, `make automations`, `make worker`), the
flow-run process is killed -9 mid-training after a checkpoint reached the store (S3 on moto); the worker reports the
run Crashed, the automation schedules it again with no command typed, and it resumes from the store's checkpoint to
the weights of a run that nothing interrupted. A Failed run is left Failed, the automation's trigger, read back from
the server, stops at the attempt limit, and `ops.py automations` converges and turns it off.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers.faults import Fault, FaultProxy
from helpers.hosts import STORE_JOB_STEPS, Host, store_job
from helpers.prefect_stack import (
    ROOT,
    PrefectStack,
    all_events,
    cmdline,
    descendants,
    kill9,
    migrated_database,
    stop_group,
    wait_for,
)
from helpers.servers import s3_client

pytestmark = [pytest.mark.slow, pytest.mark.prefect_server]

RETRIES = 1  # `make automations CRASH_RETRIES=1`: one crash is retried, a crash of the retry is not
TRAIN_STEPS = STORE_JOB_STEPS
RUN_TIMEOUT = 600  # two cores shared with other work: minutes, not seconds
RETRY_AUTOMATION = "phase1a: run crashed flow runs again"
RETRY_AFTER = timedelta(seconds=30)  # deployments/ops.py: how long a run stays Crashed before it is retried


@pytest.fixture(scope="module")
def job(aws, endpoint, tmp_path_factory) -> dict:
    """The tiny job of tests/flows/test_resume_anywhere.py: two shards on S3, checkpoints every 10 steps into the
    store."""
    tree = store_job(tmp_path_factory.mktemp("job"), "comeback", endpoint, "crash-retry")
    return {**tree, "plan": {**tree["plan"], "calibration_steps": 1}}


@pytest.fixture(scope="module")
def uninterrupted(job, tmp_path_factory) -> dict[str, torch.Tensor]:
    """The same job in this process, nothing interrupting it, with a store of its own."""
    host = Host.fresh(tmp_path_factory.mktemp("reference") / "host", {**job, "store": {
        **job["store"], "url": job["store"]["url"].replace("/store/", "/reference-store/")}})
    # One thread, as the worker's flow-run process (OMP_NUM_THREADS=1): on two busy cores more only contend.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        state, report = host.run_here()
    finally:
        torch.set_num_threads(threads)
    assert state.is_completed(), report.get("error")
    assert report["stages"]["train"]["result"]["steps"] == TRAIN_STEPS
    return _adapter(report)


@pytest.fixture(scope="module")
def stack(aws, tmp_path_factory):
    """A Prefect server of its own, the cpu pool, phase1a/cpu deployed and the automations installed through the
    Makefile, as docs/operations.md says."""
    home = tmp_path_factory.mktemp("crash-retry") / "prefect-home"
    migrated_database(home / "prefect.db")
    stack = PrefectStack(home, {"OMP_NUM_THREADS": "1"})
    try:
        server = stack.start("server", ["server", "start", "--host", "127.0.0.1", "--port", str(stack.port)])
        stack.wait_healthy(server)
        stack.make("pools")
        stack.make("deploy", "NAME=cpu")
        stack.make("automations", f"CRASH_RETRIES={RETRIES}")
        yield stack
    finally:
        stack.stop()


@contextmanager
def worker(stack: PrefectStack):
    """`make worker` on the CPU pool; stopped (SIGTERM, then SIGKILL) on exit."""
    proc = stack.start("worker", ["-s", f"PREFECT_PORT={stack.port}", "worker", "POOL=phase1a-cpu", "HEARTBEAT=30"],
                       program="make")
    log = stack.home / "worker.log"
    try:
        wait_for(lambda: "started!" in log.read_text() or proc.poll() is not None, 180, "the worker to start")
        assert proc.poll() is None, stack.logs()
        yield proc
    finally:
        stop_group(proc)


def _adapter(report: dict) -> dict[str, torch.Tensor]:
    return load_file(Path(report["stages"]["train"]["result"]["adapter_dir"]) / "adapter_model.safetensors")


def _store_step(job: dict) -> int | None:
    """The step of the store's latest complete checkpoint (its `latest.json`), if any."""
    bucket, _, prefix = job["store"]["url"].removeprefix("s3://").partition("/")
    client = s3_client(job["data"]["s3_endpoint_url"])
    listed = client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}jobs/{job['name']}/")
    [*latest] = [item["Key"] for item in listed.get("Contents", []) if item["Key"].endswith("/latest.json")]
    return json.loads(client.get_object(Bucket=bucket, Key=latest[0])["Body"].read())["step"] if latest else None


def _engines(worker_proc) -> list[int]:
    """The flow-run processes (`python -m prefect.engine`) under the worker."""
    return [pid for pid in descendants(worker_proc.pid) if "prefect.engine" in cmdline(pid)]


def _states(stack: PrefectStack, flow_run_id):
    with stack.client() as client:
        return client.read_flow_run_states(flow_run_id)


def _flow_run(stack: PrefectStack, flow_run_id):
    with stack.client() as client:
        return client.read_flow_run(flow_run_id)


def _submit(stack: PrefectStack, parameters: dict):
    with stack.client() as client:
        deployment = client.read_deployment_by_name("phase1a/cpu")
        return client.create_flow_run_from_deployment(deployment.id, parameters=parameters)


def test_a_crashed_run_comes_back_by_itself_and_resumes_from_the_store(stack, job, uninterrupted, tmp_path):
    started = time.monotonic()
    local = {"work_dir": str(tmp_path / "runs"), "cache_dir": str(tmp_path / "cache")}
    with FaultProxy(job["store"]["endpoint_url"]) as proxy, worker(stack) as worker_proc:
        # Checkpoint uploads after the first are held on the way (a slow link), so that the run is still training
        # when it is killed: steps of milliseconds would otherwise finish the job before the kill lands.
        proxy.faults = [Fault("delay", "PUT", r"/checkpoints/step-\d+/trainable\.safetensors", times=10_000, skip=1,
                              seconds=600)]
        tree = {**job, **local, "data": {**job["data"], "staging_dir": str(tmp_path / "staging")},
                "store": {**job["store"], "endpoint_url": proxy.url}}
        run = _submit(stack, {"config": tree})

        uploaded = wait_for(lambda: _store_step(job), RUN_TIMEOUT, "a checkpoint in the store", interval=0.2,
                            logs=stack.logs())
        engines = _engines(worker_proc)
        assert engines and not _flow_run(stack, run.id).state.is_final(), stack.logs()
        kill9(engines + [child for pid in engines for child in descendants(pid)])  # the worker lives on
        # The crashed run's disk goes with it, as a pod's does: the retry finds the store alone.
        for path in (tmp_path / "runs", tmp_path / "cache", tmp_path / "staging"):
            shutil.rmtree(path, ignore_errors=True)
        proxy.faults = []
        assert _store_step(job) == uploaded < TRAIN_STEPS

        # In its history: the automation schedules it again within a second or two of the report.
        wait_for(lambda: "Crashed" in [state.name for state in _states(stack, run.id)], 60,
                 "the worker to report the crash", interval=0.5, logs=stack.logs())
        wait_for(lambda: _flow_run(stack, run.id).run_count == 2, RUN_TIMEOUT, "the crashed run to start again",
                 interval=1, logs=stack.logs())
        # A run whose flow fails (no such config file) is Failed, not Crashed: never scheduled again.
        failing = _submit(stack, {"config": None, "config_file": "configs/no-such-job.yaml"})
        final = wait_for(lambda: (state := _flow_run(stack, run.id).state).is_final() and state, RUN_TIMEOUT,
                         "the run's second start to end", interval=2, logs=stack.logs())
        failed = wait_for(lambda: (state := _flow_run(stack, failing.id).state).is_final() and state, RUN_TIMEOUT,
                          "the failing run to end", interval=1, logs=stack.logs())
        # The automation acts within a second or two of an event: give it 15 s to (wrongly) take the failed run.
        time.sleep(max(0.0, 15 - (time.time() - failed.timestamp.timestamp())))
    print(f"\ncrash, retry and resume: {time.monotonic() - started:.0f} s")

    # The run's own history: Running, Crashed (the worker saw the kill), still Crashed for the automation's wait,
    # then Scheduled by it and handed to the worker within 60 s with nothing typed, Running again, Completed.
    states = _states(stack, run.id)
    names = [state.name for state in states]
    crashed = names.index("Crashed")
    assert names[crashed - 1] == "Running" and "-9" in states[crashed].message, (names, states[crashed].message)
    after = [(state.name, state.message or "") for state in states[crashed + 1:]]
    assert after[0][0] == "Scheduled" and RETRY_AUTOMATION in after[0][1], after
    # The worker reports a kill twice (its runner at once, itself after loading the flow for crash hooks): on a
    # host so loaded that the second report outlasts the wait, it lands on the next start before that start runs,
    # and is left out here. The second start walks the states of the first (Scheduled, Pending, Submitting,
    # Running), to Completed.
    late = [(name, message) for name, message in after if name == "Crashed"]
    assert all(message.startswith("Flow run infrastructure exited with non-zero status code -9") for _, message
               in late), after
    walked = [name for name, _ in after if name not in ("Crashed", "Scheduled")]
    assert walked == [name for name in names[:crashed] if name != "Scheduled"] + ["Completed"], names
    print(f"late second crash reports: {len(late)}")

    def since_crash(name: str) -> float:
        [first] = [state for state in states[crashed + 1:] if state.name == name][:1]
        return (first.timestamp - states[crashed].timestamp).total_seconds()

    wait = RETRY_AFTER.total_seconds()
    assert wait <= since_crash("Scheduled") < since_crash("Pending") < 60, (since_crash("Scheduled"), after)
    print(f"after the crash: Scheduled {since_crash('Scheduled'):.1f} s, Pending {since_crash('Pending'):.1f} s, "
          f"Running {since_crash('Running'):.1f} s")
    flow_run = _flow_run(stack, run.id)
    assert final.is_completed(), (final, stack.logs())
    assert flow_run.run_count == 2 and flow_run.parameters == {"config": tree}

    # It resumed from the store's checkpoint (its local directories were gone) to the uninterrupted weights.
    [path] = Path(local["work_dir"], job["name"]).glob(f"*-{run.name}/report.json")
    report = json.loads(path.read_text())
    train = report["stages"]["train"]["result"]
    assert train["resumed_from_step"] == uploaded > 0 and train["store"]["pulled"]["what"] == "checkpoint", train
    assert train["steps"] == TRAIN_STEPS
    actual = _adapter(report)
    assert actual.keys() == uninterrupted.keys()
    assert [name for name in uninterrupted if not torch.equal(actual[name], uninterrupted[name])] == []

    # The failed run: one start, Failed, nothing after it.
    failed_states = [state.name for state in _states(stack, failing.id)]
    assert failed_states[-1] == "Failed" and "Crashed" not in failed_states, failed_states
    assert failed_states.count("Running") == 1 and _flow_run(stack, failing.id).run_count == 1, failed_states

    _the_trigger_stops_at_the_limit(stack, run.id, failing.id)


def _the_trigger_stops_at_the_limit(stack: PrefectStack, crashed_id, failed_id) -> None:
    """The automation as the server holds it, with Prefect's own matcher: the real Crashed event of the run's first
    start opens its wait, the same event from start RETRIES + 1 does not, nor does the real Failed event."""
    from prefect.server.events.schemas.automations import Automation
    from prefect.server.events.schemas.events import ReceivedEvent

    with stack.client() as client:
        [stored] = client.read_automations_by_name(RETRY_AUTOMATION)
    automation = Automation.model_validate(stored.model_dump(mode="json"))
    trigger = automation.trigger
    [action] = automation.actions
    assert (action.type, action.state.value, action.force) == ("change-flow-run-state", "SCHEDULED", True)
    assert (trigger.posture.value, trigger.within, trigger.threshold) == ("Proactive", RETRY_AFTER, 1)

    events = [ReceivedEvent.model_validate(event) for event in all_events(stack)]

    def event_of(flow_run_id, name: str) -> ReceivedEvent:
        return [event for event in events
                if event.event == name and event.resource.id == f"prefect.flow-run.{flow_run_id}"][0]

    def opens_the_wait(event: ReceivedEvent) -> bool:
        return trigger.covers(event) and trigger.starts_after(event.event)

    crash = event_of(crashed_id, "prefect.flow-run.Crashed")
    assert crash.resource["prefect.run-count"] == "1" and opens_the_wait(crash)
    again = crash.model_dump(mode="json")
    again["resource"]["prefect.run-count"] = str(RETRIES + 1)
    assert not opens_the_wait(ReceivedEvent.model_validate(again))
    assert not opens_the_wait(event_of(failed_id, "prefect.flow-run.Failed"))


def test_the_automation_converges_and_turns_off(stack):
    """`deployments/ops.py automations` run again replaces the automation with its new limit, and
    `--crash-retries 0` removes it; a negative count is refused before the server is asked anything."""
    ops = [sys.executable, "deployments/ops.py", "automations", "--zombie-after", "600"]

    def installed() -> list:
        with stack.client() as client:
            return client.read_automations_by_name(RETRY_AUTOMATION)

    assert f"{RETRY_AUTOMATION}: replaced" in stack.run([*ops, "--crash-retries", "2"])
    [automation] = installed()
    assert automation.trigger.match.root["prefect.run-count"] == ["1", "2"]
    assert f"{RETRY_AUTOMATION}: removed" in stack.run([*ops, "--crash-retries", "0"]) and installed() == []
    assert f"{RETRY_AUTOMATION}: not installed" in stack.run([*ops, "--crash-retries", "0"])
    refused = subprocess.run([*ops, "--crash-retries", "-1"], cwd=ROOT, env={**stack.env, "PREFECT_API_URL": ""},
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--crash-retries: -1 is below 0" in refused.stderr, refused.stderr
