"""The deployments that run anywhere (deployments/prefect.yaml): phase1a/k8s-h100 and phase1a/docker-h100 run this
project's image, phase1a/h100-git clones the code at each run. On the session's Prefect server: `make pools`'s
ensure_pools makes the kubernetes and docker pools from deployments/job_templates.py; each deployment is created
with the job variables and pull steps `prefect deploy` stores from the file; a flow run of it is prepared as its
worker prepares one (`resolve_for_flow_run`: the pool's base job template, the deployment's job variables, the
flow run) and submitted by prefect-kubernetes' and prefect-docker's own workers to a fake Kubernetes API server and
a fake Docker Engine over HTTP (tests/helpers/fake_apis.py). What they were sent is checked: image, command, GPU
request, pod watch timeout, and no credential of the worker's. No cluster, no Docker daemon."""
from __future__ import annotations

import asyncio
import base64
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers.fake_apis import docker_routes, kubernetes_routes, serve
from phase1a.core.units import GIB

pytestmark = [pytest.mark.prefect_server]

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "registry.example.com/ml/phase1a:2026-11-28"
# What a worker's host holds and a pod or container must never be handed in its manifest.
PLANTED = {"AWS_ACCESS_KEY_ID": "AKIDPLANTEDANYWHERE01", "AWS_SECRET_ACCESS_KEY": "planted-secret-anywhere-8Hq2",
           "HF_TOKEN": "hf_plantedanywhere0123456789abcdef"}
PLANTED_API_KEY = "pnu_plantedanywhere0123456789abcdef"


def _loaded(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ops = _loaded("phase1a_ops", ROOT / "deployments" / "ops.py")
job_templates = _loaded("phase1a_job_templates", ROOT / "deployments" / "job_templates.py")


@pytest.fixture(autouse=True)
def deploying_shell(monkeypatch):
    monkeypatch.setenv("PHASE1A_IMAGE", IMAGE)  # as `make deploy PHASE1A_IMAGE=...` sets it


def deployment_spec(name: str) -> dict:
    """A deployment of prefect.yaml as `prefect deploy` stores it: its `{{ $VAR }}` placeholders filled from the
    deploying shell's environment (PHASE1A_IMAGE), its pull steps as written (they are resolved on the worker)."""
    from prefect.utilities.templating import apply_values

    [spec] = [d for d in yaml.safe_load((ROOT / "deployments" / "prefect.yaml").read_text())["deployments"]
              if d["name"] == name]
    pull = spec.pop("pull")
    return {**apply_values(spec, dict(os.environ), remove_notset=False), "pull": pull}


async def _flow_run(client, name: str, **run_options):
    """The deployment created from prefect.yaml on its pool, and a flow run of it."""
    spec = deployment_spec(name)
    flow_id = await client.create_flow_from_name("phase1a")
    deployment_id = await client.create_deployment(
        flow_id=flow_id, name=spec["name"], entrypoint=spec["entrypoint"], parameters=spec["parameters"],
        work_pool_name=spec["work_pool"]["name"], work_queue_name=spec["work_pool"]["work_queue_name"],
        job_variables=spec["work_pool"].get("job_variables", {}), pull_steps=spec["pull"])
    flow_run = await client.create_flow_run_from_deployment(deployment_id, **run_options)
    return spec, flow_run, await client.read_work_pool(spec["work_pool"]["name"])


@pytest.fixture(scope="module")
def pools():
    """`make pools` on the session's server, twice: the second finds everything in place."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return ops.ensure_pools(client), ops.ensure_pools(client)


@pytest.fixture
def worker_host(monkeypatch):
    """The worker's environment: AWS and Hub credentials, and (as with Prefect Cloud) an API key that
    prefect-kubernetes is told to keep in a Kubernetes Secret."""
    for name, value in PLANTED.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("PREFECT_INTEGRATIONS_KUBERNETES_WORKER_CREATE_SECRET_FOR_API_KEY", "true")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # not inside a cluster


def test_make_pools_creates_the_image_pools_with_phase1a_templates(pools):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolUpdate

    first, second = pools
    assert "phase1a-k8s: created (kubernetes, concurrency limit None)" in first
    assert "phase1a-docker: created (docker, concurrency limit 1)" in first
    assert "phase1a-h100: exists (process, concurrency limit 1)" in second
    assert "phase1a-k8s: exists (kubernetes, concurrency limit None)" in second
    with get_client(sync_client=True) as client:
        k8s, docker = client.read_work_pool("phase1a-k8s"), client.read_work_pool("phase1a-docker")
        assert k8s.base_job_template == json.loads((ROOT / "deployments" / "k8s-gpu-job-template.json").read_text())
        assert docker.base_job_template == job_templates.docker_job_template()
        # A pool's template edited since (a Secret's reference, say) is kept, unless asked for.
        edited = {**docker.base_job_template, "variables": {**docker.base_job_template["variables"],
                                                            "description": "edited"}}
        client.update_work_pool("phase1a-docker", WorkPoolUpdate(base_job_template=edited))
        assert any("phase1a-docker: its base job template differs" in line for line in ops.ensure_pools(client))
        assert client.read_work_pool("phase1a-docker").base_job_template == edited
        assert "phase1a-docker: base job template replaced" in ops.ensure_pools(client, replace_templates=True)
        assert client.read_work_pool("phase1a-docker").base_job_template == job_templates.docker_job_template()


def _kubeconfig(server: str) -> dict:
    """A cluster config (the pool's `cluster_config` variable) that reaches the fake API server, no user creds."""
    return {"config": {"apiVersion": "v1", "kind": "Config", "current-context": "fake",
                       "clusters": [{"name": "fake", "cluster": {"server": server}}],
                       "users": [{"name": "fake", "user": {}}],
                       "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}]},
            "context_name": "fake"}


def _as_the_api_server_reads_it(manifest: dict) -> dict:
    """prefect-kubernetes' default template puts parallelism and completions in the pod spec (its worker refuses a
    template without them there); they belong to the Job spec, so the API server ignores them, as the client's
    models drop them. A resource quantity sent as a JSON number is a quantity as much as its text is (the models
    take only the text). Everything else must survive the models."""
    manifest = json.loads(json.dumps(manifest))
    pod = manifest["spec"]["template"]["spec"]
    for key in ("parallelism", "completions"):
        assert pod.pop(key) == 1
    for container in pod["containers"]:
        for kind, amounts in container["resources"].items():
            container["resources"][kind] = {name: str(amount) for name, amount in amounts.items()}
    return manifest


def test_the_kubernetes_deployment_submits_a_gpu_job_of_the_image_without_credentials(pools, worker_host):
    from kubernetes.client import ApiClient
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_KEY, temporary_settings
    from prefect_kubernetes.worker import KubernetesWorker, KubernetesWorkerJobConfiguration

    async def submit(server: str):
        async with get_client() as client:
            spec, flow_run, pool = await _flow_run(client, "k8s-h100",
                                                   job_variables={"cluster_config": _kubeconfig(server)})
            with temporary_settings({PREFECT_API_KEY: PLANTED_API_KEY}):
                config = await KubernetesWorkerJobConfiguration.resolve_for_flow_run(
                    flow_run, client=client, work_pool=pool, worker_name="k8s-worker")
            result = await KubernetesWorker(work_pool_name=pool.name).run(flow_run, config)
            return spec, flow_run, config, result

    with serve(kubernetes_routes()) as cluster:
        spec, flow_run, config, result = asyncio.run(submit(cluster.url))
    [created] = cluster.sent("POST", "/apis/batch/v1/namespaces/default/jobs")
    [secret] = cluster.sent("POST", "/api/v1/namespaces/default/secrets")
    manifest = created.body
    assert result.status_code == 0 and result.identifier == "default:" + manifest["metadata"]["name"]

    # The job as Kubernetes' own models read it: nothing misspelt, nothing dropped.
    read = _as_the_api_server_reads_it(manifest)
    job = ApiClient().deserialize(json.dumps(read), "V1Job", "application/json")
    assert ApiClient().sanitize_for_serialization(job) == read
    pod = job.spec.template.spec
    [container] = pod.containers
    assert container.image == IMAGE == spec["work_pool"]["job_variables"]["image"]
    assert container.command == ["/usr/bin/env"] and container.args == ["prefect", "flow-run", "execute"]
    assert container.resources.limits == container.resources.requests == {"nvidia.com/gpu": "1"}
    assert pod.node_selector == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"} and pod.restart_policy == "Never"
    assert config.pod_watch_timeout_seconds == 1800 >= 900
    assert job.spec.backoff_limit == 3
    assert job.spec.pod_failure_policy.rules[0].on_pod_conditions[0].type == "DisruptionTarget"
    env = {item.name: item.value for item in container.env}
    assert env["PREFECT__FLOW_RUN_ID"] == str(flow_run.id)
    assert env["PREFECT_FLOW_RUN_EXECUTE_SIGTERM_BEHAVIOR"] == "relinquish"  # Kubernetes retries, the run goes on
    assert [source.secret_ref.name for source in container.env_from] == ["phase1a-store"]
    assert job.metadata.labels["prefect.io/flow-run-id"] == str(flow_run.id)

    # No credential of the worker's host in the manifest; the API key went into a Secret the pod reads.
    text = json.dumps(manifest)
    assert [name for name, value in {**PLANTED, "PREFECT_API_KEY": PLANTED_API_KEY}.items() if value in text] == []
    [api_key] = [item for item in container.env if item.name == "PREFECT_API_KEY"]
    assert api_key.value is None and api_key.value_from.secret_key_ref.name == secret.body["metadata"]["name"]
    assert base64.b64decode(secret.body["data"]["value"]).decode() == PLANTED_API_KEY


def test_the_docker_deployment_starts_the_image_with_a_gpu_device_request(pools, worker_host, monkeypatch):
    from prefect.client.orchestration import get_client
    from prefect_docker.worker import DockerWorker, DockerWorkerJobConfiguration

    async def prepared():
        async with get_client() as client:
            spec, flow_run, pool = await _flow_run(client, "docker-h100")
            config = await DockerWorkerJobConfiguration.resolve_for_flow_run(
                flow_run, client=client, work_pool=pool, worker_name="docker-worker")
            return spec, flow_run, config

    spec, flow_run, config = asyncio.run(prepared())
    with serve(docker_routes()) as engine:
        monkeypatch.setenv("DOCKER_HOST", engine.url.replace("http://", "tcp://"))
        container, _ = DockerWorker(work_pool_name="phase1a-docker")._create_and_start_container(config)
    [created] = engine.sent("POST", r"/v[0-9.]+/containers/create")
    body = created.body
    assert body["Image"] == IMAGE == spec["work_pool"]["job_variables"]["image"]
    assert body["Entrypoint"] == ["/usr/bin/env"] and body["Cmd"] == ["prefect", "flow-run", "execute"]
    [gpus] = body["HostConfig"]["DeviceRequests"]
    assert (gpus["Driver"], gpus["Count"], gpus["Capabilities"]) == ("nvidia", 1, [["gpu"]])  # docker run --gpus 1
    assert body["HostConfig"]["ShmSize"] == 16 * GIB
    assert body["HostConfig"]["Ulimits"] == [{"Name": "memlock", "Soft": -1, "Hard": -1}]
    assert body["HostConfig"]["Binds"] == ["phase1a-cache:/var/tmp/phase1a"]  # a named volume the box keeps
    assert engine.sent("POST", r"/v[0-9.]+/containers/[0-9a-f]+/start")  # started, from the image on the host
    assert not engine.sent("POST", r"/v[0-9.]+/images/create")  # IfNotPresent: no pull of a local image
    env = dict(item.split("=", 1) for item in body["Env"])
    assert env["PREFECT__FLOW_RUN_ID"] == str(flow_run.id)
    text = json.dumps(body)
    assert [name for name, value in PLANTED.items() if value in text] == []


def test_the_git_deployment_clones_the_repository_a_variable_names(tmp_path, monkeypatch):
    """phase1a/h100-git's pull step, run as its worker's flow-run process runs it: the Prefect variables are read
    on the server when the run starts, the repository is cloned into the run's directory, and the flow's module
    path is found in the clone."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import VariableCreate
    from prefect.deployments.steps.core import run_steps

    source = tmp_path / "origin"  # the project's repository as a remote holds it: its committed tree
    subprocess.run(["git", "clone", "--quiet", "--depth", "1", f"file://{ROOT}", str(source)], check=True,
                   timeout=120)
    with get_client(sync_client=True) as client:
        for name in ("phase1a_repository", "phase1a_branch"):
            if client.read_variable_by_name(name):
                client.delete_variable_by_name(name)
        client.create_variable(VariableCreate(name="phase1a_repository", value=f"file://{source}"))
    steps = deployment_spec("h100-git")["pull"]
    assert [next(iter(step)) for step in steps] == ["prefect.deployments.steps.git_clone"]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    monkeypatch.chdir(run_dir)
    output = asyncio.run(run_steps(steps))  # phase1a_branch unset: the default branch
    clone = run_dir / output["directory"]
    assert (clone / "flows" / "phase1a.py").is_file() and (clone / "configs" / "h100.yaml").is_file()
    # Prefect imports the entrypoint's module with the clone first on sys.path (importtools.load_module).
    found = subprocess.run([sys.executable, "-c", "import importlib.util, sys; sys.path.insert(0, '.'); "
                            "print(importlib.util.find_spec('flows.phase1a').origin)"],
                           cwd=clone, capture_output=True, text=True, timeout=60, check=True)
    assert Path(found.stdout.strip()) == clone / "flows" / "phase1a.py"
