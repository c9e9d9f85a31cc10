"""Sparse, crash-safe checkpoints: written to a temporary directory, renamed, valid only with a COMPLETE marker.

Trainable weights go to safetensors; optimizer, scheduler, RNG and step go to a torch file that is loaded
with `weights_only=True`, so a checkpoint can never run code when it is read. Both hold whole tensors keyed by
parameter name, whatever the number of GPUs and DDP or FSDP: a run resumes under another layout. Under FSDP
gathering the shards is collective: every rank calls `trainable_state_dict` and `optimizer_state_dict`, and
rank 0 writes.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from phase1a.core.atomic import atomic_path
from phase1a.core.layout import ARITHMETIC, MARKER, RUN_FILES, list_checkpoints


@dataclass(frozen=True)
class StepArithmetic:
    """The knobs that change the numbers a step computes, not only its speed: the packed row's size in examples
    (it decides which examples share a row, the accumulation, the order of the sums and which dropout mask each
    example draws) and compiled layers (fused kernels round otherwise), on a kind of device. A resume computes
    with its checkpoint's, so that its weights are those of an uninterrupted run whatever a new host's plan
    chose. Gradient checkpointing recomputes the same values (tests/train/test_resume_knobs.py), and the data loader's
    workers and CUDA graphs replay the same kernels: those stay the plan's."""

    micro_batch_size: int
    compile: bool
    device: str  # torch.device.type: cpu, cuda

    def differences(self, other: "StepArithmetic") -> dict[str, tuple]:
        """Knob -> (this value, the other's), for those that differ."""
        mine, theirs = asdict(self), asdict(other)
        return {name: (mine[name], theirs[name]) for name in mine if mine[name] != theirs[name]}


def read_arithmetic(checkpoint: Path) -> StepArithmetic | None:
    """The knobs a checkpoint's steps were computed with; None for a checkpoint written before they were kept."""
    path = Path(checkpoint) / ARITHMETIC
    if not path.is_file():
        return None
    return StepArithmetic(**json.loads(path.read_text()))


def resumed_arithmetic(planned: StepArithmetic, checkpoint: Path | None) -> tuple[StepArithmetic, dict[str, tuple]]:
    """What a run resuming from `checkpoint` (None: a fresh start) computes with, and what of it the checkpoint
    decided against the plan (knob -> (the checkpoint's, the plan's)). On another kind of device the arithmetic
    differs whatever the knobs: the rows still pack as before, compilation is the plan's."""
    recorded = read_arithmetic(checkpoint) if checkpoint is not None else None
    if recorded is None:
        return planned, {}
    if recorded.device != planned.device:
        recorded = StepArithmetic(recorded.micro_batch_size, planned.compile, planned.device)
    return recorded, recorded.differences(planned)


@dataclass
class TrainingState:
    step: int
    optimizer: dict
    scheduler: dict
    torch_rng: torch.Tensor
    cuda_rng: list[torch.Tensor]
    elapsed_seconds: float = 0.0  # training time spent before this checkpoint, for honest ETAs after a resume
    # Evaluation during training (plain values): the best so far, evaluations since, the last one's step
    evaluation: dict | None = None
    arithmetic: StepArithmetic | None = None  # the knobs the steps up to this one were computed with


def trainable_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().contiguous()
            for name, p in model.named_parameters() if p.requires_grad}


def optimizer_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


def save_checkpoint(root: Path, weights: dict[str, torch.Tensor], state: TrainingState, keep_last: int,
                    carry: dict[str, Path] | None = None) -> Path:
    """`carry`: files of the run's directory (relative name -> path) that go along under `run/`, for a resume on
    another host (phase1a/train/train_store.py): copied, since curves grow in place; `.safetensors` files are linked,
    since the best weights are never rewritten."""
    final = Path(root) / f"step-{state.step:08d}"
    with atomic_path(final) as partial:
        partial.mkdir()
        _carry(partial / RUN_FILES, carry or {})
        save_file(weights, partial / "trainable.safetensors")
        torch.save(
            {
                "step": state.step, "optimizer": state.optimizer, "scheduler": state.scheduler,
                "torch_rng": state.torch_rng, "cuda_rng": state.cuda_rng, "elapsed_seconds": state.elapsed_seconds,
                "evaluation": state.evaluation,
            },
            partial / "trainer_state.pt",
        )
        if state.arithmetic is not None:
            (partial / ARITHMETIC).write_text(json.dumps(asdict(state.arithmetic)) + "\n")
        (partial / MARKER).write_text("ok\n")
    for stale in list_checkpoints(root)[:-keep_last]:
        shutil.rmtree(stale, ignore_errors=True)
    return final


def _carry(directory: Path, files: dict[str, Path]) -> None:
    for name, source in files.items():
        if not source.is_file():
            continue
        target = directory / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.suffix == ".safetensors":
            os.link(source, target)
        else:
            shutil.copyfile(source, target)


def load_checkpoint(path: Path, model: torch.nn.Module) -> TrainingState:
    """Trainable weights into `model` (each rank its shard under FSDP); the rest is returned."""
    load_trainable(path / "trainable.safetensors", model)
    raw = torch.load(path / "trainer_state.pt", weights_only=True, map_location="cpu")
    return TrainingState(
        step=int(raw["step"]), optimizer=raw["optimizer"], scheduler=raw["scheduler"],
        torch_rng=raw["torch_rng"], cuda_rng=raw["cuda_rng"], elapsed_seconds=float(raw.get("elapsed_seconds", 0.0)),
        evaluation=raw.get("evaluation"),
    )


def load_trainable(path: Path, model: torch.nn.Module) -> None:
    """Whole trainable tensors by name (a safetensors file) into `model`, each rank its shard under FSDP."""
    weights = load_file(path)
    missing = [name for name, p in model.named_parameters() if p.requires_grad and name not in weights]
    if missing:
        raise ValueError(f"{path} lacks trainable weights: {missing[:3]}")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in weights:
                value = weights[name].to(p.device, p.dtype)
                p.copy_(distribute_tensor(value, p.device_mesh, p.placements) if isinstance(p, DTensor) else value)
