"""Experiment tracking (`tracking:` in the config, docs/tracking.md): an MLflow run and a Weights & Biases run
per flow run, with the resolved config and the plan's knobs as params, per-step metrics, plots, the validation
table and verdict, and (MLflow) the adapter.

  base.py            the Tracker interface, the run's context, naming (credentials: phase1a/core/redaction.py)
  mlflow_tracker.py  MLflow, through MlflowClient
  wandb_tracker.py   Weights & Biases
  trackers.py        the trackers as one; a failing tracker is a warning, never the run's failure
  follow.py          a training run's metrics.jsonl and eval.jsonl, followed while it trains

Neither mlflow nor wandb is a dependency of a run: a tracker's module is imported when the config asks for it.
"""
from phase1a.core.redaction import redact, redacted
from phase1a.tracking.base import TrackedRun
from phase1a.tracking.follow import Follower, JsonlTail
from phase1a.tracking.trackers import Trackers, require_packages, wanted

__all__ = ["Follower", "JsonlTail", "TrackedRun", "Trackers", "redact", "redacted", "require_packages", "wanted"]
