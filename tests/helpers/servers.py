"""Servers the tests start for real on 127.0.0.1: moto's S3 (HTTP, never AWS); a free port for anything else."""
from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

import boto3


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_moto(log_path: Path, timeout: float = 60) -> tuple[subprocess.Popen, str]:
    """moto in server mode, in a subprocess; returns it and its URL once it answers."""
    port = free_port()
    log = open(log_path, "wb")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_until_up(proc, f"{url}/moto-api/", log_path, timeout, lambda p: p.kill())
    return proc, url


def wait_until_up(proc: subprocess.Popen, probe_url: str, log_path: Path, timeout: float,
                  stop_it: Callable[[subprocess.Popen], None]) -> None:
    """Until the server answers `probe_url` (an HTTP error status is an answer too); the end of its log when it
    exits first; `stop_it(proc)` and the last connection error when it does not answer within `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{' '.join(map(str, proc.args[:4]))} exited: {Path(log_path).read_text()[-3000:]}")
        try:
            urllib.request.urlopen(probe_url, timeout=2).close()
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            if time.monotonic() > deadline:
                stop_it(proc)
                raise
            time.sleep(0.1)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()


def s3_client(endpoint: str, **credentials):
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", **credentials)


def isolate_aws(monkeypatch, tmp_path: Path) -> None:
    """Dummy credentials only, and nothing from the host's AWS config or instance metadata."""
    import os

    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    empty = tmp_path / "aws-empty"
    empty.write_text("")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(empty))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(empty))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
