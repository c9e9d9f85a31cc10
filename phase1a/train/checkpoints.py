"""Sparse, crash-safe checkpoints: written to a temporary directory, renamed, valid only with a COMPLETE marker.

Trainable weights go to safetensors; optimizer, scheduler, RNG and step go to a torch file that is loaded
with `weights_only=True`, so a checkpoint can never run code when it is read. Both hold whole tensors keyed by
parameter name, whatever the number of GPUs and DDP or FSDP: a run resumes under another layout. Under FSDP
gathering the shards is collective: every rank calls `trainable_state_dict` and `optimizer_state_dict`, and
rank 0 writes.
"""
from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from phase1a.core.atomic import atomic_path

MARKER = "COMPLETE"
RUN_FILES = "run"  # in a checkpoint that travels to another host: the run's curves and best weights as they were
_STEP_DIR = re.compile(r"^step-(\d{8})$")


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


def checkpoint_step(path: Path) -> int:
    return int(Path(path).name.removeprefix("step-"))


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints, oldest first; half-written ones (no marker) are ignored."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / MARKER).is_file()]
    return sorted(found, key=lambda p: p.name)


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
