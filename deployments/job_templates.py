"""The base job templates of phase1a's image pools: prefect-kubernetes' and prefect-docker's own default templates
(as the installed workers give them), adjusted for a GPU training run from this project's image.

    python deployments/job_templates.py kubernetes   # print one as JSON (docker: the other one), e.g. for
                                                     # `prefect work-pool create --base-job-template`
    python deployments/job_templates.py --write      # rewrite deployments/k8s-gpu-job-template.json

`make pools` (deployments/ops.py) creates phase1a-k8s and phase1a-docker with them. Both run the image's code:
the image's entry point is the `phase1a` CLI, so the container's entry point becomes `/usr/bin/env` and the
worker's command (`prefect flow-run execute`) runs as it is given.
"""
from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

KUBERNETES_TEMPLATE_FILE = Path(__file__).with_name("k8s-gpu-job-template.json")
ENTRYPOINT = ["/usr/bin/env"]
SCRATCH = "/var/tmp/phase1a"  # configs/h100.yaml's caches and staging: scratch of the pod or container
# A node added by the autoscaler for a GPU pod, then a multi-GB CUDA image pulled onto it, take minutes; a worker
# that waits for the pod to be created gives up after this long (prefect-kubernetes' default is 60 s).
POD_WATCH_TIMEOUT = 1800
# Every try resumes from the job's store (its last uploaded checkpoint), so Kubernetes may retry a failed pod:
# an OOM-killed or crashed one, up to this many times. Evictions (a spot node reclaimed, a drain) are not
# counted (podFailurePolicy below). With a limit above 0 prefect-kubernetes tells the run to relinquish its
# state on SIGTERM, so the retried pod takes the same flow run up again.
BACKOFF_LIMIT = 3


def _variable(title: str, description: str, kind: str, default=None, **extra) -> dict:
    spec = {"title": title, "description": description, "type": kind, **extra}
    return spec if default is None else {**spec, "default": default}


IMAGE = ("This project's image (`make image`, pushed where the nodes pull from): CUDA torch and the project, its "
         "WORKDIR the project root, where a relative config_file such as configs/h100.yaml is found.")
GPU_COUNT = _variable("GPUs", "nvidia.com/gpu requested and limited per job (the NVIDIA device plugin must run on "
                      "the nodes); hardware.num_gpus in the job's config should match.", "integer", 1, minimum=1)
STORE_SECRET = _variable(
    "Store Secret", "A Kubernetes Secret whose keys become the pod's environment (envFrom, optional: a missing "
    "Secret is skipped), e.g. AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY for the job's store, HF_TOKEN. Only its "
    "name is in the manifest. Without one, give the pod's service account a cloud role (IRSA, Workload Identity).",
    "string", "phase1a-store")
KUBERNETES_VARIABLES = {
    "gpu_count": GPU_COUNT,
    "node_selector": _variable(
        "Node Selector", "Labels a node must carry. The default is GPU Feature Discovery's product label for H100 "
        "SXM; use NVIDIA-H200 for H200 nodes.", "object", {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
        additionalProperties={"type": "string"}),
    "scratch_size": _variable(
        "Scratch Size", f"The pod's scratch disk (an emptyDir at {SCRATCH}: staging, caches, the training "
        "directory), gone with the pod. What must outlive it goes to the job's store (config `store: s3://...`): "
        "checkpoints, tokenized shards, the throughput history, reports. Size it for the staged data, the "
        "tokenized shards and two checkpoints.", "string", "200Gi"),
    "termination_grace_period": _variable(
        "Termination Grace Period", "Seconds between SIGTERM (a spot node reclaimed, kubectl delete, a cancelled "
        "run) and SIGKILL: training finishes its step, writes a checkpoint and uploads it to the store within the "
        "job's checkpoint.grace_period, which must be shorter than this.", "integer", 120, minimum=1),
    "shm_size": _variable("Shared Memory", "Size of /dev/shm (data loader workers and NCCL need more than the "
                          "container runtime's 64 MiB).", "string", "16Gi"),
    "store_secret": STORE_SECRET,
}


def kubernetes_job_template() -> dict:
    """prefect-kubernetes' default plus GPUs, a GPU node selector and the GPU taint's toleration, a scratch disk
    for the pod, a memory-backed /dev/shm, the store's credentials from a Secret, a termination grace period for
    the last checkpoint's upload, retries that resume from the store, and a pod watch long enough for a GPU node."""
    from prefect_kubernetes.worker import KubernetesWorker

    template = copy.deepcopy(KubernetesWorker.get_default_base_job_template())
    job = template["job_configuration"]["job_manifest"]
    job["spec"]["podFailurePolicy"] = {"rules": [
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}]}
    pod = job["spec"]["template"]["spec"]
    [container] = pod["containers"]
    container["command"] = ENTRYPOINT
    for amounts in container["resources"].values():
        amounts["nvidia.com/gpu"] = "{{ gpu_count }}"
    container["envFrom"] = [{"secretRef": {"name": "{{ store_secret }}", "optional": True}}]
    container["volumeMounts"] = [{"name": "phase1a-scratch", "mountPath": SCRATCH},
                                 {"name": "dshm", "mountPath": "/dev/shm"}]
    pod["nodeSelector"] = "{{ node_selector }}"
    pod["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    pod["volumes"] = [{"name": "phase1a-scratch", "emptyDir": {"sizeLimit": "{{ scratch_size }}"}},
                      {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "{{ shm_size }}"}}]
    pod["terminationGracePeriodSeconds"] = "{{ termination_grace_period }}"

    variables = template["variables"]
    properties = variables["properties"]
    properties["image"] = {"title": "Image", "description": IMAGE, "type": "string",
                           "examples": ["registry.example.com/phase1a:latest"]}
    variables["required"] = ["image"]
    properties["pod_watch_timeout_seconds"].update(default=POD_WATCH_TIMEOUT, minimum=60)
    properties["backoff_limit"]["default"] = BACKOFF_LIMIT
    properties["finished_job_ttl"]["default"] = 86400  # a day to read a finished pod's logs, then it goes
    properties.update(KUBERNETES_VARIABLES)
    variables["description"] = ("phase1a on Kubernetes GPU nodes: prefect-kubernetes' default job template plus "
                                "GPUs, node selection, scratch and shared memory, the store's Secret, a grace "
                                "period for the last checkpoint and retries that resume from the store.")
    return template


def docker_job_template() -> dict:
    """prefect-docker's default with the host's GPUs requested (the NVIDIA Container Toolkit's device request, as
    `docker run --gpus N`), a larger /dev/shm, unlimited locked memory (NCCL, pinned host buffers) and a named
    volume for the caches, so a box that stays keeps them between runs."""
    from prefect_docker.worker import DockerWorker

    template = copy.deepcopy(DockerWorker.get_default_base_job_template())
    # Its own settings, not the free-form `container_create_kwargs` variable: a deployment that set that would
    # replace the GPU request instead of adding to it.
    template["job_configuration"]["container_create_kwargs"] = {
        "entrypoint": ENTRYPOINT,
        "device_requests": [{"driver": "nvidia", "count": "{{ gpu_count }}", "capabilities": [["gpu"]]}],
        "shm_size": "{{ shm_size }}",
        "ulimits": [{"name": "memlock", "soft": -1, "hard": -1}],
    }
    variables = template["variables"]
    properties = variables["properties"]
    del properties["container_create_kwargs"]
    properties["image"] = {"title": "Image", "description": IMAGE, "type": "string",
                           "examples": ["phase1a:latest"]}
    variables["required"] = ["image"]
    # A locally built image (`make image` on the box) has no registry to pull from; Docker's default for
    # `:latest` would try.
    properties["image_pull_policy"]["default"] = "IfNotPresent"
    properties["volumes"]["default"] = [f"phase1a-cache:{SCRATCH}"]
    properties["gpu_count"] = {**GPU_COUNT, "description": "GPUs of the host given to the container (-1: all); "
                               "hardware.num_gpus in the job's config should match.", "minimum": -1}
    properties["shm_size"] = _variable("Shared Memory", "Size of /dev/shm (data loader workers and NCCL need more "
                                       "than Docker's 64 MiB).", "string", "16g")
    return template


TEMPLATES = {"kubernetes": kubernetes_job_template, "docker": docker_job_template}


def as_json(template: dict) -> str:
    return json.dumps(template, indent=2) + "\n"


def main(argv: list[str]) -> int:
    if argv == ["--write"]:
        KUBERNETES_TEMPLATE_FILE.write_text(as_json(kubernetes_job_template()))
        print(f"wrote {KUBERNETES_TEMPLATE_FILE}")
        return 0
    if len(argv) != 1 or argv[0] not in TEMPLATES:
        print(f"usage: job_templates.py {{{','.join(TEMPLATES)}}} | --write", file=sys.stderr)
        return 2
    sys.stdout.write(as_json(TEMPLATES[argv[0]]()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
