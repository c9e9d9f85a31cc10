"""Spot notices from the instance's metadata service (phase1a/train/spot_notice.py), against a fake of both clouds'
services on loopback that refuses what the real ones refuse (tests/helpers/metadata.py): nothing happens without
a notice; an AWS or GCE notice asks training to stop within a second or two and is recorded; tokens are renewed;
where no service answers, the watcher is off within a second, silently. Then whole runs: torchrun's ranks stop
at a checkpoint as on SIGTERM, and a CLI host with a store on moto, its notice armed mid-training, puts its
checkpoint in the store well within the notice and a fresh host resumes from it."""
from __future__ import annotations

import http.client
import json
import logging
import threading
import time
from pathlib import Path

import pytest
import torch

from helpers import date_records, make_tokenizer, write_jsonl
from helpers.hosts import Host, wait_until
from helpers.metadata import FakeMetadata
from helpers.servers import free_port, s3_client
from phase1a.config.schema import MethodConfig, validate_config
from phase1a.core.layout import checkpoint_step, list_checkpoints
from phase1a.data.tokenizing import TokenizeOptions, tokenize_dataset
from phase1a.train.launch import Launch
from phase1a.train.preemption import Preempted, StopRequest
from phase1a.train.runner import run
from phase1a.train.settings import TrainSettings
from phase1a.train.spot_notice import AWS_URL, GCE_URL, AwsNotices, GceNotices, SpotNotices, clients_for


@pytest.fixture
def fake():
    with FakeMetadata() as server:
        yield server


def nowhere() -> str:
    """A loopback port nothing listens on: connections are refused at once."""
    return f"http://127.0.0.1:{free_port()}"


def watcher(mode: str, request: StopRequest, output_dir: Path | None = None, aws: str | None = None,
            gce: str | None = None) -> SpotNotices:
    environ = {AWS_URL: aws or nowhere(), GCE_URL: gce or nowhere()}
    return SpotNotices(clients_for(mode, environ), request, output_dir, explicit=mode not in ("auto", "off"))


def wait_for(condition, seconds: float) -> float:
    """Seconds until `condition()` held; fails after `seconds`."""
    began = time.monotonic()
    while not condition():
        assert time.monotonic() - began < seconds, f"not within {seconds} s"
        time.sleep(0.01)
    return time.monotonic() - began


def events(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "events.jsonl").read_text().splitlines()]


def test_without_a_notice_nothing_happens(fake, tmp_path):
    request = StopRequest()
    with watcher("auto", request, tmp_path, aws=fake.url, gce=fake.url) as watching:
        wait_for(lambda: sorted(watching.watching) == ["aws", "gce"], 2)
        wait_for(lambda: sum("instance-action" in seen.path for seen in fake.requests) >= 2, 3)  # polled again
    assert request.requested is None and watching.notice is None
    assert not (tmp_path / "events.jsonl").exists()
    assert fake.refused == []


def test_an_aws_notice_stops_training_within_seconds_and_is_recorded(fake, tmp_path):
    request = StopRequest()
    with watcher("auto", request, tmp_path, aws=fake.url) as watching:
        wait_for(lambda: watching.watching == ["aws"], 2)
        fake.arm_aws("stop")
        took = wait_for(lambda: request.requested is not None, 3)
    assert took < 2.0  # polled every second
    due = fake.instance_action["time"]
    assert watching.notice.provider == "aws" and watching.notice.action == "stop"
    assert request.requested == f"the AWS spot notice (stop at {due})" and request.at is not None
    [event] = events(tmp_path)
    assert (event["event"], event["provider"], event["action"], event["action_time"]) == \
        ("spot_notice", "aws", "stop", due)
    assert fake.refused == []
    # Every metadata read carried the token the service handed out for a PUT with its TTL header.
    puts = [seen for seen in fake.requests if seen.method == "PUT"]
    assert puts and all(seen.headers["X-aws-ec2-metadata-token-ttl-seconds"] == "21600" for seen in puts)
    assert all(seen.headers.get("X-aws-ec2-metadata-token") for seen in fake.requests if seen.method == "GET")


def test_a_gce_notice_stops_training_at_once_through_the_long_poll(fake, tmp_path):
    request = StopRequest()
    with watcher("auto", request, tmp_path, gce=fake.url) as watching:
        wait_for(lambda: watching.watching == ["gce"], 2)
        wait_for(lambda: fake.held == 1, 2)  # a long poll on the current ETag: the change answers it
        fake.arm_gce()
        took = wait_for(lambda: request.requested is not None, 3)
    assert took < 1.0
    assert request.requested == "the GCE spot notice (preempted)"
    polls = [seen.path for seen in fake.requests if "wait_for_change=true" in seen.path]
    # The first asks with ETag 0 (answered at once), the next with the ETag of FALSE (held until it changed).
    assert "last_etag=0&" in polls[0] and f"last_etag={fake.gce_etag(preempted=False)}&" in polls[1]
    assert [(e["event"], e["provider"], e["action"]) for e in events(tmp_path)] == [("spot_notice", "gce", "preempted")]
    assert fake.refused == [] and all(seen.headers["Metadata-Flavor"] == "Google" for seen in fake.requests)


def test_the_fake_refuses_what_the_real_services_refuse(fake):
    def call(method: str, path: str, headers: dict[str, str]) -> int:
        connection = http.client.HTTPConnection("127.0.0.1", int(fake.url.rsplit(":", 1)[1]), timeout=5)
        try:
            connection.request(method, path, headers=headers)
            return connection.getresponse().status
        finally:
            connection.close()

    action = "/latest/meta-data/spot/instance-action"
    assert call("GET", action, {}) == 401  # IMDSv1: no token
    assert call("GET", action, {"X-aws-ec2-metadata-token": "made-up"}) == 401
    assert call("PUT", "/latest/api/token", {}) == 400  # no TTL
    assert call("PUT", "/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": "21601"}) == 400
    assert call("PUT", "/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": "60",
                                             "X-Forwarded-For": "10.0.0.1"}) == 403
    assert call("GET", "/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": "60"}) == 405
    preempted = "/computeMetadata/v1/instance/preempted"
    assert call("GET", preempted, {}) == 403
    assert call("GET", preempted, {"Metadata-Flavor": "google"}) == 403  # the value, exactly
    assert call("GET", preempted, {"Metadata-Flavor": "Google"}) == 200
    assert len(fake.refused) == 8
    # And the clients send what the services need: no refusal for them.
    aws, gce = AwsNotices(fake.url), GceNotices(fake.url, wait_seconds=1)
    assert aws.probe(1.0) and aws.check(1.0) is None and gce.probe(1.0) and gce.check(1.0) is None
    assert len(fake.refused) == 8


def test_a_token_is_renewed_before_it_expires_and_when_the_service_forgets_it(fake):
    client = AwsNotices(fake.url, token_ttl=1)  # the shortest life AWS gives
    assert client.check(1.0) is None and client.tokens == 1
    time.sleep(0.8)  # past three quarters of its life: renewed before it is refused
    assert client.check(1.0) is None and client.tokens == 2
    assert fake.refused == []
    fake.tokens.clear()  # the service restarted: its tokens are gone
    assert client.check(1.0) is None and client.tokens == 3
    assert [seen.status for seen in fake.refused] == [401]  # refused once, then asked again with a new token


def test_where_no_service_answers_the_watcher_is_off_within_a_second_and_silent(caplog):
    request = StopRequest()
    caplog.set_level(logging.DEBUG, logger="phase1a")
    # A refused port, and an address nothing answers (TEST-NET-1): the probe's timeout bounds it.
    began = time.monotonic()
    with watcher("auto", request, aws=nowhere(), gce="http://192.0.2.1") as watching:
        entered = time.monotonic() - began
        off = wait_for(lambda: watching.active() == [], 2)
    assert entered < 0.1  # the probe runs beside training, which does not wait for it
    assert off < 1.2 and watching.watching == [] and request.requested is None
    assert caplog.records == []
    with watcher("off", request) as watching:
        assert watching.clients == [] and watching.active() == []


def test_a_service_named_in_the_config_is_watched_even_when_the_probe_fails(caplog):
    request = StopRequest()
    with watcher("aws", request) as watching:
        wait_for(lambda: watching.watching == ["aws"], 2)
        time.sleep(1.5)  # a failing service is asked again every second, and said once
        assert watching.active() == ["aws"]
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings
    assert "checkpoint.spot_notice is aws, but http://127.0.0.1:" in warnings[0] and "did not answer" in warnings[0]
    assert "asking again" in warnings[1]


def test_the_config_knob_and_the_addresses_are_checked():
    assert validate_config({"data": {"source": "d.jsonl"}}).checkpoint.spot_notice == "auto"
    with pytest.raises(ValueError, match="checkpoint.spot_notice"):
        validate_config({"data": {"source": "d.jsonl"}, "checkpoint": {"spot_notice": "azure"}})
    with pytest.raises(ValueError, match=f"{AWS_URL}: '169.254.169.254' is not an address of the form"):
        clients_for("auto", {AWS_URL: "169.254.169.254"})
    assert [client.provider for client in clients_for("gce", {})] == ["gce"]
    assert clients_for("gce", {})[0].service.url == "http://metadata.google.internal"


# ---- whole runs ----------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="NCCL takes one GPU a rank")
def test_a_notice_reaches_every_torchrun_rank_as_sigterm_does(fake, tiny_model_dir, tmp_path):
    """Two ranks under torchrun, a GCE notice after their second step: the launcher stops its agent with SIGTERM,
    torchrun passes it on, both ranks end their step and write one checkpoint, and the launcher says why."""
    data = tokenize_dataset(write_jsonl(tmp_path / "d.jsonl", date_records(48)), make_tokenizer(), 256,
                            TokenizeOptions(), tmp_path / "cache" / "fp")
    output = tmp_path / "two"
    method = MethodConfig(learning_rate=5e-3, batch_size=8, epochs=50, lora={"r": 4, "alpha": 8})  # 300 steps
    settings = TrainSettings(model_dir=str(tiny_model_dir), train_path=data.train_path, output_dir=str(output),
                             launch=Launch(processes=2), method=method, micro_batch_size=2,
                             gradient_checkpointing=False, checkpoint_interval="never", show_progress=False)
    metrics = output / "metrics.jsonl"

    def arm_after_two_steps() -> None:
        wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 2, 180)
        fake.arm_gce()

    threading.Thread(target=arm_after_two_steps, daemon=True).start()
    request = StopRequest("a spot notice")
    with watcher("gce", request, output, gce=fake.url), pytest.raises(Preempted) as stopped:
        run(settings, stops=(request,))
    step = stopped.value.step
    assert stopped.value.signal_name == "the GCE spot notice (preempted)" and 2 <= step < 300
    assert [checkpoint_step(path) for path in list_checkpoints(output / "checkpoints")] == [step]
    assert stopped.value.checkpoint == str(list_checkpoints(output / "checkpoints")[0])
    assert metrics.read_text().count("\n") == step  # rank 0 recorded every step up to the stop
    kinds = [(event["event"], event.get("signal"), event.get("step")) for event in events(output)]
    assert kinds == [("spot_notice", None, None), ("preempted", "SIGTERM", step)]  # the ranks had SIGTERM


def trained_steps(host: Host) -> int:
    found = list((host.root / "runs" / host.tree["name"]).glob("train-*/metrics.jsonl"))
    return found[0].read_text().count("\n") if found else 0


@pytest.mark.slow
def test_a_notice_mid_training_puts_a_checkpoint_in_the_store_and_a_fresh_host_resumes_from_it(
        fake, aws_env, endpoint, bucket, config_tree, tmp_path, monkeypatch):
    """`phase1a run` on an EC2 spot VM (its IMDS the fake; GCE's name resolves nowhere), with a store on moto: the
    notice armed mid-training, the stop's checkpoint is in the store within 30 s of it and the run ends
    `preempted`; a fresh host, no notice there, resumes from that checkpoint and finishes."""
    monkeypatch.setenv(AWS_URL, fake.url)
    # 12 epochs of 7 steps: seconds of training on two idle cores, so the notice (asked for every second) lands
    # in the middle of it.
    tree = {**config_tree, "method": {**config_tree["method"], "epochs": 12, "eval_interval": "never"},
            "plan": {**config_tree["plan"], "profile": "custom", "micro_batch_size": 4,
                     "gradient_checkpointing": False, "compile": False, "dataloader_workers": 0},
            "checkpoint": {"interval": "1000steps", "keep_last": 2, "grace_period": "30s"},  # only the stop's
            "validation": {"max_examples": 8,
                           "tolerances": {"loss": None, "token_accuracy": None, "exact_match": None}},
            "progress": {"display": "lines", "interval": "5s"},
            "store": {"url": f"s3://{bucket}/store/", "endpoint_url": endpoint, "lease_ttl": "4s"}}
    client = s3_client(endpoint)

    def pointer() -> dict | None:
        keys = [item["Key"] for item in client.list_objects_v2(Bucket=bucket).get("Contents", [])
                if item["Key"].endswith("/latest.json")]
        return json.loads(client.get_object(Bucket=bucket, Key=keys[0])["Body"].read()) if keys else None

    first = Host.fresh(tmp_path / "a", tree)
    process = first.start_cli()
    wait_until(lambda: trained_steps(first) >= 1, "the first step", process, first.root / "run.log")
    fake.arm_aws()
    armed = time.monotonic()
    latest = wait_until(pointer, "the stop's checkpoint in the store", timeout=30)
    in_store = time.monotonic() - armed
    assert process.wait(timeout=120) == 1, first.log()[-3000:]  # stopped, not by a signal
    report = first.report()
    assert report["status"] == "preempted"
    assert f"stopped by the AWS spot notice (terminate at {fake.instance_action['time']}) after step" in report["error"]
    [train_events] = (first.root / "runs" / tree["name"]).glob("train-*/events.jsonl")
    found = {event["event"]: event for event in events(train_events.parent)}
    assert (found["spot_notice"]["provider"], found["spot_notice"]["action"]) == ("aws", "terminate")
    step = found["preempted"]["step"]
    assert step >= 1 and latest["step"] == step
    assert found["preempted_upload"]["uploaded"] and found["preempted_upload"]["step"] == step
    assert found["preempted_upload"]["seconds_since_signal"] <= 30.0 and in_store <= 30.0
    assert fake.refused == []

    fake.disarm()  # the replacement VM has no notice
    second = Host.fresh(tmp_path / "b", tree)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the CLI hosts run (helpers/hosts.py): on a loaded machine two threads contend
    try:
        state, report = second.run_here()
    finally:
        torch.set_num_threads(threads)
    assert state.is_completed(), report.get("error")
    result = report["stages"]["train"]["result"]
    assert result["resumed_from_step"] == step < result["steps"] and result["store"]["pulled"]["what"] == "checkpoint"
    print(f"notice to the checkpoint in the store: {in_store:.1f} s")
