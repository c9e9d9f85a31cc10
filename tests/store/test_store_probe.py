"""A store is checked before it is trusted (Store.probe), and a lease ages by the store's clock alone.

The conditional writes the lease relies on, against a moto S3 server over HTTP (which honours both), and against the
same server behind a proxy that drops If-None-Match and If-Match from every PUT: an S3-compatible service that
ignores them, as the server sees it. A host whose own clock is an hour off reads a lease's age as every other host
does: a subprocess with its wall clock (time.time, datetime.now) shifted, against a directory store and S3."""
from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.faults import Fault, FaultProxy
from phase1a.config.schema import Phase1aConfig, StoreConfig
from phase1a.config.stores import open_store
from phase1a.store.base import PROBE_PREFIX, LocalStore, StoreConflict, StoreUnsafe, local_only_locks
from phase1a.store.lease import Lease

ROOT = Path(__file__).resolve().parents[2]


def s3_store(endpoint: str, bucket: str, lease: bool = True):
    return open_store(StoreConfig(url=f"s3://{bucket}/team/", endpoint_url=endpoint, lease=lease))


def test_moto_and_a_directory_honour_both_conditions_and_the_probe_leaves_nothing(aws_env, endpoint, bucket,
                                                                                  tmp_path):
    for store in (s3_store(endpoint, bucket), LocalStore(tmp_path / "mount")):
        store.probe()
        assert store.list(PROBE_PREFIX) == [], store.url
    # If-Match on a key that is not there is a lost condition on both kinds, not an error of the service.
    for store in (s3_store(endpoint, bucket), LocalStore(tmp_path / "mount")):
        with pytest.raises(StoreConflict, match="no longer exists|is not the version"):
            store.put("jobs/x/lease.json", b"x", if_match="0" * 32)
        assert store.get("jobs/x/lease.json") is None


@pytest.mark.parametrize(("stripped", "behaviour"), [
    (("if-none-match", "if-match"), r"a create-if-absent \(If-None-Match: \*\) over an object that exists was to be "
                                    r"refused, and the service accepted it"),
    (("if-match",), r"a replace-if-match \(If-Match\) over a version replaced since was to be refused, and the "
                    r"service accepted it"),
])
def test_a_service_that_ignores_a_condition_is_refused_naming_what_it_did(aws_env, endpoint, bucket, stripped,
                                                                          behaviour):
    with FaultProxy(endpoint) as proxy:
        proxy.faults = [Fault("strip", "PUT", f"/{bucket}/team/probe/", times=100, headers=stripped)]
        store = s3_store(proxy.url, bucket)
        with pytest.raises(StoreUnsafe) as refused:
            store.probe()
    message = str(refused.value)
    assert message.startswith(f"store s3://{bucket}/team/: the S3 service at {proxy.url} does not honour the "
                              "conditional writes a training run's lease relies on: ")
    assert re.search(behaviour, message), message
    assert "store.lease: off" in message and "a directory on a network mount" in message
    assert proxy.requests("PUT", "/probe/") and all(seen.fault == "strip" for seen in proxy.requests("PUT", "/probe/"))
    assert s3_store(endpoint, bucket).list(PROBE_PREFIX) == []  # the probe's objects deleted, refused or not


def test_with_the_lease_off_such_a_service_is_used_with_a_warning(aws_env, endpoint, bucket, caplog):
    config = Phase1aConfig.model_validate({"name": "x", "data": {"source": "d.jsonl"},
                                           "store": {"url": f"s3://{bucket}/team/", "lease": "off"}})
    assert config.store.lease is False
    caplog.set_level(logging.WARNING, logger="phase1a")
    with FaultProxy(endpoint) as proxy:
        proxy.faults = [Fault("strip", "PUT", "", times=100)]
        s3_store(proxy.url, bucket, lease=config.store.lease).probe()
    assert proxy.requests("PUT", "/probe/") == []  # nothing tried: no lease, no conditional writes
    [warning] = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert "store.lease is off, so the store was not checked" in warning
    assert "nothing keeps two hosts out of one training run" in warning


def test_an_nfs_mount_whose_locks_stay_on_each_host_is_named():
    mounts = ("server:/export /mnt/store nfs4 rw,vers=4.2,local_lock=none 0 0\n"
              "server:/old /mnt/old nfs rw,vers=3,nolock,local_lock=all 0 0\n"
              "/dev/sda1 / ext4 rw 0 0\n")
    assert local_only_locks(Path("/mnt/store/team"), mounts) is None
    assert local_only_locks(Path("/mnt/old/team"), mounts) == "nolock"
    assert local_only_locks(Path("/home/x"), mounts) is None  # not NFS


SKEWED_READER = """
import datetime, sys, time
real = time.time
time.time = lambda: real() + 3600  # this host's wall clock, an hour ahead


class Skewed(datetime.datetime):
    @classmethod
    def now(cls, tz=None):
        return datetime.datetime.fromtimestamp(time.time(), tz)


datetime.datetime = Skewed  # before the project imports it
from phase1a.config.schema import StoreConfig
from phase1a.config.stores import open_store
from phase1a.store.lease import Lease, LeaseHeld

s3 = open_store(StoreConfig(url=sys.argv[2], endpoint_url=sys.argv[3]))
print(s3.get("jobs/x/lease.json").age_seconds, flush=True)
mount = open_store(StoreConfig(url=sys.argv[1]))
print(mount.get("jobs/x/lease.json").age_seconds, flush=True)
try:
    Lease(mount, "jobs/x/lease.json", ttl=60, wait=0).acquire()  # one look (and a 2 s pause) before giving up
    print("taken over")
except LeaseHeld:
    print("held")
"""


@pytest.mark.slow  # 10 s on two loaded cores: the reader's process imports Prefect (a lease names its flow run)
def test_a_lease_ages_by_the_store_clock_whatever_the_reading_host_clock_says(aws_env, endpoint, bucket, tmp_path):
    """A lease renewed 30 s ago (by the mount's timestamps) with a ttl of 60 s is live for every host: one whose
    clock runs an hour ahead reads the same age and does not take it over. Before, a directory store aged the
    lease by the reader's clock (an hour and 30 s: taken over)."""
    mount, s3 = LocalStore(tmp_path / "mount"), s3_store(endpoint, bucket)
    for store in (mount, s3):
        Lease(store, "jobs/x/lease.json", ttl=60, wait=0).acquire()
    os.utime(mount.root / "jobs/x/lease.json", (time.time() - 30, time.time() - 30))  # renewed 30 s ago, says the mount
    since = time.monotonic()
    done = subprocess.run([sys.executable, "-c", SKEWED_READER, mount.url, s3.url, endpoint], cwd=ROOT,
                          timeout=120, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    elapsed = time.monotonic() - since
    s3_age, mount_age, outcome = done.stdout.split()
    assert 30 <= float(mount_age) <= 30 + elapsed + 0.1 and outcome == "held", done.stdout
    # S3: the answer's Date against the object's Last-Modified, both the service's, each to the second.
    assert 0 <= float(s3_age) <= elapsed + 2, done.stdout
