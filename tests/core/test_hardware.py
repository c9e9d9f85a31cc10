"""The hardware catalogue: the cards people rent (each priced by the plan), device names as torch reports them, a GPU
the catalogue does not know (named, its peak measured by a matrix-product probe, priced only by the config)."""
import math

import pytest
import torch

from helpers import date_records, make_tokenizer, resolved, write_jsonl
from phase1a.config.schema import ConfigError, Phase1aConfig, validate_config
from phase1a.core.hardware import (
    CATALOGUE,
    CUDA,
    DATA_SHEET,
    HARDWARE_KINDS,
    catalogue_key,
    detect,
    device_accelerator,
    history_kind,
    hourly_price,
    matmul_flops,
    target_accelerator,
)
from phase1a.core.units import GIB
from phase1a.data.tokenizing import TokenizeOptions, tokenize_dataset
from phase1a.plan.planner import make_plan
from phase1a.plan.present import format_plan

RENTED = ("rtx4090", "rtx5090", "l40s", "rtx-a6000", "rtx-6000-ada", "rtx-pro-6000", "b200", "mi300x")

# torch.cuda.get_device_properties(0).name on each card (ROCm reports through torch.cuda too), and names that only
# resemble an entry: another card, which the catalogue does not know.
DEVICE_NAMES = {
    "NVIDIA GeForce RTX 4090": "rtx4090",
    "NVIDIA GeForce RTX 5090": "rtx5090",
    "NVIDIA L40S": "l40s",
    "NVIDIA RTX A6000": "rtx-a6000",
    "NVIDIA RTX 6000 Ada Generation": "rtx-6000-ada",
    "NVIDIA RTX PRO 6000 Blackwell Server Edition": "rtx-pro-6000",
    "NVIDIA RTX PRO 6000 Blackwell Workstation Edition": "rtx-pro-6000",
    "NVIDIA B200": "b200",
    "AMD Instinct MI300X": "mi300x",
    "NVIDIA H100 80GB HBM3": "h100",
    "NVIDIA H100 PCIe": "h100-pcie",
    "NVIDIA H200": "h200",
    "NVIDIA A100-SXM4-80GB": "a100-80gb",
    "NVIDIA A100-SXM4-40GB": "a100-40gb",
    "NVIDIA A100-PCIE-40GB": "a100-40gb",
    "NVIDIA A100 PCIe": "a100-80gb",
    "NVIDIA L4": "l4",
    "NVIDIA A10G": "a10g",
    "NVIDIA GeForce RTX 4090 D": None,  # China's 4090, fewer SMs
    "NVIDIA GeForce RTX 4090 Laptop GPU": None,
    "NVIDIA GeForce RTX 5090 D": None,
    "Quadro RTX 6000": None,  # Turing
    "NVIDIA RTX 5000 Ada Generation": None,
    "NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition": None,  # 300 W
    "NVIDIA L40": None,
    "NVIDIA GB200": None,
    "AMD Instinct MI300A": None,
    "AMD Instinct MI325X": None,
    "Tesla T4": None,
}


def test_device_names_are_their_own_entries_and_look_alikes_none():
    assert {name: catalogue_key(name) for name in DEVICE_NAMES} == DEVICE_NAMES


def test_each_rented_card_has_every_figure_the_plan_reads():
    for kind in RENTED:
        card = CATALOGUE[kind]
        assert card.peak_source == DATA_SHEET and card.device_names, kind
        assert 20 * GIB <= card.memory_bytes <= 192 * GIB and 1e14 < card.peak_flops < 3e15, kind
        assert 5e11 < card.memory_bandwidth < 1e13 and card.link_bandwidth >= 32e9, kind
        assert 0 < card.spot_price_per_hour < card.price_per_hour < 10, kind
        assert 0 < card.spot_interruptions_per_hour < 0.05, kind
        assert validate_config({"data": {"source": "d.jsonl"}, "hardware": {"target": kind}}).hardware.target == kind
    # Dense, not sparse: bf16 with fp32 accumulate on the GeForce cards (half their fp16-accumulate figure).
    assert CATALOGUE["rtx5090"].peak_flops == 209.5e12 and CATALOGUE["b200"].peak_flops == 2.25e15
    assert CATALOGUE["mi300x"].peak_flops == 1307.4e12 and CATALOGUE["mi300x"].memory_bytes == 192 * GIB


def test_config_takes_this_machines_gpu_and_a_positive_price():
    assert CUDA in HARDWARE_KINDS
    tree = {"data": {"source": "d.jsonl"}, "hardware": {"target": "cuda", "price_per_gpu_hour": 0.35}}
    assert validate_config(tree).hardware.price_per_gpu_hour == 0.35
    for price in (0, -1.0):  # 0 would read as no price: the catalogue's, or none
        tree["hardware"]["price_per_gpu_hour"] = price
        with pytest.raises(ConfigError, match="hardware.price_per_gpu_hour: Input should be greater than 0"):
            validate_config(tree)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-only machine's refusal")
def test_target_cuda_without_a_gpu_says_so():
    with pytest.raises(ValueError, match="hardware.target cuda is this machine's GPU, and torch sees none"):
        target_accelerator("cuda")


def test_matmul_probe_measures_a_cpu():
    for dtype in (torch.bfloat16, torch.float32):
        flops = matmul_flops("cpu", dtype, size=128, budget_seconds=0.02)
        assert math.isfinite(flops) and flops > 1e6, dtype


def test_an_uncatalogued_gpu_keeps_its_name_a_measured_peak_and_only_the_configs_price():
    """What detect() makes of a device name the catalogue does not know, its probe run here on the CPU."""
    kind, card = device_accelerator("NVIDIA GeForce RTX 3090", 24 * GIB, "cpu")
    assert (kind, card.name, card.memory_bytes) == ("cuda", "NVIDIA GeForce RTX 3090", 24 * GIB)
    assert card.peak_source.startswith("measured: float32 512x512 matrix products on cpu")
    assert math.isfinite(card.peak_flops) and card.peak_flops > 1e6
    assert hourly_price(card, spot=False) is None and hourly_price(card, spot=True, price=0.3) is None
    assert hourly_price(card, spot=False, price=0.3) == 0.3 and hourly_price(card, True, spot_price=0.1) == 0.1
    kind, known = device_accelerator("NVIDIA L40S", 45 * GIB, "cpu")  # a catalogue card: its data sheet, its price
    assert (kind, known.name, known.memory_bytes, known.peak_flops) == ("l40s", "NVIDIA L40S", 45 * GIB, 362e12)
    assert hourly_price(known, False) == 1.00 and hourly_price(known, False, price=0.79) == 0.79
    assert hourly_price(known, True) == 0.34
    # Two uncatalogued GPUs never share a history; catalogue kinds and the CPU keep their own names.
    assert history_kind("cuda", "NVIDIA GeForce RTX 3090") == "cuda-nvidia-geforce-rtx-3090"
    assert history_kind("cuda", "NVIDIA A40") != history_kind("cuda", "NVIDIA GeForce RTX 3090")
    assert (history_kind("h100", "NVIDIA H100 80GB HBM3"), history_kind("cpu", "CPU (2 cores)")) == ("h100", "cpu")


def test_the_plan_prices_the_tiny_model_on_each_rented_card(tmp_path, config_tree):
    """Planned here for a card that is not present: its own row leads the options table, with memory, a fit and a
    price, and the plan's cost is that row's; the config's price replaces the catalogue's in both."""
    data = tokenize_dataset(write_jsonl(tmp_path / "d.jsonl", date_records(40)), make_tokenizer(), 256,
                            TokenizeOptions(), tmp_path / "cache" / "fp")
    config_tree["validation"] = {"max_examples": 8, "tolerances": {"loss": 0.05}}
    for kind in RENTED:
        config_tree["hardware"] = {"target": kind}
        config = Phase1aConfig.model_validate(config_tree)
        plan = make_plan(config, resolved(config), data)
        card, own = CATALOGUE[kind], plan.options[0]
        assert (own.kind, own.gpus, own.label) == (kind, 1, f"1x {kind.upper()}"), kind
        assert own.fits and 0 < own.memory_per_gpu_gib < own.memory_available_gib, kind
        assert own.memory_available_gib == pytest.approx(card.memory_bytes * 0.9 / GIB), kind
        assert own.dollars == pytest.approx(card.price_per_hour * own.hours), kind
        assert own.spot_dollars == pytest.approx(card.spot_price_per_hour * own.spot_hours), kind
        assert own.hours * 3600 == pytest.approx(plan.estimated_total_seconds, rel=1e-6), kind
        assert plan.estimated_cost_usd == pytest.approx(card.price_per_hour * plan.estimated_total_seconds / 3600)
        assert plan.throughput_source == "modelled" and plan.memory.available_gib == pytest.approx(
            own.memory_available_gib, rel=1e-3)
        assert [row.kind for row in plan.options].count(kind) == 1, kind
    assert f"1x {kind.upper()}" in format_plan(plan)

    config_tree["hardware"] = {"target": "b200", "price_per_gpu_hour": 3.0, "num_gpus": 2}
    config = Phase1aConfig.model_validate(config_tree)
    plan = make_plan(config, resolved(config), data)
    own = plan.options[0]
    assert (own.label, own.gpus, own.strategy) == ("2x B200 DDP", 2, "ddp")
    assert own.dollars == pytest.approx(2 * 3.0 * own.hours)
    assert plan.estimated_cost_usd == pytest.approx(2 * 3.0 * plan.estimated_total_seconds / 3600)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_probe_on_this_gpu():
    """The probe on the GPU present: a finite rate in a few hundred milliseconds, below its data sheet where the
    catalogue knows the card; an uncatalogued card carries it as its peak, labelled measured."""
    import time

    began = time.perf_counter()
    flops = matmul_flops("cuda")
    assert math.isfinite(flops) and flops > 1e12 and time.perf_counter() - began < 5
    kind, card = detect()
    if kind == CUDA:
        assert card.peak_source.startswith("measured") and card.price_per_hour is None and card.peak_flops > 1e12
    else:
        assert card.peak_source == DATA_SHEET and 0.2 * card.peak_flops < flops < 1.05 * card.peak_flops
