"""SIGTERM to `phase1a plan|run` (a spot notice, `kubectl delete`, a job scheduler) stops every process the run
started: once the CLI has exited, none of its descendants is alive, Prefect's embedded server (uvicorn) included,
and the CLI has written its report, printed its summary and exited 143. Real processes throughout: the CLI is
started as a user starts it, and its descendants are recorded while it runs (flows/processes.py)."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from helpers import without_session_server
from helpers.servers import s3_client

pytestmark = [pytest.mark.slow, pytest.mark.prefect_server]


class Descendants:
    """Every process below `pid` seen while it runs, by (pid, start time): a pid reused later is not one of them."""

    def __init__(self, pid: int) -> None:
        self.root, self.seen = psutil.Process(pid), {}

    def record(self) -> None:
        try:
            children = self.root.children(recursive=True)
        except psutil.NoSuchProcess:
            return
        for child in children:
            try:
                self.seen.setdefault((child.pid, child.create_time()), " ".join(child.cmdline()))
            except psutil.Error:  # ended meanwhile
                pass

    def alive(self) -> list[str]:
        left = []
        for (pid, started), command in self.seen.items():
            try:
                process = psutil.Process(pid)
                if process.create_time() == started and process.status() != psutil.STATUS_ZOMBIE:
                    left.append(f"{pid}: {command}")
            except psutil.NoSuchProcess:
                pass
        return left

    def running(self, fragment: str) -> int:
        return sum(fragment in command for command in self.seen.values())


def start(command: str, config_tree: dict, tmp_path: Path) -> tuple[subprocess.Popen, Descendants, Path]:
    config_path = tmp_path / "tiny.yaml"
    config_path.write_text(yaml.safe_dump(config_tree))
    output = tmp_path / "output.txt"
    # The stages' progress notes are Prefect's INFO lines; the temporary server is among the processes to stop.
    env = {**without_session_server(), "PREFECT_LOGGING_LEVEL": "INFO"}
    with open(output, "w") as out:
        cli = subprocess.Popen([sys.executable, "-m", "flows.cli", command, "--config", str(config_path)],
                               stdout=out, stderr=subprocess.STDOUT, env=env)
    return cli, Descendants(cli.pid), output


def wait_for(condition, cli: subprocess.Popen, descendants: Descendants, output: Path, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        descendants.record()
        assert cli.poll() is None, f"the CLI exited {cli.returncode}:\n{output.read_text()[-3000:]}"
        assert time.monotonic() < deadline, output.read_text()[-3000:]
        time.sleep(0.1)


def stop(cli: subprocess.Popen, descendants: Descendants, seconds: float = 120) -> int:
    """SIGTERM, then the CLI's exit status, its descendants recorded until it exits."""
    cli.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + seconds
    while cli.poll() is None:
        descendants.record()
        assert time.monotonic() < deadline, "the CLI did not exit after SIGTERM"
        time.sleep(0.1)
    return cli.returncode


def printed_report(output: Path) -> dict:
    reported = [line for line in output.read_text().splitlines() if line.startswith("report: ")]
    return json.loads(Path(reported[-1].removeprefix("report: ")).read_text())


# The knobs fixed (no sweep: one calibration trial), with a DataLoader worker process, started by a fork server
# (phase1a/train/packing.py), in calibration and in training: beside the embedded server, multiprocessing's fork server,
# its worker and its resource tracker are descendants too.
ONE_WORKER = {"profile": "custom", "micro_batch_size": 8, "gradient_checkpointing": False, "dataloader_workers": 1}


def test_sigterm_mid_calibration_stops_every_process(config_tree, tmp_path):
    """`plan`, stopped in the middle of its calibration trial (before the fix, the CLI died of the signal without
    a summary, and the embedded server, the fork server, its worker and the resource tracker outlived it)."""
    config_tree["plan"] |= {**ONE_WORKER, "calibration_steps": 40}  # a trial long enough to be stopped in the middle
    cli, descendants, output = start("plan", config_tree, tmp_path)
    # The trial's worker has started: the fork server and its child (both named after the fork server).
    wait_for(lambda: "calibration: trial 1 of" in output.read_text()
             and descendants.running("multiprocessing.forkserver") >= 2, cli, descendants, output)

    assert stop(cli, descendants) == 128 + signal.SIGTERM
    assert descendants.alive() == []
    assert descendants.running("uvicorn") >= 1 and descendants.running("multiprocessing.resource_tracker") >= 1
    text = output.read_text()
    assert "calibration trial 1 (" not in text and "status: preempted" in text  # the trial did not end
    # The tracker is stopped after multiprocessing's exit hook, which still writes to it: not relaunched.
    assert "phase1a: stopped by SIGTERM" in text and "relaunching" not in text
    report = printed_report(output)
    assert report["status"] == "preempted" and report["stages"]["plan"]["state"] == "Crashed"
    assert report["stages"]["plan"]["error"].startswith("TerminationSignal: stopped by SIGTERM in stage plan")


def test_sigterm_mid_training_uploads_its_checkpoint_within_the_grace_period_and_stops_every_process(
        config_tree, tmp_path, aws_env, endpoint, bucket):
    """`run` with a store, stopped while it trains: training writes its checkpoint, uploads it to the store within
    `checkpoint.grace_period` and stops (train/preemption.py, train/loop.py), the report says `preempted`, and
    no process of the run is left."""
    config_tree["method"]["epochs"] = 40  # long enough to be stopped in the middle
    config_tree["plan"] |= ONE_WORKER
    config_tree["checkpoint"] = {"interval": "1000steps", "keep_last": 2, "grace_period": "30s"}  # only the stop's
    config_tree["store"] = {"url": f"s3://{bucket}/store/", "endpoint_url": endpoint}
    cli, descendants, output = start("run", config_tree, tmp_path)
    wait_for(lambda: any(path.read_text().count("\n") >= 2 for path in (tmp_path / "runs").rglob("metrics.jsonl")),
             cli, descendants, output)

    assert stop(cli, descendants) == 128 + signal.SIGTERM
    assert descendants.alive() == []
    assert descendants.running("uvicorn") >= 1 and descendants.running("multiprocessing.forkserver") >= 2
    report = printed_report(output)
    assert report["status"] == "preempted" and "Preempted: stopped by SIGTERM after step" in report["error"]
    assert "status: preempted" in output.read_text()
    events = [json.loads(line) for line in next((tmp_path / "runs").rglob("events.jsonl")).read_text().splitlines()]
    preempted = next(event for event in events if event["event"] == "preempted")
    upload = next(event for event in events if event["event"] == "preempted_upload")
    assert upload["uploaded"] and upload["step"] == preempted["step"] and upload["seconds_since_signal"] <= 30.0
    client = s3_client(endpoint)
    [pointer] = [item["Key"] for item in client.list_objects_v2(Bucket=bucket)["Contents"]
                 if item["Key"].endswith("/latest.json")]
    latest = json.loads(client.get_object(Bucket=bucket, Key=pointer)["Body"].read())
    assert latest["step"] == preempted["step"]
