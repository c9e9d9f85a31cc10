"""Two hosts as users run them: `phase1a run --config job.yaml` in each host's own copy of the job's directory, each
with its own HOME (its own embedded Prefect server), work directory and caches, the store on a moto S3 server named
only by the one-line `store: s3://bucket/prefix/` and the environment's AWS_ENDPOINT_URL. The first host is
killed -9 (its whole process group) after its first checkpoint reached the store, mid-run; the second resumes from
that checkpoint and ends with the uninterrupted run's adapter, tensor for tensor."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers.faults import Fault, FaultProxy
from helpers.hosts import Host, kill_host, stop_started_hosts, store_job, wait_until
from helpers.servers import s3_client

pytestmark = pytest.mark.slow

EPOCHS = 3  # 30 steps, a checkpoint every 10: the shortest run with a checkpoint to resume from and steps after it


@pytest.fixture
def job(aws, endpoint, tmp_path) -> tuple[dict, dict[str, Path]]:
    """store_job's job as a repository holds it: its config naming the model by a relative path, the data and the
    store by s3:// URLs alone (no endpoint in the file)."""
    (tmp_path / "job").mkdir()
    tree = store_job(tmp_path / "job", "two-hosts", endpoint, "two-hosts")
    model = Path(tree["model"]["name_or_path"])
    data = {key: value for key, value in tree["data"].items() if key != "s3_endpoint_url"}
    tree = {**tree, "data": data, "model": {"name_or_path": "./model"}, "store": "s3://two-hosts/store/",
            "method": {**tree["method"], "epochs": EPOCHS}}
    yield tree, {"model": model}
    stop_started_hosts()


def adapter(host: Host) -> dict[str, torch.Tensor]:
    result = host.report()["stages"]["train"]["result"]
    return load_file(Path(result["adapter_dir"]) / "adapter_model.safetensors")


def trained_steps(host: Host) -> int:
    """Steps the host has finished: its metrics file's whole lines."""
    found = list((host.root / "runs" / host.tree["name"]).glob("train-*/metrics.jsonl"))
    return found[0].read_text().count("\n") if found else 0


def store_pointer(endpoint: str) -> dict | None:
    client = s3_client(endpoint)
    found = [item["Key"] for item in client.list_objects_v2(Bucket="two-hosts", Prefix="store/jobs/two-hosts/")
             .get("Contents", []) if item["Key"].endswith("/latest.json")]
    return json.loads(client.get_object(Bucket="two-hosts", Key=found[0])["Body"].read()) if found else None


def uninterrupted(tree: dict, files: dict[str, Path], root: Path, endpoint: str,
                  monkeypatch: pytest.MonkeyPatch) -> dict[str, torch.Tensor]:
    """The same job that nothing interrupts, with a store of its own: in this process (a third CLI host would add
    a minute of Prefect's start on two cores), with one thread as the CLI hosts have (OMP_NUM_THREADS=1), so that
    its sums run in the same order."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        host = Host.fresh(root, {**tree, "model": {"name_or_path": str(files["model"])},
                                 "store": "s3://two-hosts/reference-store/"})
        state, report = host.run_here()
    finally:
        torch.set_num_threads(threads)
        monkeypatch.delenv("AWS_ENDPOINT_URL")
    assert state.is_completed(), report.get("error")
    return adapter(host)


def test_a_host_killed_mid_run_is_resumed_by_another_to_the_uninterrupted_weights(job, endpoint, tmp_path,
                                                                                  monkeypatch):
    tree, files = job
    began = time.monotonic()

    # The first host's store traffic passes a proxy that holds every checkpoint upload after the first (a slow
    # link): it is still at work when the store has its first checkpoint, whatever the machine's load.
    with FaultProxy(endpoint) as proxy:
        proxy.faults = [Fault("delay", "PUT", r"/checkpoints/step-\d+/trainable\.safetensors", times=10_000, skip=1,
                              seconds=600)]
        first = Host.checked_out(tmp_path / "a", tree, files, {"AWS_ENDPOINT_URL": proxy.url})
        lost = first.start_cli()
        uploaded = wait_until(lambda: store_pointer(endpoint), "a checkpoint in the store", lost,
                              first.root / "run.log")["step"]
        trained = trained_steps(first)
        kill_host(lost)  # lost as a machine is lost: no last checkpoint, no release of the lease
    lost_seconds = time.monotonic() - began
    assert uploaded <= trained < EPOCHS * 10 and store_pointer(endpoint)["step"] == uploaded  # killed mid-run

    second = Host.checked_out(tmp_path / "b", tree, files, {"AWS_ENDPOINT_URL": endpoint})
    resumed = time.monotonic()
    process = second.start_cli()
    expected = uninterrupted(tree, files, tmp_path / "reference", endpoint, monkeypatch)  # meanwhile
    reference_seconds = time.monotonic() - resumed
    assert process.wait(timeout=600) == 0, second.log()[-4000:]
    resumed_seconds = time.monotonic() - resumed
    report = second.report()
    train = report["stages"]["train"]["result"]
    assert train["resumed_from_step"] == uploaded and train["store"]["pulled"]["what"] == "checkpoint"
    assert train["store"]["taken_over_from"]["holder"]["pid"] == lost.pid  # the lease the lost host held
    tokenize = report["stages"]["tokenize"]["result"]
    assert (tokenize["shards_downloaded"], tokenize["shards_encoded"]) == (2, 0)
    # Keys without host paths (issue 36): the lost host's plan, from the store's records, serves this one too,
    # though the two hosts' checkouts, work directories and caches lie at different paths.
    assert report["stages"]["plan"]["state"] == "Cached"
    actual = adapter(second)
    assert actual.keys() == expected.keys()
    different = [name for name in expected if not torch.equal(actual[name], expected[name])]
    assert not different, f"{len(different)} of {len(expected)} tensors differ, e.g. {different[:3]}"
    print(f"uninterrupted {reference_seconds:.0f} s, lost host {lost_seconds:.0f} s, resuming host "
          f"{resumed_seconds:.0f} s")
