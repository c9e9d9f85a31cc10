"""Hosts that come and go, on one machine: each its own HOME, PREFECT_HOME (its own embedded Prefect server) and
local directories (staging, caches, runs), sharing only the store (S3 on a moto server) and the data source.

A host runs the flow either in this process (`run_here`) or as `phase1a run` in its own session (`start_cli`), so
that a test can kill it with its whole process group, as a lost machine is lost."""
from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from helpers import date_records, make_tiny_model_dir, without_session_server, write_jsonl
from helpers.prefect_stack import migrated_database, signal_group

ROOT = Path(__file__).resolve().parents[2]
STARTED: list[subprocess.Popen] = []  # every CLI host started, so that a failed test leaves none running
STORE_JOB_STEPS = 60  # store_job: 6 epochs of 10 steps, long enough to stop a host in the middle


def store_job(root: Path, name: str, endpoint: str, bucket: str) -> dict:
    """The job hosts that come and go run: two shards of data in a new bucket on S3, the tiny model, knobs fixed
    (every host trains the same rows), a checkpoint every 10 steps mirrored to a store in the bucket."""
    from helpers.servers import s3_client

    client = s3_client(endpoint)
    client.create_bucket(Bucket=bucket)
    for number in range(2):
        shard = write_jsonl(root / f"part-{number}.jsonl", date_records(48, seed=number))
        client.put_object(Bucket=bucket, Key=f"data/part-{number}.jsonl", Body=shard.read_bytes())
    return {
        "name": name,
        "data": {"source": f"s3://{bucket}/data/", "s3_endpoint_url": endpoint, "validation_fraction": 0.2},
        "model": {"name_or_path": str(make_tiny_model_dir(root / "model"))},
        "method": {"learning_rate": 3e-3, "batch_size": 8, "epochs": 6, "seed": 3,
                   "lora": {"r": 4, "alpha": 8, "dropout": 0.1}, "eval_interval": "never"},
        "hardware": {"target": "cpu"},
        "plan": {"profile": "custom", "micro_batch_size": 4, "gradient_checkpointing": False, "compile": False,
                 "dataloader_workers": 0},
        "checkpoint": {"interval": "10steps", "keep_last": 2, "grace_period": "30s"},
        "validation": {"max_examples": 8,
                       "tolerances": {"loss": None, "token_accuracy": None, "exact_match": None}},
        "progress": {"display": "lines", "interval": "5s"},
        "store": {"url": f"s3://{bucket}/store/", "endpoint_url": endpoint, "lease_ttl": "4s"},
    }


@dataclass
class Host:
    root: Path
    tree: dict  # the job's config, with this host's local directories
    checkout: Path | None = None  # the job's own directory on this host (checked_out): the CLI runs in it
    environment: dict[str, str] | None = None  # set for the CLI on top of this host's (AWS_ENDPOINT_URL, say)

    @classmethod
    def fresh(cls, root: Path, tree: dict) -> "Host":
        """A host with empty local directories and the job's config pointed at them."""
        root.mkdir(parents=True)
        local = {"work_dir": str(root / "runs"), "cache_dir": str(root / "cache")}
        data = {**tree["data"], "staging_dir": str(root / "staging")}
        return cls(root, {**tree, **local, "data": data})

    @classmethod
    def checked_out(cls, root: Path, tree: dict, files: dict[str, Path],
                    environment: dict[str, str] | None = None) -> "Host":
        """A host as a user sets one up: the job's directory copied to `root/checkout` (its config beside `files`,
        each copied under its name there, which the config names by relative paths as a repository's job does),
        local directories beside it, and the CLI run in it with `environment`. No path of another host's."""
        checkout = root / "checkout"
        checkout.mkdir(parents=True)
        for name, source in files.items():
            (shutil.copytree if Path(source).is_dir() else shutil.copyfile)(source, checkout / name)
        local = {"work_dir": "../runs", "cache_dir": "../cache"}
        return cls(root, {**tree, **local, "data": {**tree["data"], "staging_dir": "../staging"}}, checkout,
                   environment)

    @property
    def config_path(self) -> Path:
        path = (self.checkout or self.root) / "job.yaml"
        path.write_text(yaml.safe_dump(self.tree))
        return path

    def env(self) -> dict[str, str]:
        home = self.root / "home"
        if not (home / ".prefect" / "prefect.db").exists():
            migrated_database(home / ".prefect" / "prefect.db")
        return {**without_session_server(), "HOME": str(home), "PREFECT_HOME": str(home / ".prefect"),
                "OMP_NUM_THREADS": "1", **(self.environment or {})}

    def start_cli(self, command: str = "run") -> subprocess.Popen:
        """`phase1a run` in a session of its own (its process group is the host's processes)."""
        log = open(self.root / f"{command}.log", "w")
        config = self.config_path  # in a checkout, named as its user would: relative to the directory it runs in
        process = subprocess.Popen([sys.executable, "-m", "flows.cli", command, "--config",
                                    config.name if self.checkout else str(config)],
                                   cwd=self.checkout or ROOT, env=self.env(), stdout=log, stderr=subprocess.STDOUT,
                                   text=True, start_new_session=True)
        STARTED.append(process)
        return process

    def log(self, command: str = "run") -> str:
        return (self.root / f"{command}.log").read_text()

    def run_here(self, plan_only: bool = False):
        """The flow in this process (the tests' own embedded Prefect server); its state and report."""
        from flows.phase1a import phase1a
        from phase1a.config.schema import Phase1aConfig

        state = phase1a(Phase1aConfig.model_validate(self.tree), plan_only=plan_only, return_state=True)
        return state, self.report()

    def report(self) -> dict:
        [path] = (self.root / "runs" / self.tree["name"]).glob("*/report.json")
        return json.loads(path.read_text())

    def metrics_steps(self) -> list[int]:
        [path] = (self.root / "runs" / self.tree["name"]).glob("train-*/metrics.jsonl")
        return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def kill_host(process: subprocess.Popen) -> None:
    """kill -9 of the host's whole process group: nothing of it runs on, nothing is cleaned up."""
    signal_group(process, signal.SIGKILL)
    process.wait(timeout=60)


def stop_started_hosts() -> None:
    """Kill the CLI hosts a test left running (it failed before it stopped them): one still training would write
    to the store the next test starts from."""
    while STARTED:
        process = STARTED.pop()
        if process.poll() is None:
            kill_host(process)


def wait_until(condition, what: str, process: subprocess.Popen | None = None, log: Path | None = None,
               timeout: float = 300, every: float = 0.05):
    """Poll `condition()` until it returns something true, which is returned."""
    deadline = time.monotonic() + timeout
    while not (found := condition()):
        if process is not None and process.poll() is not None:
            raise AssertionError(f"the host exited ({process.returncode}) before {what}:\n"
                                 + (log.read_text()[-4000:] if log else ""))
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(every)
    return found
