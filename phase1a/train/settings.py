"""A training run's settings (TrainSettings: what the loop and every torchrun rank read, written as JSON into the
run's directory for the ranks) and what makes two runs the same run (training_key, which names that directory:
phase1a/plan/training.py); what the train stage evaluates as it goes (EvalSettings). No torch: the plan and the
flow build them without loading a model."""
from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import numpy as np
from pydantic import BaseModel

from phase1a.config.schema import MethodConfig, Phase1aConfig, ProgressConfig
from phase1a.core.fingerprint import hash_json
from phase1a.core.units import Clock, Interval, parse_interval
from phase1a.train.launch import Launch

if TYPE_CHECKING:
    from phase1a.train.packing import TokenRows


EVERY_CHECKPOINT = "checkpoint"
# The `method` fields that only evaluation during training reads (`EvalSettings.of`): the training key leaves them
# out, since evaluating changes no weight; with early stopping they enter as `EvalSettings.key`.
DURING_TRAINING_FIELDS = {"eval_interval", "eval_examples", "early_stopping_patience", "early_stopping_threshold"}


class EvalSettings(BaseModel):
    """What the train stage evaluates, when, and whether it stops early; None in TrainSettings: no evaluation."""

    validation_path: str  # the tokenized validation split (a SplitView)
    cadence: str = EVERY_CHECKPOINT  # 'checkpoint', or an interval such as '500steps'
    examples: int = 64
    patience: int | None = None  # early stopping: evaluations without improvement; None: off
    min_delta: float = 0.0

    @classmethod
    def of(cls, config: Phase1aConfig, validation_path: str | None,
           validation_examples: int) -> EvalSettings | None:
        """From the config (`method.eval_*`, `method.early_stopping_*`); None when it is off or there is no
        validation split to take the sample from."""
        method = config.method
        if method.eval_interval == "never" or not validation_path or validation_examples == 0:
            return None
        return cls(validation_path=validation_path, cadence=method.eval_interval,
                   # The validate stage scores the first max_examples: this sample stays a part of that one.
                   examples=min(method.eval_examples, config.validation.max_examples),
                   patience=method.early_stopping_patience,
                   min_delta=method.early_stopping_threshold)

    @property
    def at_checkpoints(self) -> bool:
        return self.cadence == EVERY_CHECKPOINT

    def interval(self, checkpoint_interval: str) -> Interval:
        return parse_interval(checkpoint_interval if self.at_checkpoints else self.cadence)

    def evaluations(self, checkpoint_interval: str, run: Clock) -> int:
        """How many a run this long makes: the interval's firings before the end, and the final weights'."""
        return self.interval(checkpoint_interval).count(run) + 1

    def sample(self, rows: TokenRows) -> np.ndarray:
        return np.arange(min(len(rows), self.examples))

    def key(self, checkpoint_interval: str) -> dict | None:
        """What of it changes the trained weights, for the training key: with early stopping, where it looks and
        when it stops; without, nothing (evaluating changes no weight, so a new cadence reuses a finished run
        and resumes from its checkpoints)."""
        if self.patience is None:
            return None
        return {"interval": str(self.interval(checkpoint_interval)), "examples": self.examples,
                "patience": self.patience, "min_delta": self.min_delta}


class TrainSettings(BaseModel):
    model_dir: str
    train_path: str
    output_dir: str
    method: MethodConfig
    micro_batch_size: int  # a packed row's token budget, in examples of max_seq_length
    gradient_checkpointing: bool
    compile: bool = False
    cuda_graphs: bool = False
    compile_cache: str | None = None  # where compiled code is kept (the plan's calibration compiled into it)
    dataloader_workers: int = 0
    max_seq_length: int | None = None  # the plan's truncation, when it is shorter than the tokenized data
    checkpoint_interval: str = "30m"
    keep_last: int = 2
    trust_remote_code: bool = False
    show_progress: bool = True
    # The config's `progress` section: torchrun ranks are other processes, where the flow's `configure` never
    # ran. None: this process's settings.
    progress: ProgressConfig | None = None
    launch: Launch = Launch()  # one process, or torchrun agents: ranks a node, nodes (phase1a/train/launch.py)
    strategy: Literal["ddp", "fsdp", "hsdp"] = "ddp"  # with several processes
    model_flops_per_token: float | None = None  # for MFU: 4N (LoRA) or 6N plus attention, no recompute
    peak_flops: float | None = None  # the device's dense bf16 peak; None on CPUs
    planned_seconds: float | None = None  # the plan's train estimate, for "on track"
    init_adapter: str | None = None  # a warm start: the adapter the trainable one starts from (local)
    carry_run_files: bool = False  # checkpoints carry the curves and best weights: a store resumes them elsewhere
    # A resume computes with its checkpoint's micro-batch and compilation (StepArithmetic); False after an
    # out-of-memory relaunch, whose smaller rows are the point.
    arithmetic_from_checkpoint: bool = True
    evaluation: EvalSettings | None = None  # evaluation during training and early stopping; None: neither


# init_from enters as the start's content, replay_fraction as the data's; evaluation during training changes no
# weight, and early stopping enters as `EvalSettings.key`, beside where it looks.
_NOT_IN_METHOD_KEY = {"init_from", "replay_fraction", *DURING_TRAINING_FIELDS}


def training_key(tokenized_fingerprint: str, model_fingerprint: str, method: MethodConfig, max_seq_length: int,
                 start_fingerprint: str | None = None, early_stopping: dict | None = None) -> str:
    """What makes two runs the same run: same data, weights (the base's, and the adapter a warm start continues)
    and training semantics (not micro-batching). The code is left out on purpose: a run preempted before a fix
    resumes from its checkpoints after it. `init_from` enters as its adapter's content, not its name: `promoted`
    names another adapter after each promotion. Early stopping enters (`EvalSettings.key`: it decides which
    weights are final); the cadence of evaluations without it does not, since evaluating changes no weight. A
    start from the base without early stopping keeps the key it had before either existed."""
    key = {"data": tokenized_fingerprint, "model": model_fingerprint, "max_seq_length": max_seq_length,
           "method": method.model_dump(exclude=_NOT_IN_METHOD_KEY)}
    if start_fingerprint is not None:
        key["start"] = start_fingerprint
    if early_stopping is not None:
        key["early_stopping"] = early_stopping
    return hash_json(key)[:16]
