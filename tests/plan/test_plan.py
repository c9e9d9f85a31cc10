import numpy as np
import pytest

from helpers import date_records, make_tokenizer, resolved, write_jsonl
from phase1a.config.schema import Phase1aConfig
from phase1a.data.lengths import right_size
from phase1a.data.tokenizing import TokenizeOptions, tokenize_dataset
from phase1a.plan.planner import make_plan
from phase1a.plan.window import WindowError


def planned(config_tree: dict, data):
    config = Phase1aConfig.model_validate(config_tree)
    return make_plan(config, resolved(config), data)


def test_plan_calibrates_on_the_present_cpu_and_fits_the_window(tiny_model_dir, tmp_path, config_tree):
    data = tokenize_dataset(write_jsonl(tmp_path / "d.jsonl", date_records(40)), make_tokenizer(), 256,
                            TokenizeOptions(), tmp_path / "cache" / "fp")
    config_tree["window"] = {"max_duration": "1h", "safety_margin": "30m"}
    plan = planned(config_tree, data)
    assert plan.calibrated and plan.precision == "float32" and plan.notes == []
    assert plan.micro_batch_size * plan.gradient_accumulation == 8
    assert plan.steps == -(-data.train_examples // 8) and plan.train_tokens > 0 and plan.estimated_train_seconds > 0
    assert plan.fits_in_window is True and plan.estimated_cost_usd is None  # no price is known for a CPU

    config_tree["hardware"] = {"target": "h100"}
    config_tree["window"] = {"max_duration": "40m", "safety_margin": "30m"}
    remote = planned(config_tree, data)
    assert not remote.calibrated and remote.precision == "bfloat16" and any("not present" in n for n in remote.notes)
    assert remote.estimated_cost_usd == pytest.approx(2.50 * remote.estimated_total_seconds / 3600)
    assert remote.fits_in_window is True and remote.throughput_source == "modelled"
    assert [row.label for row in remote.options][:2] == ["1x H100", "1x H200"] and remote.options[0].fits
    assert remote.options[0].hours * 3600 == pytest.approx(remote.estimated_total_seconds, rel=1e-6)

    # A run recorded on the target hardware replaces the assumption for the next plan of the same model.
    from phase1a.train.history import RunRecord, append_run, history_path

    config = Phase1aConfig.model_validate(config_tree)

    def ran(tokens_per_second: float) -> None:
        append_run(history_path(config.cache_dir), RunRecord(
            model_fingerprint=resolved(config).fingerprint, model_name="tiny", hardware="h100", device_name="H100",
            precision="bfloat16", micro_batch_size=remote.micro_batch_size,
            gradient_checkpointing=remote.gradient_checkpointing, max_seq_length=64,
            tokens_per_second=tokens_per_second, estimated_train_seconds=1.0, actual_train_seconds=1.1))

    ran(12345.0)
    learned = planned(config_tree, data)
    assert learned.throughput_source == "history" and learned.tokens_per_second == pytest.approx(12345.0)
    ran(1234.0)  # a run slowed tenfold (a shared host): the next plan keeps the faster of the two
    steady = planned(config_tree, data)
    assert steady.tokens_per_second == pytest.approx(12345.0)
    assert any("upper median of the last 2 runs" in note and "that run measured 1234" in note
               for note in steady.notes), steady.notes

    config_tree["window"] = {"max_duration": "30m", "safety_margin": "30m"}
    with pytest.raises(WindowError, match="nothing fits the time window"):
        planned(config_tree, data)

    config_tree["window"] = {}
    config_tree["plan"] |= {"profile": "memory_efficient"}
    lean = planned(config_tree, data)
    assert (lean.micro_batch_size, lean.gradient_checkpointing, lean.gradient_accumulation) == (1, True, 8)
    config_tree["plan"] |= {"profile": "custom", "micro_batch_size": 3, "gradient_checkpointing": False}
    with pytest.raises(ValueError, match="must divide method.batch_size 8"):
        planned(config_tree, data)


def test_two_nodes_of_eight_gpus_are_one_gpus_speed_times_sixteen_at_the_computed_scaling(tmp_path, config_tree):
    """The plan for 2 x 8 H100s takes one H100's (assumed) speed 16 times at the scaling its step's transfers
    leave, prices 16 GPUs, never takes a one-GPU run's history for it, and prints where more nodes stop paying."""
    from phase1a.plan.present import format_plan
    from phase1a.train.history import RunRecord, append_run, history_path

    data = tokenize_dataset(write_jsonl(tmp_path / "d.jsonl", date_records(40)), make_tokenizer(), 256,
                            TokenizeOptions(), tmp_path / "cache" / "fp")
    config_tree["hardware"] = {"target": "h100"}
    one = planned(config_tree, data)
    config = Phase1aConfig.model_validate(config_tree)
    append_run(history_path(config.cache_dir), RunRecord(  # a one-GPU run: not the speed of sixteen
        model_fingerprint=resolved(config).fingerprint, model_name="tiny", hardware="h100", device_name="H100",
        precision="bfloat16", micro_batch_size=one.micro_batch_size, gradient_checkpointing=one.gradient_checkpointing,
        max_seq_length=64, tokens_per_second=5.0, estimated_train_seconds=1.0, actual_train_seconds=1.1))
    config_tree["hardware"] = {"target": "h100", "num_gpus": 8, "num_nodes": 2, "nodes": []}
    sixteen = planned(config_tree, data)
    [note] = [note for note in sixteen.notes if note.startswith("16 GPUs (2 x 8, ddp)")]
    scaling = float(note.rsplit("scaling ", 1)[1].split("%")[0]) / 100
    assert sixteen.throughput_source == "modelled" and 0 < scaling <= 1
    assert sixteen.tokens_per_second == pytest.approx(one.tokens_per_second * 16 * scaling, rel=0.01)
    assert sixteen.estimated_cost_usd == pytest.approx(16 * 2.50 * sixteen.estimated_total_seconds / 3600)
    text = format_plan(sixteen)
    assert "2x8 H100 IB" in text and "more nodes: 8x H100 -> 2x8 H100 IB" in text and "scaling" in text


def test_a_cpu_plans_gpu_rows_price_evaluation_at_the_gpus_speed(tmp_path, config_tree):
    """The options table's H100 row: its training and evaluation tokens at the H100's rate (within 2x: a
    forward token costs a third of a training token), never this CPU's measured evaluation seconds."""
    from phase1a.evaluate.metrics import validation_work
    from phase1a.train.packing import TokenRows

    data = tokenize_dataset(write_jsonl(tmp_path / "d.jsonl", date_records(200)), make_tokenizer(), 256,
                            TokenizeOptions(validation_count=40), tmp_path / "cache" / "fp")
    config_tree["validation"] = {"max_examples": 40, "tolerances": {"loss": 0.05}}
    plan = planned(config_tree, data)
    assert plan.calibrated and plan.target == "cpu"
    h100 = next(row for row in plan.options if row.label == "1x H100")
    rows = TokenRows.load(data.validation_path)
    evaluation = validation_work(rows, np.arange(40), Phase1aConfig.model_validate(config_tree).validation, 1, 1)
    tokens = plan.train_tokens + evaluation.forward_tokens + evaluation.prefill_tokens + evaluation.decode_steps
    at_h100_rate = tokens / h100.tokens_per_second
    on_the_gpu = h100.hours * 3600 - h100.host_seconds
    assert at_h100_rate / 2 <= on_the_gpu <= 2 * at_h100_rate, (on_the_gpu, at_h100_rate)
    assert h100.evaluation_seconds < plan.estimate.evaluation_seconds / 100  # not the CPU's seconds


def test_an_outlier_is_named_and_balanced_truncates_it_where_quality_keeps_it(tiny_model_dir, tmp_path, config_tree,
                                                                              caplog):
    records = date_records(1500)
    records[700]["messages"][2]["content"] = " ".join(["12/31/1999"] * 200)  # one answer 40x the others
    path = write_jsonl(tmp_path / "d.jsonl", records)
    with caplog.at_level("WARNING", logger="phase1a"):
        data = tokenize_dataset(path, make_tokenizer(), 256, TokenizeOptions(), tmp_path / "cache" / "fp")
    assert data.outliers and data.outliers.count == 1 and data.outliers.longest[0][0] == f"{path}:701"
    assert f"{path}:701 ({data.outliers.longest[0][1]} tokens)" in caplog.text
    assert data.max_seq_length == 256  # tokenize sizes for it (length_percentile 100), up to the model's positions
    others = right_size(np.delete(np.load(data.lengths_path), 700), 100.0, 256, None)  # every example is kept
    assert data.outliers.others_length == others < 256

    balanced = planned(config_tree, data)
    assert balanced.max_seq_length == others
    noted = f"balanced: max_seq_length {others} (sized from the examples other than the 1 outlier(s)"
    assert any(note.startswith(noted) and f"{path}:701) instead of 256" in note
               and "1 training example(s) truncated, 0 of them left with no trained token" in note
               for note in balanced.notes), balanced.notes  # its answer starts within the cut

    records[700]["messages"][1]["content"] = " ".join(["1999-12-31"] * 25)  # now the answer starts past the cut
    moved = tokenize_dataset(write_jsonl(tmp_path / "e.jsonl", records), make_tokenizer(), 256, TokenizeOptions(),
                             tmp_path / "cache" / "fq")
    assert any("truncated, 1 of them left with no trained token" in note for note in planned(config_tree, moved).notes)

    config_tree["plan"] |= {"profile": "quality"}
    quality = planned(config_tree, data)
    assert quality.max_seq_length == 256 and not any(note.startswith("balanced:") for note in quality.notes)


def test_the_validate_estimate_leaves_out_a_base_model_an_earlier_run_scored(tiny_model_dir, tmp_path, config_tree):
    """The validate stage reads the base model's metrics from the cache when an earlier run on this device scored
    the same sample: the plan's estimate counts the candidate only then, and keeps the base's share so a report
    can compare a cached plan with the stage as it ran (Estimate.evaluation_for)."""
    import torch

    from phase1a.evaluate.scoring import Scoring, base_model_metrics
    from phase1a.model.loading import load_for_eval

    data = tokenize_dataset(write_jsonl(tmp_path / "d.jsonl", date_records(60)), make_tokenizer(), 256,
                            TokenizeOptions(validation_count=12), tmp_path / "cache" / "fp")
    plan = planned(config_tree, data)
    first = plan.estimate
    assert not first.base_cached and first.base_evaluation_seconds > 0
    assert plan.calibration.validation.base is None  # float32: the candidate is scored merged, at the base's cost

    config = Phase1aConfig.model_validate(config_tree)
    scoring = Scoring.of(config, resolved(config), data.validation_path)
    with torch.no_grad():
        base_model_metrics(load_for_eval(tiny_model_dir, None, torch.device("cpu")), scoring)
    assert scoring.base_cached(torch.device("cpu"))
    second = planned(config_tree, data).estimate
    assert second.base_cached and second.base_evaluation_seconds > 0
    seconds, (low, high) = second.evaluation_for(base_cached=False)  # a stage that scored the base after all
    assert seconds == pytest.approx(second.evaluation_seconds + second.base_evaluation_seconds)
    assert low < seconds < high
    assert second.evaluation_for(base_cached=True)[0] == second.evaluation_seconds


def test_on_a_16_bit_base_the_base_models_share_is_timed_and_priced_with_the_adapters_path_off(
        tiny_model_dir, tmp_path, config_tree, monkeypatch):
    """A bf16 base keeps the adapter separate when the candidate is scored (not merged): the candidate's steps run
    its path, the base's do not. On a GPU, where a greedy step is bound by kernel launches, the base's step took
    22 ms against the candidate's 48 (benchmarks/decode_step.py): calibration times the base as it is scored and
    the plan prices the base's share (its generation runs to max_new_tokens) at that."""
    import torch

    import phase1a.model.build as build
    from phase1a.plan.planner import _Planner

    monkeypatch.setattr(build, "training_dtype", lambda device: torch.bfloat16)  # the GPU's training dtype
    data = tokenize_dataset(write_jsonl(tmp_path / "d.jsonl", date_records(60)), make_tokenizer(), 256,
                            TokenizeOptions(validation_count=12), tmp_path / "cache" / "fp")
    config_tree["plan"] = {"calibration_budget": "60s"}
    plan = planned(config_tree, data)
    speed = plan.calibration.validation
    assert speed.base is not None and speed.base.passes >= 1 and speed.base.base is None
    assert speed.base.decode_seconds_per_step > 0 and speed.base.forward_seconds_per_token > 0
    assert speed.for_base() is speed.base
    config = Phase1aConfig.model_validate(config_tree)
    planner = _Planner(config, resolved(config), data)
    assert plan.estimate.base_evaluation_seconds == pytest.approx(planner._base_work().seconds(speed.base))
    candidate_only = planner._scored_work().seconds(speed)
    assert plan.estimate.evaluation_seconds == pytest.approx(
        candidate_only + plan.estimate.base_evaluation_seconds + 1 * plan.calibration.startup_seconds, rel=1e-6)


def test_a_runs_evaluations_correct_the_next_plans_evaluation_speed(tmp_path, config_tree):
    """The history keeps the evaluation speeds a plan estimated with, the forward pass's scaled by what the run's
    evaluations during training took against their estimate; the next plan of the job, from the history, estimates
    evaluation at those speeds (a whole run's evaluations, steadier than calibration's few timed passes) and says
    so in its range."""
    from phase1a.plan.training import record_run
    from phase1a.train.history import history_path
    from phase1a.train.result import TrainResult

    data = tokenize_dataset(write_jsonl(tmp_path / "d.jsonl", date_records(60)), make_tokenizer(), 256,
                            TokenizeOptions(validation_count=12), tmp_path / "cache" / "fp")
    config_tree["method"] |= {"eval_interval": "2steps"}
    first = planned(config_tree, data)
    timed = first.estimate.evaluation_speed
    assert first.throughput_source == "measured" and timed is not None and first.estimate.evaluations_during_training
    assert "timed pass" in first.estimate.evaluation_footing.words

    # The run's evaluations took twice their estimate, each.
    evaluations = first.estimate.evaluations_during_training
    config = Phase1aConfig.model_validate(config_tree)
    result = TrainResult(output_dir=str(tmp_path / "run"), adapter_dir=str(tmp_path / "run" / "final"),
                         steps=first.steps, resumed_from_step=None, reused_completed_run=False, wall_seconds=30.0,
                         train_tokens=first.train_tokens, tokens_per_second=900.0, final_loss=0.5,
                         checkpoints_written=0, checkpoint_seconds=0.0, startup_seconds=1.0, checkpoint_share=0.0,
                         micro_batch_size=first.micro_batch_size, out_of_memory_backoffs=0, evaluations=evaluations,
                         eval_seconds=2 * first.estimate.eval_during_training_seconds)
    record = record_run(history_path(config.cache_dir), config, resolved(config), first, result)
    assert record.eval_forward_seconds_per_token == pytest.approx(2 * timed.forward_seconds_per_token)
    assert record.eval_decode_seconds_per_step == timed.decode_seconds_per_step  # generation is not corrected
    assert record.eval_decode_seconds_per_context_token == timed.decode_seconds_per_context_token
    assert timed.training_forward_seconds_per_token > 0  # an evaluation during training, timed in its own rows
    assert record.eval_training_forward_seconds_per_token == pytest.approx(2 * timed.training_forward_seconds_per_token)
    assert timed.merge_seconds > 0 and record.eval_merge_seconds == timed.merge_seconds  # fp32 LoRA: merged to score

    second = planned(config_tree, data)
    assert second.throughput_source == "history" and second.calibration is None
    speed = second.estimate.evaluation_speed
    assert speed.forward_seconds_per_token == pytest.approx(2 * timed.forward_seconds_per_token)
    assert speed.training_forward_seconds_per_token == pytest.approx(2 * timed.training_forward_seconds_per_token)
    assert speed.decode_seconds_per_context_token == timed.decode_seconds_per_context_token  # steps by context
    assert speed.merge_seconds == timed.merge_seconds
    assert second.estimate.evaluation_footing.words == "the last run's evaluations, ±15%"
    assert second.estimate.eval_during_training_seconds == pytest.approx(
        2 * first.estimate.eval_during_training_seconds, rel=1e-6)


def test_calibration_times_the_merge_and_the_benchmarks_harness(tmp_path, config_tree):
    """The validate stage's costs beside its passes, measured on the model being planned: the adapter's merge and
    lm-eval's own seconds a benchmark."""
    from helpers.benchmarks import write_date_tasks

    tasks = write_date_tasks(tmp_path / "tasks", date_records(12, seed=7))
    data = tokenize_dataset(write_jsonl(tmp_path / "d.jsonl", date_records(60)), make_tokenizer(), 256,
                            TokenizeOptions(validation_count=12), tmp_path / "cache" / "fp")
    config_tree["validation"] |= {"benchmarks": [{"task": str(tasks["dates_choice"]), "metric": "acc", "limit": 4}]}
    speed = planned(config_tree, data).estimate.evaluation_speed
    assert speed.source == "measured" and speed.merge_seconds > 0 and speed.harness_seconds > 0


def only_history(config: Phase1aConfig, **evaluation) -> None:
    """The job's history as one past run of the tiny model on this CPU, with these evaluation speeds."""
    from phase1a.train.history import RunRecord, append_run, history_path

    path = history_path(config.cache_dir)
    path.unlink(missing_ok=True)
    append_run(path, RunRecord(
        model_fingerprint=resolved(config).fingerprint, model_name="tiny", hardware="cpu", device_name="cpu",
        precision="float32", micro_batch_size=8, gradient_checkpointing=False, max_seq_length=64,
        tokens_per_second=500.0, estimated_train_seconds=10.0, actual_train_seconds=10.0,
        eval_forward_seconds_per_token=1e-3, eval_prefill_seconds_per_token=1e-3, eval_decode_seconds_per_step=1e-2,
        **evaluation))


@pytest.mark.parametrize("baseline", ["base", "promoted"])
def test_the_validate_stage_pays_a_merge_for_each_adapter_it_scores(tmp_path, config_tree, baseline):
    """The candidate's adapter, and a promoted baseline's, is folded into the weights before scoring: two
    histories that differ only in that merge's seconds, the validate stage that much longer for each adapter."""
    data = tokenize_dataset(write_jsonl(tmp_path / "d.jsonl", date_records(60)), make_tokenizer(), 256,
                            TokenizeOptions(validation_count=12), tmp_path / "cache" / "fp")
    config_tree["validation"] = {**config_tree.get("validation", {}), "baseline": baseline}
    config_tree["promotion"] = {"to": str(tmp_path / "promoted")}
    config = Phase1aConfig.model_validate(config_tree)
    estimates = []
    for merge in (None, 2.5):
        only_history(config, eval_merge_seconds=merge)
        estimates.append(planned(config_tree, data).estimate)
    adapters = 1 + (baseline == "promoted")
    assert estimates[1].evaluation_seconds == pytest.approx(estimates[0].evaluation_seconds + 2.5 * adapters)


def test_evaluations_during_training_are_priced_at_their_own_speed_the_validate_stage_at_its(tmp_path, config_tree):
    """An evaluation during training runs the model as it trains (a LoRA adapter's path on, training's rows); the
    validate stage scores the base with the path off and, on fp32 weights, the candidate merged. Two histories
    that differ only in the first: twice its speed's seconds, twice the evaluations during training, the same
    validate stage."""
    data = tokenize_dataset(write_jsonl(tmp_path / "d.jsonl", date_records(60)), make_tokenizer(), 256,
                            TokenizeOptions(validation_count=12), tmp_path / "cache" / "fp")
    config_tree["method"] |= {"eval_interval": "2steps"}
    config = Phase1aConfig.model_validate(config_tree)
    estimates = []
    for during in (1e-3, 2e-3):
        only_history(config, eval_training_forward_seconds_per_token=during)
        plan = planned(config_tree, data)
        assert plan.throughput_source == "history"
        assert plan.estimate.evaluation_speed.training_forward_seconds_per_token == during
        estimates.append(plan.estimate)
    assert estimates[0].evaluations_during_training == estimates[1].evaluations_during_training > 0
    assert estimates[1].eval_during_training_seconds == pytest.approx(2 * estimates[0].eval_during_training_seconds)
    assert estimates[1].evaluation_seconds == pytest.approx(estimates[0].evaluation_seconds)


def test_a_run_in_the_process_that_calibrated_is_priced_without_the_first_calls_a_fresh_process_pays(
        tmp_path, config_tree, monkeypatch):
    """On an H200 the first plan of a process measured 3.0 s to load the model and 3.7 s of first-step costs beyond
    steady steps; a second plan in the same process 0.6 s and 0.17 s, and the train stage after the first plan 0.8 s
    and ~0.25 s (benchmarks/results/gpu-check-h200-2026-11-30). A one-device run trains in the process that
    calibrated, so its estimate leaves out the first calls and the device's set-up; the train range's high end keeps
    the first calls for a fresh process (a plan from the cache), and a restart on a fresh host pays them all.
    torchrun's ranks are fresh processes: their estimate counts them."""
    import phase1a.plan.planner as planner_module
    from phase1a.plan import footing
    from phase1a.plan.planner import _Planner
    from phase1a.plan.result import Calibration, Candidate

    def calibrate(config, model_dir, job):
        return Calibration(chosen=job.start, seconds_per_token=1e-3, warmup_excess_seconds=3.7,
                           first_calls_seconds=3.5, startup_seconds=3.0, device_setup_seconds=2.0,
                           checkpoint_seconds=0.1, peak_memory_gib=None, trials=[], budget_seconds=60.0, seconds=20.0,
                           footing=footing.measured(8, 1.0, 1.0, 0.05, 0.05))

    monkeypatch.setattr(planner_module, "calibrate", calibrate)
    data = tokenize_dataset(write_jsonl(tmp_path / "d.jsonl", date_records(40)), make_tokenizer(), 256,
                            TokenizeOptions(), tmp_path / "cache" / "fp")
    one = planned(config_tree, data).estimate
    assert (one.warmup_seconds, one.startup_seconds, one.first_calls_seconds) == pytest.approx((0.2, 1.0, 3.5))
    config = Phase1aConfig.model_validate(config_tree)
    planner = _Planner(config, resolved(config), data)
    throughput = planner._calibrated(Candidate(micro_batch_size=8, gradient_checkpointing=False), 256, False)
    assert planner.checkpoints(throughput, 256).restart_seconds == pytest.approx(3.0 + 3.7)  # a fresh host's
    config_tree["hardware"] = {"target": "cpu", "num_gpus": 2}  # two ranks under torchrun
    ranks = planned(config_tree, data).estimate
    assert (ranks.warmup_seconds, ranks.startup_seconds, ranks.first_calls_seconds) == pytest.approx((3.7, 3.0, 0.0))
    assert ranks.steady_seconds == pytest.approx(one.steady_seconds)  # a CPU's processes keep one's speed
    assert ranks.train_seconds - one.train_seconds == pytest.approx(3.5)
    assert one.train_range()[1] == pytest.approx(ranks.train_range()[1])  # a fresh process still inside
    assert one.train_range()[0] == pytest.approx(ranks.train_range()[0] - 3.5)
    # The device's set-up: in the ranks' start-up only. The validate stage loads the trained model in the process
    # that calibrated, after the ranks exit: warm whatever the world size.
    assert ranks.evaluation_seconds == pytest.approx(one.evaluation_seconds)
    assert ranks.total_seconds - one.total_seconds == pytest.approx(2.0 + 3.5)
