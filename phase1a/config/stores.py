"""Which store a config names: `open_store` (one home for the choice between a directory and S3, so that
phase1a/store/base.py, which s3_store.py builds on, never reaches back to it)."""
from __future__ import annotations

from pathlib import Path

from phase1a.config.schema import StoreConfig
from phase1a.store.base import LocalStore, Store


def open_store(settings: StoreConfig) -> Store | None:
    """The configured store, or None when there is none (everything stays on local disk)."""
    if settings.url is None:
        return None
    from phase1a.store.s3 import is_s3_url  # boto3: only where a store is on S3 (a bare GPU host has none)

    if is_s3_url(settings.url):
        from phase1a.store.s3_store import S3Store

        store: Store = S3Store(settings.url, settings.endpoint_url)
    else:
        store = LocalStore(Path(settings.url))
    store.lease = settings.lease  # whether its probe checks the conditional writes a lease relies on
    return store
