"""Hardware catalogue (vendor data sheets: dense bf16 without sparsity) and detection of what is present.

The catalogue is the one list of hardware kinds: the config's `hardware.target` choices, the options table and
the device-name matching all read it, so a new kind is one entry here. torch is imported where it is used:
validating a config reads the catalogue and should not load torch.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from phase1a.units import GIB

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Accelerator:
    name: str
    memory_bytes: int
    peak_flops: float | None  # dense bf16 FLOP/s; None where no data sheet figure applies (CPUs)
    price_per_hour: float | None  # typical on-demand rental per GPU-hour, USD; override in config
    memory_bandwidth: float | None = None  # data-sheet memory bandwidth, bytes/s; None where not catalogued


CATALOGUE: dict[str, Accelerator] = {
    "h100": Accelerator("NVIDIA H100 80GB SXM", 80 * GIB, 989e12, 2.50, 3.35e12),
    "h100-pcie": Accelerator("NVIDIA H100 80GB PCIe", 80 * GIB, 756e12, 2.00, 2.0e12),
    "h200": Accelerator("NVIDIA H200 141GB SXM", 141 * GIB, 989e12, 3.50, 4.8e12),
    "a100-80gb": Accelerator("NVIDIA A100 80GB", 80 * GIB, 312e12, 1.60, 2.0e12),
    "a100-40gb": Accelerator("NVIDIA A100 40GB", 40 * GIB, 312e12, 1.20, 1.555e12),
    "l4": Accelerator("NVIDIA L4 24GB", 24 * GIB, 121e12, 0.70, 0.3e12),
    "a10g": Accelerator("NVIDIA A10G 24GB", 24 * GIB, 70e12, 1.00, 0.6e12),
    "l40s": Accelerator("NVIDIA L40S 48GB", 48 * GIB, 362e12, 1.00, 0.864e12),
    # 165 TFLOP/s is bf16 with fp32 accumulate (training); the often-quoted 330 accumulates in fp16.
    "rtx4090": Accelerator("NVIDIA GeForce RTX 4090 24GB", 24 * GIB, 165e12, 0.40, 1.008e12),
}
CPU = "cpu"  # this machine's own CPU: a target whose memory and cores are read, not catalogued
HARDWARE_KINDS = (CPU, *CATALOGUE)  # the config's hardware.target choices


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity (a container's or taskset's share), not the machine's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cpu_accelerator() -> Accelerator:
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return Accelerator(f"CPU ({usable_cores()} cores)", pages, None, None)


def target_accelerator(target: str) -> Accelerator:
    return cpu_accelerator() if target == CPU else CATALOGUE[target]


def detect() -> tuple[str, Accelerator]:
    """(catalogue key or 'cpu' or 'cuda', description) of the device this process will train on."""
    import torch

    if not torch.cuda.is_available():
        return CPU, cpu_accelerator()
    props = torch.cuda.get_device_properties(0)
    name = props.name
    key = catalogue_key(name)
    if key is None:
        return "cuda", Accelerator(name, props.total_memory, None, None)
    known = CATALOGUE[key]
    return key, Accelerator(name, props.total_memory, known.peak_flops, known.price_per_hour, known.memory_bandwidth)


def catalogue_key(device_name: str) -> str | None:
    """The catalogue entry whose key best matches a CUDA device name. The key's first part must appear in the
    name; the entry whose parts cover most characters wins, so "L40S" is not taken for "l4", nor
    "H100 PCIe" for the SXM "h100", nor "A100-SXM4-40GB" for "a100-80gb"."""
    compact = device_name.upper().replace(" ", "")
    best, best_score = None, 0
    for key in CATALOGUE:
        parts = key.upper().split("-")
        if parts[0] not in compact:
            continue
        score = sum(len(part) for part in parts if part in compact)
        if score > best_score:
            best, best_score = key, score
    return best


def training_device() -> torch.device:
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def training_dtype(device: torch.device) -> torch.dtype:
    """bf16 where the GPU supports it, else fp16; fp32 on CPU, where half precision is slower and less exact."""
    import torch

    if device.type != "cuda":
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
