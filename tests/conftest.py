"""Fixtures, and the isolation every test runs in: its own Prefect and HF homes, offline. Helpers a test imports
are in tests/helpers."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path

import pytest

# Isolate every cache before Prefect or transformers are imported by any test module.
_HOME = Path(tempfile.mkdtemp(prefix="phase1a-tests-"))
# What a session's processes share (the migrated Prefect database, tests/helpers/prefect_stack.py): made by the
# first process, pytest-xdist's controller, whose environment its workers inherit; removed by that process.
_SHARED_OWNER = "PHASE1A_TESTS_SHARED" not in os.environ
if _SHARED_OWNER:
    os.environ["PHASE1A_TESTS_SHARED"] = tempfile.mkdtemp(prefix="phase1a-tests-shared-")
os.environ["PREFECT_HOME"] = str(_HOME / "prefect")
os.environ["HF_HOME"] = str(_HOME / "hf")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = "180"  # a fresh database migrates slowly on 2 cores
os.environ.pop("PREFECT_API_URL", None)
# pytest-xdist's workers share the cores: each gets its share of torch's threads, and so does every process it
# starts, as torchrun gives its ranks (phase1a/train/launch.py: a thread a core in each of two ranks ran 5.3x slower
# on 2 cores). A user's own OMP_NUM_THREADS is kept.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // _WORKERS)))

from helpers import date_records, make_tiny_model_dir, make_tokenizer, write_jsonl  # noqa: E402 - after the isolation above

_SERVER = []  # the session's Prefect server, once started


def pytest_collection_finish(session):
    """Where any selected test runs a flow, one real `prefect server` for the session: every `phase1a` command a
    test starts, and the flows run in this process, talk to it (PREFECT_API_URL), as on a machine with a server,
    instead of each starting a temporary server of its own (8 s a command on two cores). What is about the
    temporary server (tests/flows/test_cli_signals.py, one test_flow.py command) or about hosts with servers of their
    own (helpers/hosts.py) leaves the variable out: `without_session_server`."""
    if not any(item.get_closest_marker("prefect_server") for item in session.items):
        return
    from prefect.context import refresh_global_settings_context

    from helpers.prefect_stack import session_server

    _SERVER.append(session_server(Path(os.environ["PREFECT_HOME"])))
    os.environ["PREFECT_API_URL"] = _SERVER[0].api_url
    refresh_global_settings_context()


def pytest_unconfigure(config):
    for stack in _SERVER:
        stack.stop()
    shutil.rmtree(_HOME, ignore_errors=True)  # a session's homes go with it: /tmp does not fill run after run
    if _SHARED_OWNER:
        shutil.rmtree(os.environ["PHASE1A_TESTS_SHARED"], ignore_errors=True)


# Each file's seconds in a `make test` (tests/file_seconds.py writes them from `--durations=0` output).
FILE_SECONDS: dict[str, int] = json.loads((Path(__file__).with_name("file_seconds.json")).read_text())


def pytest_collection_modifyitems(items):
    """A test that uses the moto server is an S3 test: the fixture marks it, so no test has to say so. The slowest
    files first: pytest-xdist (`--dist loadfile --no-loadscope-reorder`, the Makefile) hands files to its workers in
    this order, so that a run ends on short files on both workers, not on one worker's five-minute file while the
    other idles. A file not in FILE_SECONDS (new) goes last, its tests in their order."""
    for item in items:
        if "endpoint" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.s3)
    items.sort(key=lambda item: -FILE_SECONDS.get(item.nodeid.split("::")[0], 0))  # stable: a file stays whole


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tokenizer():
    """The tiny word-level tokenizer with a ChatML template (helpers.make_tokenizer)."""
    return make_tokenizer()


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 64 records, so a few hundred records make several chunks for several workers, some across a
    Parquet row group's end."""
    from phase1a.data import encoding

    monkeypatch.setattr(encoding, "CHUNK", 64)


@pytest.fixture
def dataset(tmp_path) -> Path:
    return write_jsonl(tmp_path / "dates.jsonl", date_records(64))


@pytest.fixture
def config_tree(tmp_path, tiny_model_dir, dataset) -> dict:
    """A complete config for the tiny model; tests override what they exercise."""
    return {
        "name": "tiny",
        "work_dir": str(tmp_path / "runs"),
        "cache_dir": str(tmp_path / "cache"),
        "data": {"source": str(dataset), "staging_dir": str(tmp_path / "staging"), "validation_fraction": 0.2},
        "model": {"name_or_path": str(tiny_model_dir)},
        "method": {"learning_rate": 5e-3, "batch_size": 8, "epochs": 1, "lora": {"r": 4, "alpha": 8}},
        "hardware": {"target": "cpu"},
        "plan": {"calibration_steps": 1},
        "checkpoint": {"interval": "3steps", "keep_last": 2},
        "validation": {"max_examples": 16, "tolerances": {"loss": 0.05}},
    }


@pytest.fixture(scope="session")
def endpoint(tmp_path_factory):
    """A moto S3 server for the session (HTTP on 127.0.0.1)."""
    from helpers.servers import start_moto, stop  # boto3 and moto: a bare GPU host runs its tests without them

    proc, url = start_moto(tmp_path_factory.mktemp("moto") / "moto.log")
    yield url
    stop(proc)


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """An `mlflow server` for the session (SQLite, HTTP on 127.0.0.1; its URL), started on first use: its
    database migrates in about 5 s on two cores, once."""
    from helpers.prefect_stack import stop_group
    from helpers.tracking import start_mlflow

    proc, url = start_mlflow(tmp_path_factory.mktemp("mlflow"))
    yield url
    stop_group(proc)


@pytest.fixture
def aws_env(monkeypatch, tmp_path):
    """Dummy credentials only (S3 test modules use it for every test: `pytestmark`)."""
    from helpers.servers import isolate_aws

    isolate_aws(monkeypatch, tmp_path)


@pytest.fixture(scope="module")
def aws(tmp_path_factory):
    """Dummy credentials for a whole module, whose module-scoped fixtures (a job on S3) need them too."""
    from helpers.servers import isolate_aws

    with pytest.MonkeyPatch.context() as patch:
        isolate_aws(patch, tmp_path_factory.mktemp("aws"))
        yield


@pytest.fixture
def bucket(endpoint) -> str:
    from helpers.servers import s3_client

    name = f"b-{uuid.uuid4().hex[:12]}"
    s3_client(endpoint).create_bucket(Bucket=name)
    return name


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    """Each kind of store a test of the store runs on: a directory (a network mount), and S3 on the moto server."""
    from phase1a.config.schema import StoreConfig
    from phase1a.config.stores import open_store
    from phase1a.store.base import LocalStore

    if request.param == "local":
        return LocalStore(tmp_path / "mount")
    request.getfixturevalue("aws_env")
    endpoint, bucket = (request.getfixturevalue(name) for name in ("endpoint", "bucket"))
    return open_store(StoreConfig(url=f"s3://{bucket}/team/", endpoint_url=endpoint))
