"""phase1a on a Modal H100: the `phase1a run` CLI inside a Modal function, on an image built from this project.

    modal secret create phase1a-store AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=... HF_TOKEN=...
    modal run launchers/modal_app.py --config configs/my-job.yaml               # a file here
    modal run launchers/modal_app.py --config s3://bucket/jobs/my-job.yaml      # or one the container reads
    modal run launchers/modal_app.py --config my-job.yaml --set "method.epochs=2 window.max_duration=4h"

The image: Debian with Python 3.11, the locked dependencies installed by `uv sync --frozen` with the `cuda` extra
(PyPI's torch, the CUDA build), `tracking` and `eval`, without the dev group, then this checkout's `phase1a`, `flows`
and `tasks` packages, `configs/` and `data/eval/` on top, so a code change rebuilds no dependency layer.

Where things go: a config file given by path is sent as text and written to the volume `phase1a-runs` at
/runs-volume/jobs/<file name>, and runs from there, so its relative paths resolve against /runs-volume/jobs
(`work_dir: ../runs` is the volume's /runs, kept between runs; `modal volume get phase1a-runs runs/...`). A URL
config (s3://, hf://) is read in the container; its relative paths resolve against the project's directory in
the image. Absolute paths such as /var/tmp/phase1a/cache are the container's own disk, gone with it. Give the job a
`store: s3://...` (credentials from the `phase1a-store` secret) so that a retried or later run resumes from its
checkpoints, shards and history wherever it lands. Modal retries a container that crashes or is preempted
(`retries`); a run that ends with an exit status (a refused gate, a bad config) is not retried.
"""
from __future__ import annotations

import tomllib
from pathlib import Path

import modal

ROOT = Path(__file__).resolve().parents[1]
# The lock's extras a run may need: PyPI's CUDA torch, the trackers, lm-eval for validation.benchmarks (where the
# project has made it an extra).
EXTRAS = [name for name in ("cuda", "tracking", "eval")
          if name in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]]
PROJECT = "/root"  # the image's project directory: Modal puts /root on the function's sys.path
VOLUME_PATH = "/runs-volume"
GPU = "H100"
TIMEOUT_SECONDS = 24 * 60 * 60  # Modal's longest; the job's window.max_duration bounds the run itself
STORE_SECRET = "phase1a-store"

image = (
    modal.Image.debian_slim(python_version="3.11")
    .uv_sync(str(ROOT), frozen=True, extras=EXTRAS, extra_options="--no-dev")
    .env({"PYTHONUNBUFFERED": "1"})  # the run's log lines reach `modal run` as they are written
    .add_local_python_source("phase1a", "flows", "tasks")
    .add_local_dir(ROOT / "configs", f"{PROJECT}/configs")
    .add_local_dir(ROOT / "data" / "eval", f"{PROJECT}/data/eval")
)
runs = modal.Volume.from_name("phase1a-runs", create_if_missing=True)
app = modal.App("phase1a", image=image)


@app.function(gpu=GPU, timeout=TIMEOUT_SECONDS, secrets=[modal.Secret.from_name(STORE_SECRET)],
              volumes={VOLUME_PATH: runs},
              retries=modal.Retries(max_retries=2, backoff_coefficient=1.0, initial_delay=30.0))
def run(config: str, overrides: list[str], config_text: str | None = None) -> int:
    """`phase1a run --config CONFIG --set ...` in the container: its exit status (0 passed, 143 stopped by
    SIGTERM at a checkpoint, else 1 or 2)."""
    import os

    from flows.cli import main

    os.chdir(PROJECT)
    if config_text is not None:  # a file from the caller's machine, kept with the runs it starts
        job = Path(VOLUME_PATH) / "jobs" / config
        job.parent.mkdir(parents=True, exist_ok=True)
        job.write_text(config_text)
        config = str(job)
    try:
        return main(["run", "--config", config, *[arg for item in overrides for arg in ("--set", item)]])
    finally:
        runs.commit()  # what the run wrote under the volume, visible to `modal volume get` at once


@app.local_entrypoint()
def start(config: str, set: str = "") -> None:  # noqa: A002 - the CLI's option is --set, as phase1a's
    """--config: a YAML file here, or s3://bucket/key.yaml / hf://[datasets/]org/name/path.yaml. --set: key=value
    overrides, separated by spaces, as phase1a's --set."""
    if "://" in config:
        status = run.remote(config, set.split())
    else:
        path = Path(config)
        status = run.remote(path.name, set.split(), config_text=path.read_text())
    if status:
        raise SystemExit(status)
