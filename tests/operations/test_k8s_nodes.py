"""Several nodes on Kubernetes (phase1a/train/k8s_nodes.py): the Service and Indexed Job the train stage would submit
for 2 nodes x 8 GPUs, read back by the official client's models; and the submit, watch and cancel logic against a
fake API that answers with the client's own types (no cluster runs here)."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from kubernetes.client import (
    ApiClient,
    V1ContainerState,
    V1ContainerStateTerminated,
    V1ContainerStatus,
    V1Job,
    V1JobStatus,
    V1ObjectMeta,
    V1Pod,
    V1PodList,
    V1PodStatus,
)

from phase1a.config.schema import HardwareConfig, KubernetesNodes
from phase1a.train import k8s_nodes
from phase1a.train.launch import Launch, LaunchError, launch_for, on_kubernetes
from phase1a.train.rank import ENTRY

K8S = KubernetesNodes(image="registry.example/phase1a:cuda", namespace="training", volume_claim="phase1a-shared",
                      mount_path="/shared", gpu_product="NVIDIA-H100-80GB-HBM3")
LAUNCH = Launch(processes=8, nodes=2, launcher="kubernetes", kubernetes=K8S, run_id="train-0719b9ef46202c81-0",
                entry=ENTRY)
SETTINGS = Path("/shared/runs/job/train-0719b9ef46202c81/settings.json")
NAME = "phase1a-train-0719b9ef46202c81-0"


@pytest.fixture(autouse=True)
def no_wait(monkeypatch):
    monkeypatch.setattr(k8s_nodes, "POLL_SECONDS", 0.0)  # the fake cluster answers at once


def read_back(manifest: dict, kind: str):
    """The manifest as the API client reads an answer's body, and that object written out again: a key the
    client's model does not know would be missing from the second."""
    client = ApiClient()
    model = client.deserialize(json.dumps(manifest), kind, "application/json")
    return model, client.sanitize_for_serialization(model)


class FakeCluster:
    """BatchV1Api and CoreV1Api as the launcher calls them. The test plays the cluster: `script[n]` is the Job's
    status and its pods at the n-th look (the last repeats); `interrupt_at` raises KeyboardInterrupt there, as a
    cancelled flow run's signal interrupts the wait."""

    def __init__(self, script: list[tuple[V1JobStatus, list[V1Pod], str]], interrupt_at: int | None = None):
        self.script, self.interrupt_at, self.looks = script, interrupt_at, 0
        self.services, self.jobs, self.deleted = {}, {}, []

    def create_namespaced_service(self, namespace, body):
        self.services[(namespace, body["metadata"]["name"])] = body

    def create_namespaced_job(self, namespace, body):
        self.jobs[(namespace, body["metadata"]["name"])] = body

    def _now(self):
        return self.script[min(self.looks, len(self.script) - 1)]

    def read_namespaced_job_status(self, name, namespace):
        assert (namespace, name) in self.jobs
        if self.interrupt_at is not None and self.looks == self.interrupt_at:
            raise KeyboardInterrupt
        self.looks += 1
        return V1Job(metadata=V1ObjectMeta(name=name), status=self._now()[0])

    def list_namespaced_pod(self, namespace, label_selector):
        wanted = dict(part.split("=") for part in label_selector.split(","))
        return V1PodList(items=[pod for pod in self._now()[1]
                                if all(pod.metadata.labels.get(key) == value for key, value in wanted.items())])

    def read_namespaced_pod_log(self, name, namespace):
        return self._now()[2]

    def delete_namespaced_job(self, name, namespace, propagation_policy):
        self.deleted.append(("job", name, propagation_policy))

    def delete_namespaced_service(self, name, namespace):
        self.deleted.append(("service", name))


def pod(index: int, phase: str, terminated: V1ContainerStateTerminated | None = None) -> V1Pod:
    statuses = [V1ContainerStatus(name="agent", image="i", image_id="", ready=False, restart_count=0,
                                  state=V1ContainerState(terminated=terminated))] if terminated else None
    return V1Pod(metadata=V1ObjectMeta(name=f"{NAME}-{index}-x7k2p", labels={
        "phase1a.run": NAME, "batch.kubernetes.io/job-completion-index": str(index)}),
        status=V1PodStatus(phase=phase, container_statuses=statuses))


def test_two_nodes_of_eight_gpus_as_a_service_and_an_indexed_job_the_client_reads_back(tmp_path):
    cluster = FakeCluster([(V1JobStatus(succeeded=2), [], "")])
    on_kubernetes(LAUNCH, SETTINGS, Path("/app"), cluster)
    service_manifest = cluster.services[("training", NAME)]
    job_manifest = cluster.jobs[("training", NAME)]
    service, written = read_back(service_manifest, "V1Service")
    assert written == service_manifest and service.spec.cluster_ip == "None"
    job, written = read_back(job_manifest, "V1Job")
    assert written == job_manifest  # nothing misspelt, nothing dropped
    spec, pod_spec = job.spec, job.spec.template.spec
    assert (spec.completion_mode, spec.completions, spec.parallelism, spec.backoff_limit) == ("Indexed", 2, 2, 0)
    assert pod_spec.subdomain == NAME and service.spec.selector == job.spec.template.metadata.labels
    [container] = pod_spec.containers
    assert container.resources.limits == {"nvidia.com/gpu": "8"} and container.working_dir == "/app"
    assert container.command[1:7] == ["--nnodes=2", "--nproc_per_node=8", "--rdzv_backend=c10d",
                                      f"--rdzv_endpoint={NAME}-0.{NAME}.training.svc:29400",
                                      f"--rdzv_id={LAUNCH.run_id}", "--max_restarts=3"]
    assert container.command[-1] == str(SETTINGS)
    assert {v.name: v.persistent_volume_claim and v.persistent_volume_claim.claim_name
            for v in pod_spec.volumes} == {"shared": "phase1a-shared", "dshm": None}
    assert pod_spec.node_selector == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert len(f"{NAME}-1") <= 63 and NAME == NAME.lower()
    assert cluster.deleted == [("service", NAME)]  # a finished Job stays for its TTL, with its pods' logs


def test_node_zeros_log_is_followed_until_the_job_succeeds(caplog):
    caplog.set_level(logging.INFO, logger="phase1a")
    running = [pod(0, "Running"), pod(1, "Running")]
    cluster = FakeCluster([(V1JobStatus(active=2), [pod(0, "Pending"), pod(1, "Pending")], ""),
                           (V1JobStatus(active=2), running, "step 1 loss 2.31\n"),
                           (V1JobStatus(active=2), running, "step 1 loss 2.31\nstep 2 loss 2.05\n"),
                           (V1JobStatus(succeeded=2), running, "step 1 loss 2.31\nstep 2 loss 2.05\n")])
    on_kubernetes(LAUNCH.model_copy(update={"max_restarts": 0}), SETTINGS, Path("/app"), cluster)
    lines = [record.getMessage() for record in caplog.records if record.getMessage().startswith("[node 0]")]
    assert lines == ["[node 0] step 1 loss 2.31", "[node 0] step 2 loss 2.05"]  # each line once


def test_a_failed_pod_fails_the_launch_naming_it_and_the_job_is_deleted():
    killed = V1ContainerStateTerminated(reason="OOMKilled", exit_code=137)
    cluster = FakeCluster([(V1JobStatus(active=2), [pod(0, "Running"), pod(1, "Running")], ""),
                           (V1JobStatus(active=1, failed=1), [pod(0, "Running"), pod(1, "Failed", killed)], "")])
    failure = rf"Job training/{NAME}: pod {NAME}-1-x7k2p \(node 1\): OOMKilled \(exit 137\)"
    with pytest.raises(LaunchError, match=failure):
        on_kubernetes(LAUNCH, SETTINGS, Path("/app"), cluster)
    assert cluster.deleted == [("job", NAME, "Background"), ("service", NAME)]


def test_a_cancelled_run_deletes_the_job_and_its_service():
    cluster = FakeCluster([(V1JobStatus(active=2), [pod(0, "Running"), pod(1, "Running")], "")], interrupt_at=1)
    with pytest.raises(KeyboardInterrupt):
        on_kubernetes(LAUNCH, SETTINGS, Path("/app"), cluster)
    assert cluster.deleted == [("job", NAME, "Background"), ("service", NAME)]


def test_the_run_must_be_on_the_shared_volume_and_the_config_picks_kubernetes():
    with pytest.raises(ValueError, match="not under hardware.kubernetes.mount_path \\(/shared\\).*'phase1a-shared'"):
        on_kubernetes(LAUNCH, Path("/var/tmp/runs/train-x/settings.json"), Path("/app"), FakeCluster([]))
    launch = launch_for(HardwareConfig(num_gpus=8, num_nodes=2, kubernetes=K8S), "train-abc")
    assert (launch.launcher, launch.kubernetes, launch.world_size) == ("kubernetes", K8S, 16)
