"""The Kubernetes GPU job template (deployments/k8s-gpu-job-template.json, written by deployments/job_templates.py
from prefect-kubernetes' default) rendered as Prefect's worker renders it, then read by the official Kubernetes
client's models: a manifest the API server would accept, whose pod keeps nothing on the node (a scratch emptyDir;
what outlives it is in the job's store) and gives training time to upload its last checkpoint after SIGTERM. No
cluster runs here; tests/operations/test_deployments_anywhere.py submits a deployment's job through
prefect-kubernetes' worker to a fake API server, and tests/operations/test_operations.py reads the pool
`make pools` made back from a real server."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from kubernetes.client import ApiClient
from prefect.utilities.templating import apply_values

from phase1a.config.schema import load_config
from phase1a.core.units import parse_duration_seconds

ROOT = Path(__file__).resolve().parents[2]


def as_job(manifest: dict):
    """The manifest as the API client reads an answer's body: a V1Job."""
    return ApiClient().deserialize(json.dumps(manifest), "V1Job", "application/json")


def quantities_as_text(manifest: dict) -> dict:
    """The manifest as the API server reads it: a resource quantity sent as a JSON number is a Quantity as much as
    its decimal text is (the client's models take only the text); parallelism and completions, which
    prefect-kubernetes' default template puts in the pod spec (its worker refuses a template without them there),
    belong to the Job spec and are ignored there, as the models drop them."""
    manifest = json.loads(json.dumps(manifest))
    pod = manifest["spec"]["template"]["spec"]
    assert (pod.pop("parallelism"), pod.pop("completions")) == (1, 1)
    for container in pod["containers"]:
        for kind, amounts in container["resources"].items():
            container["resources"][kind] = {name: str(amount) for name, amount in amounts.items()}
    return manifest


def rendered_job(**values) -> dict:
    template = json.loads((ROOT / "deployments" / "k8s-gpu-job-template.json").read_text())
    # A null default leaves its key out, as a value never given does (the worker fills in the command later).
    defaults = {key: spec["default"] for key, spec in template["variables"]["properties"].items()
                if spec.get("default") is not None}
    manifest = apply_values(template["job_configuration"], {**defaults, "image": "registry.example/phase1a:cuda",
                                                             "name": "nightly", **values})["job_manifest"]
    return manifest


def test_the_template_renders_a_job_the_kubernetes_models_accept_whole():
    manifest = quantities_as_text(rendered_job(gpu_count=8))
    job = as_job(manifest)
    # Read back through the models: a misspelt key would be dropped on the way and the two would differ.
    assert ApiClient().sanitize_for_serialization(job) == manifest
    pod = job.spec.template.spec
    assert pod.containers[0].resources.limits == {"nvidia.com/gpu": "8"}
    assert pod.restart_policy == "Never" and job.spec.backoff_limit == 3  # each retry resumes from the store
    assert pod.containers[0].command == ["/usr/bin/env"]  # the image's entry point (the phase1a CLI) set aside


def test_the_file_is_what_job_templates_makes_from_the_installed_prefect_kubernetes():
    spec = importlib.util.spec_from_file_location("phase1a_job_templates", ROOT / "deployments" / "job_templates.py")
    templates = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(templates)
    written = (ROOT / "deployments" / "k8s-gpu-job-template.json").read_text()
    assert written == templates.as_json(templates.kubernetes_job_template()), \
        "regenerate it: python deployments/job_templates.py --write"


def test_the_pod_keeps_nothing_on_the_node_and_has_time_for_its_last_upload():
    pod = as_job(quantities_as_text(rendered_job())).spec.template.spec
    volumes = {volume.name: volume for volume in pod.volumes}
    assert all(volume.host_path is None for volume in volumes.values())
    assert volumes["phase1a-scratch"].empty_dir.size_limit == "200Gi"
    mounts = {mount.mount_path: mount.name for mount in pod.containers[0].volume_mounts}
    assert mounts["/var/tmp/phase1a"] == "phase1a-scratch"  # where configs/h100.yaml's caches and staging live
    job = load_config(ROOT / "configs" / "h100.yaml")
    assert job.store.url is not None and job.store.url.startswith("s3://")
    assert all(str(path).startswith("/var/tmp/phase1a") for path in (job.cache_dir, job.data.staging_dir))
    assert parse_duration_seconds(job.checkpoint.grace_period) < pod.termination_grace_period_seconds == 120
