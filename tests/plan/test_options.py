import math

import pytest

from phase1a.core.hardware import CATALOGUE
from phase1a.core.units import GIB
from phase1a.plan.options import (
    DEFAULT_OPTIONS,
    OptionsJob,
    OptionSpec,
    OptionsPolicy,
    OtherWork,
    format_options,
    option_rows,
    scaling_factor,
)

TOKENS = 36_000_000
JOB = dict(train_tokens=TOKENS, flops_per_token=6 * 1e9, reference="h100", reference_tokens_per_second=10_000.0,
           memory_needed_bytes_per_gpu=30 * GIB, weights_and_state_bytes=16 * GIB, global_batch=16,
           learning_rate=1e-4)
H100x = [OptionSpec(label=f"{n}x H100", gpus=n, kind="h100", strategy="single" if n == 1 else "ddp") for n in (1, 2, 4)]


def by_label(rows):
    return {row.label: row for row in rows}


def priced(job: dict | None = None, **policy):
    """The options table for JOB with `job`'s fields changed, under a policy of `policy`'s fields."""
    return option_rows(OptionsJob(**{**JOB, **(job or {})}), OptionsPolicy(**policy))


def test_scaling_efficiency_per_doubling():
    assert scaling_factor(1) == 1.0
    assert scaling_factor(2) == pytest.approx(0.9)
    assert scaling_factor(4) == pytest.approx(0.81)
    assert scaling_factor(8, 0.95) == pytest.approx(0.95**3)


def test_hours_and_dollars_arithmetic():
    rows = by_label(priced({"other": OtherWork(host_seconds=600)}, options=H100x))
    one, four = rows["1x H100"], rows["4x H100"]
    assert one.tokens_per_second == pytest.approx(10_000)
    assert one.hours == pytest.approx(TOKENS / 10_000 / 3600 + 600 / 3600)
    assert one.dollars == pytest.approx(1 * CATALOGUE["h100"].price_per_hour * one.hours)
    assert four.tokens_per_second == pytest.approx(10_000 * 4 * 0.81)
    assert four.hours == pytest.approx(TOKENS / (10_000 * 4 * 0.81) / 3600 + 600 / 3600)
    assert four.dollars == pytest.approx(4 * CATALOGUE["h100"].price_per_hour * four.hours)
    assert one.mfu == pytest.approx(10_000 * 6e9 / 989e12)


def test_evaluation_is_priced_at_each_options_own_speed():
    """Forward tokens at the option's peak FLOP/s, greedy steps at its memory bandwidth, on one GPU however
    many train: the reference's evaluation speed scaled, never the host's."""
    other = OtherWork(host_seconds=60, forward_tokens=2e6, decode_steps=5_000,
                      reference_forward_seconds_per_token=1e-5, reference_decode_seconds_per_step=2e-3)
    specs = [*H100x, OptionSpec(label="1x H200", gpus=1, kind="h200", strategy="single"),
             OptionSpec(label="4x A100", gpus=4, kind="a100-40gb", strategy="zero3")]
    rows = by_label(priced({"other": other}, options=specs))
    on_h100 = 2e6 * 1e-5 + 5_000 * 2e-3
    assert rows["1x H100"].evaluation_seconds == pytest.approx(on_h100)
    assert rows["4x H100"].evaluation_seconds == pytest.approx(on_h100)  # the validate stage runs on one GPU
    h100, h200 = CATALOGUE["h100"], CATALOGUE["h200"]
    assert rows["1x H200"].evaluation_seconds == pytest.approx(
        2e6 * 1e-5 * h100.peak_flops / h200.peak_flops + 5_000 * 2e-3 * h100.memory_bandwidth / h200.memory_bandwidth)
    assert rows["1x H200"].evaluation_seconds < on_h100 < rows["4x A100"].evaluation_seconds
    one = rows["1x H100"]
    assert one.hours * 3600 == pytest.approx(TOKENS / one.tokens_per_second + 60 + on_h100)


def test_throughput_scales_by_peak_flops_between_kinds():
    spec = [OptionSpec(label="1x A100", gpus=1, kind="a100-80gb", strategy="single")]
    (row,) = priced(options=spec)
    assert row.tokens_per_second == pytest.approx(10_000 * 312e12 / 989e12)
    assert "scaled from h100" in row.note


def test_learning_rate_rules_and_global_batch():
    sqrt = by_label(priced(options=H100x))
    assert sqrt["2x H100"].learning_rate == pytest.approx(1e-4 * math.sqrt(2))
    assert sqrt["4x H100"].learning_rate == pytest.approx(2e-4)
    assert sqrt["4x H100"].global_batch == 64
    assert sqrt["1x H100"].learning_rate == 1e-4 and sqrt["1x H100"].global_batch == 16
    linear = by_label(priced(options=H100x, lr_rule="linear"))
    assert linear["4x H100"].learning_rate == pytest.approx(4e-4)
    none = by_label(priced(options=H100x, lr_rule="none"))
    assert none["4x H100"].learning_rate == 1e-4 and none["4x H100"].global_batch == 64
    kept = by_label(priced(options=H100x, keep_global_batch=True))
    assert kept["4x H100"].learning_rate == 1e-4 and kept["4x H100"].global_batch == 16
    assert "accumulation / 4" in kept["4x H100"].note


def test_sharding_fits_where_ddp_does_not():
    parameters = 8_030_000_000
    state = parameters * 16  # fp32 weights 4 + grads 4 + Adam moments 8, as in the plan's memory model
    activations = 5 * GIB
    specs = [OptionSpec(label="4x A100-40GB ZeRO-3", gpus=4, kind="a100-40gb", strategy="zero3"),
             OptionSpec(label="4x A100-40GB DDP", gpus=4, kind="a100-40gb", strategy="ddp"),
             OptionSpec(label="4x A100-40GB FSDP", gpus=4, kind="a100-40gb", strategy="fsdp")]
    rows = by_label(priced({"memory_needed_bytes_per_gpu": state + activations, "weights_and_state_bytes": state},
                            options=specs))
    zero3, ddp = rows["4x A100-40GB ZeRO-3"], rows["4x A100-40GB DDP"]
    assert zero3.fits and rows["4x A100-40GB FSDP"].fits and not ddp.fits
    assert zero3.memory_per_gpu_gib == pytest.approx((state / 4 + activations) / GIB)
    assert ddp.memory_per_gpu_gib == pytest.approx((state + activations) / GIB)
    assert "needs" in ddp.note
    # Headroom can tip a tight fit over.
    tight = by_label(priced({"memory_needed_bytes_per_gpu": state + activations, "weights_and_state_bytes": state},
                             options=specs, memory_headroom=0.5))
    assert not tight["4x A100-40GB ZeRO-3"].fits


def test_price_override_is_respected_and_missing_kind_is_refused():
    rows = by_label(priced(options=H100x, prices={"h100": 1.0}))
    assert rows["2x H100"].dollars == pytest.approx(2 * 1.0 * rows["2x H100"].hours)
    with pytest.raises(ValueError, match="not in the hardware catalogue"):
        priced({"reference": "cpu"})
    with pytest.raises(ValueError, match="exactly one GPU"):
        priced(options=[OptionSpec(label="bad", gpus=2, kind="h100", strategy="single")])


def test_default_options_and_text_table():
    rows = priced()
    assert [row.label for row in rows] == [spec.label for spec in DEFAULT_OPTIONS]
    table = format_options(rows)
    for spec in DEFAULT_OPTIONS:
        assert spec.label in table
    assert len(table.splitlines()) == len(rows) + 1


def test_new_catalogue_entries_are_detected_by_their_own_names():
    from phase1a.core.hardware import catalogue_key

    names = {"NVIDIA H100 80GB HBM3": "h100", "NVIDIA H100 PCIe": "h100-pcie", "NVIDIA L4": "l4",
             "NVIDIA L40S": "l40s", "NVIDIA A100-SXM4-40GB": "a100-40gb", "NVIDIA A100 PCIe": "a100-80gb",
             "NVIDIA GeForce RTX 4090": "rtx4090", "Tesla T4": None}
    assert {name: catalogue_key(name) for name in names} == names
    assert all(accelerator.memory_bandwidth for accelerator in CATALOGUE.values())


def test_each_row_says_its_source_and_range():
    """The reference kind's rows are measured, with the reference's range (the plan's footing); another kind's are
    modelled: scaled by peak FLOP/s where the job has no GPU step, the range down to the reference's own speed (a
    step bound by overhead runs no faster on a faster GPU)."""
    specs = [*H100x[:2], OptionSpec(label="1x A100", gpus=1, kind="a100-80gb", strategy="single")]
    rows = by_label(priced({"reference_range": (0.8, 1.25), "reference_basis": "4 measured steps, ±25%",
                            "other": OtherWork(host_seconds=600)}, options=specs))
    one, two, a100 = rows["1x H100"], rows["2x H100"], rows["1x A100"]
    assert one.source == two.source == "measured" and one.basis == "4 measured steps, ±25%"
    assert (one.tokens_per_second_low, one.tokens_per_second_high) == (pytest.approx(8_000), pytest.approx(12_500))
    assert two.tokens_per_second_low == pytest.approx(8_000 * 2 * 0.9)
    assert one.hours_low < one.hours < one.hours_high and one.hours_low == pytest.approx(
        (TOKENS / 12_500 + 600) / 3600)
    assert one.dollars_low == pytest.approx(CATALOGUE["h100"].price_per_hour * one.hours_low)
    assert a100.source == "modelled" and a100.tokens_per_second == pytest.approx(10_000 * 312 / 989)
    assert a100.tokens_per_second_low == pytest.approx(8_000 * 312 / 989)
    assert a100.tokens_per_second_high == pytest.approx(12_500)
    assert "peak FLOP/s" in a100.basis
    lines = format_options([one, a100]).splitlines()
    assert lines[0].split()[:5] == ["option", "fits", "GiB/GPU", "source", "tok/s"]
    assert "measured  10,000 [8,000-12,500]" in lines[1] and "modelled  3,155 [2,524-12,500]" in lines[2]
    # A reference that is assumed, not measured (a target not present): its own rows are modelled too.
    (assumed,) = priced({"reference_source": "assumed"}, options=H100x[:1])
    assert assumed.source == "modelled" and assumed.tokens_per_second_low == assumed.tokens_per_second == 10_000
