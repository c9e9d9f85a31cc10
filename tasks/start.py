"""Start: where training starts (`method.init_from`): fresh adapters on the base model, the promoted version's
adapter, or a given one, fetched and checked against the model (phase1a/start/warmstart.py); and, for a warm
start with `method.replay_fraction`, the training data as the new shards plus old examples replayed
(phase1a/start/replay.py).

The start runs before any long stage, so a missing or mismatched adapter fails in seconds; it may fetch from S3
or the store, so the flow retries it on transient errors. The replay mix is a view beside the tokenized dataset
with its own fingerprint: the plan and the training key follow it.
"""
from __future__ import annotations

from phase1a.config.schema import Phase1aConfig
from phase1a.data.tokenized import TokenizedData
from phase1a.model.result import ResolvedModel
from phase1a.start.replay import warm_start_data
from phase1a.start.result import StartPoint
from phase1a.start.warmstart import resolve_start
from tasks.caching import task


@task(name="start")
def start_task(config: Phase1aConfig, model: ResolvedModel) -> StartPoint:
    return resolve_start(config, model)


@task(name="replay")
def replay_task(config: Phase1aConfig, data: TokenizedData, start: StartPoint) -> TokenizedData:
    return warm_start_data(data, start, config.method.replay_fraction, config.method.seed)
