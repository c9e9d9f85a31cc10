"""Sparse, crash-safe checkpoints: written to a temporary directory, renamed, valid only with a COMPLETE marker.

Trainable weights go to safetensors; optimizer, scheduler, RNG and step go to a torch file that is loaded
with `weights_only=True`, so a checkpoint can never run code when it is read.
"""
from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

MARKER = "COMPLETE"
_STEP_DIR = re.compile(r"^step-(\d{8})$")


@dataclass
class TrainingState:
    step: int
    optimizer: dict
    scheduler: dict
    torch_rng: torch.Tensor
    cuda_rng: list[torch.Tensor]
    elapsed_seconds: float = 0.0  # training time spent before this checkpoint, for honest ETAs after a resume


def trainable_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().cpu().contiguous() for name, p in model.named_parameters() if p.requires_grad}


def save_checkpoint(root: Path, model: torch.nn.Module, state: TrainingState, keep_last: int) -> Path:
    final = Path(root) / f"step-{state.step:08d}"
    partial = final.with_name(f".{final.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    save_file(trainable_state_dict(model), partial / "trainable.safetensors")
    torch.save(
        {
            "step": state.step, "optimizer": state.optimizer, "scheduler": state.scheduler,
            "torch_rng": state.torch_rng, "cuda_rng": state.cuda_rng, "elapsed_seconds": state.elapsed_seconds,
        },
        partial / "trainer_state.pt",
    )
    (partial / MARKER).write_text("ok\n")
    shutil.rmtree(final, ignore_errors=True)
    partial.rename(final)
    for stale in list_checkpoints(root)[:-keep_last]:
        shutil.rmtree(stale, ignore_errors=True)
    return final


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints, oldest first; half-written ones (no marker) are ignored."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / MARKER).is_file()]
    return sorted(found, key=lambda p: p.name)


def load_checkpoint(path: Path, model: torch.nn.Module) -> TrainingState:
    weights = load_file(path / "trainable.safetensors")
    missing = [name for name, p in model.named_parameters() if p.requires_grad and name not in weights]
    if missing:
        raise ValueError(f"checkpoint {path} lacks trainable weights: {missing[:3]}")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in weights:
                p.copy_(weights[name].to(p.device, p.dtype))
    raw = torch.load(path / "trainer_state.pt", weights_only=True, map_location="cpu")
    return TrainingState(
        step=int(raw["step"]), optimizer=raw["optimizer"], scheduler=raw["scheduler"],
        torch_rng=raw["torch_rng"], cuda_rng=raw["cuda_rng"], elapsed_seconds=float(raw.get("elapsed_seconds", 0.0)),
    )
