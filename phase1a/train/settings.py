"""A training run's settings (TrainSettings: what the loop and every torchrun rank read, written as JSON into the
run's directory for the ranks) and what makes two runs the same run (training_key, which names that directory:
phase1a/plan/training.py)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

from phase1a.config.schema import MethodConfig, ProgressConfig
from phase1a.core.fingerprint import hash_json
from phase1a.train.evaluation import DURING_TRAINING_FIELDS, EvalSettings
from phase1a.train.launch import Launch


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
