"""The Kubernetes GPU job template (deployments/k8s-gpu-job-template.json) rendered as Prefect's worker renders
it, then read by the official Kubernetes client's models: a manifest the API server would accept, whose pod
keeps nothing on the node (a scratch emptyDir; what outlives it is in the job's store) and gives training time
to upload its last checkpoint after SIGTERM. No cluster runs here; tests/test_operations.py creates a work pool
from the same file on a real Prefect server."""
from __future__ import annotations

import json
from pathlib import Path

from kubernetes.client import ApiClient
from prefect.utilities.templating import apply_values

from phase1a.config.schema import load_config
from phase1a.core.units import parse_duration_seconds

ROOT = Path(__file__).resolve().parents[1]


def as_job(manifest: dict):
    """The manifest as the API client reads an answer's body: a V1Job."""
    return ApiClient().deserialize(json.dumps(manifest), "V1Job", "application/json")


def quantities_as_text(manifest: dict) -> dict:
    """Resource quantities as the API server reads them: a JSON number is a Quantity as much as its decimal text
    is (the client's models take only the text)."""
    manifest = json.loads(json.dumps(manifest))
    for container in manifest["spec"]["template"]["spec"]["containers"]:
        for kind, amounts in container["resources"].items():
            container["resources"][kind] = {name: str(amount) for name, amount in amounts.items()}
    return manifest


def rendered_job(**values) -> dict:
    template = json.loads((ROOT / "deployments" / "k8s-gpu-job-template.json").read_text())
    defaults = {key: spec["default"] for key, spec in template["variables"]["properties"].items() if "default" in spec}
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
    assert pod.restart_policy == "Never" and job.spec.backoff_limit == 0


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
