"""Plan: the knobs training runs with and what the run will cost, from the model, the tokenized data and the
hardware (the planner: phase1a/plan/planner.py; reading a plan: phase1a/plan/present.py).

The recipe, in named phases:
  1. history  with a store, the throughput records of the hosts before this one (phase1a/train/history.py), so a
              fresh host plans from what they measured instead of calibrating again
  2. plan     `make_plan`: truncation, throughput, checkpoints, the window, the estimate, the options table

Its key (`plan_fingerprint`) is its own inputs' content: the sections it reads, the model, the data, the device.
"""
from __future__ import annotations

from phase1a.config.schema import ConfigError, Phase1aConfig
from phase1a.config.stores import open_store
from phase1a.core.fingerprint import hash_json
from phase1a.core.hardware import detect, history_kind
from phase1a.data.tokenized import TokenizedData
from phase1a.evaluate.benchmarks import BenchmarkError, validation_key
from phase1a.model.result import ResolvedModel
from phase1a.plan.result import Plan
from phase1a.train.history import history_path, pull_records
from tasks.caching import StageCache, task


def plan_fingerprint(config: Phase1aConfig, model: ResolvedModel, data: TokenizedData) -> str:
    """The plan stage's key, from its own inputs: the sections it reads, the model, the data, and the device it
    would calibrate on. No host path enters, so a host with another checkout or work directory takes the plan a
    host before it measured (a calibration is minutes on a GPU, and may choose other knobs): the benchmarks by
    their content, the warm start's adapter and promotion.to, which the plan never reads, not at all; the replay
    share as the data it made (its fingerprint)."""
    sections = config.model_dump(mode="json", include={"method", "plan", "hardware", "window", "checkpoint"},
                                 exclude={"method": {"init_from", "replay_fraction"}})
    try:
        sections["validation"] = validation_key(config.validation)
    except BenchmarkError as error:  # no key: the stage runs and fails on it in its own words
        raise ConfigError(str(error)) from None
    # Whether there is a store, not where: it decides the checkpoint's upload and what an interruption loses.
    store = {"configured": config.store.url is not None, "lease_ttl": config.store.lease_ttl}
    return hash_json({"config": sections, "store": store, "model": model.fingerprint, "data": data.fingerprint,
                      "device": detect()[1].name})


@task(name="plan", cache_policy=StageCache(fingerprint=plan_fingerprint), persist_result=True,
      result_serializer="json")
def plan_task(config: Phase1aConfig, model: ResolvedModel, data: TokenizedData) -> Plan:
    from phase1a.plan.planner import make_plan  # torch: imported by the stage that calibrates (tasks/caching.py)

    store = open_store(config.store)
    if store is not None:  # 1. history: a fresh host plans from the throughput the hosts before it measured
        pull_records(store, history_path(config.cache_dir), model.fingerprint,
                     history_kind(config.hardware.target, detect()[1].name))
    return make_plan(config, model, data)  # 2. plan
