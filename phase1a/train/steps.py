"""One optimizer step as training runs it, shared by the train stage and the plan's calibration, so that the
calibration times exactly the work training will do.

Nothing here reads the device: the loss and the gradient norm stay tensors on it until whoever reports them
reads them, at its own cadence (phase1a/train/progress.py). A read would make the host wait for the device to
drain its queue, once a micro-batch, and leave it idle while the host queues the next work.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from phase1a.train import distributed
from phase1a.train.packing import StepBatch, summed_loss


@dataclass(frozen=True)
class StepOutcome:
    """One optimizer step: this rank's share of the step's loss and the gradient norm, both on the device."""

    loss: torch.Tensor
    grad_norm: torch.Tensor


def train_step(model, step: StepBatch, world_size: int = 1, rows: int | None = None) -> torch.Tensor:
    """Forward and backward over one rank's rows of an optimizer step (its first `rows` of them: calibration
    shortens a step); the loss is normalised over the whole step's supervised tokens, so accumulation (and DDP's
    average, undone by `world_size`) gives the gradient of one big batch. Gradients are all-reduced once, on the
    last row. Returns this rank's loss, on the device."""
    device = next(model.parameters()).device
    scale = step.weight * world_size / max(1, step.supervised)
    micro_batches = step.micro_batches[:rows]
    total = torch.zeros((), device=device)
    for index, micro in enumerate(micro_batches):
        row = micro.to(device, non_blocking=True)
        with distributed.gradient_sync(model, enabled=index == len(micro_batches) - 1):
            loss, _ = summed_loss(model, row)
            (loss * scale).backward()
        total += loss.detach()
    return total * (step.weight / max(1, step.supervised))


def optimizer_step(model, optimizer, step: StepBatch, world_size: int = 1) -> StepOutcome:
    """One whole optimizer step as training runs it, shared with calibration so both time the same work."""
    loss = train_step(model, step, world_size)
    return StepOutcome(loss=loss, grad_norm=apply_update(model, optimizer))


def apply_update(model, optimizer) -> torch.Tensor:
    """The step's update once its gradients are in: clip, step, clear. Returns the gradient norm, on the device."""
    grad_norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if hasattr(grad_norm, "full_tensor"):  # FSDP: the norm over all shards, a distributed tensor
        grad_norm = grad_norm.full_tensor()
    return grad_norm.detach()
