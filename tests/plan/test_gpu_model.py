"""The plan's GPU model (phase1a/plan/gpu_model.py): its fit to the committed GPU measurements, the options rows it
prices, and the measurements each row's range must contain."""
import json
import sys
from pathlib import Path

import pytest

from phase1a.core.hardware import CATALOGUE
from phase1a.core.units import GIB
from phase1a.model.cost_model import ModelFacts, flops_per_token
from phase1a.plan.gpu_model import Measured, StepJob, fit, gpu_step, load_overheads, modelled_speed, step_seconds
from phase1a.plan.options import OptionsJob, OptionSpec, OptionsPolicy, OtherWork, format_options, option_rows

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import fit_gpu_overheads  # noqa: E402

SINGLE = [OptionSpec(label="1x H100", gpus=1, kind="h100", strategy="single"),
          OptionSpec(label="1x H200", gpus=1, kind="h200", strategy="single")]
SMOLLM2 = ModelFacts(parameters=134_515_008, layers=30, hidden=576, intermediate=1536, vocab=49_152,
                     max_positions=8192, heads=9, kv_heads=3, head_dim=64)
LLAMA3_8B = ModelFacts(parameters=8_030_261_248, layers=32, hidden=4096, intermediate=14_336, vocab=128_256,
                       max_positions=131_072, heads=32, kv_heads=8, head_dim=128)


def rows_for(step, train_tokens: float = 1e6, **job) -> dict:
    """The plan's rows for a step nothing measured here: every kind from the GPU model (phase1a/plan/planner.py
    `_options` for a target that is no catalogue GPU)."""
    reference = modelled_speed(step, "h100", 0.35).value
    fields = dict(train_tokens=int(train_tokens), flops_per_token=step.flops_per_token, reference="h100",
                  reference_tokens_per_second=reference, memory_needed_bytes_per_gpu=2 * GIB,
                  weights_and_state_bytes=GIB, global_batch=16, learning_rate=1e-4, gpu=step,
                  reference_source="modelled", other=OtherWork(host_seconds=60))
    return {row.label: row for row in option_rows(OptionsJob(**{**fields, **job}), OptionsPolicy(options=SINGLE))}


# ---- the committed measurements --------------------------------------------------------------------------------

def committed_sources() -> list[Path]:
    """The result files the committed fit rests on."""
    return [ROOT / source.file for source in load_overheads().sources]


def test_the_committed_fit_rests_on_the_committed_gpu_results_and_is_their_fit():
    """gpu_overheads.json is what benchmarks/fit_gpu_overheads.py fits on the newest GPU check's train results,
    and names each: its file, device, commit and measured tokens/s."""
    overheads = load_overheads()
    assert overheads == fit_gpu_overheads.fitted(), "refit: uv run python benchmarks/fit_gpu_overheads.py"
    files = committed_sources()
    assert len(files) >= 3 and all(path.is_file() for path in files)
    for source in overheads.sources:
        result = json.loads((ROOT / source.file).read_text())
        assert source.kind in CATALOGUE and source.commit and source.device
        assert source.tokens_per_second == pytest.approx(result["useful_tokens_per_s"], abs=0.06)


@pytest.mark.parametrize("path", committed_sources(), ids=lambda path: f"{path.parent.parent.name}/{path.stem}")
def test_each_committed_gpu_measurement_lies_within_its_h100_and_h200_rows_range(path):
    """The plan's rows for the measured job (the SmolLM2-135M shape, and the 8B shape's once a GPU check measures
    it; the batch, examples and lengths its result file records) on an H200, where it ran, and an H100 (the same
    host-bound overheads): the measurement within the range, the row modelled and saying what it rests on."""
    result = json.loads(path.read_text())
    check = path.parent.parent
    measured = fit_gpu_overheads.measurement(path, result, fit_gpu_overheads._environment(check),
                                             fit_gpu_overheads._part_summary(check, path, result))
    # The job as the file records it: its batch (micro x accumulation), the steps timed (the examples measured, as
    # its part's log records them, over the batch), their tokens.
    batch = result.get("batch") or result["micro_batch_size"] * result["accumulation"]
    summary = fit_gpu_overheads._part_summary(check, path, result)
    steps = result.get("steps") or summary["examples_measured"] / batch
    assert measured.step.useful_tokens == pytest.approx(result["useful_tokens"] / steps)
    computed = result.get("computed_tokens") or result.get("padded_tokens")
    assert measured.step.computed_tokens == pytest.approx(computed / steps)
    assert measured.seconds_per_step == pytest.approx(result["seconds"] / steps)
    assert measured.kind in ("h100", "h200") and measured.model in ("smollm2", "llama3-8b")
    tokens_per_second = result["useful_tokens"] / result["seconds"]
    for row in rows_for(measured.step).values():
        assert row.source == "modelled", row.label
        assert row.tokens_per_second_low <= tokens_per_second <= row.tokens_per_second_high, (
            row.label, result["config"], row.tokens_per_second_low, tokens_per_second, row.tokens_per_second_high)
        assert row.tokens_per_second_low <= row.tokens_per_second <= row.tokens_per_second_high
        assert "overhead-bound" in row.note and measured.commit in row.basis and result["config"] in row.basis


def test_the_demo_batch_rows_hold_both_code_paths_measured_at_that_batch():
    """The 16-example step of the H200 run as our packed rows run it (one micro-batch a step): its rows' range holds
    what both configurations measured at that batch, ours (938 tokens/s) and the padded "before" (1,238); the
    FLOP-bound speed of the old table (35 % MFU) lies far above it."""
    runs = {m.config: m for m in fit_gpu_overheads.read_check(ROOT / "benchmarks/results/gpu-check-h200-2026-11-26")}
    ours, before = runs["ours"], runs["before"]
    assert ours.step.useful_tokens == pytest.approx(before.step.useful_tokens)  # the same examples, 16 a step
    for row in rows_for(ours.step).values():
        for m in (ours, before):
            assert row.tokens_per_second_low <= m.tokens_per_second <= row.tokens_per_second_high, (row.label, m.config)
        assert row.mfu < 0.01
        assert row.tokens_per_second_high < CATALOGUE[row.kind].peak_flops * 0.35 / ours.step.flops_per_token / 20


# ---- the demo: tiny steps are overhead-bound ---------------------------------------------------------------------

def demo_step():
    """The demo's job (configs/demo.yaml, `phase1a plan`: 24,023 train tokens in 54 steps of 8 examples, max_seq_length
    64, micro-batch 8) on SmolLM2-135M."""
    mean = 24_023 / 432
    return gpu_step(SMOLLM2, StepJob(examples=8, mean_length=mean, row_tokens=8 * 64,
                                     flops_per_token=flops_per_token(SMOLLM2, False, False, mean)))


def llama3_8b_step():
    """configs/llama3-8b-lora-h100.yaml's batch of 64 at a chat mean of 1,500 tokens, rows of 8 x 4,096."""
    return gpu_step(LLAMA3_8B, StepJob(examples=64, mean_length=1500, row_tokens=8 * 4096,
                                       flops_per_token=flops_per_token(LLAMA3_8B, False, False, 1500)))


def test_the_demos_gpu_rows_are_overhead_bound_not_a_flop_bound_35_percent_mfu():
    step = demo_step()
    flop_bound = CATALOGUE["h100"].peak_flops * 0.35 / step.flops_per_token  # what the table printed: 636,430
    assert flop_bound > 600_000
    rows = rows_for(step, train_tokens=24_023)
    for row in rows.values():
        assert row.source == "modelled" and row.note.startswith("overhead-bound: ")
        assert row.mfu < 0.001 and row.tokens_per_second_high < flop_bound / 100
        assert row.tokens_per_second_low <= row.tokens_per_second <= row.tokens_per_second_high
        assert row.hours_low <= row.hours <= row.hours_high and row.dollars_low <= row.dollars <= row.dollars_high
    # An overhead-bound step runs as fast on an H100 as on an H200 (the same peak, the same host-bound overheads).
    assert rows["1x H100"].tokens_per_second == pytest.approx(rows["1x H200"].tokens_per_second)
    table = format_options(list(rows.values()))
    assert "modelled" in table and f"{rows['1x H100'].tokens_per_second:,.0f} [" in table and "35%" not in table


def test_a_plan_for_the_cpu_prices_its_gpu_rows_with_the_gpu_model(tmp_path, config_tree):
    """Through the planner (phase1a/plan/planner.py `_options`): a plan made on this CPU models every GPU row, each
    with its range and source, and report.md's plan section shows them."""
    from flows.report_md import _options
    from helpers import date_records, make_tokenizer, resolved, write_jsonl
    from phase1a.config.schema import Phase1aConfig
    from phase1a.data.tokenizing import TokenizeOptions, tokenize_dataset
    from phase1a.plan.planner import make_plan
    from phase1a.plan.present import format_plan

    data = tokenize_dataset(write_jsonl(tmp_path / "d.jsonl", date_records(40)), make_tokenizer(), 256,
                            TokenizeOptions(), tmp_path / "cache" / "fp")
    config = Phase1aConfig.model_validate(config_tree)
    plan = make_plan(config, resolved(config), data)
    h100 = next(row for row in plan.options if row.label == "1x H100")
    assert h100.source == "modelled" and "overhead-bound" in h100.note and h100.mfu < 0.01
    assert h100.tokens_per_second_low < h100.tokens_per_second < h100.tokens_per_second_high
    assert all(row.source == "modelled" and row.basis for row in plan.options)
    assert "modelled" in format_plan(plan)
    section = "\n".join(_options(plan))
    assert "| 1x H100 | modelled |" in section and "[" in section and "9744733" in section


# ---- rows measured on the reference, and compute-bound ones ------------------------------------------------------

def test_a_measured_reference_keeps_its_rows_and_the_model_scales_the_other_kinds():
    """A speed measured on an H100 (calibration there, or its history): its rows measured with the footing's
    range; an A100's by the model's ratio: the same speed where overhead bounds the step, not peak FLOP/s' 0.32x."""
    step = demo_step()
    specs = [*SINGLE, OptionSpec(label="1x A100", gpus=1, kind="a100-80gb", strategy="single")]
    job = OptionsJob(train_tokens=24_023, flops_per_token=step.flops_per_token, reference="h100",
                     reference_tokens_per_second=900.0, memory_needed_bytes_per_gpu=GIB, weights_and_state_bytes=GIB,
                     global_batch=8, learning_rate=1e-3, gpu=step, reference_source="measured",
                     reference_basis="4 measured steps, ±5%", reference_range=(1 / 1.05, 1 / 0.95))
    rows = {row.label: row for row in option_rows(job, OptionsPolicy(options=specs))}
    h100, a100 = rows["1x H100"], rows["1x A100"]
    assert h100.source == "measured" and h100.tokens_per_second == 900.0 and h100.basis == "4 measured steps, ±5%"
    assert h100.tokens_per_second_low == pytest.approx(900 / 1.05)
    assert a100.source == "modelled" and a100.tokens_per_second == pytest.approx(900.0, rel=0.01)
    assert "by the GPU model (overhead-bound)" in a100.note
    # The same job in token-rich steps of an 8B model is compute-bound: peak FLOP/s sets the ratio again.
    big = llama3_8b_step()
    rows = {row.label: row for row in option_rows(job.model_copy(update={"gpu": big}), OptionsPolicy(options=specs))}
    ratio = rows["1x A100"].tokens_per_second / rows["1x H100"].tokens_per_second
    assert 312 / 989 <= ratio < 1.2 * 312 / 989 and "compute-bound" in rows["1x A100"].note


def test_the_8b_shapes_rows_are_compute_bound_within_the_ceiling():
    step = llama3_8b_step()
    h100 = rows_for(step)["1x H100"]
    assert h100.note.startswith("compute-bound") and 0.25 < h100.mfu <= 0.35
    peak = CATALOGUE["h100"].peak_flops
    assert h100.tokens_per_second_high * step.flops_per_token / peak <= 0.35 + 1e-9  # never above the ceiling
    assert h100.tokens_per_second_low * step.flops_per_token / peak >= 0.1  # half the ceiling, and per-step overhead


# ---- the fit ----------------------------------------------------------------------------------------------------

def measured(config: str, step, seconds: float) -> Measured:
    return Measured(file=f"{config}.json", device="NVIDIA H200", kind="h200", commit="abc1234", date="2026-11-26",
                    model="smollm2", config=config, tokens_per_second=step.useful_tokens / seconds,
                    seconds_per_step=seconds, step=step)


def test_the_fit_takes_the_largest_per_kernel_overhead_all_allow_and_the_rest_per_step():
    one = demo_step()
    four = one.model_copy(update={"micro_batches": 4.0, "loss_chunks": 4.0})
    runs = [measured("a", one, 0.5), measured("b", four, 0.8), measured("c", one, 1.1)]
    overheads = fit(runs)
    k = overheads.per_kernel_seconds
    assert k.value == pytest.approx(0.8 / four.kernels, rel=1e-3) and k.low == k.value == k.high
    assert k.value <= 0.8 / four.kernels  # rounded down: b stays explained by its kernels alone
    s = overheads.per_step_seconds
    assert s.low <= 1e-3 and s.value == pytest.approx(0.5 - one.kernels * k.value, rel=1e-3)
    assert s.high == pytest.approx(1.1 - one.kernels * k.value, rel=1e-3)
    for run in runs:  # each measurement within the range of its own step
        m = modelled_speed(run.step, "h200", 0.35, overheads)
        assert m.low <= run.tokens_per_second <= m.high
    assert overheads.ceiling(0.35).value == 0.35 and overheads.ceiling(0.35).low == pytest.approx(0.175)
    assert step_seconds(one, 989e12, k.value, 0.0, 0.35) == pytest.approx(one.kernels * k.value)
    assert "3 h200 runs of commit abc1234" in overheads.basis()
    with pytest.raises(ValueError, match="no GPU measurement"):
        fit([])


def test_kernels_grow_with_layers_micro_batches_and_checkpointing():
    step = demo_step()
    assert step.micro_batches == 1 and step.loss_chunks == 1 and step.trainable_tensors == 2 * 30 * 7
    twice = step.model_copy(update={"micro_batches": 2.0})
    assert 1.9 < twice.kernels / step.kernels < 2.0
    assert step.model_copy(update={"checkpointing": True}).kernels > 1.3 * step.kernels
    assert step.share(4).useful_tokens == step.useful_tokens / 4 and step.share(4).micro_batches == 1
