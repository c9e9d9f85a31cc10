"""Operations end to end, against one real Prefect server that `make server` starts for this module: the
Makefile's pools, deployments and automations read back from the API; then one nightly-like scenario on S3
data: kill -9 of a flow-run process, a worker killed with its run, the deployment run twice at once to
recover, and no planted credential anywhere.

Credentials are planted the two supported ways and no other AWS configuration exists: the key id and a
session token in the workers' environment, the secret key in a Secret block that the work pool's job
template names (the worker resolves it per run). The S3 stage can only succeed with all three. A Hugging Face
token (HF_TOKEN) sits in the workers' environment too, as on a host that pulls gated models.
"""
from __future__ import annotations

import http.server
import json
import secrets
import subprocess
import threading
import time
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest

from helpers.prefect_stack import (
    ROOT,
    PrefectStack,
    all_events,
    cmdline,
    descendants,
    dump,
    flow_run_logs,
    free_port,
    kill9,
    migrated_database,
    states,
    stop_group,
    task_window,
    wait_for,
)
from helpers.servers import s3_client
from phase1a.config.schema import ConfigError, load_config, validate_config

pytestmark = [pytest.mark.slow, pytest.mark.prefect_server]

PLANTED_KEY_ID = "AKIDPLANTEDOPS000001"
PLANTED_SECRET = "planted-secret-ops-5Jd8Qw3LzR"
PLANTED_TOKEN = "planted-token-ops-Vb7Kp2Xn4M"
PLANTED_HF_TOKEN = "hf_" + secrets.token_hex(17)  # a Hugging Face token, shaped like one, new each run
PLANTED_TRACKERS = {"MLFLOW_TRACKING_TOKEN": "planted-mlflow-ops-" + secrets.token_hex(8),
                    "WANDB_API_KEY": secrets.token_hex(20)}  # the trackers' keys, as a tracked host has them
SECRET_BLOCK = "phase1a-aws-secret-access-key"
TIMEZONE = "Europe/Berlin"
ZOMBIE_AFTER = 60  # seconds without a heartbeat; flow runs send one every 30 s (the minimum) in these tests
RUN_TIMEOUT = 300


def _report(config: dict, flow_run_name: str) -> dict:
    [path] = Path(config["work_dir"], config["name"]).glob(f"*-{flow_run_name}/report.json")
    return json.loads(path.read_text())


class _Hook(http.server.BaseHTTPRequestHandler):
    received: list[str] = []

    def do_POST(self):
        _Hook.received.append(self.rfile.read(int(self.headers.get("Content-Length", 0))).decode())
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def hook():
    """A local webhook that the failure-notification automation posts to."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), _Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/", _Hook.received
    server.shutdown()


@pytest.fixture(scope="module")
def ops(tmp_path_factory, hook):
    """`make server`, `make pools` (twice), `make deploy`, `make automations`, against a fresh PREFECT_HOME."""
    home = tmp_path_factory.mktemp("ops") / "prefect-home"
    migrated_database(home / "prefect.db")  # an empty database: `make server` finds nothing to migrate
    empty = home.parent / "aws-empty"
    empty.write_text("")
    stack = PrefectStack(home)
    for name in [name for name in stack.env if name.startswith("AWS_")]:  # nothing from the host's AWS set-up
        del stack.env[name]
    stack.env.update({"AWS_CONFIG_FILE": str(empty), "AWS_SHARED_CREDENTIALS_FILE": str(empty),
                      "AWS_EC2_METADATA_DISABLED": "true", "AWS_DEFAULT_REGION": "us-east-1",
                      "AWS_ACCESS_KEY_ID": PLANTED_KEY_ID, "AWS_SESSION_TOKEN": PLANTED_TOKEN,
                      "HF_TOKEN": PLANTED_HF_TOKEN, **PLANTED_TRACKERS})
    try:
        stack.make("server")
        assert "already running" in stack.make("server")  # a second `make server` starts nothing
        stack.make("pools")
        assert "phase1a-h100: exists (process, concurrency limit 1)" in stack.make("pools")
        stack.make("deploy", f"PHASE1A_TZ={TIMEZONE}")
        from prefect.blocks.notifications import CustomWebhookNotificationBlock

        with stack.client():
            CustomWebhookNotificationBlock(name="phase1a-test", url=hook[0],
                                           json_data={"text": "{{subject}}: {{body}}"}).save("phase1a-test")
        # CRASH_RETRIES=0: the crashed runs here are recovered by hand (retried by themselves: test_crash_retry.py)
        stack.make("automations", f"ZOMBIE_AFTER={ZOMBIE_AFTER}", "CRASH_RETRIES=0",
                   "NOTIFY_BLOCK=custom-webhook/phase1a-test")
        _secret_key_from_a_block(stack)
        yield stack
    finally:
        stack.stop()
        subprocess.run(["make", "-s", f"PREFECT_PORT={stack.port}", "server-stop"], cwd=ROOT, env=stack.env,
                       timeout=60)


def _secret_key_from_a_block(stack: PrefectStack) -> None:
    """docs/operations.md, "Credentials": a Secret block named in the pool's base job template, resolved by the
    worker."""
    from prefect.blocks.system import Secret
    from prefect.client.schemas.actions import WorkPoolUpdate

    with stack.client() as client:
        Secret(value=PLANTED_SECRET).save(SECRET_BLOCK)
        template = client.read_work_pool("phase1a-cpu").base_job_template
        template["variables"]["properties"]["env"]["default"] = {
            "AWS_SECRET_ACCESS_KEY": "{{ prefect.blocks.secret.%s }}" % SECRET_BLOCK}
        client.update_work_pool("phase1a-cpu", WorkPoolUpdate(base_job_template=template))


@contextmanager
def worker(stack: PrefectStack, name: str):
    """`make worker` on the CPU pool, heartbeats every 30 s; stopped (SIGTERM, then SIGKILL) on exit."""
    proc = stack.start(name, ["-s", f"PREFECT_PORT={stack.port}", "worker", "POOL=phase1a-cpu", "HEARTBEAT=30"],
                       program="make")
    log = stack.home / f"{name}.log"
    try:
        wait_for(lambda: "started!" in log.read_text() or proc.poll() is not None, 180, f"{name} to start")
        assert proc.poll() is None, stack.logs()
        yield proc
    finally:
        stop_group(proc)


def _submit(stack: PrefectStack, config: dict):
    with stack.client() as client:
        deployment = client.read_deployment_by_name("phase1a/cpu")
        return client.create_flow_run_from_deployment(deployment.id, parameters={"config": config})


def _state(stack: PrefectStack, flow_run):
    with stack.client() as client:
        return client.read_flow_run(flow_run.id).state


def _wait_final(stack: PrefectStack, flow_run, timeout: float = RUN_TIMEOUT):
    return wait_for(lambda: (state := _state(stack, flow_run)).is_final() and state, timeout,
                    f"flow run {flow_run.name} to finish", interval=2, logs=stack.logs())


def _checkpoint_steps(config: dict) -> list[int]:
    root = Path(config["work_dir"], config["name"])
    return sorted(int(p.parent.name.split("-")[1]) for p in root.glob("train-*/checkpoints/step-*/COMPLETE"))


def test_credentials_are_never_parameters(config_tree):
    for section, key in (("data", "aws_secret_access_key"), ("data", "aws_access_key_id"), ("model", "aws_profile")):
        tree = json.loads(json.dumps(config_tree))
        tree[section][key] = PLANTED_SECRET
        with pytest.raises(ConfigError, match=rf"{section}.{key}: Extra inputs are not permitted") as refused:
            validate_config(tree)
        assert PLANTED_SECRET not in str(refused.value)


def test_pools_schedule_and_templates_read_back_from_the_api(ops):
    output = "\n".join(ops.outputs)
    assert "phase1a-h100: created (process, concurrency limit 1)" in output
    assert "phase1a-k8s: created (kubernetes, concurrency limit None)" in output
    assert "crash flow runs that stopped sending heartbeats: created" in output
    with ops.client() as client:
        pools = {name: client.read_work_pool(name) for name in ("phase1a-cpu", "phase1a-h100", "phase1a-h200")}
        deployments = {name: client.read_deployment_by_name(f"phase1a/{name}") for name in ("cpu", "h100", "h200")}
    assert {name: (pool.type, pool.concurrency_limit) for name, pool in pools.items()} == {
        "phase1a-cpu": ("process", None), "phase1a-h100": ("process", 1), "phase1a-h200": ("process", 1)}

    for name, deployment in deployments.items():
        assert deployment.work_pool_name == f"phase1a-{name}" and deployment.entrypoint == "flows.phase1a:phase1a"
        # phase1a/cpu carries the demo config inline; the GPU deployments read their job from a config file.
        config = (validate_config(deployment.parameters["config"]) if name == "cpu"
                  else load_config(ROOT / deployment.parameters["config_file"]))
        assert config.hardware.target == name
        limit = deployment.global_concurrency_limit
        assert (limit.limit if limit else None) == (None if name == "cpu" else 1), name
    assert deployments["cpu"].schedules == [] and deployments["h200"].schedules == []
    [nightly] = deployments["h100"].schedules
    assert nightly.active and nightly.schedule.cron == "0 2 * * *" and nightly.schedule.timezone == TIMEZONE
    assert deployments["h100"].parameters == {"config_file": "configs/h100.yaml", "overrides": []}
    assert load_config(ROOT / "configs/h100.yaml").cache_dir == Path("/var/tmp/phase1a/cache")

    # The server's scheduler turns the cron into runs at 02:00 Berlin time (01:00 or 00:00 UTC).
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterDeploymentId

    def scheduled():
        with ops.client() as client:
            return client.read_flow_runs(flow_run_filter=FlowRunFilter(
                deployment_id=FlowRunFilterDeploymentId(any_=[deployments["h100"].id])))

    runs = wait_for(scheduled, 90, "the scheduler to create the nightly runs", interval=2, logs=ops.logs())
    starts = sorted(run.expected_start_time.astimezone(ZoneInfo(TIMEZONE)) for run in runs)
    assert all(run.state.name == "Scheduled" for run in runs)
    assert all((start.hour, start.minute) == (2, 0) for start in starts), starts
    assert all(later - earlier == timedelta(days=1) for earlier, later in zip(starts, starts[1:])), starts

    # `make pools` made the image pools from deployments/job_templates.py (the Kubernetes one is the committed
    # k8s-gpu-job-template.json) and `make deploy` put the image deployments on them, with the Makefile's image.
    from prefect.utilities.templating import apply_values

    with ops.client() as client:
        k8s, docker = client.read_work_pool("phase1a-k8s"), client.read_work_pool("phase1a-docker")
        anywhere = {name: client.read_deployment_by_name(f"phase1a/{name}")
                    for name in ("h100-git", "k8s-h100", "docker-h100")}
    assert (k8s.type, k8s.concurrency_limit, docker.type, docker.concurrency_limit) == ("kubernetes", None, "docker", 1)
    base = k8s.base_job_template
    assert base == json.loads((ROOT / "deployments" / "k8s-gpu-job-template.json").read_text())
    values = {key: spec["default"] for key, spec in base["variables"]["properties"].items()
              if spec.get("default") is not None}
    rendered = apply_values(base["job_configuration"], {**values, "image": "registry.example/phase1a:cuda",
                                                        "gpu_count": 8})
    pod = rendered["job_manifest"]["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"] == {"limits": {"nvidia.com/gpu": 8}, "requests": {"nvidia.com/gpu": 8}}
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert base["variables"]["required"] == ["image"]
    assert {name: (d.work_pool_name, d.job_variables) for name, d in anywhere.items()} == {
        "h100-git": ("phase1a-h100", {}),
        "k8s-h100": ("phase1a-k8s", {"image": "phase1a:latest", "gpu_count": 1, "pod_watch_timeout_seconds": 1800,
                                     "backoff_limit": 3}),
        "docker-h100": ("phase1a-docker", {"image": "phase1a:latest", "gpu_count": 1})}
    assert anywhere["h100-git"].pull_steps == [{"prefect.deployments.steps.git_clone": {
        "repository": "{{ prefect.variables.phase1a_repository }}",
        "branch": "{{ prefect.variables.phase1a_branch }}"}}]  # resolved on the worker, at each run
    assert all(d.pull_steps == [{"prefect.deployments.steps.set_working_directory": {"directory": "."}}]
               for name, d in anywhere.items() if name != "h100-git")  # the image's WORKDIR


def _engines(worker_proc) -> list[int]:
    """The flow-run processes (`python -m prefect.engine`) under a worker."""
    return [pid for pid in descendants(worker_proc.pid) if "prefect.engine" in cmdline(pid)]


def test_crash_recovery_and_a_duplicate_run_leak_no_credentials(ops, config_tree, endpoint, hook, mlflow_server):
    s3 = s3_client(endpoint, aws_access_key_id="testing", aws_secret_access_key="testing")
    s3.create_bucket(Bucket="nightly")
    s3.upload_file(config_tree["data"]["source"], "nightly", "data/part-000.jsonl")
    config = {**config_tree, "method": {**config_tree["method"], "epochs": 5},
              "checkpoint": {"interval": "2steps", "keep_last": 2},
              "data": {**config_tree["data"], "source": "s3://nightly/data/", "s3_endpoint_url": endpoint},
              "promotion": {"to": str(Path(config_tree["work_dir"]) / "promoted")}}

    with worker(ops, "worker-a") as worker_a:
        # 1. kill -9 the flow-run process once it has a checkpoint: the worker sees it die and reports Crashed.
        first = _submit(ops, config)
        engines = wait_for(lambda: _engines(worker_a), 120, "a flow-run process", logs=ops.logs())
        environ = Path(f"/proc/{engines[0]}/environ").read_bytes()
        assert PLANTED_SECRET.encode() in environ  # the block resolved
        assert PLANTED_HF_TOKEN.encode() in environ  # the worker passed the Hugging Face token on
        wait_for(lambda: _checkpoint_steps(config), RUN_TIMEOUT, "a first checkpoint", interval=0.2, logs=ops.logs())
        engines = _engines(worker_a)
        kill9(engines + [child for pid in engines for child in descendants(pid)])
        first_state = wait_for(lambda: (s := _state(ops, first)).is_final() and s, 60, "run 1 reported")
        resumed_from = max(_checkpoint_steps(config))

        # 2. the next run resumes; kill -9 the worker together with it, the way a lost machine would. Nothing
        # reports the run now: it stays Running until the zombie automation sees its heartbeats stop.
        second = _submit(ops, config)
        wait_for(lambda: max(_checkpoint_steps(config)) > resumed_from, RUN_TIMEOUT, "a checkpoint of run 2",
                 interval=0.2, logs=ops.logs())
        kill9([worker_a.pid, *descendants(worker_a.pid)])
        worker_a.wait(10)
        time.sleep(2)
    assert _state(ops, second).name == "Running"
    last_checkpoint = max(_checkpoint_steps(config))

    # 3. a new worker, and the deployment run twice (a manual rerun after the scheduled one): the first
    # resumes from run 2's last checkpoint, the second reuses the model; stage and tokenize are Cached for
    # both. Both are tracked (MLflow, W&B offline in the run directory): tracking is in no key.
    tracked = {**config, "tracking": {"mlflow": {"tracking_uri": mlflow_server}, "wandb": {"mode": "offline"}}}
    with worker(ops, "worker-b"):
        # One after the other: two at once race to promote (the later one's gate saw the pointer before the first
        # moved it, and promotion refuses it: PromotionConflict, by design); the lock between two runs at once
        # is tested in tests/operations/test_operations_postgres.py and tests/core/test_locks.py.
        again = [_submit(ops, tracked)]
        finals = [_wait_final(ops, again[0])]
        again.append(_submit(ops, tracked))
        finals.append(_wait_final(ops, again[1]))
    second_state = wait_for(lambda: (s := _state(ops, second)).is_final() and s, 150, "the zombie automation",
                            interval=2, logs=ops.logs())

    assert first_state.name == "Crashed" and "-9" in first_state.message, first_state
    assert second_state.name == "Crashed", second_state
    assert second_state.message.startswith(f"No heartbeat for {ZOMBIE_AFTER} s"), second_state.message
    assert [state.name for state in finals] == ["Completed", "Completed"], (finals, ops.logs())
    for run in again:
        name, tasks = states(ops, run.id)
        assert tasks["stage"] == ["Cached"] and tasks["tokenize"] == ["Cached"], tasks
    reports = [_report(config, run.name) for run in again]
    assert [report["status"] for report in reports] == ["passed", "passed"]
    assert reports[0]["stages"]["stage"]["result"]["objects"][0]["key"] == "data/part-000.jsonl"
    trains = [report["stages"]["train"]["result"] for report in reports]
    assert sorted(train["reused_completed_run"] for train in trains) == [False, True], trains
    trained, waited = (0, 1) if not trains[0]["reused_completed_run"] else (1, 0)
    assert trains[trained]["resumed_from_step"] == last_checkpoint > resumed_from, (trains, resumed_from)
    waiter_logs = "\n".join(flow_run_logs(ops, again[waited].id))
    # Whether the other run reaches its train stage before the first one's training ends is the scheduler's and
    # the load's: one that started it while the other trained waited on the lock and says so; one that started
    # after found the finished run (the lock alone: tests/core/test_locks.py).
    if task_window(ops, again[waited].id, "train")[0] < task_window(ops, again[trained].id, "train")[1]:
        assert f"is in use by flow run {again[trained].name}" in waiter_logs, waiter_logs  # they overlapped

    # One training, untangled by three crashes and a race: each step logged once and in order (a resumed run
    # trims what followed its checkpoint), one final adapter, one history record.
    [train_dir] = Path(config["work_dir"], config["name"]).glob("train-*/")
    steps = [json.loads(line)["step"] for line in (train_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, trains[trained]["steps"] + 1)), steps
    assert (train_dir / "final" / "COMPLETE").is_file() and not (train_dir / "final.partial").exists()
    assert len(Path(config["cache_dir"], "history.jsonl").read_text().splitlines()) == 1

    # Both passed the gate with the same adapter: one promoted it, the other found the pointer already on it.
    promotions = [report["stages"]["promote"]["result"] for report in reports]
    assert sorted(promotion["promoted"] for promotion in promotions) == [False, True], promotions
    pointer = json.loads(Path(config["promotion"]["to"], "promoted.json").read_text())
    assert {promotion["pointer"]["version"] for promotion in promotions} == {pointer["version"]}
    assert all(Path(pointer["path"], name).is_file() for name in pointer["files"]), pointer

    # The failure notification fired for both crashes.
    url, received = hook
    wait_for(lambda: all(any(run.name in body for body in received) for run in (first, second)), 60,
             "failure notifications", interval=1)
    assert any("Crashed" in body and first.name in body for body in received), received

    # Each tracked run has the whole curve in MLflow, the reused training's too (read back from its files).
    texts = _tracked_texts(mlflow_server, reports, trains[trained]["steps"], ops.home / "mlflow-artifacts")

    # No credential anywhere: API logs, events, artifacts, runs, deployments and pools, process output, files,
    # the trackers' runs.
    runs = [first, second, *again]
    texts["worker and server output"] = ops.logs() + "\n".join(ops.outputs)
    with ops.client() as client:
        texts["artifacts"] = dump([a.model_dump() for a in client.read_artifacts()])
        texts["flow runs"] = dump([client.read_flow_run(run.id).model_dump() for run in runs])
        texts["deployments"] = dump([d.model_dump() for d in client.read_deployments()])
        texts["work pools"] = dump([p.model_dump() for p in client.read_work_pools()])
    texts["events"] = dump(all_events(ops))
    for run in runs:
        texts[f"logs of {run.name}"] = "\n".join(flow_run_logs(ops, run.id))
    for path in [*Path(config["work_dir"]).rglob("*"), *ops.home.glob("*.log")]:
        if path.is_file() and path.suffix in (".json", ".jsonl", ".log", ".txt", ".lock", ".wandb", ".yaml", ""):
            texts[str(path)] = path.read_text(errors="replace")
    assert any(path.endswith("report.json") for path in texts) and any(path.endswith("plan.json") for path in texts)
    leaked = [where for where, text in texts.items()
              if any(planted in text for planted in (PLANTED_SECRET, PLANTED_KEY_ID, PLANTED_TOKEN, PLANTED_HF_TOKEN,
                                                     *PLANTED_TRACKERS.values()))]
    assert leaked == []
    assert any(path.endswith(".wandb") for path in texts)


def _tracked_texts(mlflow_server: str, reports: list[dict], steps: int, downloads: Path) -> dict[str, str]:
    """The tracked runs' MLflow params, tags and artifacts as text, after checking each run: finished, and
    one `loss` point per step."""
    from mlflow.tracking import MlflowClient

    client, texts = MlflowClient(mlflow_server), {}
    for report in reports:
        run_id = report["tracking"]["mlflow"]["run_id"]
        run = client.get_run(run_id)
        assert run.info.status == "FINISHED" and report["tracking"]["mlflow"]["dropped_metrics"] == 0, report
        assert [m.step for m in client.get_metric_history(run_id, "loss")] == list(range(1, steps + 1))
        assert Path(report["tracking"]["wandb"]["dir"]).is_relative_to(report["run_dir"])
        tags = run.data.tags  # the link back to the flow run, on the server's UI
        assert tags["prefect.flow_run_url"].endswith(f"/flow-runs/flow-run/{tags['prefect.flow_run_id']}"), tags
        texts[f"mlflow run {run_id}"] = json.dumps([run.data.params, tags])
        artifacts = Path(client.download_artifacts(run_id, "", str(downloads / run_id)))
        files = [path for path in artifacts.rglob("*") if path.is_file()]
        texts.update({str(path): path.read_bytes().decode("latin-1") for path in files})
    return texts
