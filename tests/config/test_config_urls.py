"""`config_file` as a URL, so that a pod, a spot VM or a Modal container gets its job without a checkout: an
`s3://` object read from a moto S3 server over HTTP, and `hf://` files of model and dataset repositories laid out
in HF_HOME's cache as huggingface_hub writes it (conftest sets HF_HUB_OFFLINE=1), read through the same
`config_from` the flow and the CLI call. Relative paths in such a config resolve against the working directory."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from flows.cli import main
from helpers.hub_cache import cache_repo, unique_repo
from helpers.servers import s3_client
from phase1a.config.remote import MAX_CONFIG_BYTES
from phase1a.config.schema import ConfigError, config_from

JOB = {"name": "remote-job", "work_dir": "runs", "cache_dir": "/var/tmp/phase1a/cache",
       "data": {"source": "s3://data/shards/", "staging_dir": "staging"},
       "model": {"name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct"},
       "method": {"epochs": 1}, "store": "s3://store/remote-job/"}


@pytest.fixture
def s3_job(aws_env, endpoint, bucket, monkeypatch) -> str:
    """The job's YAML in a bucket; the endpoint from the environment, as on a host with a store off AWS."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    s3_client(endpoint).put_object(Bucket=bucket, Key="jobs/remote.yaml", Body=yaml.safe_dump(JOB).encode())
    return f"s3://{bucket}/jobs/remote.yaml"


def test_an_s3_config_is_read_overridden_and_its_relative_paths_resolve_against_the_working_directory(
        s3_job, tmp_path):
    config = config_from(config_file=s3_job, overrides=["method.epochs=3"], base=tmp_path)
    assert (config.name, config.method.epochs) == ("remote-job", 3)
    assert config.work_dir == tmp_path / "runs" and config.data.staging_dir == tmp_path / "staging"
    assert config.data.source == "s3://data/shards/" and config.store.url == "s3://store/remote-job/"
    assert config.model.name_or_path == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_the_cli_takes_an_s3_config(s3_job, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9")  # the S3-specific variable wins: one that
    with pytest.raises(SystemExit):  # refuses connections fails the read, naming the endpoint
        raise SystemExit(main(["runs", "--config", s3_job]))
    assert f"config_file {s3_job}: cannot connect to the S3 endpoint http://127.0.0.1:9" in capsys.readouterr().err
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3")
    assert main(["runs", "--config", s3_job]) == 0  # nothing runs: its runs are listed (none yet)
    assert f"no runs under {tmp_path / 'runs' / 'remote-job'}" in capsys.readouterr().out


@pytest.mark.parametrize("key, expected", [
    ("jobs/missing.yaml", "config_file s3://{bucket}/jobs/missing.yaml: no such key"),
    ("jobs/", "config_file s3://{bucket}/jobs/: a prefix, not a file"),
    ("jobs/big.yaml", f"config_file s3://{{bucket}}/jobs/big.yaml: {MAX_CONFIG_BYTES + 1} bytes is not a config"),
    ("jobs/list.yaml", "s3://{bucket}/jobs/list.yaml: the top level must be a mapping of sections"),
    ("jobs/bad.yaml", "invalid config (s3://{bucket}/jobs/bad.yaml with overrides):\n  method.epochs: Input should be "
                      "greater than 0"),
])
def test_a_bad_s3_config_fails_naming_the_url(s3_job, endpoint, bucket, key, expected):
    s3 = s3_client(endpoint)
    s3.put_object(Bucket=bucket, Key="jobs/big.yaml", Body=b"#" * (MAX_CONFIG_BYTES + 1))
    s3.put_object(Bucket=bucket, Key="jobs/list.yaml", Body=b"- name: a list\n")
    s3.put_object(Bucket=bucket, Key="jobs/bad.yaml", Body=yaml.safe_dump(JOB).encode())
    with pytest.raises(ConfigError) as refused:
        config_from(config_file=f"s3://{bucket}/{key}", overrides=["method.epochs=0"] if "bad" in key else None)
    assert str(refused.value).startswith(expected.format(bucket=bucket)), refused.value


def test_a_missing_bucket_is_named(s3_job):
    with pytest.raises(ConfigError, match="^config_file s3://no-such-bucket-x/job.yaml: no such bucket"):
        config_from(config_file="s3://no-such-bucket-x/job.yaml")


@pytest.mark.parametrize("repo_type, prefix", [("model", ""), ("dataset", "datasets/")])
def test_a_hub_config_is_read_from_a_model_or_dataset_repository(repo_type, prefix, tmp_path):
    repo_id = unique_repo("jobs")
    cache_repo(repo_id, {"jobs/remote.yaml": yaml.safe_dump(JOB).encode()}, repo_type=repo_type)
    config = config_from(config_file=f"hf://{prefix}{repo_id}/jobs/remote.yaml", base=tmp_path)
    assert config.name == "remote-job" and config.work_dir == tmp_path / "runs"


def test_a_hub_config_at_a_revision(tmp_path):
    repo_id = unique_repo("jobs")
    cache_repo(repo_id, {"job.yaml": yaml.safe_dump({**JOB, "name": "pinned"}).encode()}, ref="v1",
               repo_type="dataset")
    cache_repo(repo_id, {"job.yaml": yaml.safe_dump(JOB).encode()}, repo_type="dataset")
    assert config_from(config_file=f"hf://datasets/{repo_id}@v1/job.yaml", base=tmp_path).name == "pinned"
    assert config_from(config_file=f"hf://datasets/{repo_id}/job.yaml", base=tmp_path).name == "remote-job"


def test_a_bad_hub_config_fails_naming_the_url():
    repo_id = unique_repo("jobs")
    cache_repo(repo_id, {"job.yaml": yaml.safe_dump(JOB).encode()}, repo_type="dataset")
    cases = {
        f"hf://datasets/{repo_id}/other.yaml": "HF_HUB_OFFLINE=1 and 'other.yaml' of Hugging Face dataset",
        f"hf://datasets/{repo_id}@v2/job.yaml": "HF_HUB_OFFLINE=1 and revision 'v2' of Hugging Face dataset",
        "hf://datasets/org/never-cached/job.yaml": "HF_HUB_OFFLINE=1 and no cached snapshot of Hugging Face dataset",
        f"hf://datasets/{repo_id}": "name a file in a model or dataset repository",
        "hf://buckets/org/bucket/job.yaml": "name a file in a model or dataset repository",
        "hf://datasets/org/na me/job.yaml": "not a Hub file URL",
    }
    for url, reason in cases.items():
        with pytest.raises(ConfigError) as refused:
            config_from(config_file=url)
        assert str(refused.value).startswith(f"config_file {url}: ") and reason in str(refused.value), refused.value


def test_other_schemes_are_refused_and_local_paths_keep_their_meaning(tmp_path):
    with pytest.raises(ConfigError, match=r"^config_file gs://b/job.yaml: gs:// is not a config location; give a "
                                          r"path on this host, s3://... or hf://..."):
        config_from(config_file="gs://b/job.yaml")
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "local.yaml").write_text(yaml.safe_dump(JOB))
    config = config_from(config_file="jobs/local.yaml", base=tmp_path)
    assert config.work_dir == tmp_path / "jobs" / "runs"  # a file's relative paths: relative to the file
    assert Path(config.data.staging_dir) == tmp_path / "jobs" / "staging"
