"""The configured hardware as the plan sees it: how many GPUs its weights are sharded over, how often a host is
interrupted, what a GPU-hour costs, and its own row of the options table (phase1a/plan/options.py)."""
from __future__ import annotations

from phase1a.config.schema import HardwareConfig, Phase1aConfig
from phase1a.core.hardware import Accelerator, hourly_price
from phase1a.plan.options import OptionSpec


def shards(hardware: HardwareConfig) -> int:
    """The GPUs a model's weights and state are sharded over: all (fsdp), a node's (hsdp), none (ddp)."""
    return {"fsdp": hardware.world_size, "hsdp": hardware.num_gpus}.get(hardware.strategy, 1)


def interruption_rate(config: Phase1aConfig, target: Accelerator) -> tuple[float, str]:
    """Interruptions per hour of a host, and where the figure comes from."""
    hardware = config.hardware
    if hardware.interruptions_per_hour is not None:
        return hardware.interruptions_per_hour, "hardware.interruptions_per_hour"
    if hardware.spot:  # the config requires a catalogue kind or a rate of its own
        return target.spot_interruptions_per_hour or 0.0, f"the catalogue's typical spot rate for {hardware.target}"
    return 0.0, "on demand"


def gpu_hour_price(hardware: HardwareConfig, target: Accelerator) -> float | None:
    """Per GPU-hour: the config's own price over the target's typical one; None: no cost shown."""
    return hourly_price(target, hardware.spot, hardware.price_per_gpu_hour, hardware.spot_price_per_gpu_hour)


def own_option(hardware: HardwareConfig) -> OptionSpec:
    """The config's own hardware as a row of the options table (a catalogue target): its GPUs, nodes, strategy."""
    kind, gpus, nodes = hardware.target, hardware.world_size, hardware.num_nodes
    shape = f"{gpus}x" if nodes == 1 else f"{nodes}x{hardware.num_gpus}"
    strategy = "single" if gpus == 1 else hardware.strategy
    return OptionSpec(label=f"{shape} {kind.upper()}" + ("" if gpus == 1 else f" {strategy.upper()}"), gpus=gpus,
                      kind=kind, strategy=strategy, nodes=nodes, network=hardware.network)


def own_overrides(hardware: HardwareConfig) -> dict:
    """The config's own prices and rate, for its target's rows of the options table."""
    def own(value: float | None) -> dict[str, float] | None:
        return {hardware.target: value} if value is not None else None

    return {"prices": own(hardware.price_per_gpu_hour), "spot_prices": own(hardware.spot_price_per_gpu_hour),
            "interruption_rates": own(hardware.interruptions_per_hour)}
