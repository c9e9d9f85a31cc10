"""Stage: copy a dataset source (`data.source`, or `data.validation_source`) to fast local disk, verified,
skipped when already identical (phase1a/data/staging.py does the copying).

The key is the source's content fingerprint, computed without downloading anything: the sha256 of a local
file's bytes (of every file's, for a directory or glob), for S3 the hash of its keys, sizes and ETags, for
the Hub the commit the revision resolves to. The staged copy lives at a place named by that fingerprint, so
the cache can tell from its inputs alone whether the copy still exists.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from phase1a.config.schema import Phase1aConfig
from phase1a.config.stores import open_store
from phase1a.data.staging import (
    StagedData,
    StageOptions,
    data_source_fingerprint,
    file_hashes,
    stage_dataset,
    staged_location,
    staged_name,
)
from tasks.caching import StageCache, task

Source = Literal["source", "validation_source"]  # which field of the config's `data` section


def staged_fingerprint(config: Phase1aConfig, field: Source = "source") -> str:
    data = config.data
    source = getattr(data, field)
    return data_source_fingerprint(source, config.endpoint_for(source), data.revision, field=f"data.{field}",
                                   hashes=file_hashes(data.staging_dir), config=data.config)


def staged_copy(fingerprint: str, config: Phase1aConfig, field: Source = "source") -> Path:
    """Where the stage puts the source's copy: a place named by its fingerprint."""
    return staged_location(config.data.staging_dir, fingerprint, staged_name(getattr(config.data, field)))


@task(name="stage", cache_policy=StageCache(fingerprint=staged_fingerprint, output=staged_copy),
      persist_result=True, result_serializer="json")
def stage_task(config: Phase1aConfig, field: Source = "source") -> StagedData:
    data = config.data
    options = StageOptions(revision=data.revision, config=data.config, store=open_store(config.store))
    source = getattr(data, field)
    return stage_dataset(source, data.staging_dir, config.endpoint_for(source), options)
