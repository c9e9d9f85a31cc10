"""Model: the run's model on local disk (a Hub snapshot, a staged copy from S3 or a directory, the converted
built-in) and its identity: the fingerprints of its weights and tokenizer, its context length
(phase1a/model/loading.py).

It crosses the network, so the flow retries it on transient errors (tasks/caching.py: with_retries); a download
cut off resumes where it stopped. Prefect does not cache it: the snapshot, the staged copy and the fingerprints
are each kept by content already, so a second run checks them in seconds, and a Hub revision that moved is seen.
"""
from __future__ import annotations

from pathlib import Path

from phase1a.config.schema import Phase1aConfig
from phase1a.model.gguf import check_gguf_export
from phase1a.model.loading import prepare_model
from phase1a.model.result import ResolvedModel
from tasks.caching import task


@task(name="model")
def model_task(config: Phase1aConfig) -> ResolvedModel:
    model = prepare_model(config)
    if "gguf" in config.promotion.export:
        check_gguf_export(Path(model.path))  # an architecture GGUF export does not cover fails here, not at promote
    return model
