"""One optimizer step as training runs it, shared by the train stage and the plan's calibration, so that the
calibration times exactly the work training will do."""
from __future__ import annotations

import torch

from phase1a.train import distributed
from phase1a.train.packing import summed_loss


def train_step(model, micro_batches: list[dict[str, torch.Tensor]], supervised: int, weight: float = 1.0,
               world_size: int = 1) -> tuple[float, int]:
    """Forward and backward over one rank's rows of an optimizer step; the loss is normalised over the whole
    step's supervised tokens, so accumulation (and DDP's average, undone by `world_size`) gives the gradient of
    one big batch. Gradients are all-reduced once, on the last row. Returns (this rank's loss, tokens)."""
    device = next(model.parameters()).device
    scale = weight * world_size / max(1, supervised)
    total_loss, tokens = 0.0, 0
    for index, micro in enumerate(micro_batches):
        batch = {k: v.to(device, non_blocking=True) for k, v in micro.items()}
        last = index == len(micro_batches) - 1
        with distributed.gradient_sync(model, enabled=last):
            loss, _, _ = summed_loss(model, batch)
            (loss * scale).backward()
        total_loss += loss.item() * weight
        tokens += batch["input_ids"].numel() if weight else 0
    return total_loss / max(1, supervised), tokens


def optimizer_step(model, optimizer, step_batch: dict, world_size: int = 1) -> tuple[float, int, float]:
    """One whole optimizer step as training runs it, shared with calibration so both time the same work."""
    loss, tokens = train_step(model, step_batch["micro_batches"], step_batch["supervised"],
                              step_batch.get("weight", 1.0), world_size)
    return loss, tokens, apply_update(model, optimizer)


def apply_update(model, optimizer) -> float:
    """The step's update once its gradients are in: clip, step, clear. Returns the gradient norm."""
    grad_norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if hasattr(grad_norm, "full_tensor"):  # FSDP: the norm over all shards, a distributed tensor
        grad_norm = grad_norm.full_tensor()
    return float(grad_norm)
