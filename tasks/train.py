"""Train: what the plan chose, trained from the warm start's weights, then the run's measured speed recorded for
the next plan (the work: phase1a/train/, its loop in loop.py).

The recipe, in named phases:
  1. settings  the config and the plan as TrainSettings, in the directory the training key names
               (phase1a/plan/training.py: train_settings)
  2. alone     one run of a training directory at a time on this host (with a store, its lease: on any host),
               and a spot notice watched in the process SIGTERM reaches
  3. train     in one process or torchrun's ranks (phase1a/train/runner.py); with a store, its checkpoints
               mirrored there and a run another host began resumed (phase1a/train/store_run.py)
  4. record    a run that trained (not one reused) appended to the throughput history the next plan reads, and
               shared through the store

Not a Prefect cache: a finished run is found in its directory and reused (docs/stages.md).
"""
from __future__ import annotations

from pathlib import Path

from phase1a.config.schema import Phase1aConfig
from phase1a.config.stores import open_store
from phase1a.core.locks import exclusive
from phase1a.data.tokenized import TokenizedData
from phase1a.model.result import ResolvedModel
from phase1a.plan.result import Plan
from phase1a.plan.training import record_run, train_settings
from phase1a.start.result import StartPoint
from phase1a.train.history import history_path, share_record
from phase1a.train.preemption import StopRequest
from phase1a.train.result import TrainResult
from phase1a.train.spot_notice import SpotNotices
from tasks.caching import task


@task(name="train")
def train_task(config: Phase1aConfig, model: ResolvedModel, data: TokenizedData, plan: Plan,
               start: StartPoint) -> TrainResult:
    """Trains what the plan chose from `start`, then appends the run's measured speed to the history the next
    plan reads. The result names its start, which promotion records as the new version's parent."""
    from phase1a.train.runner import run  # torch: imported by the stage that trains (tasks/caching.py)
    from phase1a.train.store_run import run_with_store

    settings = train_settings(config, plan, data, model, start)  # 1. settings
    # 2. alone. Two runs with the same training key share output_dir (a duplicate manual run, or one during the
    # nightly run): training side by side would interleave metrics, race on checkpoint renames and write one
    # final.partial. The second waits, then reuses the finished run, or resumes if the first one died. The
    # launching process holds the lock for all its torchrun ranks.
    # With a store, a lease in it does the same between hosts.
    store = open_store(config.store)
    # A spot VM's notice comes from its metadata service, not as a signal: watched here, in the process SIGTERM
    # reaches, and answered the same way (phase1a/train/spot_notice.py).
    notice = StopRequest("a spot notice")
    with (exclusive(Path(settings.output_dir + ".lock"), f"training directory {settings.output_dir}"),
          SpotNotices.of(config.checkpoint.spot_notice, notice, Path(settings.output_dir))):
        # 3. train
        result = run(settings, (notice,)) if store is None else run_with_store(settings, store, config, notice)
    result = result.model_copy(update={"start": start})
    if result.reused_completed_run:
        return result
    record = record_run(history_path(config.cache_dir), config, model, plan, result)  # 4. record
    if store is not None:
        share_record(store, record)
    return result.model_copy(update={"recorded": record})
