"""Past one machine (docs/operations.md), for real: PostgreSQL as Prefect's database and two hosts on one GPU pool.

A PostgreSQL server from the machine's binaries (tests/helpers/postgres.py), then the Makefile's targets as the
docs give them: `PREFECT_API_DATABASE_CONNECTION_URL=postgresql+asyncpg://... make server`, `make pools`,
`make deploy NAME="cpu h100"`, `make automations`. Two `make worker POOL=phase1a-h100` processes stand for two hosts:
each has its own HOME (the job's `~/cache` and `~/staging` are that host's local disk) and PREFECT_HOME (its
task cache records); the job's work_dir, where runs and checkpoints live, stands for shared storage.

Two runs are queued at once. The pool and the deployment (concurrency limits of 1) let one through; its host
is killed with it (kill -9), the zombie automation marks it Crashed, and only then does the other host take the
second run, which resumes from the first one's checkpoint. Meanwhile, on phase1a-cpu (no limit), two runs do run
at once: the server takes their concurrent writes, and one at a time on the GPU pool is seen to be the limits'
doing.
"""
from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import yaml

from helpers.postgres import postgres_server, unavailable_reason
from helpers.prefect_stack import PrefectStack, cmdline, descendants, kill9, signal_group, states, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.prefect_server, pytest.mark.postgres,
              pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or "")]

ZOMBIE_AFTER = 60  # seconds without a heartbeat; flow runs send one every 30 s (the minimum) here
RUN_TIMEOUT = 300


@pytest.fixture(scope="module")
def postgres():
    with postgres_server() as server:
        yield server


@pytest.fixture(scope="module")
def stack(tmp_path_factory, postgres):
    """`make server` on PostgreSQL, the pools, phase1a/h100 (its nightly schedule paused) and the zombie
    automation."""
    home = tmp_path_factory.mktemp("ops-postgres") / "prefect-home"
    home.mkdir()
    stack = PrefectStack(home, extra_env={"PREFECT_API_DATABASE_CONNECTION_URL": postgres.url})
    try:
        stack.make("server")
        stack.make("pools")
        stack.make("deploy", "NAME=cpu h100")
        stack.cli("deployment", "schedule", "pause", "--all")  # no 02:00 run of configs/h100.yaml in the middle
        # CRASH_RETRIES=0: the lost host's run stays Crashed, the queued run recovers it (retries: test_crash_retry.py)
        stack.make("automations", f"ZOMBIE_AFTER={ZOMBIE_AFTER}", "CRASH_RETRIES=0")
        yield stack
    finally:
        stack.stop()
        stack.make("server-stop", timeout=60)


def _job(config_tree: dict, shared: Path) -> Path:
    """A job file like configs/h100.yaml: runs and checkpoints on shared storage, caches on each host's disk."""
    job = shared / "job.yaml"
    shared.mkdir(parents=True, exist_ok=True)
    job.write_text(yaml.safe_dump({
        **config_tree, "work_dir": str(shared / "runs"), "cache_dir": "~/cache",
        "data": {**config_tree["data"], "staging_dir": "~/staging"},
        "method": {**config_tree["method"], "epochs": 5}, "checkpoint": {"interval": "2steps", "keep_last": 2},
        "promotion": {"to": str(shared / "promoted")}}))
    return job


def _start_host(stack: PrefectStack, name: str, hosts: Path, pool: str = "phase1a-h100"):
    """`make worker POOL=...` as if on its own machine: its own HOME and PREFECT_HOME."""
    home = hosts / name
    (home / "prefect").mkdir(parents=True)
    # A worker talks to the server's API only: it is not told where the database is.
    env = {**{key: value for key, value in stack.env.items() if key != "PREFECT_API_DATABASE_CONNECTION_URL"},
           "HOME": str(home), "PREFECT_HOME": str(home / "prefect")}
    proc = stack.start(name, ["-s", f"PREFECT_PORT={stack.port}", "worker", f"POOL={pool}", "HEARTBEAT=30"],
                       program="make", env=env)
    log = stack.home / f"{name}.log"
    wait_for(lambda: "started!" in log.read_text() or proc.poll() is not None, 180, f"{name} to start")
    assert proc.poll() is None, stack.logs()
    return proc


def _engines(worker) -> list[int]:
    """The flow-run processes (`python -m prefect.engine`) under a worker."""
    return [pid for pid in descendants(worker.pid) if "prefect.engine" in cmdline(pid)]


def _checkpoint_steps(job: Path) -> list[int]:
    root = Path(yaml.safe_load(job.read_text())["work_dir"], "tiny")
    return sorted(int(p.parent.name.split("-")[1]) for p in root.glob("train-*/checkpoints/step-*/COMPLETE"))


def _submit(stack: PrefectStack, deployment: str, parameters: dict):
    with stack.client() as client:
        deployment_id = client.read_deployment_by_name(deployment).id
        return client.create_flow_run_from_deployment(deployment_id, parameters=parameters)


def _final(stack: PrefectStack, run):
    with stack.client() as client:
        state = client.read_flow_run(run.id).state
    return state if state.is_final() else None


def _history(stack: PrefectStack, run) -> list:
    with stack.client() as client:
        return sorted(client.read_flow_run_states(run.id), key=lambda state: state.timestamp)


def _held_slot(stack: PrefectStack, run) -> tuple:
    """When the run held the pool's slot: from a worker taking it (Pending) to its final state."""
    history = _history(stack, run)
    taken = next(state.timestamp for state in history if state.type.value in ("PENDING", "RUNNING"))
    return taken, next(state.timestamp for state in history if state.is_final())


def _wait_final(stack: PrefectStack, runs: list, timeout: float) -> list:
    return [wait_for(lambda run=run: _final(stack, run), timeout, f"flow run {run.name} to finish", interval=2,
                     logs=stack.logs()) for run in runs]


def _kill_host(worker) -> None:
    """kill -9 of the worker's process group and of its flow-run processes (they run in sessions of their own),
    the way a lost machine ends them: nothing is left to report the run."""
    pids = descendants(worker.pid)
    signal_group(worker, signal.SIGKILL)
    kill9(pids)
    worker.wait(10)


def _lose_the_busy_host(stack: PrefectStack, hosts: dict, job: Path) -> tuple[str, int]:
    """Once a host's flow run has a checkpoint, lose that host; its name and the last complete checkpoint."""
    busy = wait_for(lambda: next((name for name, proc in hosts.items() if _engines(proc)), None), 120,
                    "a host to start a flow run", logs=stack.logs())
    wait_for(lambda: _checkpoint_steps(job), RUN_TIMEOUT, "a first checkpoint", interval=0.2, logs=stack.logs())
    _kill_host(hosts[busy])
    return busy, max(_checkpoint_steps(job))


def _one_at_a_time(stack: PrefectStack, runs: list) -> tuple:
    """The lost run Crashed by the automation, and only then the other run taken and Completed."""
    finals = dict(zip([run.id for run in runs], _wait_final(stack, runs, ZOMBIE_AFTER + 2 * RUN_TIMEOUT)))
    crashed, resumed = sorted(runs, key=lambda run: _held_slot(stack, run))
    assert finals[crashed.id].name == "Crashed", finals[crashed.id]
    assert finals[crashed.id].message.startswith(f"No heartbeat for {ZOMBIE_AFTER} s"), finals[crashed.id].message
    assert finals[resumed.id].name == "Completed", (finals[resumed.id], stack.logs())
    (_, crashed_at), (taken_at, _) = _held_slot(stack, crashed), _held_slot(stack, resumed)
    assert taken_at >= crashed_at, (crashed_at, taken_at)
    # Before a worker took it, it only waited. Late: Prefect's name for a Scheduled run past its start time.
    # AwaitingConcurrencySlot: the pool's limit is read when a worker polls, and on PostgreSQL two polls at
    # the same instant can each be handed a run (rows are locked with SKIP LOCKED); the deployment's limit,
    # taken atomically with Pending, then parks the second run until the slot is free (docs/operations.md).
    history = [state.name for state in _history(stack, resumed)]
    assert set(history[:history.index("Pending")]) <= {"Scheduled", "Late", "AwaitingConcurrencySlot"}, history
    return crashed, resumed


def _resumed_on(stack: PrefectStack, run, job: Path, host_home: Path, checkpoint: int) -> None:
    """The run ran on that host's own disk and Prefect home (stage and tokenize ran again there), and resumed
    training from the checkpoint on the shared storage."""
    [path] = Path(yaml.safe_load(job.read_text())["work_dir"], "tiny").glob(f"*-{run.name}/report.json")
    report = json.loads(path.read_text())
    assert report["status"] == "passed"
    assert report["config"]["cache_dir"] == str(host_home / "cache")
    assert report["stages"]["train"]["result"]["resumed_from_step"] == checkpoint
    assert states(stack, run.id)[1]["stage"] == ["Completed"]


def _overlapped(stack: PrefectStack, runs: list) -> None:
    """Both Completed, each taken before the other ended."""
    assert [state.name for state in _wait_final(stack, runs, RUN_TIMEOUT)] == ["Completed", "Completed"]
    (first_taken, first_done), (second_taken, second_done) = (_held_slot(stack, run) for run in runs)
    assert first_taken < second_done and second_taken < first_done, (first_taken, first_done, second_taken,
                                                                       second_done)


def test_two_hosts_on_one_gpu_pool_with_postgres(stack, postgres, config_tree, tmp_path):
    job, hosts_dir = _job(config_tree, tmp_path / "shared"), tmp_path / "hosts"
    hosts = {name: _start_host(stack, name, hosts_dir) for name in ("host-a", "host-b")}
    runs = [_submit(stack, "phase1a/h100", {"config_file": str(job), "overrides": []}) for _ in range(2)]
    lost, last_checkpoint = _lose_the_busy_host(stack, hosts, job)
    # While the lost run holds the GPU pool's slot: two runs at once on the CPU pool, which has no limit.
    _start_host(stack, "cpu-host", hosts_dir, pool="phase1a-cpu")
    together = [_submit(stack, "phase1a/cpu", {"config": config_tree}) for _ in range(2)]

    crashed, resumed = _one_at_a_time(stack, runs)
    [survivor] = set(hosts) - {lost}
    _resumed_on(stack, resumed, job, hosts_dir / survivor, last_checkpoint)
    _overlapped(stack, together)

    # The server kept all of it in PostgreSQL, and made no SQLite database. (Scheduled: any nightly run the
    # scheduler made before the schedule was paused.)
    rows = dict(postgres.fetch("SELECT name, state_name FROM flow_run WHERE state_type <> 'SCHEDULED'"))
    assert rows == {run.name: state for run, state in ((crashed, "Crashed"), (resumed, "Completed"),
                                                       (together[0], "Completed"), (together[1], "Completed"))}, rows
    assert not list(stack.home.glob("*.db"))
