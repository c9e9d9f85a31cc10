"""Hardware catalogue (vendor data sheets: dense bf16 without sparsity) and detection of what is present.

The catalogue is the one list of hardware kinds: the config's `hardware.target` choices, the options table and
the device-name matching all read it, so a new kind is one entry here. torch is imported where it is used:
validating a config reads the catalogue and should not load torch.

Beside the catalogue, two targets are this machine's own device: `cpu`, and `cuda`, whatever GPU torch sees (a
ROCm GPU too: torch reports it through torch.cuda). A GPU the catalogue does not know keeps its device name, its
peak is measured by a short run of matrix products on it (`matmul_flops`: the achieved rate, labelled measured,
below a data sheet's figure), and it has no price: the plan gives it the cost of `hardware.price_per_gpu_hour`, or
none.

Prices and interruption rates are typical figures for planning, not quotes: `hardware.price_per_gpu_hour`,
`hardware.spot_price_per_gpu_hour` and `hardware.interruptions_per_hour` override them. Spot prices are per GPU-hour
as published in March 2026: RunPod's interruptible ("spot") pods where RunPod rents the card (deploybase.ai, "Spot
GPU Pricing", March 2026), else AWS spot (SkyPilot's catalogue of AWS spot prices, skypilot-org/skypilot-catalog
catalogs/v7/aws/vms.csv) or GCP's Spot VM discount; the cards added since (RTX 5090, the RTX workstation cards, B200,
MI300X) carry their own sources, mostly marketplace listings (RunPod, Vast.ai, Lambda, Modal), and where no spot
listing was found, half the on-demand price (Vast.ai's interruptible discount: "50 %+ cheaper"). Interruption rates
come from the AWS Spot Instance Advisor's
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
import functools
import math
import os
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from phase1a.core.units import GIB

if TYPE_CHECKING:
    import torch

DATA_SHEET = "data sheet"


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
    # The device names this entry is (a regular expression over the name torch reports, upper case, each run of
    # other characters one space: "NVIDIA A100-SXM4-40GB" reads "NVIDIA A100 SXM4 40GB"); the longest match wins.
    device_names: str = ""
    peak_source: str = DATA_SHEET  # where peak_flops comes from: the data sheet, or "measured: ..." (matmul_flops)


def interrupted_per_day(share: float) -> float:
    """Interruptions per hour when `share` of the days a host runs see one (a constant hazard): -ln(1 - p) / 24."""
    return -math.log(1.0 - share) / 24.0


# link_bandwidth: NVLink 5 (B200) 1.8 TB/s, NVLink 4 (H100/H200 SXM) 900 GB/s and NVLink 3 (A100 SXM) 600 GB/s both
# ways; Infinity Fabric (MI300X) 7 links of 128 GB/s both ways, 896 GB/s; PCIe 5.0 x16 (H100 PCIe, RTX 5090, RTX PRO
# 6000) 64 GB/s, PCIe 4.0 x16 32 GB/s, each way.
CATALOGUE: dict[str, Accelerator] = {
    # Spot: RunPod H100 SXM $0.81; AWS Advisor p5: 10-20 %.
    "h100": Accelerator("NVIDIA H100 80GB SXM", 80 * GIB, 989e12, 2.50, 3.35e12, 0.81,
                        interrupted_per_day(0.20), link_bandwidth=450e9, device_names=r"\bH100\b"),
    # Spot: RunPod H100 PCIe $0.72; no Advisor band (no AWS PCIe H100): the SXM's.
    "h100-pcie": Accelerator("NVIDIA H100 80GB PCIe", 80 * GIB, 756e12, 2.00, 2.0e12, 0.72,
                             interrupted_per_day(0.20), link_bandwidth=64e9, device_names=r"\bH100 PCIE\b"),
    # Spot: RunPod H200 $1.65 ("newer, less stable"); AWS p5e/p5en: taken as the H100's band.
    "h200": Accelerator("NVIDIA H200 141GB SXM", 141 * GIB, 989e12, 3.50, 4.8e12, 1.65,
                        interrupted_per_day(0.20), link_bandwidth=450e9, device_names=r"\bH200\b"),
    # Spot: RunPod A100 SXM 80GB $0.59; Advisor p4d: 5-10 %. A name without its memory ("NVIDIA A100 PCIe") is this.
    "a100-80gb": Accelerator("NVIDIA A100 80GB", 80 * GIB, 312e12, 1.60, 2.0e12, 0.59,
                             interrupted_per_day(0.10), link_bandwidth=300e9, device_names=r"\bA100\b"),
    # Spot: RunPod A100 PCIe $0.42 (a 40 GB card rents for no more); Advisor p4d (A100 40GB): 5-10 %.
    "a100-40gb": Accelerator("NVIDIA A100 40GB", 40 * GIB, 312e12, 1.20, 1.555e12, 0.42,
                             interrupted_per_day(0.10), link_bandwidth=300e9, device_names=r"\bA100\b.*\b40GB\b"),
    # Spot: GCP's Spot VM discount of at least 60 % on the on-demand price (no per-card figure found); Advisor L4: <5 %.
    "l4": Accelerator("NVIDIA L4 24GB", 24 * GIB, 121e12, 0.70, 0.3e12, 0.28,
                      interrupted_per_day(0.05), link_bandwidth=32e9, device_names=r"\bL4\b"),
    # Spot: AWS g5.12xlarge (4x A10G) us-east-1 spot $1.99-2.73 an instance by zone, about $0.55 a GPU;
    # g5: no band found, taken as <5 %.
    "a10g": Accelerator("NVIDIA A10G 24GB", 24 * GIB, 70e12, 1.00, 0.6e12, 0.55,
                        interrupted_per_day(0.05), link_bandwidth=32e9, device_names=r"\bA10G\b"),
    # L40S data sheet: 362.05 TFLOP/s bf16 (733 with sparsity), 864 GB/s. On demand: RunPod $0.79, Modal $1.95
    # (techbytes.app, May 2026), typical marketplace prices. Spot: RunPod L40S $0.34; AWS g6e: no band found, taken
    # as 5-10 %. Not the L40 ("NVIDIA L40"), nor the L4.
    "l40s": Accelerator("NVIDIA L40S 48GB", 48 * GIB, 362e12, 1.00, 0.864e12, 0.34,
                        interrupted_per_day(0.10), link_bandwidth=32e9, device_names=r"\bL40S\b"),
    # 165 TFLOP/s is bf16 with fp32 accumulate (training); the often-quoted 330 accumulates in fp16.
    # On demand: RunPod $0.34 (deploybase.ai, March 2026), Vast.ai $0.68-0.88 (usagepricing.com, June 2026), typical
    # marketplace prices. Spot: RunPod RTX 4090 $0.22 ("volatile"); a marketplace card is taken back when outbid:
    # the >20 % band's floor. Not the 4090 D (China, fewer SMs) nor the laptop part.
    "rtx4090": Accelerator("NVIDIA GeForce RTX 4090 24GB", 24 * GIB, 165e12, 0.40, 1.008e12, 0.22,
                           interrupted_per_day(0.20), link_bandwidth=32e9,
                           device_names=r"\bRTX 4090\b(?! (D|LAPTOP)\b)"),
    # RTX Blackwell whitepaper (2025): 209.5 TFLOP/s bf16 with fp32 accumulate; the often-quoted 419 (838 sparse)
    # accumulates in fp16; 1,792 GB/s GDDR7. On demand: Vast.ai $0.87-1.14 (usagepricing.com, June 2026), a typical
    # marketplace price. Spot: half of it (no spot listing found); a marketplace card, as the RTX 4090: >20 %.
    "rtx5090": Accelerator("NVIDIA GeForce RTX 5090 32GB", 32 * GIB, 209.5e12, 0.90, 1.792e12, 0.45,
                           interrupted_per_day(0.20), link_bandwidth=64e9,
                           device_names=r"\bRTX 5090\b(?! (D|LAPTOP)\b)"),
    # RTX A6000 data sheet (Ampere, 2021): 154.8 TFLOP/s bf16 dense (309.7 with sparsity; the pro cards accumulate
    # fp32 at full rate), 768 GB/s. On demand: RunPod $0.49, Lambda $0.80 (their 2025 price lists), typical
    # marketplace prices. Spot: RunPod $0.25 (2025); a data-centre card, taken as the L40S's 5-10 %.
    # An NVLink bridge joins two cards at most: PCIe 4.0.
    "rtx-a6000": Accelerator("NVIDIA RTX A6000 48GB", 48 * GIB, 154.8e12, 0.50, 0.768e12, 0.25,
                             interrupted_per_day(0.10), link_bandwidth=32e9, device_names=r"\bRTX A6000\b"),
    # RTX 6000 Ada data sheet (2023): 1,457 TFLOP/s fp8 with sparsity, 364.2 bf16 dense; 960 GB/s. On demand: RunPod
    # $0.77 (2025), a typical marketplace price. Spot: half of it (no spot listing found); taken as the L40S's
    # 5-10 %. Not the RTX A6000 (Ampere), the Quadro RTX 6000 (Turing) nor the RTX 5000 Ada.
    "rtx-6000-ada": Accelerator("NVIDIA RTX 6000 Ada 48GB", 48 * GIB, 364.2e12, 0.77, 0.96e12, 0.39,
                                interrupted_per_day(0.10), link_bandwidth=32e9, device_names=r"\bRTX 6000 ADA\b"),
    # RTX PRO 6000 Blackwell Server Edition data sheet (2025): 4 PFLOP/s fp4 with sparsity, 503.8 TFLOP/s bf16 dense
    # (fp32 accumulate at full rate); 96 GB GDDR7 at 1,597 GB/s (the Workstation Edition's 1,792). On demand: RunPod
    # $1.69-1.84 (2025-2026), Vast.ai $1.0-1.3 (2026): $1.50, a typical marketplace price. Spot: RunPod $0.89
    # (deploybase.ai, "RunPod GPU Pricing", March 2026); taken as the L40S's 5-10 %. Not the 300 W Max-Q.
    "rtx-pro-6000": Accelerator("NVIDIA RTX PRO 6000 Blackwell 96GB", 96 * GIB, 503.8e12, 1.50, 1.597e12, 0.89,
                                interrupted_per_day(0.10), link_bandwidth=64e9,
                                device_names=r"\bRTX PRO 6000\b(?!.*\bMAX Q\b)"),
    # HGX B200 data sheet (2025): 4.5 PFLOP/s bf16 with sparsity a GPU, 2.25 dense; 180 GB HBM3e at 8 TB/s. On demand:
    # Lambda $4.99, RunPod $5.99, Modal $6.25 (their 2025-2026 price lists), Vast.ai $4.49 (usagepricing.com, June
    # 2026): $5.50, a typical price. Spot: half of it (no spot listing found); AWS p6-b200: taken as the H100's band.
    # Not the GB200 (Grace-Blackwell, "NVIDIA GB200").
    "b200": Accelerator("NVIDIA B200 180GB SXM", 180 * GIB, 2250e12, 5.50, 8.0e12, 2.75,
                        interrupted_per_day(0.20), link_bandwidth=900e9, device_names=r"\bB200\b"),
    # AMD Instinct MI300X data sheet (2023): 1,307.4 TFLOP/s bf16 dense (2,614.9 with sparsity); 192 GB HBM3 at
    # 5.3 TB/s. ROCm: torch reports it through torch.cuda as "AMD Instinct MI300X". On demand: the median listing
    # $1.99 (TensorWave $1.50, Vultr $1.85; cliffcenter.com, May 2026), a typical price. Spot: Crusoe $1.71 (the
    # same); no Advisor band: taken as the H100's. Not the MI300A (an APU) nor the MI325X.
    "mi300x": Accelerator("AMD Instinct MI300X 192GB", 192 * GIB, 1307.4e12, 1.99, 5.3e12, 1.71,
                          interrupted_per_day(0.20), link_bandwidth=448e9, device_names=r"\bMI300X\b"),
}
CPU = "cpu"  # this machine's own CPU: a target whose memory and cores are read, not catalogued
CUDA = "cuda"  # this machine's own GPU, whatever it is: a target read from the device (peak measured if uncatalogued)
HARDWARE_KINDS = (CPU, CUDA, *CATALOGUE)  # the config's hardware.target choices


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity (a container's or taskset's share), not the machine's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cpu_accelerator() -> Accelerator:
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return Accelerator(f"CPU ({usable_cores()} cores)", pages, None, None)


def target_accelerator(target: str) -> Accelerator:
    """What a `hardware.target` is: this CPU, this machine's GPU (`cuda`: there must be one), or a catalogue kind."""
    if target == CPU:
        return cpu_accelerator()
    if target == CUDA:
        key, accelerator = detect()
        if key == CPU:
            raise ValueError("hardware.target cuda is this machine's GPU, and torch sees none here "
                             "(torch.cuda.is_available() is False); plan on the GPU host, or name a catalogue kind: "
                             f"{', '.join(CATALOGUE)}")
        return accelerator
    return CATALOGUE[target]


def is_present(target: str, detected_key: str) -> bool:
    """Whether `target` is the device this process trains on: its own kind, or `cuda` on any GPU."""
    return detected_key == target or (target == CUDA and detected_key != CPU)


def history_kind(target: str, device_name: str) -> str:
    """The hardware a run's speed is remembered under: the target, and for `cuda` the device's own name as well
    ("cuda-nvidia-geforce-rtx-3090"), so two GPUs the catalogue does not know never share a history."""
    if target != CUDA:
        return target
    return f"{CUDA}-" + re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")


def detect() -> tuple[str, Accelerator]:
    """(catalogue key, or 'cpu', or 'cuda' for a GPU the catalogue does not know; its description) of the device
    this process will train on. An uncatalogued GPU keeps its device name, its peak measured (`matmul_flops`, once a
    process) and no price."""
    import torch

    if not torch.cuda.is_available():
        return CPU, cpu_accelerator()
    props = torch.cuda.get_device_properties(0)
    return device_accelerator(props.name, props.total_memory, torch.device("cuda", 0))


def device_accelerator(name: str, memory_bytes: int, device: torch.device | str) -> tuple[str, Accelerator]:
    """(catalogue key, description) of a GPU called `name` with `memory_bytes`: its catalogue entry under its own
    name, else `cuda` with the peak `matmul_flops` measures on `device` (once a process) and no price."""
    key = catalogue_key(name)
    if key is None:
        peak, source = _measured_peak(str(device))
        return CUDA, Accelerator(name, memory_bytes, peak, None, peak_source=source)
    return key, dataclasses.replace(CATALOGUE[key], name=name, memory_bytes=memory_bytes)


def hourly_price(accelerator: Accelerator, spot: bool, price: float | None = None,
                 spot_price: float | None = None) -> float | None:
    """Per GPU-hour, spot or on demand: the config's own `price` (`spot_price`) over the accelerator's typical one;
    None where neither is known (a CPU, a GPU the catalogue does not know given no price): no cost, not a guess."""
    own, typical = (spot_price, accelerator.spot_price_per_hour) if spot else (price, accelerator.price_per_hour)
    return own if own is not None else typical


def catalogue_key(device_name: str) -> str | None:
    """The catalogue entry a device name (as torch reports it) is: the entry whose `device_names` matches the
    longest stretch of it, so "NVIDIA H100 PCIe" is the PCIe card and not the SXM "h100", "NVIDIA A100-SXM4-40GB"
    the 40 GB card; names that only resemble an entry ("NVIDIA L40", "Quadro RTX 6000", "NVIDIA GB200") are none."""
    words = re.sub(r"[^A-Z0-9]+", " ", device_name.upper()).strip()
    best, longest = None, 0
    for key, accelerator in CATALOGUE.items():
        match = re.search(accelerator.device_names, words) if accelerator.device_names else None
        if match and len(match.group()) > longest:
            best, longest = key, len(match.group())
    return best


def matmul_flops(device: torch.device | str, dtype: torch.dtype | None = None, size: int = 8192,
                 budget_seconds: float = 0.2) -> float:
    """The FLOP/s `device` achieves on `size` x `size` matrix products in `dtype` (bf16 unless given): two warm-up
    products (kernel selection, clocks), one timed alone to size the run, then as many as fit `budget_seconds`
    (at most 100) timed together, by CUDA events on a GPU and the wall clock elsewhere. 2 size^3 FLOPs a product.

    The achieved rate, not a data sheet's: on a GPU whose data sheet is known it reads below the sheet's figure."""
    import torch

    device = torch.device(device)
    dtype = dtype or torch.bfloat16
    generator = torch.Generator(device=device).manual_seed(0)
    operands = [torch.randn(size, size, device=device, dtype=dtype, generator=generator) for _ in range(2)]
    operands.append(torch.empty(size, size, device=device, dtype=dtype))
    _timed_products(operands, 2)
    one = _timed_products(operands, 1)
    products = max(1, min(100, int(budget_seconds / max(one, 1e-9))))
    seconds = _timed_products(operands, products)
    operands.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the probe's 3 x size^2 elements go back to the device
    return 2.0 * size**3 * products / seconds


def _timed_products(operands: list[torch.Tensor], products: int) -> float:
    """Seconds for `products` products a @ b into out: CUDA events on a GPU (after what was queued before), the
    wall clock elsewhere."""
    import torch

    a, b, out = operands
    if a.device.type != "cuda":
        began = time.perf_counter()
        for _ in range(products):
            torch.matmul(a, b, out=out)
        return time.perf_counter() - began
    torch.cuda.synchronize(a.device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(products):
        torch.matmul(a, b, out=out)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000.0


@functools.cache
def _measured_peak(device: str) -> tuple[float, str]:
    """`device`'s peak as `matmul_flops` measures it in the dtype training uses there, and its label; once a process
    (a few hundred milliseconds). Products of 8192 on a GPU; 512 on a CPU, where 8192 would take minutes."""
    import torch

    where = torch.device(device)
    dtype, size = training_dtype(where), 8192 if where.type == "cuda" else 512
    peak = matmul_flops(where, dtype, size)
    return peak, f"measured: {str(dtype).removeprefix('torch.')} {size}x{size} matrix products on {where}"


def training_device() -> torch.device:
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def training_dtype(device: torch.device) -> torch.dtype:
    """bf16 where the GPU supports it, else fp16; fp32 on CPU, where half precision is slower and less exact."""
    import torch

    if device.type != "cuda":
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
