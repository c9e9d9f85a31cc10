"""What the train stage hands validate and promote, and report.json records: the trained adapter and how its
training went (TrainResult), with its dealings with the store (StoreTraining)."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from phase1a.start.result import StartPoint
from phase1a.train.history import RunRecord
from phase1a.train.train_store import Pulled


class StoreTraining(BaseModel):
    """The train stage's dealings with the store, for the report."""

    location: str
    pulled: Pulled
    lease_waited_seconds: float = 0.0
    taken_over_from: dict | None = None  # the holder whose lease had expired, and the step it had reached
    # Steps that holder trained past the checkpoint this run resumed from, at least: its last renewal's step (it
    # renews every lease_ttl/3 and at each checkpoint it commits); what it trained after that, the store cannot know.
    lost_steps: int | None = None
    taken_over_silent_seconds: float | None = None  # how long its lease had gone unrenewed at the takeover
    checkpoint_uploads: int = 0
    checkpoint_upload_seconds: float = 0.0  # all uploads together, in the background
    uploaded_step: int | None = None  # the newest checkpoint in the store when training ended
    upload_failures: list[str] = []
    final_uploaded: bool = False
    preempted_upload_seconds: float | None = None  # signal to the final checkpoint in the store


class TrainResult(BaseModel):
    adapter_dir: str
    output_dir: str
    steps: int
    resumed_from_step: int | None
    reused_completed_run: bool
    wall_seconds: float
    train_tokens: int
    tokens_per_second: float
    final_loss: float | None
    checkpoints_written: int
    checkpoint_seconds: float
    startup_seconds: float = 0.0  # model load, adapter, optimizer, resume: before the first step
    checkpoint_share: float = 0.0  # checkpoint writes as a share of the wall time
    micro_batch_size: int = 0  # at the end: smaller than planned after out-of-memory back-offs
    out_of_memory_backoffs: int = 0
    # A resume's knobs that its checkpoint decided against the plan (phase1a.train.checkpoints.StepArithmetic):
    # knob -> the checkpoint's value, which the steps computed with
    arithmetic_from_checkpoint: dict[str, Any] = {}
    padding_tokens: int = 0  # computed tokens that were not an example's: zero when rows are packed
    mean_mfu: float | None = None
    evaluations: int = 0  # during training (eval.jsonl), the final weights' included; this process's
    eval_seconds: float = 0.0  # their time, part of wall_seconds, early stopping's writes of best/ included
    best_step: int | None = None  # the lowest eval loss during training; with early stopping, the final weights
    best_eval_loss: float | None = None
    stopped_early: bool = False  # early stopping's patience was spent before the last step
    stopped_at_step: int | None = None
    recorded: RunRecord | None = None  # the history line this run appended (None when a finished run was reused)
    start: StartPoint | None = None  # where its weights started (set by the train task)
    store: StoreTraining | None = None  # with a store: what came from it, what went to it (set by the train task)
