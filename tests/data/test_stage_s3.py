"""Staging from S3 against a real moto server in a subprocess (HTTP on 127.0.0.1, never AWS)."""
from __future__ import annotations

import gzip
import hashlib
import json
import os
import time
import traceback
import urllib.error
import urllib.request
from pathlib import Path

import boto3
import pytest
from boto3.s3.transfer import TransferConfig

import phase1a.data.staging as staging_module
from helpers import date_records
from helpers.servers import free_port, s3_client, start_moto, stop
from phase1a.config.schema import Phase1aConfig
from phase1a.core.errors import DataError
from phase1a.data.datasource import describe, iter_records, resolve_shards
from phase1a.data.staging import (
    StageOptions,
    data_source_fingerprint,
    stage_dataset,
    stage_model,
    staged_location,
    verify_download,
)
from phase1a.store.s3 import S3Error, download_objects, list_objects, make_client, parse_s3_url
from tasks.stage import staged_copy

MiB = 1024 * 1024
PLANTED_KEY_ID = "AKIDPLANTEDKEYID0001"
PLANTED_SECRET = "planted-secret-7Qx9ZkR2vW"


pytestmark = pytest.mark.usefixtures("aws_env")


def copy_present(source: str, staging: Path, fingerprint: str) -> bool:
    """What the stage task's cache asks before it reuses a result: is the staged copy still there?"""
    config = Phase1aConfig.model_validate({"data": {"source": source, "staging_dir": str(staging)}})
    return staged_copy(fingerprint, config).exists()


def _put(endpoint: str, bucket: str, key: str, body: bytes) -> None:
    s3_client(endpoint).put_object(Bucket=bucket, Key=key, Body=body)


def _jsonl(count: int, seed: int) -> bytes:
    return "".join(json.dumps(record) + "\n" for record in date_records(count, seed)).encode()


def test_single_object_staged_verified_skipped_and_restaged_on_change(tmp_path, endpoint, bucket):
    data = _jsonl(32, seed=0)
    _put(endpoint, bucket, "data/dates.jsonl", data)
    source, staging = f"s3://{bucket}/data/dates.jsonl", tmp_path / "staging"

    fingerprint = data_source_fingerprint(source, endpoint)
    first = stage_dataset(source, staging, endpoint)
    assert first.copied and Path(first.path).read_bytes() == data
    assert first.fingerprint == hashlib.sha256(data).hexdigest() and first.size_bytes == len(data)
    assert [(o.key, o.size, o.etag) for o in first.objects] == [("data/dates.jsonl", len(data),
                                                                 hashlib.md5(data).hexdigest())]
    # The stage cache finds the copy from its inputs alone, without touching S3.
    assert Path(first.path) == staged_location(staging, fingerprint, "dates.jsonl")
    assert copy_present(source, staging, fingerprint)

    again = stage_dataset(source, staging, endpoint)
    assert not again.copied and again.path == first.path and again.fingerprint == first.fingerprint

    Path(first.path).write_bytes(b"X" + data[1:])  # same size, different bytes: the manifest's sha256 catches it
    repaired = stage_dataset(source, staging, endpoint)
    assert repaired.copied and Path(repaired.path).read_bytes() == data

    changed = _jsonl(33, seed=1)
    _put(endpoint, bucket, "data/dates.jsonl", changed)
    assert data_source_fingerprint(source, endpoint) != fingerprint
    second = stage_dataset(source, staging, endpoint)
    assert second.copied and second.path != first.path and Path(second.path).read_bytes() == changed
    assert second.fingerprint == hashlib.sha256(changed).hexdigest()


def test_large_objects_download_as_parallel_ranges_single_and_multipart_etags(tmp_path, endpoint, bucket):
    small_parts = TransferConfig(multipart_threshold=1 * MiB, multipart_chunksize=1 * MiB, max_concurrency=4)
    body = os.urandom(3 * MiB + 17)
    _put(endpoint, bucket, "big.bin", body)
    staged = stage_dataset(f"s3://{bucket}/big.bin", tmp_path / "staging", endpoint, StageOptions(transfer=small_parts))
    assert Path(staged.path).read_bytes() == body and staged.fingerprint == hashlib.sha256(body).hexdigest()

    # A multipart upload's ETag is not an MD5 ("<hash>-<parts>"): verified by size, then hashed.
    multipart = os.urandom(6 * MiB)
    (tmp_path / "mp.bin").write_bytes(multipart)
    s3_client(endpoint).upload_file(str(tmp_path / "mp.bin"), bucket, "mp.bin",
                                  Config=TransferConfig(multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB))
    staged = stage_dataset(f"s3://{bucket}/mp.bin", tmp_path / "staging", endpoint, StageOptions(transfer=small_parts))
    assert staged.objects[0].etag.endswith("-2")
    assert Path(staged.path).read_bytes() == multipart and staged.fingerprint == hashlib.sha256(multipart).hexdigest()


def test_prefix_shards_stage_as_a_directory_in_key_order_with_a_manifest(tmp_path, endpoint, bucket):
    shards = {"shards/part-002.jsonl": _jsonl(5, 2), "shards/part-000.jsonl": _jsonl(4, 0),
              "shards/part-001.jsonl": _jsonl(3, 1).rstrip(b"\n")}  # uploaded out of order; one lacks its "\n"
    for key, body in shards.items():
        _put(endpoint, bucket, key, body)
    _put(endpoint, bucket, "shards/", b"")  # a console folder marker: not data
    _put(endpoint, bucket, "shards/_SUCCESS", b"")  # a job's marker: staged, never read as data
    _put(endpoint, bucket, "other/part-000.jsonl", _jsonl(2, 9))  # outside the prefix
    source, staging = f"s3://{bucket}/shards/", tmp_path / "staging"

    staged = stage_dataset(source, staging, endpoint)
    assert staged.copied and Path(staged.path).name == "shards" and Path(staged.path).is_dir()
    assert staged.files == ["part-000.jsonl", "part-001.jsonl", "part-002.jsonl"]  # key order
    assert staged.files_ignored == 1 and staged.ignored_files == [f"{source}_SUCCESS"]  # said, not passed over
    for name in staged.files:
        assert (Path(staged.path) / name).read_bytes() == shards[f"shards/{name}"]
    records = list(iter_records(resolve_shards(staged, None, "train")))
    assert [(r.shard, r.index) for r in records][:5] == [(0, 1), (0, 2), (0, 3), (0, 4), (1, 1)] and len(records) == 12

    manifest = json.loads(Path(staged.path + ".manifest.json").read_text())
    assert [o["key"] for o in manifest["objects"]] == sorted([*shards, "shards/_SUCCESS"])
    assert set(manifest["file_sha256"]) == {*shards, "shards/_SUCCESS"}

    again = stage_dataset(source, staging, endpoint)
    assert not again.copied and again.path == staged.path and again.fingerprint == staged.fingerprint
    assert Path(staged.path) == staged_location(staging, data_source_fingerprint(source, endpoint), "shards")
    assert copy_present(source, staging, data_source_fingerprint(source, endpoint))


def test_a_new_object_under_the_prefix_is_the_only_one_downloaded(tmp_path, endpoint, bucket, caplog):
    for number in range(3):
        _put(endpoint, bucket, f"nightly/part-{number}.jsonl", _jsonl(4, number))
    source, staging = f"s3://{bucket}/nightly/", tmp_path / "staging"
    first = stage_dataset(source, staging, endpoint)
    assert (first.files_copied, first.files_reused) == (3, 0)

    _put(endpoint, bucket, "nightly/part-3.jsonl", _jsonl(4, 3))
    caplog.set_level("INFO", logger="phase1a")
    second = stage_dataset(source, staging, endpoint)
    assert second.path != first.path and (second.files_copied, second.files_reused) == (1, 3)
    # Its progress counts the one download: that object's bytes.
    assert f"stage: {len(_jsonl(4, 3))} B to do; downloading 1 of 4 objects of {source}" in caplog.text
    assert f"stage: {len(_jsonl(4, 3))} B in " in caplog.text
    assert second.file_sha256 == first.file_sha256 | {"part-3.jsonl": hashlib.sha256(_jsonl(4, 3)).hexdigest()}
    for name in first.files:  # one copy on disk, linked from both listings' directories
        assert os.path.samefile(Path(first.path) / name, Path(second.path) / name)

    _put(endpoint, bucket, "nightly/part-1.jsonl", _jsonl(5, 1))  # rewritten: a new ETag, downloaded again
    third = stage_dataset(source, staging, endpoint)
    assert (third.files_copied, third.files_reused) == (1, 3)
    assert (Path(third.path) / "part-1.jsonl").read_bytes() == _jsonl(5, 1)


def test_gzip_and_json_array_shards_under_a_prefix(tmp_path, endpoint, bucket):
    plain = [_jsonl(3, 0), _jsonl(2, 1)]
    for index, body in enumerate(plain):
        _put(endpoint, bucket, f"gz/part-{index}.jsonl.gz", gzip.compress(body))
    array = [json.loads(line) for line in _jsonl(4, 2).splitlines()]
    _put(endpoint, bucket, "gz/part-2.json", json.dumps(array).encode())
    staged = stage_dataset(f"s3://{bucket}/gz/", tmp_path / "staging", endpoint)
    shards = resolve_shards(staged, None, "train")
    assert [s.json_array for s in shards] == [False, False, True]
    assert len(list(iter_records(shards))) == 9
    # Messages name the object under the user's prefix, not the staged copy.
    assert [describe(shards, n, 2) for n in range(3)] == [
        f"s3://{bucket}/gz/part-0.jsonl.gz:2", f"s3://{bucket}/gz/part-1.jsonl.gz:2", f"s3://{bucket}/gz/part-2.json:[2]"]

    _put(endpoint, bucket, "none/README", b"no data here")
    with pytest.raises(DataError, match=rf"s3://{bucket}/none/: no data file under the prefix"):
        stage_dataset(f"s3://{bucket}/none/", tmp_path / "staging", endpoint)


def test_parquet_on_s3_tokenizes_like_the_same_records_in_jsonl(tmp_path, endpoint, bucket):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from helpers import make_tokenizer, read_arrow, write_jsonl
    from phase1a.data.tokenizing import TokenizeOptions, tokenize_dataset

    records = date_records(40, seed=3)
    for index in range(2):  # two shards under a prefix
        buffer = pa.BufferOutputStream()
        pq.write_table(pa.Table.from_pylist(records[index * 20:(index + 1) * 20]), buffer)
        _put(endpoint, bucket, f"pq/train-{index:05d}.parquet", buffer.getvalue().to_pybytes())
    staged = stage_dataset(f"s3://{bucket}/pq/", tmp_path / "staging", endpoint)
    tokenizer, options = make_tokenizer(), TokenizeOptions(validation_count=5)
    from_s3 = tokenize_dataset(staged, tokenizer, 256, options, tmp_path / "c1" / "parquet")
    jsonl = tokenize_dataset(write_jsonl(tmp_path / "d.jsonl", records), tokenizer, 256, options,
                             tmp_path / "c2" / "jsonl")
    for split in ("train_path", "validation_path"):
        assert read_arrow(getattr(from_s3, split)).to_pylist() == read_arrow(getattr(jsonl, split)).to_pylist()
    assert from_s3.shards == 2 and from_s3.train_examples == 35


def test_an_object_replaced_after_listing_is_refused(tmp_path, endpoint, bucket):
    _put(endpoint, bucket, "d.jsonl", _jsonl(4, 0))
    client = make_client(endpoint)
    listed = list_objects(client, parse_s3_url(f"s3://{bucket}/d.jsonl"))
    _put(endpoint, bucket, "d.jsonl", _jsonl(5, 1))
    with pytest.raises(S3Error, match=rf"s3://{bucket}/d.jsonl: the object changed since it was listed"):
        download_objects(client, bucket, [(listed[0], tmp_path / "d.part")])
    assert list(tmp_path.glob("d.part*")) == []  # neither our name nor s3transfer's temporary one


def test_an_object_replaced_between_head_and_get_fails_the_pinned_ranged_gets(tmp_path, endpoint, bucket,
                                                                               monkeypatch):
    import phase1a.store.s3 as s3_module

    _put(endpoint, bucket, "d.bin", os.urandom(3 * MiB))
    client = make_client(endpoint)
    listed = list_objects(client, parse_s3_url(f"s3://{bucket}/d.bin"))
    stale_head = s3_module._head(client, bucket, "d.bin")
    _put(endpoint, bucket, "d.bin", os.urandom(3 * MiB))  # same size, new ETag
    monkeypatch.setattr(s3_module, "_head", lambda *args: stale_head)  # the race: HEAD saw the old version
    small_parts = TransferConfig(multipart_threshold=1 * MiB, multipart_chunksize=1 * MiB, max_concurrency=4)
    with pytest.raises(S3Error, match=rf"s3://{bucket}/d.bin: the object changed while it was being downloaded"):
        download_objects(client, bucket, [(listed[0], tmp_path / "d.part")], small_parts)
    assert list(tmp_path.glob("d.part*")) == []  # neither our name nor s3transfer's temporary one


def test_missing_bucket_key_empty_prefix_and_empty_data(tmp_path, endpoint, bucket):
    staging = tmp_path / "staging"
    with pytest.raises(DataError, match=r"s3://no-such-bucket-x/a.jsonl: no such bucket 'no-such-bucket-x'"):
        stage_dataset("s3://no-such-bucket-x/a.jsonl", staging, endpoint)
    with pytest.raises(DataError, match=r"s3://no-such-bucket-x/p/: no such bucket 'no-such-bucket-x'"):
        data_source_fingerprint("s3://no-such-bucket-x/p/", endpoint)
    with pytest.raises(DataError, match=rf"s3://{bucket}/missing.jsonl: no such key"):
        stage_dataset(f"s3://{bucket}/missing.jsonl", staging, endpoint)
    with pytest.raises(DataError, match=rf"s3://{bucket}/empty/: no objects under this prefix"):
        stage_dataset(f"s3://{bucket}/empty/", staging, endpoint)
    _put(endpoint, bucket, "zero.jsonl", b"")
    with pytest.raises(DataError, match=rf"s3://{bucket}/zero.jsonl: the data is empty"):
        stage_dataset(f"s3://{bucket}/zero.jsonl", staging, endpoint)
    assert not staging.exists() or not any(staging.rglob("*.jsonl"))


def test_no_credentials_is_named(tmp_path, endpoint, bucket, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(DataError, match=rf"s3://{bucket}/a.jsonl: no AWS credentials found"):
        stage_dataset(f"s3://{bucket}/a.jsonl", tmp_path / "staging", endpoint)


def test_endpoint_down_fails_fast_and_says_which(tmp_path):
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    started = time.monotonic()
    with pytest.raises(DataError, match=rf"s3://b/a.jsonl: cannot connect to the S3 endpoint {down}"):
        stage_dataset("s3://b/a.jsonl", tmp_path / "staging", down)
    assert time.monotonic() - started < 15


def test_verify_download_deletes_a_corrupted_file(tmp_path):
    good = b'{"a": 1}\n' * 100
    path = tmp_path / "download.part"
    path.write_bytes(good)
    assert verify_download(path, len(good), hashlib.md5(good).hexdigest()) == hashlib.sha256(good).hexdigest()
    path.write_bytes(b"!" + good[1:])
    with pytest.raises(DataError, match=r"s3://b/k.jsonl: download failed verification \(md5"):
        verify_download(path, len(good), hashlib.md5(good).hexdigest(), what="s3://b/k.jsonl")
    assert not path.exists()
    path.write_bytes(good[:-1])
    with pytest.raises(DataError, match=rf"download failed verification \({len(good) - 1} bytes, expected {len(good)}"):
        verify_download(path, len(good), None)
    assert not path.exists()


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_download_corrupted_before_verification_is_never_staged(tmp_path, endpoint, bucket, monkeypatch, damage):
    data = _jsonl(16, seed=3)
    _put(endpoint, bucket, "d.jsonl", data)
    real_download = staging_module.download_objects

    def corrupting(client, bucket_name, items, transfer, **options):
        md5s = real_download(client, bucket_name, items, transfer, **options)
        for _, path in items:  # the real bytes arrived; damage them as a bad disk or proxy would
            raw = path.read_bytes()
            path.write_bytes(b"#" + raw[1:] if damage == "flip" else raw[:-5])
        return md5s

    monkeypatch.setattr(staging_module, "download_objects", corrupting)
    staging = tmp_path / "staging"
    with pytest.raises(DataError, match=rf"s3://{bucket}/d.jsonl: download failed verification"):
        stage_dataset(f"s3://{bucket}/d.jsonl", staging, endpoint)
    assert [p for p in staging.rglob("*") if p.is_file()] == []  # no staged file, no partial, no manifest


def test_staging_disk_too_small(tmp_path, endpoint, bucket, monkeypatch):
    _put(endpoint, bucket, "d.jsonl", _jsonl(8, seed=4))
    real = staging_module.shutil.disk_usage
    monkeypatch.setattr(staging_module.shutil, "disk_usage", lambda path: real(path)._replace(free=10))
    with pytest.raises(DataError, match=rf"staging dir .*: 10 bytes free, s3://{bucket}/d.jsonl needs \d+"):
        stage_dataset(f"s3://{bucket}/d.jsonl", tmp_path / "staging", endpoint)
    assert not any(p.is_file() for p in (tmp_path / "staging").rglob("*"))


def test_credentials_never_reach_manifests_reports_or_errors(tmp_path, endpoint, bucket, mlflow_server, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", PLANTED_KEY_ID)  # moto's default mode accepts any key
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", PLANTED_SECRET)
    monkeypatch.setenv("AWS_SESSION_TOKEN", PLANTED_SECRET + "-token")
    _put(endpoint, bucket, "s/a.jsonl", _jsonl(4, 5))
    staged = stage_dataset(f"s3://{bucket}/s/", tmp_path / "staging", endpoint)
    texts = [staged.model_dump_json(), Path(staged.path + ".manifest.json").read_text()]
    for source, where in [(f"s3://{bucket}/nope.jsonl", endpoint), ("s3://no-bucket-zz/p/", endpoint),
                          (f"s3://{bucket}/s/", f"http://{PLANTED_SECRET}@127.0.0.1:{free_port()}")]:
        with pytest.raises(DataError) as caught:
            stage_dataset(source, tmp_path / "staging", where)
        texts += [str(caught.value), "".join(traceback.format_exception(caught.value))]
    texts += _tracked_texts(tmp_path, f"s3://{bucket}/s/", f"http://{PLANTED_SECRET}@127.0.0.1:{free_port()}",
                            mlflow_server, monkeypatch)
    for text in texts:
        assert PLANTED_SECRET not in text and PLANTED_KEY_ID not in text


def _tracked_texts(tmp_path: Path, source: str, endpoint_url: str, mlflow_server: str, monkeypatch) -> list[str]:
    """A job's MLflow run and W&B offline run, started as the flow starts them, with the trackers' own
    credentials planted too: what they hold (params, tags, artifacts, every file W&B wrote), as text."""
    from mlflow.tracking import MlflowClient

    from flows.tracking import run_context
    from phase1a.tracking import Trackers

    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", PLANTED_SECRET)
    monkeypatch.setenv("WANDB_API_KEY", PLANTED_SECRET + "0" * (40 - len(PLANTED_SECRET)))
    config = Phase1aConfig.model_validate({
        "data": {"source": source, "s3_endpoint_url": endpoint_url},
        "tracking": {"mlflow": {"tracking_uri": mlflow_server},
                     "wandb": {"mode": "offline", "dir": str(tmp_path / "wandb")}}})
    trackers = Trackers.start(config.tracking, run_context(config, tmp_path / "run"))
    trackers.log_records("train", [{"step": 1, "loss": 1.0}])
    trackers.log_text("gate.txt", f"source {source}")
    trackers.finish("passed")
    assert set(trackers.up) == {"mlflow", "wandb"}, trackers.sections
    client = MlflowClient(mlflow_server)
    run = client.get_run(trackers.sections["mlflow"]["run_id"])
    assert run.data.params["config.data.s3_endpoint_url"].startswith("http://***@127.0.0.1:")
    downloaded = Path(client.download_artifacts(run.info.run_id, "", str(tmp_path / "artifacts")))
    files = [path for root in (downloaded, tmp_path / "wandb") for path in root.rglob("*") if path.is_file()]
    assert any(path.suffix == ".wandb" for path in files) and any(path.name == "gate.txt" for path in files)
    return [json.dumps([run.data.params, run.data.tags, trackers.sections]),
            *(path.read_bytes().decode("latin-1") for path in files)]


def test_model_directory_staged_from_a_prefix(tmp_path, endpoint, bucket):
    files = {"config.json": b'{"model_type": "llama"}', "tokenizer/vocab.json": b'{"a": 0}',
             "model.safetensors": os.urandom(200_000)}
    for name, body in files.items():
        _put(endpoint, bucket, f"models/tiny/{name}", body)
    _put(endpoint, bucket, "models/tiny-other/config.json", b"{}")  # shares the prefix text, not the directory
    staging = tmp_path / "models"

    model_dir = stage_model(f"s3://{bucket}/models/tiny/", staging, endpoint)
    assert model_dir.name == "tiny" and model_dir.is_dir()
    assert {p.relative_to(model_dir).as_posix(): p.read_bytes() for p in model_dir.rglob("*") if p.is_file()} == files
    mtimes = {p: p.stat().st_mtime_ns for p in model_dir.rglob("*") if p.is_file()}

    assert stage_model(f"s3://{bucket}/models/tiny", staging, endpoint) == model_dir  # no trailing slash: same dir
    assert {p: p.stat().st_mtime_ns for p in mtimes} == mtimes  # skipped: nothing rewritten

    weights = model_dir / "model.safetensors"
    weights.write_bytes(b"\0" * len(files["model.safetensors"]))  # same size: only the recorded sha256 catches it
    assert stage_model(f"s3://{bucket}/models/tiny/", staging, endpoint) == model_dir
    assert weights.read_bytes() == files["model.safetensors"]
    assert (model_dir / "config.json").stat().st_mtime_ns == mtimes[model_dir / "config.json"]  # the rest kept

    local = tmp_path / "local-model"
    local.mkdir()
    assert stage_model(str(local), staging) == local
    with pytest.raises(DataError, match=rf"s3://{bucket}/models/none/: no objects under this prefix"):
        stage_model(f"s3://{bucket}/models/none/", staging, endpoint)


@pytest.fixture(scope="session")
def auth_endpoint(tmp_path_factory):
    """A second moto server that enforces IAM: a user with no policy, then auth switched on."""
    proc, url = start_moto(tmp_path_factory.mktemp("moto-auth") / "moto.log")
    dummy = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}
    iam = boto3.client("iam", endpoint_url=url, region_name="us-east-1", **dummy)
    iam.create_user(UserName="reader")
    key = iam.create_access_key(UserName="reader")["AccessKey"]
    s3 = s3_client(url, **dummy)
    s3.create_bucket(Bucket="locked")
    s3.put_object(Bucket="locked", Key="d.jsonl", Body=_jsonl(2, 0))
    # text/plain, or Flask parses the body as a form and moto reads an empty count.
    switch_on = urllib.request.Request(f"{url}/moto-api/reset-auth", data=b"0", method="POST",
                                       headers={"Content-Type": "text/plain"})
    urllib.request.urlopen(switch_on, timeout=10).close()
    yield url, key["AccessKeyId"], key["SecretAccessKey"]
    stop(proc)


def test_access_denied_and_rejected_credentials(tmp_path, auth_endpoint, monkeypatch):
    url, key_id, secret = auth_endpoint
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)  # a real user, but no policy grants it anything
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    with pytest.raises(DataError, match=r"s3://locked/: access denied \(list\)") as denied:
        stage_dataset("s3://locked/", tmp_path / "staging", url)
    with pytest.raises(DataError, match=r"s3://locked/d.jsonl: access denied \(HEAD\)"):
        stage_dataset("s3://locked/d.jsonl", tmp_path / "staging", url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDUNKNOWN000000000")
    with pytest.raises(DataError, match=r"s3://locked/: the AWS credentials were rejected \(InvalidAccessKeyId\)"):
        stage_dataset("s3://locked/", tmp_path / "staging", url)
    assert secret not in str(denied.value) and secret not in "".join(traceback.format_exception(denied.value))
