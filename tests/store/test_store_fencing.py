"""Fenced writes to a training run's directory in the store (phase1a/train/train_store.py): a holder that lost its
lease without knowing it (paused past its expiry, its upload slow) cannot move the pointer, cannot delete the new
holder's checkpoints and cannot publish a final adapter; a refusal that is not a lost lease refreshes what the
host knows and the next commits go on; lost work is counted to the last renewal and said to be a lower bound.

Two RemoteRun instances stand for two hosts, on a directory store (a network mount) and on S3 (a moto server over
HTTP, through a fault proxy that holds one host's requests on the way)."""
from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from flows.report_md import _store as report_rows
from helpers.faults import Fault, FaultProxy
from phase1a.config.schema import StoreConfig
from phase1a.config.stores import open_store
from phase1a.core import layout
from phase1a.store.base import LocalStore, Store
from phase1a.store.bundles import upload_bundle
from phase1a.store.lease import Lease, LeaseLost
from phase1a.train.train_store import POINTER, RemoteRun

PREFIX = "jobs/fence/train-k/"


@contextmanager
def direct_and_through_a_proxy(endpoint: str, bucket: str) -> Iterator[tuple[Store, Store, FaultProxy]]:
    """The run's store on moto as one host reaches it directly, and as another reaches it through a fault proxy."""
    config = StoreConfig(url=f"s3://{bucket}/team/", endpoint_url=endpoint)
    with FaultProxy(endpoint) as proxy:
        yield open_store(config), open_store(config.model_copy(update={"endpoint_url": proxy.url})), proxy


def a_checkpoint(root: Path, step: int) -> Path:
    """A local checkpoint's files as training writes them (a few KiB stand for the weights)."""
    root.mkdir(parents=True)
    (root / "trainable.safetensors").write_bytes(step.to_bytes(4, "big") * 1000)
    (root / "trainer_state.json").write_text(json.dumps({"step": step}))
    return root


def a_host(store: Store, root: Path, ttl: float, step: int = 0) -> tuple[RemoteRun, Lease]:
    """A host's view of the run and its lease, acquired with `ttl` (how stale another's must be to take it over)
    and claimed; its curve says it has trained `step` steps (what a renewal reports). Nothing renews the lease in
    the background: it counts as confirmed for 30 s from each write (a ttl of 60 s), whatever `ttl` was."""
    root.mkdir(parents=True, exist_ok=True)
    trained(root, step)
    remote = RemoteRun(store, PREFIX)
    lease = remote.lease(ttl, wait=30.0, output_dir=root).acquire()
    lease.ttl = 60.0
    remote.claim(lease)
    return remote, lease


def trained(root: Path, step: int) -> None:
    (root / layout.METRICS).write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, step + 1)))


def pointer(store: Store) -> dict:
    return json.loads(store.get(PREFIX + POINTER).data)


def keys(store: Store, under: str = "") -> list[str]:
    return [item.key.removeprefix(PREFIX) for item in store.list(PREFIX + under)]


def checkpoint_dirs(store: Store) -> dict[str, bool]:
    """Each checkpoint directory in the store ('<holder>/checkpoints/step-N'), and whether it has its manifest."""
    found: dict[str, bool] = {}
    for key in keys(store):
        match = re.fullmatch(r"(.*checkpoints/step-\d+)/(.+)", key)
        if match:
            found[match[1]] = found.get(match[1], False) or match[2] == "manifest.json"
    return found


def own(lease: Lease, step: int) -> str:
    """The checkpoint directory of `step` that `lease`'s holder writes."""
    return f"e{lease.record.epoch}-{lease.record.token[:8]}/checkpoints/step-{step:08d}"



def test_a_holder_whose_lease_was_taken_cannot_commit_even_before_the_new_holder_writes_a_checkpoint(store, tmp_path):
    """The new holder resumed from the same pointer and is still training: the stale host's If-Match on the
    version it last saw would still succeed, but the takeover's claim rewrote the pointer."""
    a, a_lease = a_host(store, tmp_path / "a", ttl=60.0, step=10)
    a.push_checkpoint(a_checkpoint(tmp_path / "a" / "ck10", 10), 10, keep_last=2)
    # To b, a's lease is stale after 0.3 s (a host whose clock or config says so); a believes it holds it 30 s.
    b, b_lease = a_host(store, tmp_path / "b", ttl=0.3)
    assert b_lease.taken_over.token == a_lease.record.token and b_lease.record.epoch == a_lease.record.epoch + 1
    assert b.pull(tmp_path / "b").step == 10
    claimed = pointer(store)
    assert (claimed["step"], claimed["token"], claimed["epoch"]) == (10, b_lease.record.token, 2)

    assert a_lease.valid()  # by its own clock, a still holds it
    with pytest.raises(LeaseLost, match=r"lease lost to a process, pid \d+ .*: the final adapter not committed"):
        a.push_final(a_checkpoint(tmp_path / "a" / "final", 60))
    assert pointer(store) == claimed  # not moved
    assert b.pull(tmp_path / "c").what == "checkpoint"  # a third host would not take a's adapter either
    # Refused once, a writes nothing more: neither a checkpoint's files nor anything else.
    before = keys(store)
    with pytest.raises(LeaseLost, match="the final adapter not committed; checkpoint step 20 not written"):
        a.push_checkpoint(a_checkpoint(tmp_path / "a" / "ck20", 20), 20, keep_last=2)
    assert keys(store) == before and pointer(store) == claimed

    b.push_checkpoint(a_checkpoint(tmp_path / "b" / "ck20", 20), 20, keep_last=2)
    assert pointer(store)["checkpoint"] == own(b_lease, 20) + "/"


def test_a_stale_holders_slow_upload_lands_under_its_own_name_and_is_not_committed(aws_env, endpoint, bucket,
                                                                                  tmp_path):
    """S3 through a fault proxy: host a's upload of step 20 is held on the way while host b takes the lease over,
    resumes from a's step 10 and commits its own checkpoints; a's upload then lands, and its commit is refused."""
    with direct_and_through_a_proxy(endpoint, bucket) as (direct, slow, proxy):
        a, a_lease = a_host(slow, tmp_path / "a", ttl=60.0, step=10)
        a.push_checkpoint(a_checkpoint(tmp_path / "a" / "ck10", 10), 10, keep_last=1)
        proxy.faults = [Fault("delay", "PUT", r"/e1-[0-9a-f]+/checkpoints/step-00000020/trainable", times=1,
                              seconds=6.0)]
        failed: list[Exception] = []
        upload = threading.Thread(target=lambda: _catch(failed, a.push_checkpoint,
                                                        a_checkpoint(tmp_path / "a" / "ck20", 20), 20, 1))
        upload.start()
        while not proxy.requests("PUT", r"/e1-[0-9a-f]+/checkpoints/step-00000020/"):  # a's upload is on its way
            time.sleep(0.02)
        b, b_lease = a_host(direct, tmp_path / "b", ttl=0.3)
        assert b.pull(tmp_path / "b").step == 10
        for step in (20, 30):
            b.push_checkpoint(a_checkpoint(tmp_path / "b" / f"ck{step}", step), step, keep_last=1)
        upload.join(30)
    [refused] = failed
    assert isinstance(refused, LeaseLost) and "checkpoint step 20 not committed" in str(refused)
    assert pointer(direct)["checkpoint"] == own(b_lease, 30) + "/"
    # a's upload landed under a name of its own: nothing of b's was overwritten, and it counts for nothing
    assert checkpoint_dirs(direct) == {own(a_lease, 20): True, own(b_lease, 30): True}
    assert b.pull(tmp_path / "c").step == 30


def test_a_holder_paused_after_its_commit_prunes_nothing_of_the_holder_that_took_over(aws_env, endpoint, bucket,
                                                                                     tmp_path):
    """Host a commits step 20; its listing before pruning is held on the way while host b takes the lease over,
    finds step 20 corrupt, resumes from step 10 and commits step 15 of its own: a's pruning spares it."""
    with direct_and_through_a_proxy(endpoint, bucket) as (direct, slow, proxy):
        a, a_lease = a_host(slow, tmp_path / "a", ttl=60.0, step=10)
        a.push_checkpoint(a_checkpoint(tmp_path / "a" / "ck10", 10), 10, keep_last=1)
        proxy.faults = [Fault("delay", "GET", r"list-type=2", times=1, seconds=6.0)]
        pruning = threading.Thread(target=a.push_checkpoint, args=(a_checkpoint(tmp_path / "a" / "ck20", 20), 20, 1))
        pruning.start()
        while not proxy.requests("GET", "list-type=2")[1:]:  # committed step 20; its listing is held
            time.sleep(0.02)
        assert pointer(direct)["checkpoint"] == own(a_lease, 20) + "/"
        direct.put(f"{PREFIX}{own(a_lease, 20)}/trainer_state.json", b'{"step": 99}')  # a flipped object
        b, b_lease = a_host(direct, tmp_path / "b", ttl=0.3)
        pulled = b.pull(tmp_path / "b")
        assert pulled.step == 10 and "not what the manifest says" in pulled.corrupt[0]
        b.push_checkpoint(a_checkpoint(tmp_path / "b" / "ck15", 15), 15, keep_last=1)
        pruning.join(30)
    # a pruned after its commit of 20 (its listing then showed b's step 15 and a's 20, step 10 gone by b's
    # pruning), but not b's step 15, a later holder's, which the pointer names
    assert pointer(direct)["checkpoint"] == own(b_lease, 15) + "/"
    assert checkpoint_dirs(direct) == {own(b_lease, 15): True, own(a_lease, 20): True}


def _catch(failed: list[Exception], call, *args) -> None:
    try:
        call(*args)
    except Exception as error:  # noqa: BLE001 - the test looks at it
        failed.append(error)


def test_a_pointer_moved_by_the_holder_itself_is_read_again_and_later_commits_and_pruning_go_on(store, tmp_path):
    remote, lease = a_host(store, tmp_path / "a", ttl=60.0, step=10)
    remote.push_checkpoint(a_checkpoint(tmp_path / "ck10", 10), 10, keep_last=1)
    # The same content written again in other bytes (a retried request of this host's, another of its writes):
    # the version this host saw is gone, though nobody took the lease.
    store.put(PREFIX + POINTER, json.dumps(pointer(store), indent=1).encode())
    for step in (20, 30, 40):
        remote.push_checkpoint(a_checkpoint(tmp_path / f"ck{step}", step), step, keep_last=1)
        assert pointer(store)["step"] == step
    assert checkpoint_dirs(store) == {own(lease, 40): True}  # pruned all along
    assert not lease.lost.is_set()

    # A predecessor's late write (a holder from before fencing: no token) while this host still holds the lease.
    store.put(PREFIX + POINTER, json.dumps({"step": 40, "checkpoint": own(lease, 40) + "/"}).encode())
    remote.push_checkpoint(a_checkpoint(tmp_path / "ck50", 50), 50, keep_last=1)
    assert (pointer(store)["step"], pointer(store)["token"]) == (50, lease.record.token)


def test_a_pointer_write_whose_answer_was_lost_is_taken_as_committed(aws_env, endpoint, bucket, tmp_path):
    """The PUT reaches the store, its answer is lost, the client sends it again and is refused (the version it
    names is gone: its own first try replaced it)."""
    with direct_and_through_a_proxy(endpoint, bucket) as (_, store, proxy):
        remote, lease = a_host(store, tmp_path / "a", ttl=60.0, step=10)
        remote.push_checkpoint(a_checkpoint(tmp_path / "ck10", 10), 10, keep_last=1)
        proxy.faults = [Fault("drop", "PUT", r"/latest\.json", times=1)]
        remote.push_checkpoint(a_checkpoint(tmp_path / "ck20", 20), 20, keep_last=1)
        assert [seen.fault for seen in proxy.requests("PUT", r"/latest\.json")][-2:] == ["drop", None]
        remote.push_checkpoint(a_checkpoint(tmp_path / "ck30", 30), 30, keep_last=1)
        assert pointer(store)["step"] == 30 and not lease.lost.is_set()
        assert list(checkpoint_dirs(store)) == [own(lease, 30)]


def test_lost_work_is_counted_to_the_holders_last_renewal_and_said_to_be_at_least_that(tmp_path):
    from phase1a.train.result import StoreTraining
    from phase1a.train.train_store import Pulled

    store = LocalStore(tmp_path / "mount")
    a, a_lease = a_host(store, tmp_path / "a", ttl=0.5, step=0)
    assert a_lease.in_store().step is None  # nothing trained when it took the lease
    trained(tmp_path / "a", 23)  # the commit of step 20 renews the lease with the step reached by then
    a.push_checkpoint(a_checkpoint(tmp_path / "ck20", 20), 20, keep_last=2)
    assert a_lease.in_store().step == 23
    trained(tmp_path / "a", 29)  # then a's host is lost: steps 24 to 29 reach no renewal
    b, b_lease = a_host(store, tmp_path / "b", ttl=0.5)
    assert b_lease.taken_over.step == 23 and b_lease.taken_over_silent_seconds > 0.5
    assert b.pull(tmp_path / "b").step == 20

    report = StoreTraining(location=store.url, pulled=Pulled(what="checkpoint", step=20),
                           taken_over_from=b_lease.taken_over.model_dump(mode="json"), lost_steps=23 - 20,
                           taken_over_silent_seconds=round(b_lease.taken_over_silent_seconds, 1))
    [(_, row)] = [row for row in report_rows(report) if row[0] == "taken over"]
    assert "last renewal of its lease was at step 23" in row and "at least 3 steps lost" in row
    assert "before this host took it over (steps after it unknown to the store)" in row


def test_a_free_lease_creates_no_pointer_a_takeover_does_and_stores_from_before_fencing_are_read(tmp_path):
    store = LocalStore(tmp_path / "mount")
    first, lease = a_host(store, tmp_path / "a", ttl=60.0)
    assert store.get(PREFIX + POINTER) is None  # a run with nothing committed has no pointer yet
    taker, taken = a_host(store, tmp_path / "b", ttl=0.3)
    assert pointer(store) == {"epoch": 2, "token": taken.record.token, "holder": taken.record.holder}
    assert taker.pull(tmp_path / "b").what == "nothing"
    with pytest.raises(LeaseLost, match="checkpoint step 10 not committed"):
        first.push_checkpoint(a_checkpoint(tmp_path / "ck10", 10), 10, keep_last=2)

    # A store an earlier version wrote: checkpoints/step-N/, final/, a pointer without a holder.
    old = LocalStore(tmp_path / "old")
    upload_bundle(old, a_checkpoint(tmp_path / "old10", 10), f"{PREFIX}checkpoints/step-00000010/", {"step": 10})
    upload_bundle(old, a_checkpoint(tmp_path / "old20", 20), f"{PREFIX}checkpoints/step-00000020/", {"step": 20})
    old.put(PREFIX + POINTER, json.dumps({"step": 10, "checkpoint": "checkpoints/step-00000010/"}).encode())
    remote, lease = a_host(old, tmp_path / "c", ttl=60.0)
    assert lease.record.epoch == 1 and pointer(old)["step"] == 10
    assert remote.pull(tmp_path / "c").step == 10  # step 20 was never committed
    remote.push_checkpoint(a_checkpoint(tmp_path / "ck30", 30), 30, keep_last=1)
    # the old names are pruned as the new ones are (keep_last 1): step 20, never committed, is of an earlier holder
    assert list(checkpoint_dirs(old)) == [own(lease, 30)]
    upload_bundle(old, a_checkpoint(tmp_path / "oldfinal", 60), f"{PREFIX}final/")
    fresh = RemoteRun(old, PREFIX)
    assert fresh.pull(tmp_path / "d").what == "final" and not remote.push_final(tmp_path / "oldfinal")


def test_renewals_from_two_threads_never_read_as_a_takeover(tmp_path):
    """A commit's renewal and the renewal thread at once: each writes over the version the other left, so
    neither takes the other's write for another host's."""
    store = LocalStore(tmp_path / "store")
    _, lease = a_host(store, tmp_path / "a", ttl=60.0, step=3)
    threads = [threading.Thread(target=lambda: [lease.renew() for _ in range(15)]) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not lease.lost.is_set() and lease.valid()
    assert lease.in_store().token == lease.record.token


def test_a_renewal_whose_answer_was_lost_is_adopted_and_another_holders_is_not(tmp_path):
    store = LocalStore(tmp_path / "store")
    _, lease = a_host(store, tmp_path / "a", ttl=60.0, step=3)
    # This holder's own record landed under a version it never saw (the answer to its PUT was lost).
    landed = lease.record.model_copy(update={"step": 4})
    store.put(lease.key, landed.model_dump_json().encode())
    lease.renew()
    assert not lease.lost.is_set() and lease.in_store().token == lease.record.token
    # Another acquisition's record there: a takeover, which the renewal does not overwrite.
    other = lease.record.model_copy(update={"token": "another-acquisition"})
    store.put(lease.key, other.model_dump_json().encode())
    lease.renew()
    assert lease.lost.is_set() and lease.in_store().token == "another-acquisition"
