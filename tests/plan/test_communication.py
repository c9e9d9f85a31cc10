"""The plan's communication model (phase1a/plan/communication.py) against hand calculations, and the options table's
multi-node rows built on it (phase1a/plan/options.py)."""
import pytest

from phase1a.core.units import GIB
from phase1a.plan.communication import StepTraffic, step_communication
from phase1a.plan.options import OptionsJob, OptionSpec, OptionsPolicy, format_options, more_nodes, option_rows

# Llama-3-8B, full fine-tune: 16 GB of bf16 weights, 32 GB of fp32 gradients; 4 micro-batches, 2 s of compute.
FULL_8B = StepTraffic(weight_bytes=16e9, gradient_bytes=32e9, micro_batches=4, compute_seconds=2.0)
LORA_8B = StepTraffic(weight_bytes=16e9, gradient_bytes=160e6, micro_batches=4, compute_seconds=2.0,
                      backward_share=0.5)


def test_lora_ddp_across_two_infiniband_nodes_hides_its_all_reduce():
    # 2 x 7/8 x 160 MB / 450 GB/s inside the node + 2 x 1/2 x 20 MB / 50 GB/s across: 1.02 ms, under the last
    # micro-batch's backward (2 s x 1/2 / 4 = 0.25 s)
    moved = step_communication(LORA_8B, "ddp", "h100", gpus_per_node=8, nodes=2)
    assert moved.seconds == pytest.approx(2 * 7 / 8 * 160e6 / 450e9 + 20e6 / 50e9)
    assert moved.exposed_seconds == 0.0 and moved.efficiency == 1.0


def test_full_fsdp_over_two_nodes_is_bound_by_the_network():
    # 4 micro-batches x 2 gathers of 15/16 x 16 GB + a reduce-scatter of 15/16 x 32 GB, all at 50 GB/s: 3.0 s,
    # 1.0 s of it past the 2.0 s of compute
    moved = step_communication(FULL_8B, "fsdp", "h100", gpus_per_node=8, nodes=2)
    assert moved.seconds == pytest.approx(8 * 15 / 16 * 16e9 / 50e9 + 15 / 16 * 32e9 / 50e9)
    assert moved.seconds == pytest.approx(3.0)
    assert moved.exposed_seconds == pytest.approx(1.0) and moved.efficiency == pytest.approx(2 / 3)


def test_hsdp_keeps_the_gathers_on_nvlink():
    # 8 gathers of 7/8 x 16 GB + a reduce-scatter of 7/8 x 32 GB at 450 GB/s, and the node's 4 GB shard of the
    # gradients all-reduced between the 2 nodes at 50 GB/s: 0.39 s, hidden
    moved = step_communication(FULL_8B, "hsdp", "h100", gpus_per_node=8, nodes=2)
    assert moved.seconds == pytest.approx(8 * 7 / 8 * 16e9 / 450e9 + 7 / 8 * 32e9 / 450e9 + 4e9 / 50e9)
    assert moved.efficiency == 1.0


def test_full_ddp_over_ethernet_loses_more_than_half():
    # 100 Gb/s a node is 1.5625 GB/s for each of 8 GPUs: the node's 4 GB share takes 2.56 s
    moved = step_communication(FULL_8B, "ddp", "h100", gpus_per_node=8, nodes=2, network="ethernet-100")
    assert moved.seconds == pytest.approx(2 * 7 / 8 * 32e9 / 450e9 + 4e9 / (12.5e9 / 8))
    hidden = 2.0 * (2 / 3) / 4
    assert moved.efficiency == pytest.approx(2.0 / (2.0 + moved.seconds - hidden))
    assert moved.efficiency < 0.5


def job(weights_gib: float, total_gib: float) -> OptionsJob:
    """A full fine-tune whose unsharded bill is `total_gib` a GPU, `weights_gib` of it shardable."""
    return OptionsJob(train_tokens=2_000_000_000, flops_per_token=6 * 8e9, reference="h100",
                      reference_tokens_per_second=3_000.0, memory_needed_bytes_per_gpu=total_gib * GIB,
                      weights_and_state_bytes=weights_gib * GIB, global_batch=64, learning_rate=1e-5,
                      traffic=FULL_8B)


SPECS = [OptionSpec(label="8x H100", gpus=8, kind="h100", strategy="auto"),
         OptionSpec(label="2x8 H100 IB", gpus=16, kind="h100", strategy="auto", nodes=2),
         OptionSpec(label="4x8 H100 IB", gpus=32, kind="h100", strategy="auto", nodes=4),
         OptionSpec(label="2x8 H100 Eth", gpus=16, kind="h100", strategy="auto", nodes=2, network="ethernet-100")]


def test_auto_picks_ddp_then_hsdp_then_fsdp_and_says_why():
    small = {row.label: row for row in option_rows(job(8, 40), OptionsPolicy(options=SPECS))}
    assert small["2x8 H100 IB"].strategy == "ddp" and "the model fits a GPU" in small["2x8 H100 IB"].note
    big = {row.label: row for row in option_rows(job(120, 150), OptionsPolicy(options=SPECS))}
    assert big["8x H100"].strategy == "fsdp"  # one node: its shard over 8 GPUs (30 + 15 GiB)
    assert big["2x8 H100 IB"].strategy == "hsdp" and "a node's shard fits" in big["2x8 H100 IB"].note
    huge = {row.label: row for row in option_rows(job(600, 630), OptionsPolicy(options=SPECS))}
    assert huge["2x8 H100 IB"].strategy == "fsdp" and "does not fit" in huge["2x8 H100 IB"].note
    assert huge["4x8 H100 IB"].fits and huge["4x8 H100 IB"].memory_per_gpu_gib == pytest.approx(30 + 600 / 32)


def test_the_table_shows_computed_scaling_and_where_more_nodes_stop_paying():
    rows = {row.label: row for row in option_rows(job(8, 40), OptionsPolicy(options=SPECS))}
    # ddp of a full 8B: the 32 GB all-reduce is mostly hidden over InfiniBand, not over Ethernet
    assert rows["2x8 H100 IB"].scaling_efficiency > 0.6 > rows["2x8 H100 Eth"].scaling_efficiency
    assert rows["2x8 H100 IB"].communication_seconds > 0
    table = format_options(list(rows.values()))
    assert "scaling" in table.splitlines()[0]
    lines = more_nodes(list(rows.values()))
    [ib] = [line for line in lines if line.startswith("8x H100 -> 2x8 H100 IB (400 Gb/s InfiniBand a GPU): time -")]
    assert ", cost +" in ib  # twice the GPUs, a little less than half the time
    assert any(line.startswith("2x8 H100 IB -> 4x8 H100 IB") for line in lines)
    assert any(line.startswith("8x H100 -> 2x8 H100 Eth (100 Gb/s Ethernet a node)") for line in lines)


def test_a_measured_scaling_efficiency_overrides_the_model():
    rows = option_rows(job(8, 40), OptionsPolicy(options=SPECS, scaling_efficiency=0.9))
    assert [round(row.scaling_efficiency, 4) for row in rows] == [0.729, 0.6561, 0.5905, 0.6561]
