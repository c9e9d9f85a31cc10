"""Several nodes on Kubernetes: the train task submits an Indexed Job of one pod a node and a headless Service for
the rendezvous, follows it, and deletes it when the run fails or is cancelled (docs/operations.md#several-nodes).

Pod i of Job `name` is `name-i.name` in the Service's DNS (`subdomain`), so every pod's torchrun agent joins the
c10d rendezvous on pod 0. The pods run the flow pod's image in its working directory and mount the same
ReadWriteMany volume at the same path: the run's settings, tokenized data and checkpoints are there, as on any
shared filesystem. `backoffLimit: 0`: a pod that fails fails the Job; the train stage then starts the group again
(a new Job) from the latest checkpoint. The client is the official `kubernetes` package's; `api` is anything with
BatchV1Api's and CoreV1Api's methods used here (a test passes a fake).
"""
from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from phase1a.config.schema import KubernetesNodes
from phase1a.core.logs import run_logger

POLL_SECONDS = 2.0
_RUN_LABEL = "phase1a.run"
_INDEX_LABEL = "batch.kubernetes.io/job-completion-index"


class KubernetesFailed(RuntimeError):
    """The Job failed: which pod, and why (its container's reason and exit code)."""


def object_name(run_id: str) -> str:
    """A DNS-1123 label for the Job and its Service: lowercase alphanumerics and dashes, short enough that
    `<name>-<index>` stays a valid pod hostname."""
    name = re.sub(r"[^a-z0-9-]+", "-", f"phase1a-{run_id}".lower()).strip("-")
    return name[:50].rstrip("-")


class PodGroup(BaseModel):
    """The pods of one launch: a node each."""

    name: str  # the Job's and the Service's (object_name)
    nodes: int
    gpus: int  # a node's
    port: int  # the rendezvous'
    agent: list[str]  # each pod's command: its torchrun agent
    cwd: Path  # the image's project directory


def manifests(settings: KubernetesNodes, group: PodGroup) -> tuple[dict, dict]:
    """(Service, Job) as the API takes them: one pod a node, each requesting the node's GPUs and running its
    agent, the rendezvous on the group's port."""
    name, nodes, gpus, port, agent, cwd = group.name, group.nodes, group.gpus, group.port, group.agent, group.cwd
    labels = {_RUN_LABEL: name}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "labels": labels},
               "spec": {"clusterIP": "None", "selector": labels, "publishNotReadyAddresses": True,
                        "ports": [{"name": "rendezvous", "port": port}]}}
    container = {
        "name": "agent", "image": settings.image, "command": agent, "workingDir": str(cwd),
        "resources": {"limits": {"nvidia.com/gpu": str(gpus)}, "requests": {"nvidia.com/gpu": str(gpus)}},
        "ports": [{"containerPort": port}],
        "volumeMounts": [{"name": "shared", "mountPath": settings.mount_path},
                         {"name": "dshm", "mountPath": "/dev/shm"}],
    }
    pod = {"metadata": {"labels": labels},
           "spec": {"subdomain": name, "restartPolicy": "Never", "containers": [container],
                    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                    "volumes": [{"name": "shared", "persistentVolumeClaim": {"claimName": settings.volume_claim}},
                                {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": settings.shm_size}}]}}
    if settings.gpu_product:
        pod["spec"]["nodeSelector"] = {"nvidia.com/gpu.product": settings.gpu_product}
    if settings.service_account:
        pod["spec"]["serviceAccountName"] = settings.service_account
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name, "labels": labels},
           "spec": {"completionMode": "Indexed", "completions": nodes, "parallelism": nodes, "backoffLimit": 0,
                    "ttlSecondsAfterFinished": 3600, "template": pod}}
    return service, job


def rendezvous_host(settings: KubernetesNodes, name: str) -> str:
    return f"{name}-0.{name}.{settings.namespace}.svc"


def check_shared(settings: KubernetesNodes, settings_path: Path) -> None:
    """The run's directory must be on the volume every pod mounts, at the same path."""
    if not settings_path.resolve().is_relative_to(Path(settings.mount_path)):
        raise ValueError(f"{settings_path.parent} is not under hardware.kubernetes.mount_path "
                         f"({settings.mount_path}): put work_dir and cache_dir on the shared volume "
                         f"{settings.volume_claim!r} so that every node's pod reads the run's files")


def run_job(api: Any, settings: KubernetesNodes, service: dict, job: dict) -> None:
    """Create the Service and the Job, follow pod 0's log into this run's, and return when every pod succeeded;
    a failed pod raises KubernetesFailed naming it. Anything else that ends the wait (a cancelled flow run, a
    signal) deletes the Job and the Service on the way out."""
    namespace, name = settings.namespace, job["metadata"]["name"]
    api.create_namespaced_service(namespace, service)
    succeeded = False
    try:
        api.create_namespaced_job(namespace, job)
        log = _LogFollower(api, namespace, name)
        while True:
            status = api.read_namespaced_job_status(name, namespace).status
            log.follow()
            if (status.succeeded or 0) >= job["spec"]["completions"]:
                succeeded = True
                return
            if status.failed:
                raise KubernetesFailed(f"Kubernetes Job {namespace}/{name}: {_failure(api, namespace, name)}")
            time.sleep(POLL_SECONDS)
    finally:
        if not succeeded:
            api.delete_namespaced_job(name, namespace, propagation_policy="Background")
        api.delete_namespaced_service(name, namespace)


class _LogFollower:
    """Pod 0's (rank 0's) log, line by line as it grows, into the run's log."""

    def __init__(self, api: Any, namespace: str, name: str) -> None:
        self.api, self.namespace, self.name, self.seen = api, namespace, name, 0

    def follow(self) -> None:
        pods = self.api.list_namespaced_pod(self.namespace, label_selector=f"{_RUN_LABEL}={self.name},"
                                                                           f"{_INDEX_LABEL}=0").items
        if not pods or pods[0].status.phase == "Pending":
            return
        text = self.api.read_namespaced_pod_log(pods[0].metadata.name, self.namespace)
        lines = text.splitlines()
        for line in lines[self.seen:]:
            run_logger().info(f"[node 0] {line}")
        self.seen = len(lines)


def _failure(api: Any, namespace: str, name: str) -> str:
    """Each failed pod's index, container reason and exit code."""
    pods = api.list_namespaced_pod(namespace, label_selector=f"{_RUN_LABEL}={name}").items
    said = []
    for pod in pods:
        if pod.status.phase != "Failed":
            continue
        index = (pod.metadata.labels or {}).get(_INDEX_LABEL, "?")
        states = [status.state.terminated for status in pod.status.container_statuses or []
                  if status.state and status.state.terminated]
        why = ", ".join(f"{state.reason} (exit {state.exit_code})" for state in states) or (pod.status.reason or
                                                                                          "failed")
        said.append(f"pod {pod.metadata.name} (node {index}): {why}")
    return "; ".join(said) or "the Job failed (no failed pod found: deleted, or evicted before it ran)"


def kubernetes_api() -> Any:
    """The in-cluster client (the flow runs in a pod), else the local kubeconfig's."""
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return _Api(client.BatchV1Api(), client.CoreV1Api())


class _Api:
    """BatchV1Api and CoreV1Api as one object: the calls above, each to its API."""

    def __init__(self, batch: Any, core: Any) -> None:
        self.batch, self.core = batch, core

    def __getattr__(self, method: str):
        return getattr(self.batch if hasattr(self.batch, method) else self.core, method)
