"""Experiment trackers for the tests, for real: an `mlflow server` on 127.0.0.1 (SQLite, artifacts in a folder),
a reader of wandb's offline run files, and a TCP relay that a test closes to take a server away mid-run."""
from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path

from helpers.prefect_stack import stop_group
from helpers.servers import free_port, wait_until_up


def start_mlflow(root: Path, timeout: float = 120) -> tuple[subprocess.Popen, str]:
    """`mlflow server` with a SQLite backend and proxied artifacts under `root`, one worker, no job runner (its
    consumers would take cores for nothing); its own process group, so `stop_group` ends its worker too."""
    port = free_port()
    log = open(root / "mlflow.log", "wb")
    command = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
               "--artifacts-destination", str(root / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
               "--workers", "1"]
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_until_up(proc, f"{url}/health", root / "mlflow.log", timeout, stop_group)
    return proc, url


def wandb_records(run_dir: Path) -> list:
    """Every record of an offline run's `run-<id>.wandb` file, parsed with wandb's own protobuf classes. The file
    is a LevelDB-style log: a 7-byte header, then 32 KiB blocks of chunks (crc32, length, type), each record
    in one chunk (FULL) or split over several (FIRST, MIDDLE..., LAST)."""
    from wandb.proto import wandb_internal_pb2

    [path] = Path(run_dir).glob("run-*.wandb")
    data, block, position, pending, records = path.read_bytes(), 32 * 1024, 7, b"", []
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a chunk header is padding
            position += block - position % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if kind == 0 and length == 0:
            break
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # FULL, LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_history(records: list) -> list[dict]:
    """The run's `log()` rows, each as {key: value}."""
    return [{"/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in record.history.item}
            for record in records if record.WhichOneof("record_type") == "history"]


def wandb_config(records: list) -> dict:
    """The run's config: what it started with and every update after."""
    config = {}
    for record in records:
        kind = record.WhichOneof("record_type")
        updates = record.run.config.update if kind == "run" else record.config.update if kind == "config" else []
        for item in updates:
            config["/".join(item.nested_key) or item.key] = json.loads(item.value_json)
    return config


class TcpRelay:
    """Forwards 127.0.0.1:<port> to a target port; `close()` drops every connection and stops listening, as a
    server going away would."""

    def __init__(self, target_port: int) -> None:
        self.target_port, self.sockets = target_port, []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            self.sockets += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while chunk := source.recv(65536):
                sink.sendall(chunk)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                try:
                    end.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread: close() alone would leave it serving
        self.listener.close()
        for sock in self.sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
