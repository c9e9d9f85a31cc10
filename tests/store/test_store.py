"""The store's parts, on both kinds of store: a directory (standing for a network mount) and S3 (a moto server over
HTTP): files up and down, conditional writes, bundles that count only once whole, and the lease."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from phase1a.config.schema import StoreConfig
from phase1a.config.stores import open_store
from phase1a.store.base import LocalStore, StoreConflict
from phase1a.store.bundles import BundleCorrupt, delete_bundle, download_bundle, read_bundle, upload_bundle
from phase1a.store.lease import Lease, LeaseHeld
from phase1a.store.s3 import S3Error


def a_directory(root: Path) -> Path:
    (root / "best").mkdir(parents=True)
    (root / "weights.bin").write_bytes(bytes(range(256)) * 400)
    (root / "best" / "evaluation.json").write_text('{"step": 4}')
    (root / ".scratch").write_text("not part of it")
    return root


def test_small_objects_are_written_only_if_absent_or_over_the_version_read(store):
    first = store.put("jobs/x/lease.json", b"one", if_absent=True)
    with pytest.raises(StoreConflict):
        store.put("jobs/x/lease.json", b"two", if_absent=True)
    read = store.get("jobs/x/lease.json")
    assert (read.data, read.etag) == (b"one", first) and abs(read.age_seconds) < 60
    second = store.put("jobs/x/lease.json", b"two", if_match=first)
    with pytest.raises(StoreConflict):
        store.put("jobs/x/lease.json", b"three", if_match=first)  # a writer that read the old version loses
    assert store.get("jobs/x/lease.json").data == b"two" and second != first
    assert store.get("jobs/x/missing.json") is None
    assert [item.key for item in store.list("jobs/")] == ["jobs/x/lease.json"]
    store.delete(["jobs/x/lease.json", "jobs/x/never-there.json"])
    assert store.list("jobs/") == []


def test_a_bundle_round_trips_verified_and_counts_only_with_its_manifest(store, tmp_path):
    source = a_directory(tmp_path / "source")
    bundle = upload_bundle(store, source, "shards/abc/", meta={"step": 4})
    assert sorted(bundle.files) == ["best/evaluation.json", "weights.bin"] and bundle.meta == {"step": 4}
    assert read_bundle(store, "shards/abc/") == bundle
    download_bundle(store, "shards/abc/", tmp_path / "copy", bundle)
    assert (tmp_path / "copy" / "weights.bin").read_bytes() == (source / "weights.bin").read_bytes()
    assert not (tmp_path / "copy" / ".scratch").exists()

    store.delete(["shards/abc/manifest.json"])  # an upload cut off before its manifest: no bundle
    assert read_bundle(store, "shards/abc/") is None
    delete_bundle(store, "shards/abc/")
    assert store.list("shards/") == []


def test_a_bundle_with_a_flipped_byte_is_refused_and_leaves_nothing_behind(store, tmp_path):
    source = a_directory(tmp_path / "source")
    bundle = upload_bundle(store, source, "shards/abc/")
    flipped = bytearray((source / "weights.bin").read_bytes())
    flipped[1000] ^= 0xFF
    (tmp_path / "flipped.bin").write_bytes(bytes(flipped))
    store.put_file(tmp_path / "flipped.bin", "shards/abc/weights.bin")
    with pytest.raises(BundleCorrupt, match=r"weights.bin: not what the manifest says \(its sha256 differs\)"):
        download_bundle(store, "shards/abc/", tmp_path / "copy", bundle)
    assert not (tmp_path / "copy").exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []

    store.put("shards/abc/manifest.json", b"{not json")
    with pytest.raises(BundleCorrupt, match="not a readable manifest"):
        read_bundle(store, "shards/abc/")


def test_a_lease_is_held_renewed_refused_to_others_and_released(store):
    with Lease(store, "jobs/x/train-k/lease.json", ttl=1.5, wait=None, progress=lambda: 7) as held:
        time.sleep(1.0)  # past ttl/3: renewed at least once, so it never ages past its ttl while held
        assert held.valid()
        other = Lease(store, "jobs/x/train-k/lease.json", ttl=1.5, wait=0.8)
        with pytest.raises(LeaseHeld, match=r"is held by a process, pid \d+ on .* renewed \d+ s ago.*store.lease_wait"):
            other.acquire()
    assert store.get("jobs/x/train-k/lease.json") is None  # released: the next host goes on at once
    with Lease(store, "jobs/x/train-k/lease.json", ttl=1.5, wait=0) as again:
        assert again.taken_over is None and again.waited_seconds < 0.5


def test_a_lease_whose_holder_stopped_renewing_is_taken_over_with_the_step_it_reached(store):
    stale = Lease(store, "jobs/x/train-k/lease.json", ttl=1.0, wait=None, progress=lambda: 12).acquire()
    # The holder's host is gone: nobody renews. A waiting host takes it over once a ttl has passed.
    taker = Lease(store, "jobs/x/train-k/lease.json", ttl=1.0, wait=10.0)
    started = time.monotonic()
    taker.acquire()
    assert 0.5 < time.monotonic() - started < 6
    assert taker.taken_over.token == stale.record.token and taker.taken_over.step == 12
    assert not stale._write(if_match=stale._etag)  # the old holder's renewal now fails: it has lost it


def test_a_waiting_host_goes_on_when_the_holder_releases(store):
    holder = Lease(store, "jobs/x/train-k/lease.json", ttl=30.0, wait=None)
    holder.__enter__()
    threading.Timer(1.0, holder.__exit__, args=(None, None, None)).start()
    waiter = Lease(store, "jobs/x/train-k/lease.json", ttl=30.0, wait=None)
    started = time.monotonic()
    waiter.acquire()  # a live lease of 30 s: only the release lets it go on this soon
    assert time.monotonic() - started < 12 and waiter.taken_over is None


def test_a_store_that_cannot_be_used_fails_at_once_naming_it(aws_env, tmp_path, endpoint):
    with pytest.raises(S3Error, match="s3://no-such-store-bucket/x/: no such bucket 'no-such-store-bucket'"):
        open_store(StoreConfig(url="s3://no-such-store-bucket/x/", endpoint_url=endpoint)).probe()
    (tmp_path / "a-file").write_text("")
    with pytest.raises(OSError, match="cannot be created"):
        LocalStore(tmp_path / "a-file" / "store").probe()
