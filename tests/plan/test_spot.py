"""Spot / preemptible hardware: the catalogue's spot figures, `checkpoint.interval: auto` (Young/Daly), the expected
cost of interruptions in the estimate, the window and the options table, and the report's comparison."""
import math
import re

import pytest

from helpers import date_records, make_tokenizer, resolved, write_jsonl
from phase1a.config.schema import ConfigError, Phase1aConfig, validate_config
from phase1a.core.hardware import CATALOGUE
from phase1a.data.tokenizing import TokenizeOptions, tokenize_dataset
from phase1a.plan.interruptions import (
    Exposure,
    NotExpectedToFinish,
    auto_interval,
    bounded_seconds,
    expected,
    interval_text,
    young_daly_seconds,
)
from phase1a.plan.options import OptionsJob, OptionSpec, OptionsPolicy, OtherWork, SpotJob, format_options, option_rows
from phase1a.plan.planner import make_plan
from phase1a.plan.training import train_settings
from phase1a.plan.window import WindowError
from phase1a.run_report import interruptions_outcome
from phase1a.start.result import StartPoint
from phase1a.store.base import LocalStore
from phase1a.train.history import RunRecord, append_run, history_path
from phase1a.train.result import StoreTraining, TrainResult
from phase1a.train.train_store import Pulled

TOKENS_PER_SECOND = 10.0  # the history's speed: a few hundred seconds of training, so intervals are seconds long


@pytest.fixture
def data(tmp_path):
    return tokenize_dataset(write_jsonl(tmp_path / "d.jsonl", date_records(40)), make_tokenizer(), 256,
                            TokenizeOptions(), tmp_path / "cache" / "fp")


def planned(config_tree: dict, data):
    config = Phase1aConfig.model_validate(config_tree)
    return make_plan(config, resolved(config), data)


def remember(config_tree: dict, write: float, upload: float | None, startup: float = 5.0) -> None:
    """A finished run of the tiny model on this CPU in the history: the plan takes its speed and costs from it."""
    config = Phase1aConfig.model_validate(config_tree)
    append_run(history_path(config.cache_dir), RunRecord(
        model_fingerprint=resolved(config).fingerprint, model_name="tiny", hardware="cpu", device_name="cpu",
        precision="float32", micro_batch_size=8, gradient_checkpointing=False, max_seq_length=64,
        tokens_per_second=TOKENS_PER_SECOND, startup_seconds=startup, checkpoint_seconds_each=write,
        checkpoint_upload_seconds_each=upload, estimated_train_seconds=1.0, actual_train_seconds=1.0))


def spot_tree(config_tree: dict, tmp_path, rate: float, store: bool = True) -> dict:
    config_tree["hardware"] = {"target": "cpu", "spot": True, "interruptions_per_hour": rate}
    config_tree["checkpoint"] = {"interval": "auto", "keep_last": 2}
    if store:
        config_tree["store"] = {"url": str(tmp_path / "store"), "lease_ttl": "20s"}
    return config_tree


# ---- the formulas --------------------------------------------------------------------------------------------

def test_young_daly_against_hand_computed_numbers():
    # delta 30 s, one interruption in 100 h: sqrt(2 * 30 * 360000) - 30 = 4647.58 - 30
    assert young_daly_seconds(30.0, 360_000.0) == pytest.approx(4617.58, abs=0.01)
    assert young_daly_seconds(2.0, 180.0) == pytest.approx(math.sqrt(720) - 2)  # 24.83
    assert young_daly_seconds(100.0, 40.0) == 40.0  # delta >= 2M: checkpoint once per mean time between
    assert auto_interval(0.01, 30.0, 1e9, store=True) == (4618.0, "young-daly")
    assert interval_text(4617.58) == "4618s" and interval_text(0.2) == "1s"


def test_auto_without_an_interruption_rate_is_bounded():
    assert bounded_seconds(4000.0, 1.0) == 1000.0  # the train time in four parts
    assert bounded_seconds(20_000.0, 1.0) == 1800.0  # at most 30 min
    assert bounded_seconds(100.0, 5.0) == 50.0  # at least ten checkpoint costs
    assert auto_interval(0.0, 1.0, 4000.0, store=True) == (1000.0, "bounded")
    # Without a store the local checkpoints go with the host: nothing to trade against, bounded too.
    assert auto_interval(0.5, 1.0, 4000.0, store=False) == (1000.0, "bounded")


def test_expected_interruptions_against_hand_computed_numbers():
    exposure = Exposure(run_seconds=36_000.0, train_seconds=30_000.0, interval_seconds=1_000.0,
                        checkpoint_seconds=20.0, restart_seconds=100.0, store=True)
    assert exposure.lost_each == 520.0 and exposure.cost_each == 620.0  # 1000/2 + 20, + 100
    cost = expected(0.1, exposure)  # r c = 0.1 / 3600 * 620 = 0.017222
    assert cost.interruptions == pytest.approx(1.0 / (1 - 0.1 / 3600 * 620))  # r T = 1, over 1 - r c
    assert cost.extra_seconds == pytest.approx(36_000 * (0.1 / 3600 * 620) / (1 - 0.1 / 3600 * 620))
    assert cost.lost_seconds + cost.restart_seconds == pytest.approx(cost.extra_seconds)
    lost_everything = Exposure(36_000.0, 30_000.0, 1_000.0, 20.0, 100.0, store=False)
    assert lost_everything.lost_each == 15_000.0  # half the training, whatever the interval


# ---- the catalogue and the config ------------------------------------------------------------------------------

def test_every_catalogue_kind_has_a_spot_price_and_rate():
    for kind, gpu in CATALOGUE.items():
        assert 0 < gpu.spot_price_per_hour < gpu.price_per_hour, kind
        assert 0 < gpu.spot_interruptions_per_hour < 0.05, kind
    assert CATALOGUE["h100"].spot_interruptions_per_hour == pytest.approx(-math.log(0.8) / 24)  # 0.0093: 1 in 108 h
    assert CATALOGUE["l4"].spot_interruptions_per_hour == pytest.approx(-math.log(0.95) / 24)


def test_config_takes_auto_and_needs_a_rate_for_spot_without_a_catalogue_figure():
    tree = {"data": {"source": "d.jsonl"}, "checkpoint": {"interval": " Auto "},
            "method": {"early_stopping_patience": 2, "eval_interval": "checkpoint"}}
    assert validate_config(tree).checkpoint.interval == "auto"  # early stopping's check reads auto as an interval
    with pytest.raises(ConfigError, match="hardware: Value error, spot on target 'cpu'.*interruptions_per_hour"):
        validate_config({"data": {"source": "d.jsonl"}, "hardware": {"spot": True}})
    assert validate_config({"data": {"source": "d.jsonl"}, "hardware": {"spot": True, "target": "h100"}})


# ---- the plan --------------------------------------------------------------------------------------------------

def test_spot_with_a_store_measures_write_and_upload_and_checkpoints_at_young_daly(tmp_path, config_tree, data):
    plan = planned(spot_tree(config_tree, tmp_path, rate=2.0), data)
    section, e = plan.interruptions, plan.estimate
    cost = section.checkpoint
    assert plan.calibrated and cost.write_source == "measured" and cost.upload_source == "measured"
    assert cost.write_seconds == plan.calibration.checkpoint_seconds and cost.upload_seconds > 0
    assert cost.bytes == plan.calibration.checkpoint_bytes > 0
    assert LocalStore(tmp_path / "store").list("scratch/") == []  # the timed upload is gone again
    # One interruption in half an hour: tau = sqrt(2 delta 1800) - delta, whole seconds.
    assert section.interval_rule == "young-daly"
    assert plan.checkpoint_interval == section.interval == interval_text(young_daly_seconds(cost.seconds, 1800.0))
    interval = min(float(plan.checkpoint_interval.removesuffix("s")), e.train_seconds)
    assert section.expected.lost_seconds_each == pytest.approx(interval / 2 + cost.seconds)
    calibration = plan.calibration
    restart = calibration.startup_seconds + calibration.warmup_excess_seconds + 20.0 + cost.upload_seconds
    assert section.expected.restart_seconds_each == pytest.approx(restart)  # lease 20 s, start-up, download
    uninterrupted = e.startup_seconds + e.train_seconds + e.evaluation_seconds
    rc = 2.0 / 3600 * (section.expected.lost_seconds_each + restart)
    assert e.interruption_seconds == pytest.approx(uninterrupted * rc / (1 - rc))
    assert e.total_seconds == pytest.approx(uninterrupted + e.interruption_seconds)
    assert not any(note.startswith("WARNING") for note in plan.notes)


def test_a_store_that_fails_the_timed_upload_leaves_an_assumed_one(tmp_path, config_tree, data, caplog):
    tree = spot_tree(config_tree, tmp_path, rate=2.0)
    (tmp_path / "store").write_text("a file where the store's directory should be")
    with caplog.at_level("WARNING", logger="phase1a"):
        plan = planned(tree, data)
    cost = plan.interruptions.checkpoint
    assert plan.calibrated and cost.write_source == "measured" and cost.upload_source == "assumed"
    assert cost.upload_seconds == pytest.approx(cost.bytes / 100e6)
    assert "the checkpoint upload to" in caplog.text and "was not timed" in caplog.text
    assert any(note.startswith("checkpoint upload assumed at 100 MB/s") for note in plan.notes)


def test_the_training_key_holds_auto_not_the_interval_it_chose(tmp_path, config_tree, data):
    """Two hosts measure checkpoints a few seconds apart and choose different intervals; with early stopping at
    each checkpoint the interval enters the training key, and a resume must still find the same directory."""
    tree = spot_tree(config_tree, tmp_path, rate=2.0)
    tree["method"] |= {"eval_interval": "checkpoint", "early_stopping_patience": 2}
    config = Phase1aConfig.model_validate(tree)
    start = StartPoint(init_from="base", kind="base", base_model=config.model.name_or_path)
    settings = []
    for write in (1.0, 4.0):
        remember(tree, write=write, upload=1.0)
        plan = planned(tree, data)
        assert plan.throughput_source == "history" and plan.interruptions.checkpoint.write_seconds == write
        settings.append(train_settings(config, plan, data, resolved(config), start))
    fast, slow = settings
    assert fast.checkpoint_interval == interval_text(young_daly_seconds(2.0, 1800.0)) == "83s"
    assert slow.checkpoint_interval == interval_text(young_daly_seconds(5.0, 1800.0)) == "129s"
    assert fast.output_dir == slow.output_dir


def test_the_plan_prices_spot_and_its_options_table_agrees(tmp_path, config_tree, data):
    config_tree["hardware"] = {"target": "h100", "spot": True}
    config_tree["store"] = str(tmp_path / "store")
    plan = planned(config_tree, data)  # not present: assumed throughput and an assumed upload, both flagged
    section = plan.interruptions
    assert section.rate_per_hour == CATALOGUE["h100"].spot_interruptions_per_hour
    assert section.interval_rule == "configured" and plan.checkpoint_interval == "3steps"
    assert section.checkpoint.upload_source == "assumed"
    assert any(note.startswith("checkpoint upload assumed at 100 MB/s") for note in plan.notes)
    assert plan.estimated_cost_usd == pytest.approx(0.81 * plan.estimated_total_seconds / 3600)
    h100 = plan.options[0]
    assert h100.hours * 3600 == pytest.approx(plan.estimated_total_seconds - plan.estimate.interruption_seconds)
    assert h100.spot_hours * 3600 == pytest.approx(plan.estimated_total_seconds, rel=1e-6)
    assert h100.spot_dollars == pytest.approx(0.81 * h100.spot_hours)


def test_a_window_that_fits_on_demand_but_not_spots_interruptions_fails_before_training(tmp_path, config_tree, data):
    config_tree["plan"] |= {"profile": "quality"}  # nothing to cut: one epoch, never truncated
    remember(config_tree, write=1.0, upload=1.0)
    on_demand = planned(config_tree, data)
    spot = planned(spot_tree(config_tree, tmp_path, rate=20.0), data)
    extra = spot.estimate.interruption_seconds
    assert on_demand.estimate.interruption_seconds == 0 and extra > 0.2 * on_demand.estimated_total_seconds
    window = math.ceil(on_demand.estimated_total_seconds + extra / 2)
    config_tree["window"] = {"max_duration": f"{window}s", "safety_margin": "0s"}
    with pytest.raises(WindowError, match=r"h of it the lost work and restarts expected from interruptions"):
        planned(config_tree, data)
    config_tree["hardware"] = {"target": "cpu"}
    assert planned(config_tree, data).fits_in_window is True  # the same window, on demand

    # Where epochs may be cut, the spot run is cut until its expected interruptions fit too: a promise kept.
    config_tree = spot_tree(config_tree, tmp_path, rate=20.0)
    config_tree["plan"]["min_epochs"] = 0.25
    cut = planned(config_tree, data)
    assert cut.fits_in_window and [a.step for a in cut.adjustments] == ["epochs"] and 0.25 <= cut.epochs < 1
    assert cut.estimated_total_seconds <= window


def test_spot_without_a_store_is_warned_and_each_interruption_loses_half_the_training(tmp_path, config_tree, data,
                                                                                      caplog):
    remember(config_tree, write=1.0, upload=1.0)
    with caplog.at_level("WARNING", logger="phase1a"):
        plan = planned(spot_tree(config_tree, tmp_path, rate=2.0, store=False), data)
    warning = "WARNING: hardware.spot without a store"
    assert any(note.startswith(warning) for note in plan.notes) and "hardware.spot without a store" in caplog.text
    section, e = plan.interruptions, plan.estimate
    assert not section.store and section.checkpoint.upload_source == "no store"
    assert section.checkpoint.upload_seconds == 0 and section.interval_rule == "bounded"
    assert plan.checkpoint_interval == interval_text(bounded_seconds(plan.train_tokens / TOKENS_PER_SECOND, 1.0))
    assert section.expected.lost_seconds_each == pytest.approx(e.train_seconds / 2)
    assert section.expected.restart_seconds_each == pytest.approx(e.startup_seconds + e.warmup_seconds)


def test_interruptions_faster_than_a_restart_fail_the_plan(tmp_path, config_tree, data):
    remember(config_tree, write=1.0, upload=1.0)
    with pytest.raises(NotExpectedToFinish, match="at 200 interruptions an hour, each costing"):
        planned(spot_tree(config_tree, tmp_path, rate=200.0), data)  # one every 18 s; a restart takes 25


def test_auto_on_demand_takes_the_bounded_interval_and_costs_nothing(tmp_path, config_tree, data):
    remember(config_tree, write=1.0, upload=None)
    config_tree["checkpoint"] = {"interval": "auto"}
    plan = planned(config_tree, data)
    assert plan.interruptions.rate_per_hour == 0 and plan.interruptions.interval_rule == "bounded"
    assert plan.checkpoint_interval == interval_text(bounded_seconds(plan.train_tokens / TOKENS_PER_SECOND, 1.0))
    steps_seconds = plan.train_tokens / TOKENS_PER_SECOND
    assert plan.estimate.checkpoints == math.ceil(steps_seconds / float(plan.checkpoint_interval[:-1])) - 1
    assert plan.estimate.interruption_seconds == 0 and plan.interruptions.expected.interruptions == 0


# ---- the options table -----------------------------------------------------------------------------------------

def test_the_options_spot_columns_equal_the_formula():
    job = OptionsJob(train_tokens=36_000_000, flops_per_token=6e9, reference="h100",
                     reference_tokens_per_second=10_000.0, memory_needed_bytes_per_gpu=1e9,
                     weights_and_state_bytes=5e8, global_batch=16, learning_rate=1e-4,
                     other=OtherWork(host_seconds=600.0),
                     spot=SpotJob(checkpoint_seconds=20.0, restart_seconds=100.0, startup_seconds=300.0))
    specs = [OptionSpec(label="1x H100", gpus=1, kind="h100", strategy="single"),
             OptionSpec(label="4x H200 DDP", gpus=4, kind="h200", strategy="ddp")]
    for row in option_rows(job, OptionsPolicy(options=specs)):
        rate, price = CATALOGUE[row.kind].spot_interruptions_per_hour, CATALOGUE[row.kind].spot_price_per_hour
        run = row.hours * 3600
        tau = round(math.sqrt(2 * 20.0 * 3600 / rate) - 20.0)  # Young/Daly at the kind's rate
        rc = rate / 3600 * (min(tau, run - 300) / 2 + 20.0 + 100.0)
        assert row.spot_hours == pytest.approx(row.hours / (1 - rc)), row.label
        assert row.spot_dollars == pytest.approx(row.gpus * price * row.spot_hours), row.label
        assert row.spot_interruptions == pytest.approx(rate * row.hours / (1 - rc)), row.label
    header = format_options(option_rows(job, OptionsPolicy(options=specs))).splitlines()[0]
    assert re.search(r"hours +USD +spot h +spot USD", header), header  # on demand and spot side by side
    # A rate the run cannot outpace: no spot figure, and the note says why.
    (row,) = option_rows(job, OptionsPolicy(options=specs[:1], interruption_rates={"h100": 60.0}))
    assert row.spot_hours is None and "spot: not expected to finish" in row.note


# ---- the report ------------------------------------------------------------------------------------------------

def test_the_report_sets_the_plans_expectation_beside_this_attempt(tmp_path, config_tree, data):
    from flows.report_md import render_report
    from phase1a.run_report import RunReport, StageRecord

    remember(config_tree, write=1.0, upload=1.0)
    plan = planned(spot_tree(config_tree, tmp_path, rate=2.0), data)
    trained = TrainResult(
        adapter_dir="a", output_dir=str(tmp_path / "t"), steps=200, resumed_from_step=120,
        reused_completed_run=False, wall_seconds=80.0, train_tokens=1000, tokens_per_second=12.5, final_loss=0.1,
        checkpoints_written=3, checkpoint_seconds=1.0,
        store=StoreTraining(location="s", pulled=Pulled(what="checkpoint", step=120),
                            taken_over_from={"holder": {}, "step": 130}, lost_steps=10,
                            taken_over_silent_seconds=64.0))
    outcome = interruptions_outcome(plan, trained)
    assert outcome.resumed_after_interruption and outcome.taken_over_from_step == 130 and outcome.lost_steps == 10
    assert outcome.lost_seconds == pytest.approx(10 * 80.0 / 80)  # this attempt ran 80 steps in 80 s
    assert outcome.expected_interruptions == plan.interruptions.expected.interruptions
    report = RunReport(started_at="2026-01-01T00:00:00+00:00", run_dir=str(tmp_path), config={"name": "tiny"},
                       status="passed", interruptions_vs_actual=outcome,
                       stages={"plan": StageRecord(state="Completed", seconds=1.0,
                                                   result=plan.model_dump(mode="json"))})
    text = render_report(report, tmp_path, [])
    assert f"| checkpoint interval | {plan.checkpoint_interval} (young-daly)" in text
    assert "| this attempt | resumed from step 120 in the store, after an interruption |" in text
    assert outcome.taken_over_silent_seconds == 64.0
    # A lower bound: the store knows the gone host's step at its last renewal, not what it trained after it.
    assert ("| host taken over | had reached step 130 at its last renewal, 64.0 s before this host took it over "
            "(steps after it unknown to the store): at least 10 steps lost (~10.0 s at this attempt's speed) |") in text
