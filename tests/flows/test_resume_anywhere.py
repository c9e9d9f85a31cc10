"""Hosts that come and go share one store (S3 on a moto server over HTTP): a host killed mid-run is resumed on an
empty one, a torn upload is never the one a resume takes, two hosts started at once never train into one
directory, and a fresh host tokenizes only what the store lacks. Each host has its own HOME, Prefect server and
local directories (tests/helpers/hosts.py). A SIGTERM's checkpoint reaching the store within the grace period is
in tests/flows/test_cli_signals.py."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from botocore.exceptions import ClientError
from safetensors.torch import load_file

from helpers import date_records, write_jsonl
from helpers.faults import Fault, FaultProxy
from helpers.hosts import ROOT, STORE_JOB_STEPS, Host, kill_host, stop_started_hosts, store_job, wait_until
from helpers.prefect_stack import signal_group
from helpers.servers import s3_client

pytestmark = pytest.mark.slow

TRAIN_STEPS = STORE_JOB_STEPS


@pytest.fixture(scope="module")
def job(aws, endpoint, tmp_path_factory) -> dict:
    return store_job(tmp_path_factory.mktemp("job"), "spot", endpoint, "resume-anywhere")


@pytest.fixture(scope="module")
def uninterrupted(job, tmp_path_factory) -> dict[str, torch.Tensor]:
    """The same job on one host that nothing interrupts, with a store of its own."""
    host = Host.fresh(tmp_path_factory.mktemp("reference") / "host", {**job, "store": {
        **job["store"], "url": job["store"]["url"].replace("/store/", "/reference-store/")}})
    state, report = host.run_here()
    assert state.is_completed(), report.get("error")
    assert report["stages"]["train"]["result"]["steps"] == TRAIN_STEPS
    return adapter(report)


def adapter(report: dict) -> dict[str, torch.Tensor]:
    return load_file(Path(report["stages"]["train"]["result"]["adapter_dir"]) / "adapter_model.safetensors")


def assert_same_weights(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Bit for bit: the same steps on the same rows from the same state give the same bytes."""
    assert actual.keys() == expected.keys()
    different = [name for name in expected if not torch.equal(actual[name], expected[name])]
    assert not different, f"{len(different)} of {len(expected)} tensors differ, e.g. {different[:3]}"


def trained_steps(host: Host) -> int:
    """Steps a host running the CLI has finished (its metrics file's whole lines). Not a recursive search: it
    would list checkpoint directories that training renames meanwhile (a .partial one gone mid-scan)."""
    found = list((host.root / "runs" / host.tree["name"]).glob("train-*/metrics.jsonl"))
    return found[0].read_text().count("\n") if found else 0


def _lease_step(store: "StoreView") -> int:
    """The step the lease's holder last reported (none before its first renewal in training)."""
    return (store.lease() or {}).get("step") or 0


class StoreView:
    """What the store holds for the job, read with a plain S3 client."""

    def __init__(self, job: dict) -> None:
        url = job["store"]["url"].removeprefix("s3://")
        self.bucket, _, self.prefix = url.partition("/")
        self.client = s3_client(job["store"]["endpoint_url"])

    def keys(self, under: str = "") -> list[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix + under)
        return [item["Key"][len(self.prefix):] for page in pages for item in page.get("Contents", [])]

    def read(self, key: str) -> bytes:
        return self.client.get_object(Bucket=self.bucket, Key=self.prefix + key)["Body"].read()

    def pointer(self) -> dict | None:
        found = [key for key in self.keys("jobs/spot/train-") if key.endswith("/latest.json")]
        return json.loads(self.read(found[0])) if found else None

    def lease(self) -> dict | None:
        found = [key for key in self.keys("jobs/spot/train-") if key.endswith("/lease.json")]
        return json.loads(self.read(found[0])) if found else None

    def versions(self) -> dict[str, str]:
        """Every object of the job's training runs and its version: what a host wrote, and when it wrote again."""
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket,
                                                                      Prefix=self.prefix + "jobs/spot/train-")
        return {item["Key"]: item["ETag"] for page in pages for item in page.get("Contents", [])}

    def checkpoints(self) -> dict[int, list[str]]:
        """Each checkpoint's step and its files' names."""
        found: dict[int, list[str]] = {}
        for key in self.keys("jobs/spot/train-"):
            match = re.search(r"/checkpoints/step-(\d+)/(.+)$", key)
            if match:
                found.setdefault(int(match[1]), []).append(match[2])
        return found

    def clear(self) -> None:
        keys = self.keys()
        for start in range(0, len(keys), 1000):
            self.client.delete_objects(Bucket=self.bucket, Delete={
                "Objects": [{"Key": self.prefix + key} for key in keys[start:start + 1000]]})


@pytest.fixture
def store(job):
    view = StoreView(job)
    view.clear()  # each test starts from an empty store; the data stays
    yield view
    stop_started_hosts()


def _a_host_past_its_upload(job, store, root, proxy: FaultProxy, hold_seconds: float):
    """A CLI host whose checkpoint uploads after the first are held `hold_seconds` on the way, started and waited
    for until its lease reports a step past the store's checkpoint (it renews with the step it has trained, every
    third of the ttl); the host, its process and that step."""
    proxy.faults = [Fault("delay", "PUT", r"/checkpoints/step-\d+/trainable\.safetensors", times=10_000, skip=1,
                          seconds=hold_seconds)]
    host = Host.fresh(root, {**job, "store": {**job["store"], "endpoint_url": proxy.url}})
    process = host.start_cli()
    wait_until(lambda: (store.pointer() or {}).get("step"), "a checkpoint in the store", process,
               host.root / "run.log")
    reported = wait_until(lambda: _lease_step(store) > store.pointer()["step"] and _lease_step(store),
                          "a renewal past the upload", process, host.root / "run.log")
    return host, process, reported


def test_a_host_killed_after_an_upload_is_resumed_on_an_empty_host(job, store, tmp_path, uninterrupted):
    # Checkpoint uploads after the first are held on the way (a slow link), so that the host trains on past the
    # store's latest checkpoint: steps of a few milliseconds would otherwise reach each checkpoint before a renewal
    # of the lease could report any step beyond it.
    with FaultProxy(job["store"]["endpoint_url"]) as proxy:
        # Once the host has reported training past its upload, it is lost, as a machine is lost.
        first, process, reported = _a_host_past_its_upload(job, store, tmp_path / "a", proxy, hold_seconds=600)
        kill_host(process)  # the host is lost: no final checkpoint, no release of the lease
    uploaded = store.pointer()["step"]
    assert uploaded < TRAIN_STEPS and "final/manifest.json" not in "\n".join(store.keys())

    second = Host.fresh(tmp_path / "b", job)
    state, report = second.run_here()
    assert state.is_completed(), report.get("error")
    tokenize = report["stages"]["tokenize"]["result"]
    assert (tokenize["shards"], tokenize["shards_downloaded"], tokenize["shards_encoded"]) == (2, 2, 0)
    train = report["stages"]["train"]["result"]
    assert train["resumed_from_step"] == uploaded and train["store"]["pulled"]["what"] == "checkpoint"
    taken = train["store"]["taken_over_from"]
    # The lost host's last renewal said how far it had trained: the work lost, as far as the store knows.
    assert taken["holder"]["pid"] == process.pid and taken["step"] >= reported
    assert train["store"]["lost_steps"] == taken["step"] - uploaded > 0
    assert train["store"]["taken_over_silent_seconds"] >= 4  # the lease's ttl: the steps of that time are unknown
    assert_same_weights(adapter(report), uninterrupted)
    assert second.metrics_steps() == list(range(1, TRAIN_STEPS + 1))  # the curve as one run: redone steps once
    complete = [step for step, names in store.checkpoints().items() if "manifest.json" in names]
    assert 1 <= len(complete) <= 2  # checkpoint.keep_last holds in the store too


def test_a_host_paused_through_its_leases_expiry_writes_nothing_once_continued(job, store, tmp_path, uninterrupted):
    """SIGSTOP to a host with a checkpoint upload in flight, held until its lease has expired and another host has
    taken the run over and finished it; SIGCONT then. The paused host believes for a moment that it still holds the
    lease: the requests it had sent before the pause go on, under its own directory, and then it writes nothing
    more: it commits nothing, completes nothing, deletes nothing, publishes no adapter."""
    with FaultProxy(job["store"]["endpoint_url"]) as proxy:
        # The uploads after the first are held 10 s on the way: the host trains past the store's checkpoint, and
        # an upload is on its way when it is paused.
        first, process, _ = _a_host_past_its_upload(job, store, tmp_path / "a", proxy, hold_seconds=10)
        signal_group(process, signal.SIGSTOP)
        committed, paused_holder = store.pointer()["step"], store.lease()["token"]
        try:
            second = Host.fresh(tmp_path / "b", job)
            state, report = second.run_here()
            assert state.is_completed(), report.get("error")
            # The upload held when the host was paused lands now or, when the pause caught its body half-sent,
            # after SIGCONT: either way under its own directory, which the checks below allow.
            before = store.versions()
        finally:
            signal_group(process, signal.SIGCONT)
        assert process.wait(timeout=120) != 0
    train = report["stages"]["train"]["result"]
    assert train["resumed_from_step"] == committed and train["store"]["taken_over_from"]["token"] == paused_holder
    assert_same_weights(adapter(report), uninterrupted)
    log = first.log()
    assert "the lease was taken over by another host" in log or "lease lost to" in log, log[-3000:]
    after = store.versions()
    assert set(before) <= set(after)  # continued, it deleted nothing
    # and changed nothing but the files of its upload that were on their way when it was paused: under its own
    # directory (lease epoch 1), never complete (no manifest), never named by the pointer
    changed = [key for key in after if before.get(key) != after[key]]
    assert all(re.search(r"/e1-[0-9a-f]+/checkpoints/step-\d+/", key) and not key.endswith("/manifest.json")
               for key in changed), changed
    # The pointer names the second host's checkpoint and adapter, under its own directory (lease epoch 2).
    latest = store.pointer()
    assert latest["epoch"] == 2 and latest["holder"]["pid"] == os.getpid() and latest["step"] > committed
    assert latest["checkpoint"].startswith("e2-") and latest["final"].startswith("e2-")
    # What the paused host uploaded after the takeover counts for nothing: never complete, never named.
    paused = {key for key in before if re.search(r"/e1-[0-9a-f]+/", key)}
    assert not [key for key in paused if key.endswith("/manifest.json") and f"step-{committed:08d}" not in key]


def test_a_cut_upload_never_becomes_the_latest_and_the_resume_takes_the_one_before(job, store, tmp_path, endpoint,
                                                                                 uninterrupted):
    """Every checkpoint upload after the first is cut off mid-body; SIGTERM then stops the host. Its stopping
    checkpoint never reaches the store, and an empty host resumes from the first one."""
    with FaultProxy(endpoint) as proxy:
        proxy.faults = [Fault("cut_upload", "PUT", r"/checkpoints/step-\d+/trainable\.safetensors", times=10_000,
                              after_bytes=2000, skip=1)]
        first = Host.fresh(tmp_path / "a", {**job, "store": {**job["store"], "endpoint_url": proxy.url}})
        process = first.start_cli()
        wait_until(lambda: trained_steps(first) >= 25, "step 25", process, first.root / "run.log")
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=120) != 0
    uploads = proxy.requests("PUT", r"trainable\.safetensors")
    assert [seen.fault for seen in uploads][:2] == [None, "cut_upload"]
    uploaded = int(re.search(r"step-(\d+)", uploads[0].target)[1])  # the mirror uploads the newest it finds
    assert store.pointer()["step"] == uploaded
    torn = {step: names for step, names in store.checkpoints().items() if "manifest.json" not in names}
    assert torn and all(step > uploaded for step in torn)  # begun, cut off, never complete

    second = Host.fresh(tmp_path / "b", job)
    state, report = second.run_here()
    assert state.is_completed(), report.get("error")
    assert report["stages"]["train"]["result"]["resumed_from_step"] == uploaded
    assert_same_weights(adapter(report), uninterrupted)


def test_two_hosts_started_at_once_train_one_run_and_a_fresh_host_plans_from_its_throughput(job, store, tmp_path):
    # The lease lives long enough to pause its holder until the other host has seen it held (a run of 20 steps
    # ends in about a second: which host comes second, and when, is up to the machine's load).
    tree = {**job, "method": {**job["method"], "epochs": 2}, "store": {**job["store"], "lease_ttl": "120s"}}
    hosts = [Host.fresh(tmp_path / name, tree) for name in "ab"]
    processes = [host.start_cli() for host in hosts]
    holder = pause_the_first_holder(store, processes)
    other = hosts[1 - processes.index(holder)]
    wait_until(lambda: "waiting for it" in other.log(), "the other host waiting for the lease", timeout=50)
    signal_group(holder, signal.SIGCONT)
    for process, host in zip(processes, hosts):
        assert process.wait(timeout=600) == 0, host.log()[-4000:]
    trains = [host.report()["stages"]["train"]["result"] for host in hosts]
    trained, waited = sorted(trains, key=lambda result: result["reused_completed_run"])
    assert trained["store"]["pulled"]["what"] == "nothing" and not trained["reused_completed_run"]
    assert waited["store"]["pulled"]["what"] == "final" and waited["reused_completed_run"]
    assert waited["store"]["lease_waited_seconds"] > 0
    waiter = hosts[trains.index(waited)]
    assert re.search(r"is held by flow run .*, pid \d+ on .* waiting for it", waiter.log())
    # Every checkpoint in the store is the trainer's alone: one writer, no interleaved files.
    writers = {json.loads(store.read(key))["writer"]["pid"] for key in store.keys("jobs/spot/train-")
               if key.endswith("/manifest.json")}
    assert writers == {processes[trains.index(trained)].pid}

    third = Host.fresh(tmp_path / "c", {**hosts[0].tree, "method": {**hosts[0].tree["method"], "seed": 4}})
    state, report = third.run_here(plan_only=True)
    plan = report["stages"]["plan"]["result"]
    assert state.is_completed() and plan["throughput_source"] == "history", plan["notes"]
    # Every host's report is in the store: `phase1a runs` on the third host lists the two others' runs too.
    listed = subprocess.run([sys.executable, "-m", "flows.cli", "runs", "--config", str(third.config_path)],
                            cwd=ROOT, env=third.env(), capture_output=True, text=True, check=True).stdout
    names = [Path(host.report()["run_dir"]).name for host in (*hosts, third)]
    assert all(name in listed for name in names), listed


def pause_the_first_holder(store: StoreView, processes: list[subprocess.Popen]) -> subprocess.Popen:
    """SIGSTOP to the host that took the lease first, as soon as the store shows it; that host's process."""
    def holder_pid() -> int | None:
        try:
            return (store.lease() or {}).get("holder", {}).get("pid")
        except ClientError:  # released between the listing and the read: the run was faster than the poll
            return None

    pid = wait_until(holder_pid, "a host holding the lease", timeout=300, every=0.02)
    [holder] = [process for process in processes if os.getpgid(pid) == process.pid]
    signal_group(holder, signal.SIGSTOP)
    return holder


def test_a_fresh_host_encodes_only_the_new_shard_and_redoes_a_corrupt_one(aws_env, config_tree, tmp_path, endpoint,
                                                                           bucket):
    client = s3_client(endpoint)

    def add_shard(number: int) -> None:
        shard = write_jsonl(tmp_path / f"p{number}.jsonl", date_records(24, seed=number))
        client.put_object(Bucket=bucket, Key=f"data/part-{number}.jsonl", Body=shard.read_bytes())

    for number in range(3):
        add_shard(number)
    tree = {**config_tree, "data": {**config_tree["data"], "source": f"s3://{bucket}/data/",
                                    "s3_endpoint_url": endpoint},
            "store": {"url": f"s3://{bucket}/store/", "endpoint_url": endpoint}}

    def tokenize_on_a_fresh_host(name: str) -> tuple[dict, dict]:
        state, report = Host.fresh(tmp_path / name, tree).run_here(plan_only=True)
        assert state.is_completed(), report.get("error")
        return report["stages"]["tokenize"]["result"], report["stages"]["stage"]["result"]

    first, staged = tokenize_on_a_fresh_host("night1")
    assert (first["shards_encoded"], first["shards_uploaded"], staged["files_copied"]) == (3, 3, 3)

    add_shard(3)  # night 2: one new shard, on a host that has never seen the data
    second, staged = tokenize_on_a_fresh_host("night2")
    assert (second["shards"], second["shards_downloaded"], second["shards_encoded"]) == (4, 3, 1)
    assert second["shards_uploaded"] == 1 and second["train_examples"] > first["train_examples"]
    # Staging downloaded the new object alone: the store knew the others' content, and tokenize needed none.
    assert staged["files_copied"] == 1 and staged["deferred"] == {f"part-{number}.jsonl": False for number in range(3)}
    assert sorted(p.name for p in Path(staged["path"]).iterdir()) == ["part-3.jsonl"]

    # One byte of a stored shard's tokens flipped: the next fresh host finds it, encodes that shard again, says so.
    tokens = sorted(item["Key"] for item in client.list_objects_v2(Bucket=bucket, Prefix="store/shards/")["Contents"]
                    if item["Key"].endswith("/tokens.arrow"))[0]
    body = bytearray(client.get_object(Bucket=bucket, Key=tokens)["Body"].read())
    body[len(body) // 2] ^= 0x01
    client.put_object(Bucket=bucket, Key=tokens, Body=bytes(body))
    third, staged = tokenize_on_a_fresh_host("night3")
    assert (third["shards_downloaded"], third["shards_encoded"], third["shards_uploaded"]) == (3, 1, 1)
    assert staged["files_copied"] == 0 and len(staged["deferred"]) == 4  # the shard to encode again: fetched then
    assert len(list(Path(staged["path"]).iterdir())) == 1
    [problem] = third["shards_corrupt"]
    assert tokens.removeprefix("store/") in problem and "not what the manifest says" in problem
    assert {key: third[key] for key in ("train_examples", "validation_examples", "lengths")} == \
        {key: second[key] for key in ("train_examples", "validation_examples", "lengths")}
    [run] = (tmp_path / "night3" / "runs" / tree["name"]).glob("*/report.md")
    shown = run.read_text()
    assert "| shards | 4 (1 encoded, 0 reused, 3 from the store, 1 uploaded) |" in shown
    assert f"| corrupt in the store | {problem} |" in shown
