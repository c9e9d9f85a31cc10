"""What a step spends moving tensors between GPUs, and the scaling efficiency that leaves (docs/stages.md#plan).

Bandwidth terms only, at data-sheet rates (NCCL's achieved bus bandwidth is typically 70-90 % of them; no
latency term, which matters only for small messages): a ring collective over n ranks moves (n-1)/n of the
tensor through each rank's slowest link for an all-gather or a reduce-scatter, twice that for an all-reduce.
Per optimizer step, for `nodes` nodes of `g` GPUs (n = nodes x g), with W the weights as computed with, G the
trainable gradients and a the micro-batches a GPU runs each step:

    ddp     all-reduce of G, hierarchical: 2 (g-1)/g G / link + 2 (m-1)/m G / (g net)
            (reduce-scatter in the node, all-reduce of a node's 1/g share across nodes, all-gather in the node)
    fsdp    a x 2 all-gathers of W (forward, backward) + 1 reduce-scatter of G, over all n ranks: (n-1)/n x bytes
            through the slowest link (the network once the ranks span nodes)
    hsdp    the same inside a node (g ranks, at link speed) + an all-reduce of the node's G/g across nodes

where link is a GPU's bandwidth inside its node (NVLink, else PCIe) and net a GPU's share of the network between
nodes. What training hides: DDP's all-reduce runs during the last micro-batch's backward pass (accumulation
skips it before); FSDP's and HSDP's gathers are prefetched during the compute of the layer before:

    exposed = max(0, communication - what overlaps it)        efficiency = compute / (compute + exposed)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel

from phase1a.core.hardware import CATALOGUE

Spread = Literal["ddp", "fsdp", "hsdp"]


@dataclass(frozen=True)
class Network:
    """The network between nodes: a GPU's own share (one NIC a GPU) or the node's, split among its GPUs."""

    name: str
    per_gpu: float | None = None  # bytes/s a GPU, each direction
    per_node: float | None = None  # bytes/s a node, each direction

    def per_gpu_share(self, gpus_per_node: int) -> float:
        return self.per_gpu if self.per_gpu is not None else self.per_node / gpus_per_node


NETWORKS: dict[str, Network] = {
    # 8 x 400 Gb/s NDR InfiniBand a node, one NIC a GPU (DGX H100, p5 with EFA at 3,200 Gb/s a node).
    "infiniband-400": Network("400 Gb/s InfiniBand a GPU", per_gpu=400e9 / 8),
    # One 100 Gb/s Ethernet port a node: rented hosts without a GPU fabric.
    "ethernet-100": Network("100 Gb/s Ethernet a node", per_node=100e9 / 8),
}


class StepTraffic(BaseModel):
    """What one optimizer step computes and moves, per GPU."""

    weight_bytes: float  # the weights as the forward pass uses them: what sharded strategies gather
    gradient_bytes: float  # the trainable parameters' gradients: reduced once a step
    micro_batches: int  # a GPU's micro-batches a step: sharded strategies gather the weights for each
    compute_seconds: float  # a GPU's step, forward and backward, without communication
    backward_share: float = 2 / 3  # of compute: backward is 2 of 3 forward-equivalents (full); LoRA's 1 of 2


class Communication(BaseModel):
    seconds: float  # a step's transfers, all of them
    exposed_seconds: float  # what compute does not hide
    efficiency: float  # compute / (compute + exposed)


def ring(bytes_: float, ranks: int, bandwidth: float, all_reduce: bool = False) -> float:
    """A ring all-gather or reduce-scatter of a `bytes_` tensor over `ranks` (an all-reduce is both)."""
    if ranks <= 1:
        return 0.0
    return (2 if all_reduce else 1) * (ranks - 1) / ranks * bytes_ / bandwidth


def step_communication(traffic: StepTraffic, spread: Spread, kind: str, gpus_per_node: int, nodes: int = 1,
                       network: str = "infiniband-400") -> Communication:
    """A step's transfers for `nodes` x `gpus_per_node` GPUs of catalogue `kind`; formulas: the module's."""
    link = CATALOGUE[kind].link_bandwidth
    net = NETWORKS[network].per_gpu_share(gpus_per_node) if nodes > 1 else link
    g, n, w, grad = gpus_per_node, nodes * gpus_per_node, traffic.weight_bytes, traffic.gradient_bytes
    if spread == "ddp":
        seconds = ring(grad, g, link, all_reduce=True) + ring(grad / g, nodes, net, all_reduce=True)
        hidden = traffic.compute_seconds * traffic.backward_share / traffic.micro_batches
    elif spread == "fsdp":
        slowest = min(link, net)
        seconds = 2 * traffic.micro_batches * ring(w, n, slowest) + ring(grad, n, slowest)
        hidden = traffic.compute_seconds
    else:  # hsdp
        seconds = (2 * traffic.micro_batches * ring(w, g, link) + ring(grad, g, link)
                   + ring(grad / g, nodes, net, all_reduce=True))
        hidden = traffic.compute_seconds
    exposed = max(0.0, seconds - hidden)
    return Communication(seconds=seconds, exposed_seconds=exposed,
                         efficiency=traffic.compute_seconds / (traffic.compute_seconds + exposed))
