"""Hardware catalogue (vendor data sheets: dense bf16 without sparsity) and detection of what is present."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

GIB = 1024**3


@dataclass(frozen=True)
class Accelerator:
    name: str
    memory_bytes: int
    peak_flops: float | None  # dense bf16 FLOP/s; None where no data sheet figure applies (CPUs)
    price_per_hour: float | None  # typical on-demand rental per GPU-hour, USD; override in config


CATALOGUE: dict[str, Accelerator] = {
    "h100": Accelerator("NVIDIA H100 80GB SXM", 80 * GIB, 989e12, 2.50),
    "h200": Accelerator("NVIDIA H200 141GB SXM", 141 * GIB, 989e12, 3.50),
    "a100-80gb": Accelerator("NVIDIA A100 80GB", 80 * GIB, 312e12, 1.60),
    "a100-40gb": Accelerator("NVIDIA A100 40GB", 40 * GIB, 312e12, 1.20),
    "l4": Accelerator("NVIDIA L4 24GB", 24 * GIB, 121e12, 0.70),
    "a10g": Accelerator("NVIDIA A10G 24GB", 24 * GIB, 70e12, 1.00),
}


def cpu_accelerator() -> Accelerator:
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return Accelerator(f"CPU ({os.cpu_count()} cores)", pages, None, None)


def target_accelerator(target: str) -> Accelerator:
    return cpu_accelerator() if target == "cpu" else CATALOGUE[target]


def detect() -> tuple[str, Accelerator]:
    """(catalogue key or 'cpu' or 'cuda', description) of the device this process will train on."""
    if not torch.cuda.is_available():
        return "cpu", cpu_accelerator()
    props = torch.cuda.get_device_properties(0)
    name = props.name
    for key, known in CATALOGUE.items():
        if key.split("-")[0].upper() in name.upper():
            return key, Accelerator(name, props.total_memory, known.peak_flops, known.price_per_hour)
    return "cuda", Accelerator(name, props.total_memory, None, None)


def training_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def training_dtype(device: torch.device) -> torch.dtype:
    """bf16 where the GPU supports it, else fp16; fp32 on CPU, where half precision is slower and less exact."""
    if device.type != "cuda":
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
