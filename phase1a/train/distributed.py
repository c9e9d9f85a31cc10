"""Several processes, one run: torchrun starts one process a GPU (or, for tests, a CPU process with gloo).

Each optimizer step's examples are split across ranks (`StepBatches(rank, world)`), every rank normalises
its loss by the whole step's supervised tokens and scales it by the world size, so DDP's gradient average is
exactly the one-process gradient of the same global batch: the plan's global batch and learning rate hold
whatever the number of GPUs. DDP keeps a whole model on every GPU and all-reduces gradients; FSDP (`fully_shard`,
one unit a decoder layer) keeps 1/n of the weights, gradients and optimizer state on each and gathers a layer's
weights just before it runs: a model that does not fit one GPU trains, at the price of that traffic. Rank 0
writes checkpoints, metrics and the final adapter; decisions that depend on a clock or a signal (checkpoint now,
stop now) are taken together, so no rank waits for one that moved on.
"""
from __future__ import annotations

import faulthandler
import logging
import os
import sys
import traceback
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1  # ranks on this node: the size of an HSDP shard group

    @property
    def main(self) -> bool:
        return self.rank == 0


def init_world() -> World:
    """Join the process group torchrun described in the environment; one process needs none."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1:
        return World()
    world = World(int(os.environ["RANK"]), size, int(os.environ.get("LOCAL_RANK", "0")),
                  int(os.environ.get("LOCAL_WORLD_SIZE", str(size))))
    if torch.cuda.is_available():
        torch.cuda.set_device(world.local_rank)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return world


def wrap(model: torch.nn.Module, world: World, strategy: str = "ddp") -> torch.nn.Module:
    """Before the optimizer is made: FSDP replaces the parameters with their shards."""
    if world.size == 1:
        return model
    if strategy in ("fsdp", "hsdp"):
        return _shard(model, world, hybrid=strategy == "hsdp")
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[world.local_rank] if torch.cuda.is_available() else None)


def _shard(model: torch.nn.Module, world: World, hybrid: bool = False) -> torch.nn.Module:
    """FSDP over every rank, or `hybrid` (HSDP): sharded over a node's ranks, replicated across the nodes, so the
    per-layer gathers stay inside a node and only gradients cross the network."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft keeps the class list there
    layer_classes = set(getattr(base, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    if not layers:
        raise ValueError(f"FSDP needs the model's decoder layer class; {type(base).__name__} names none "
                         "(_no_split_modules)")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if hybrid:
        mesh = init_device_mesh(device, (world.size // world.local_size, world.local_size),
                                mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device, (world.size,))
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)  # embeddings, final norm and head: the root unit
    return model


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model whose parameter names are the checkpoint's: DDP adds a `module.` prefix, FSDP adds none."""
    return model.module if is_ddp(model) else model


def is_ddp(model: torch.nn.Module) -> bool:
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(model, DistributedDataParallel)


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def gradient_sync(model: torch.nn.Module, enabled: bool):
    """Accumulating micro-batches skip the gradient all-reduce (DDP) or reduce-scatter (FSDP) until the last."""
    if is_ddp(model) and not enabled:
        return model.no_sync()
    if is_sharded(model):
        model.set_requires_gradient_sync(enabled)
    return nullcontext()


def step_loss(loss: torch.Tensor, world: World) -> torch.Tensor:
    """A step's loss over every rank, still on the device: each rank's loss is its share of the step's (normalised
    by the whole step's supervised tokens), so their sum is the step's loss."""
    if world.size == 1:
        return loss
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total


def any_rank(flag: bool, world: World) -> bool:
    """True on every rank when it is true on any: rank 0's clock says checkpoint, one rank got SIGTERM."""
    if world.size == 1:
        return flag
    value = torch.tensor([1.0 if flag else 0.0], device="cuda" if torch.cuda.is_available() else "cpu")
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item() > 0)


def from_main(values: list[float], world: World) -> list[float]:
    """Rank 0's numbers on every rank: a decision taken from them (an evaluation improved, stop now) is the same
    everywhere, even where ranks computed them to a different last bit."""
    if world.size == 1:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device="cuda" if torch.cuda.is_available() else "cpu")
    dist.broadcast(tensor, src=0)
    return tensor.tolist()


def barrier(world: World) -> None:
    if world.size > 1:
        dist.barrier()


def finish(world: World) -> None:
    if world.size > 1 and dist.is_initialized():
        dist.destroy_process_group()


def run_rank(entry: Callable[[], object]) -> None:
    """A torchrun rank from start to exit: join the group, run `entry`, leave the group, exit 0 (or 1 with the
    traceback printed) without the interpreter's shutdown.

    Why not a normal exit: gloo's worker threads drop the tensors of finished collectives on their own schedule
    (the last barrier holds FSDP's earlier all-gathers). One that does so while the interpreter finalizes must
    take the GIL, is unwound by Python instead, and that aborts the process from a destructor ("terminate called
    without an active exception", SIGABRT): a rank that had finished its work failed its launch about one run in
    twenty on a loaded 2-core machine (seen in a core dump). Everything a rank writes is closed by `entry`'s end;
    faulthandler prints the Python stacks of a rank that dies in native code all the same."""
    faulthandler.enable()
    world, code = init_world(), 0
    try:
        entry()
    except BaseException:  # noqa: BLE001 - the traceback is printed; the exit code tells the launcher
        traceback.print_exc()
        code = 1
    finally:
        finish(world)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
