"""Transient failures between the S3 client and a real moto server, injected by a real proxy (tests/helpers/faults.py):
downloads cut off mid-object resume with a ranged GET, botocore absorbs a single 503, and what reaches a stage
is retried by Prefect and counted in the report; a permanent error fails at once."""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import pytest
from boto3.s3.transfer import TransferConfig

from helpers.faults import Fault, FaultProxy
from helpers.servers import s3_client
from phase1a.core.errors import DataError
from phase1a.core.meter import MeterSettings, stage_meter
from phase1a.core.retries import is_transient
from phase1a.data.staging import StagedData, stage_dataset
from phase1a.data.tokenized import TokenizedData
from phase1a.model.result import ResolvedModel
from phase1a.run_report import RunReport
from phase1a.store.s3 import S3Error, download_objects, list_objects, make_client, parse_s3_url

MiB = 1024 * 1024
CHUNK = TransferConfig().io_chunksize  # what the downloader reads (and so keeps) at a time

pytestmark = pytest.mark.usefixtures("aws_env")


@pytest.fixture
def proxy(endpoint):
    with FaultProxy(endpoint) as running:
        yield running


def resume_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if ".resume" in p.name)


def test_a_download_cut_off_mid_object_resumes_with_a_ranged_get(tmp_path, endpoint, bucket, proxy):
    body = os.urandom(MiB + 123)
    s3_client(endpoint).put_object(Bucket=bucket, Key="d.bin", Body=body)
    client = make_client(proxy.url)
    [item] = list_objects(client, parse_s3_url(f"s3://{bucket}/d.bin"))
    proxy.faults = [Fault("drop", "GET", rf"^/{bucket}/d\.bin$", times=1, after_bytes=3 * CHUNK // 2)]

    dest = tmp_path / "d.part"
    with pytest.raises(S3Error, match=rf"s3://{bucket}/d.bin: the connection to the S3 endpoint {proxy.url} broke "
                                      r"off during download") as cut:
        download_objects(client, bucket, [(item, dest)])
    assert is_transient(cut.value) and not dest.exists()
    [partial] = resume_files(tmp_path)
    kept = partial.stat().st_size
    assert 0 < kept < len(body) and body.startswith(partial.read_bytes())

    with stage_meter("stage", len(body), "bytes", settings=MeterSettings("off")) as meter:
        download_objects(client, bucket, [(item, dest)], meter=meter)
    assert dest.read_bytes() == body and resume_files(tmp_path) == []
    assert (meter.count.carried, meter.count.done) == (kept, len(body))  # the rest counted; what was kept, carried
    first, second = proxy.requests("GET", rf"^/{bucket}/d\.bin$")
    assert (first.range, first.fault) == (None, "drop")
    assert second.range == f"bytes={kept}-" and second.fault is None
    assert second.response_bytes < len(body) - kept + 2000  # the rest and a response head, not the whole again


def test_parts_of_a_large_object_resume_each_from_where_it_stopped(tmp_path, endpoint, bucket, proxy):
    body = os.urandom(3 * MiB)
    s3_client(endpoint).put_object(Bucket=bucket, Key="big.bin", Body=body)
    parts = TransferConfig(multipart_threshold=MiB, multipart_chunksize=MiB, max_concurrency=3)
    client = make_client(proxy.url)
    [item] = list_objects(client, parse_s3_url(f"s3://{bucket}/big.bin"))
    proxy.faults = [Fault("drop", "GET", rf"^/{bucket}/big\.bin$", times=1, after_bytes=5 * CHUNK // 2)]

    dest = tmp_path / "big.part"
    with pytest.raises(S3Error, match="broke off during download"):
        download_objects(client, bucket, [(item, dest)], parts)
    download_objects(client, bucket, [(item, dest)], parts)
    assert hashlib.sha256(dest.read_bytes()).digest() == hashlib.sha256(body).digest()
    assert resume_files(tmp_path) == []

    # The three parts ran at once; the cut one alone is asked for again, from where it stopped.
    gets = proxy.requests("GET", rf"^/{bucket}/big\.bin$")
    assert [get.fault for get in gets] == ["drop", None, None, None], [get.range for get in gets]
    cut_start, cut_end = map(int, gets[0].range.removeprefix("bytes=").split("-"))
    resumed_start, resumed_end = map(int, gets[3].range.removeprefix("bytes=").split("-"))
    assert cut_start < resumed_start < cut_end and resumed_end == cut_end
    assert sum(get.response_bytes for get in gets) < len(body) + CHUNK + 4 * 2000  # not the part twice


def test_a_finished_object_of_a_failed_batch_is_not_fetched_again(tmp_path, endpoint, bucket, proxy):
    small, large = os.urandom(1000), os.urandom(MiB)
    client = s3_client(endpoint)
    client.put_object(Bucket=bucket, Key="p/a.jsonl", Body=small)
    client.put_object(Bucket=bucket, Key="p/b.jsonl", Body=large)
    proxy.faults = [Fault("drop", "GET", rf"^/{bucket}/p/b\.jsonl$", times=1, after_bytes=3 * CHUNK // 2)]

    with pytest.raises(DataError, match=rf"s3://{bucket}/p/b.jsonl: the connection .* broke off"):
        stage_dataset(f"s3://{bucket}/p/", tmp_path / "staging", proxy.url)
    staged = stage_dataset(f"s3://{bucket}/p/", tmp_path / "staging", proxy.url)
    assert [(Path(staged.path) / name).read_bytes() for name in staged.files] == [small, large]
    assert len(proxy.requests("GET", rf"^/{bucket}/p/a\.jsonl$")) == 1  # kept whole from the failed attempt
    assert [p.name for p in Path(staged.path).iterdir() if p.name.startswith(".")] == []


def test_botocore_absorbs_a_single_503_and_three_reach_the_caller_as_transient(tmp_path, endpoint, bucket, proxy):
    data = b'{"text": "hello"}\n' * 100
    s3_client(endpoint).put_object(Bucket=bucket, Key="d.jsonl", Body=data)
    source, get = f"s3://{bucket}/d.jsonl", rf"^/{bucket}/d\.jsonl$"

    proxy.faults = [Fault("slow_down", "GET", get, times=1)]
    staged = stage_dataset(source, tmp_path / "one", proxy.url)
    assert Path(staged.path).read_bytes() == data
    assert [seen.fault for seen in proxy.requests("GET", get)] == ["slow_down", None]

    # botocore's standard mode makes 3 attempts of a request: a fourth is the stage's retry to make.
    proxy.faults = [Fault("slow_down", "GET", get, times=3)]
    with pytest.raises(DataError, match=rf"{source}: download failed with S3 error SlowDown") as slow:
        stage_dataset(source, tmp_path / "three", proxy.url)
    assert is_transient(slow.value)


def test_permanent_errors_are_not_transient(tmp_path, endpoint, bucket):
    for source in ("s3://no-such-bucket-q/d.jsonl", f"s3://{bucket}/missing.jsonl", f"s3://{bucket}/empty/"):
        with pytest.raises(DataError) as caught:
            stage_dataset(source, tmp_path / "staging", endpoint)
        assert not is_transient(caught.value), caught.value


def padded_jsonl(count: int, pad: int) -> bytes:
    """Date records, each with an unread field that makes the file long enough to be cut off mid-way."""
    from helpers import date_records

    return b"".join(json.dumps({**record, "note": "x" * pad}).encode() + b"\n" for record in date_records(count))


def run_flow(tree: dict, plan_only: bool = False) -> tuple[object, RunReport]:
    from flows.phase1a import phase1a
    from phase1a.config.schema import Phase1aConfig

    config = Phase1aConfig.model_validate(tree)
    state = phase1a(config, plan_only=plan_only, return_state=True)
    [report] = (config.work_dir / config.name).glob("*/report.json")
    return state, RunReport.load(report)


@pytest.mark.prefect_server
def test_the_flow_retries_through_faults_resumes_and_counts_the_retries(config_tree, endpoint, bucket, proxy,
                                                                        tiny_model_dir):
    """The model's weights and the data cut off mid-object, the pointer's PUT answered 503 past botocore's own
    attempts: the model and stage stages resume their downloads on each Prefect retry, promotion is retried, and
    report.json counts them."""
    data = padded_jsonl(64, pad=12_000)
    s3_client(endpoint).put_object(Bucket=bucket, Key="data/dates.jsonl", Body=data)
    files = {p.relative_to(tiny_model_dir).as_posix(): p.read_bytes() for p in tiny_model_dir.iterdir() if p.is_file()}
    for name, body in files.items():
        s3_client(endpoint).put_object(Bucket=bucket, Key=f"models/tiny/{name}", Body=body)
    get, pointer = rf"^/{bucket}/data/dates\.jsonl$", rf"^/{bucket}/promoted/promoted\.json"
    weights = rf"^/{bucket}/models/tiny/model\.safetensors$"
    proxy.faults = [Fault("drop", "GET", get, times=2, after_bytes=300_000),
                    Fault("slow_down", "PUT", pointer, times=3),
                    Fault("drop", "GET", weights, times=1, after_bytes=len(files["model.safetensors"]) // 2)]
    config_tree["model"]["name_or_path"] = f"s3://{bucket}/models/tiny/"
    config_tree["data"] |= {"source": f"s3://{bucket}/data/dates.jsonl", "s3_endpoint_url": proxy.url}
    config_tree["promotion"] = {"to": f"s3://{bucket}/promoted/"}
    config_tree["retries"] = {"count": 3, "delay": "0.2s", "jitter": 0}

    state, report = run_flow(config_tree)
    assert state.is_completed(), report.stages
    stage, promote = report.stages["stage"], report.stages["promote"]
    assert (stage.state, stage.retries, promote.state, promote.retries) == ("Completed", 2, "Completed", 1)
    assert report.stages["tokenize"].retries == 0 and report.result("tokenize", TokenizedData).train_examples
    staged = report.result("stage", StagedData)
    assert hashlib.sha256(Path(staged.path).read_bytes()).hexdigest() == hashlib.sha256(data).hexdigest() == \
        staged.fingerprint
    staged = Path(staged.path)
    assert sorted(p.name for p in staged.parent.iterdir()) == [staged.name, staged.name + ".manifest.json"]  # no resume

    # Each retry asked for what the one before had not received.
    first, second, third = proxy.requests("GET", get)
    starts = [int(seen.range.removeprefix("bytes=").rstrip("-")) for seen in (second, third)]
    assert first.range is None and 0 < starts[0] < starts[1] < len(data), starts
    assert [seen.fault for seen in (first, second, third)] == ["drop", "drop", None]
    assert [seen.fault for seen in proxy.requests("PUT", pointer)] == ["slow_down"] * 3 + [None]
    assert (report.stages["model"].state, report.stages["model"].retries) == ("Completed", 1)
    model = Path(report.result("model", ResolvedModel).path)
    assert {name: (model / name).read_bytes() for name in files} == files
    cut, resumed = proxy.requests("GET", weights)
    assert cut.fault == "drop" and resumed.range.startswith("bytes=") and resumed.range != "bytes=0-"
    promoted = json.loads(s3_client(endpoint).get_object(Bucket=bucket, Key="promoted/promoted.json")["Body"].read())
    assert promoted["version"] == Path(report.run_dir).name == report.validation.promotion.version


@pytest.mark.prefect_server
def test_a_permanent_error_fails_the_stage_at_once_with_its_own_message(config_tree, proxy):
    config_tree["data"] |= {"source": "s3://no-such-bucket-r/d.jsonl", "s3_endpoint_url": proxy.url}
    config_tree["retries"] = {"count": 3, "delay": "30s"}

    started = time.monotonic()
    state, report = run_flow(config_tree, plan_only=True)
    assert state.is_failed() and time.monotonic() - started < 30
    stage = report.stages["stage"]
    assert (stage.state, stage.retries) == ("Failed", 0) and stage.seconds < 5
    assert stage.error == "DataError: s3://no-such-bucket-r/d.jsonl: no such bucket 'no-such-bucket-r'"
    # One HEAD of the key and one of the bucket, for the cache key and then for the one attempt.
    assert len(proxy.requests("HEAD", "^/no-such-bucket-r")) == 4
