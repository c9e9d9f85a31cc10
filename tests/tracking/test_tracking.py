"""Experiment tracking for real: an `mlflow server` this module starts (SQLite, 127.0.0.1), read back through
MlflowClient; Weights & Biases offline, read back from its run file. One flow run covers both trackers."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from helpers import _HIDING, write_jsonl
from helpers.tracking import TcpRelay, wandb_config, wandb_history, wandb_records
from phase1a.config.schema import MlflowSettings, TrackingConfig
from phase1a.tracking import Follower, JsonlTail, TrackedRun, Trackers, redact, redacted
from phase1a.tracking.base import flatten, metric_values

PLANTED = {"MLFLOW_TRACKING_TOKEN": "planted-mlflow-token-Zr8Kq2", "WANDB_API_KEY": "planted0wandb0key" + "7" * 23,
           "HF_TOKEN": "hf_plantedTrackingToken9X", "AWS_SECRET_ACCESS_KEY": "planted-aws-secret-Tm4Lw1"}


@pytest.fixture(autouse=True)
def wandb_home(monkeypatch, tmp_path):
    """wandb's own settings, cache and staging directories in the test's tmp, never the home directory."""
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home" / name.lower()))
    monkeypatch.setenv("WANDB_SILENT", "true")


def test_naming_flattening_and_credentials_cut_out_of_urls():
    assert flatten({"method": {"lora": {"r": 16, "target_modules": ["q", "v"]}, "init_from": "base"}, "x": None}) \
        == {"method.lora.r": "16", "method.lora.target_modules": '["q", "v"]', "method.init_from": "base", "x": "null"}
    train = {"step": 3, "loss": 1.5, "lr": 2e-4, "mfu": None, "on_track": True, "tokens": 40}
    assert metric_values("train", train) == {"loss": 1.5, "lr": 2e-4, "tokens": 40.0}
    evaluation = {"step": 3, "eval_loss": 1.2, "eval_token_accuracy": 0.5, "examples": 8, "best": True}
    assert metric_values("eval", evaluation) == {"eval_loss": 1.2, "eval_token_accuracy": 0.5, "eval_examples": 8.0}
    assert redact("http://user:pw@host:9000/x and s3://k@b/p") == "http://***@host:9000/x and s3://***@b/p"
    assert redacted({"a": ["https://t0ken@h/"], "b": 1}) == {"a": ["https://***@h/"], "b": 1}


def test_following_hands_on_each_step_once_live_and_across_a_rewrite(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    write_jsonl(metrics, [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.0}])
    with metrics.open("a") as file:
        file.write('{"step": 3, "lo')  # a line still being written waits for its newline
    tail = JsonlTail(metrics)
    assert [r["step"] for r in tail.read()] == [1, 2] and tail.read() == []
    with metrics.open("a") as file:
        file.write('ss": 1.0}\n')
    assert [r["step"] for r in tail.read()] == [3]
    # A resume rewrites the file up to its checkpoint (step 2) and redoes step 3: nothing goes back.
    write_jsonl(tmp_path / "rewritten", [{"step": 1}, {"step": 2}, {"step": 3}, {"step": 4, "loss": 0.5}])
    (tmp_path / "rewritten").replace(metrics)
    assert [r["step"] for r in tail.read()] == [4]

    received, arrived = [], threading.Event()

    def sink(source, records):
        received.extend((source, r["step"]) for r in records)
        arrived.set()

    run_dir = tmp_path / "train"
    run_dir.mkdir()
    with Follower(run_dir, sink, interval=0.05):
        write_jsonl(run_dir / "metrics.jsonl", [{"step": 1, "loss": 1.0}])
        assert arrived.wait(10)  # while training runs: the follower's thread, not the end
        write_jsonl(run_dir / "eval.jsonl", [{"step": 1, "eval_loss": 0.9}])
    assert received == [("train", 1), ("eval", 1)]


def test_a_missing_tracker_package_is_a_config_error_naming_the_field_and_the_install(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(_HIDING.format(hidden={"mlflow"}))
    code = ("from phase1a.config.schema import TrackingConfig\nfrom phase1a.tracking import require_packages\n"
            "require_packages(TrackingConfig(wandb={'mode': 'disabled'}))\n"  # disabled: wandb is not needed
            "require_packages(TrackingConfig(mlflow={}))")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 1
    assert ("ConfigError: tracking.mlflow: the mlflow package is not installed: pip install 'phase1a[tracking]'"
            in done.stderr), done.stderr[-2000:]


def test_a_server_that_goes_away_mid_run_is_a_warning_and_counted(mlflow_server, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # the client's own retries would wait minutes
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    relay = TcpRelay(int(mlflow_server.rsplit(":", 1)[1]))
    context = TrackedRun(job="relay", run_name="r", run_dir=tmp_path, params={"config": {"name": "relay"}})
    trackers = Trackers.start(TrackingConfig(mlflow=MlflowSettings(tracking_uri=relay.url)), context)
    trackers.log_records("train", [{"step": 1, "loss": 2.0, "lr": 1e-3}, {"step": 2, "loss": 1.5, "lr": 1e-3}])
    trackers.log_records("eval", [{"step": 2, "eval_loss": 1.7, "examples": 4}])
    relay.close()
    trackers.log_records("train", [{"step": 3, "loss": 1.0, "lr": 1e-3}])  # no exception: a warning
    trackers.log_records("train", [{"step": 4, "loss": 0.9, "lr": 1e-3}])  # skipped: the tracker is down
    trackers.finish("passed")
    section = trackers.sections["mlflow"]
    assert section["dropped_metrics"] == 4 and len(section["errors"]) == 1, section
    assert section["errors"][0].startswith("metrics: MlflowException: API request to"), section["errors"]

    client = MlflowClient(mlflow_server)
    assert [(m.step, m.value) for m in client.get_metric_history(section["run_id"], "loss")] == [(1, 2.0), (2, 1.5)]
    assert [(m.step, m.value) for m in client.get_metric_history(section["run_id"], "eval_loss")] == [(2, 1.7)]
    assert client.get_run(section["run_id"]).data.params == {"config.name": "relay"}

    # A server that is not there at the start: the tracker is reported, the run goes on without it; the
    # password in its URL stays out of the warning.
    secret = PLANTED["AWS_SECRET_ACCESS_KEY"]
    url = relay.url.replace("://", f"://user:{secret}@")
    down = Trackers.start(TrackingConfig(mlflow=MlflowSettings(tracking_uri=url)), context)
    down.log_records("train", [{"step": 1, "loss": 2.0}])
    down.finish("passed")
    [error] = down.sections["mlflow"]["errors"]
    assert down.up == {} and down.sections["mlflow"]["run_id"] is None
    assert down.sections["mlflow"]["dropped_metrics"] == 1
    assert error.startswith("start: MlflowException: API request to http://***@127.0.0.1") and secret not in error


@pytest.mark.slow
@pytest.mark.prefect_server
def test_a_flow_run_in_mlflow_and_wandb_with_links_and_no_credentials(mlflow_server, config_tree, tmp_path,
                                                                       monkeypatch):
    from mlflow.tracking import MlflowClient
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.settings import PREFECT_UI_URL, temporary_settings

    from flows.phase1a import phase1a
    from phase1a.config.schema import Phase1aConfig

    for name, value in PLANTED.items():
        monkeypatch.setenv(name, value)
    # A password in the tracking URI (basic auth in front of a server): the server ignores it, no file keeps it.
    with_password = mlflow_server.replace("://", f"://alice:{PLANTED['AWS_SECRET_ACCESS_KEY']}@")
    config_tree["tracking"] = {"mlflow": {"tracking_uri": with_password, "tags": {"team": "dates"}},
                               "wandb": {"mode": "offline", "dir": str(tmp_path / "wandb")}}
    with temporary_settings({PREFECT_UI_URL: "http://127.0.0.1:4200"}):  # the embedded server has no UI to link
        state = phase1a(Phase1aConfig.model_validate(config_tree), return_state=True)
    [report_path] = (tmp_path / "runs" / "tiny").glob("*/report.json")
    report = json.loads(report_path.read_text())
    assert state.is_completed(), report["stages"]
    tracking, plan, train = report["tracking"], report["stages"]["plan"]["result"], report["stages"]["train"]["result"]
    run_name = report_path.parent.name.split("-", 1)[1]

    # MLflow: params, per-step metrics, the verdict, images and the adapter; tags back to Prefect, and back.
    client = MlflowClient(mlflow_server)
    mlflow = tracking["mlflow"]
    assert mlflow["dropped_metrics"] == 0 and mlflow["errors"] == []
    assert mlflow["url"].startswith(mlflow_server.replace("://", "://***@"))
    assert report["config"]["tracking"]["mlflow"]["tracking_uri"] == mlflow_server.replace("://", "://***@")
    run = client.get_run(mlflow["run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == run_name
    params, tags = run.data.params, run.data.tags
    assert params["config.method.lora.r"] == "4" and params["config.data.source"] == config_tree["data"]["source"]
    assert params["plan.micro_batch_size"] == str(plan["micro_batch_size"])
    assert params["plan.steps"] == str(plan["steps"])
    assert tags["prefect.flow_run_name"] == run_name and tags["team"] == "dates"
    assert tags["prefect.flow_run_url"] == f"http://127.0.0.1:4200/flow-runs/flow-run/{tags['prefect.flow_run_id']}"
    assert tags["gate"] == "pass" and run.data.metrics["candidate_loss"] == report["validation"]["metrics"]["loss"][
        "candidate"]
    metrics = (Path(train["output_dir"]) / "metrics.jsonl").read_text().splitlines()
    losses = [json.loads(line)["loss"] for line in metrics]
    history = client.get_metric_history(mlflow["run_id"], "loss")
    assert [(m.step, m.value) for m in history] == list(enumerate(losses, start=1)) and len(losses) == train["steps"]
    assert len(client.get_metric_history(mlflow["run_id"], "tokens_per_s")) == train["steps"]
    evaluations = client.get_metric_history(mlflow["run_id"], "eval_loss")  # evaluation during training
    assert len(evaluations) == train["evaluations"] >= 1 and evaluations[-1].step == train["steps"]
    files = {a.path for folder in ("", "plots", "adapter") for a in client.list_artifacts(mlflow["run_id"], folder)}
    assert {"plots/lengths.png", "plots/loss.png", "plots/throughput.png", "plots/estimate_vs_actual.png",
            "adapter/adapter_config.json", "adapter/adapter_model.safetensors",
            "validation.json", "gate.txt"} <= files, files
    with get_client(sync_client=True) as prefect:
        [link] = prefect.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["mlflow-run"])))
    assert link.data == f"[mlflow run {mlflow['run_id']}]({mlflow['url']})"  # Prefect keeps a link as markdown
    assert str(link.flow_run_id) == tags["prefect.flow_run_id"]

    # W&B offline: the run's file holds the config, the plan, one row per step and the verdict.
    wandb_dir = Path(tracking["wandb"]["dir"])
    assert wandb_dir.parent == tmp_path / "wandb" / "wandb" and tracking["wandb"]["dropped_metrics"] == 0
    records = wandb_records(wandb_dir)
    config = wandb_config(records)
    assert config["config"]["method"]["lora"]["r"] == 4 and config["plan"]["steps"] == plan["steps"]
    assert config["prefect"]["prefect.flow_run_name"] == run_name
    rows = [row for row in wandb_history(records) if "train/loss" in row]
    assert [(row["train/global_step"], row["train/loss"]) for row in rows] == list(enumerate(losses, start=1))
    assert any("plots/lengths" in key for row in wandb_history(records) for key in row)
    summary = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
               for record in records if record.WhichOneof("record_type") == "summary"
               for item in record.summary.update}
    assert summary["gate"] == "pass" and summary["candidate_loss"] == pytest.approx(run.data.metrics["candidate_loss"])
    assert summary["gate_text"].startswith("baseline: base model") and "gate: PASS" in summary["gate_text"]
    [exit_record] = [record.exit for record in records if record.WhichOneof("record_type") == "exit"]
    assert exit_record.exit_code == 0
    [artifact] = [record.artifact for record in records if record.WhichOneof("record_type") == "artifact"
                  and record.artifact.type == "model"]
    assert artifact.name == "tiny-adapter"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {item.path for item in artifact.manifest.contents}

    # No credential from the environment in MLflow's params, tags or artifacts, W&B's files or the report.
    texts = {"mlflow params and tags": json.dumps([params, tags])}
    downloaded = Path(client.download_artifacts(mlflow["run_id"], "", str(tmp_path / "downloaded")))
    for path in [*downloaded.rglob("*"), *(tmp_path / "wandb").rglob("*"), report_path]:
        if path.is_file():
            texts[str(path)] = path.read_bytes().decode("latin-1")
    leaked = [where for where, text in texts.items() if any(secret in text for secret in PLANTED.values())]
    assert leaked == [] and len(texts) > 10

    # Again, against a baseline no model this size meets: the training is reused (its curve read back from its
    # files), the gate fails the flow run, and the tracker's run with it.
    reference = tmp_path / "reference.json"
    reference.write_text(json.dumps({"source": "unreachable", "metrics": {"loss": 0.0, "token_accuracy": 1.0,
                                                                          "exact_match": 1.0}}))
    config_tree["validation"].update({"baseline": "file", "baseline_file": str(reference)})
    state = phase1a(Phase1aConfig.model_validate(config_tree), return_state=True)
    [again] = [path for path in (tmp_path / "runs" / "tiny").glob("*/report.json") if path != report_path]
    second = json.loads(again.read_text())
    assert state.is_failed() and second["stages"]["train"]["result"]["reused_completed_run"]
    run = client.get_run(second["tracking"]["mlflow"]["run_id"])
    assert run.info.status == "FAILED" and run.data.tags["gate"] == "fail"
    history = client.get_metric_history(run.info.run_id, "loss")
    assert [(m.step, m.value) for m in history] == list(enumerate(losses, start=1))


@pytest.mark.slow
def test_a_preempted_flow_run_ends_killed_in_mlflow_and_preempted_in_its_report(mlflow_server, config_tree, tmp_path):
    """SIGTERM to the CLI's process while it trains (a spot instance reclaimed): training writes a checkpoint
    and stops, report.json's status is `preempted`, report.md says where, and the MLflow run ends KILLED, not
    FAILED; the next run resumes (tests/train/test_train_interrupts.py)."""
    import signal
    import time

    import yaml
    from mlflow.tracking import MlflowClient

    config_tree["method"]["epochs"] = 40  # long enough to be stopped in the middle
    config_tree["tracking"] = {"mlflow": {"tracking_uri": mlflow_server}}
    config_path = tmp_path / "tiny.yaml"
    config_path.write_text(yaml.safe_dump(config_tree))
    with open(tmp_path / "out.txt", "w") as out, open(tmp_path / "err.txt", "w") as err:
        cli = subprocess.Popen([sys.executable, "-m", "flows.cli", "run", "--config", str(config_path)],
                               stdout=out, stderr=err, text=True)
        deadline = time.monotonic() + 300
        while not any(path.read_text().count("\n") >= 2 for path in (tmp_path / "runs").rglob("metrics.jsonl")):
            assert cli.poll() is None and time.monotonic() < deadline, (tmp_path / "err.txt").read_text()[-3000:]
            time.sleep(0.2)
        cli.send_signal(signal.SIGTERM)
        assert cli.wait(timeout=300) == 128 + signal.SIGTERM  # "terminated", as a shell reports a SIGTERM'd process
    reported = [line for line in (tmp_path / "out.txt").read_text().splitlines() if line.startswith("report: ")]
    report_path = Path(reported[-1].removeprefix("report: "))
    report = json.loads(report_path.read_text())
    assert report["status"] == "preempted" and "Preempted: stopped by SIGTERM after step" in report["error"]
    assert "> **Preempted in stage `train`**" in (report_path.parent / "report.md").read_text()
    run = MlflowClient(mlflow_server).get_run(report["tracking"]["mlflow"]["run_id"])
    assert run.info.status == "KILLED"
    assert 2 <= len(MlflowClient(mlflow_server).get_metric_history(run.info.run_id, "loss")) < report["stages"][
        "plan"]["result"]["steps"]
