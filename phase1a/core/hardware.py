"""Hardware catalogue (vendor data sheets: dense bf16 without sparsity) and detection of what is present.

The catalogue is the one list of hardware kinds: the config's `hardware.target` choices, the options table and
the device-name matching all read it, so a new kind is one entry here. torch is imported where it is used:
validating a config reads the catalogue and should not load torch.

Prices and interruption rates are typical figures for planning, not quotes: `hardware.price_per_gpu_hour`,
`hardware.spot_price_per_gpu_hour` and `hardware.interruptions_per_hour` override them. Spot prices are per GPU-hour
as published in March 2026: RunPod's interruptible ("spot") pods where RunPod rents the card (deploybase.ai, "Spot
GPU Pricing", March 2026), else AWS spot (SkyPilot's catalogue of AWS spot prices, skypilot-org/skypilot-catalog
catalogs/v7/aws/vms.csv) or GCP's Spot VM discount. Interruption rates come from the AWS Spot Instance Advisor's
"frequency of interruption" bands (<5 %, 5-10 %, 10-15 %, 15-20 %, >20 %, over the trailing month; as read on
1 May 2025 by thundercompute.com: p5 H100 10-20 %, p4d A100 5-10 %, L4 <5 %), the band's upper bound read as the
chance that a day of running is interrupted: rate = -ln(1 - p) / 24 h (H100: 0.0093 an hour, one in 108 h).
Published readings differ by two orders of magnitude: per month of running the same bands give a rate 30 times
lower, while reports from contested regions speak of H100 spot "availability windows" of 2-4 hours (digiterialabs.com,
Q1 2026), about 0.3 an hour. The per-day reading sits between; where a region is known to be contested, set
`hardware.interruptions_per_hour`.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from phase1a.core.units import GIB

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Accelerator:
    name: str
    memory_bytes: int
    peak_flops: float | None  # dense bf16 FLOP/s; None where no data sheet figure applies (CPUs)
    price_per_hour: float | None  # typical on-demand rental per GPU-hour, USD; override in config
    memory_bandwidth: float | None = None  # data-sheet memory bandwidth, bytes/s; None where not catalogued
    spot_price_per_hour: float | None = None  # typical spot / interruptible rental per GPU-hour, USD
    spot_interruptions_per_hour: float | None = None  # expected interruptions per hour of a spot host
    link_bandwidth: float | None = None  # a GPU's bandwidth to the others in its node, bytes/s each direction


def interrupted_per_day(share: float) -> float:
    """Interruptions per hour when `share` of the days a host runs see one (a constant hazard): -ln(1 - p) / 24."""
    return -math.log(1.0 - share) / 24.0


# link_bandwidth: NVLink 4 (H100/H200 SXM) 900 GB/s and NVLink 3 (A100 SXM) 600 GB/s both ways; PCIe 5.0 x16 (H100
# PCIe) 64 GB/s, PCIe 4.0 x16 32 GB/s, each way.
CATALOGUE: dict[str, Accelerator] = {
    # Spot: RunPod H100 SXM $0.81; AWS Advisor p5: 10-20 %.
    "h100": Accelerator("NVIDIA H100 80GB SXM", 80 * GIB, 989e12, 2.50, 3.35e12, 0.81,
                        interrupted_per_day(0.20), link_bandwidth=450e9),
    # Spot: RunPod H100 PCIe $0.72; no Advisor band (no AWS PCIe H100): the SXM's.
    "h100-pcie": Accelerator("NVIDIA H100 80GB PCIe", 80 * GIB, 756e12, 2.00, 2.0e12, 0.72,
                             interrupted_per_day(0.20), link_bandwidth=64e9),
    # Spot: RunPod H200 $1.65 ("newer, less stable"); AWS p5e/p5en: taken as the H100's band.
    "h200": Accelerator("NVIDIA H200 141GB SXM", 141 * GIB, 989e12, 3.50, 4.8e12, 1.65,
                        interrupted_per_day(0.20), link_bandwidth=450e9),
    # Spot: RunPod A100 SXM 80GB $0.59; Advisor p4d: 5-10 %.
    "a100-80gb": Accelerator("NVIDIA A100 80GB", 80 * GIB, 312e12, 1.60, 2.0e12, 0.59,
                             interrupted_per_day(0.10), link_bandwidth=300e9),
    # Spot: RunPod A100 PCIe $0.42 (a 40 GB card rents for no more); Advisor p4d (A100 40GB): 5-10 %.
    "a100-40gb": Accelerator("NVIDIA A100 40GB", 40 * GIB, 312e12, 1.20, 1.555e12, 0.42,
                             interrupted_per_day(0.10), link_bandwidth=300e9),
    # Spot: GCP's Spot VM discount of at least 60 % on the on-demand price (no per-card figure found); Advisor L4: <5 %.
    "l4": Accelerator("NVIDIA L4 24GB", 24 * GIB, 121e12, 0.70, 0.3e12, 0.28,
                      interrupted_per_day(0.05), link_bandwidth=32e9),
    # Spot: AWS g5.12xlarge (4x A10G) us-east-1 spot $1.99-2.73 an instance by zone, about $0.55 a GPU;
    # g5: no band found, taken as <5 %.
    "a10g": Accelerator("NVIDIA A10G 24GB", 24 * GIB, 70e12, 1.00, 0.6e12, 0.55,
                        interrupted_per_day(0.05), link_bandwidth=32e9),
    # Spot: RunPod L40S $0.34; AWS g6e: no band found, taken as 5-10 %.
    "l40s": Accelerator("NVIDIA L40S 48GB", 48 * GIB, 362e12, 1.00, 0.864e12, 0.34,
                        interrupted_per_day(0.10), link_bandwidth=32e9),
    # 165 TFLOP/s is bf16 with fp32 accumulate (training); the often-quoted 330 accumulates in fp16.
    # Spot: RunPod RTX 4090 $0.22 ("volatile"); a marketplace card is taken back when outbid: the >20 % band's floor.
    "rtx4090": Accelerator("NVIDIA GeForce RTX 4090 24GB", 24 * GIB, 165e12, 0.40, 1.008e12, 0.22,
                           interrupted_per_day(0.20), link_bandwidth=32e9),
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
    return key, dataclasses.replace(known, name=name, memory_bytes=props.total_memory)


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
