"""The calibration sweep: real steps on this CPU, one knob at a time, the global batch fixed, within a budget."""
import re
import time

import numpy as np
import pytest

from helpers import FACTS_8B, date_records, make_tokenizer, write_jsonl
from phase1a.config.schema import Phase1aConfig
from phase1a.core.hardware import training_device
from phase1a.core.meter import stage_meter
from phase1a.core.units import GIB
from phase1a.data.tokenizing import TokenizeOptions, tokenize_dataset
from phase1a.model.cost_model import MemoryModel, TrainingShape
from phase1a.plan.calibration import _MIN_GAIN, CalibrationJob, _Session, calibrate, memory_alternatives, pooled
from phase1a.plan.footing import floor
from phase1a.plan.result import Candidate, Trial


@pytest.fixture(scope="module")
def train_path(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("calibration")
    data = write_jsonl(root / "d.jsonl", date_records(64))
    return tokenize_dataset(data, make_tokenizer(), 256, TokenizeOptions(), root / "cache" / "fp").train_path


def config(tmp_path, tiny_model_dir, **plan) -> Phase1aConfig:
    return Phase1aConfig.model_validate({
        "work_dir": str(tmp_path), "data": {"source": "unused"}, "model": {"name_or_path": str(tiny_model_dir)},
        "method": {"batch_size": 8, "lora": {"r": 4, "alpha": 8}}, "plan": {"calibration_steps": 3, **plan},
    })


def test_the_sweep_measures_each_knob_and_keeps_the_fastest(tmp_path, tiny_model_dir, train_path):
    settings = config(tmp_path, tiny_model_dir, sweep=["micro_batch", "gradient_checkpointing", "dataloader_workers"],
                      calibration_share=1.0)

    def alternatives(best: Candidate, knob: str) -> list[Candidate]:
        return {"micro_batch": [best.model_copy(update={"micro_batch_size": 4})],
                "gradient_checkpointing": [best.model_copy(update={"gradient_checkpointing": True})],
                "dataloader_workers": [best.model_copy(update={"dataloader_workers": 1})]}[knob]

    start = Candidate(micro_batch_size=8, gradient_checkpointing=False)
    job = CalibrationJob(train_path, 256, start, train_tokens=10**9, work_dir=tmp_path / "run",
                         alternatives=alternatives)
    result = calibrate(settings, tiny_model_dir, job)
    *sweep, confirmation = result.trials
    measured = [t for t in sweep if t.status == "measured"]
    assert sweep[0].candidate == start and len(measured) >= 2, [(t.status, t.note) for t in result.trials]
    assert all(8 % t.candidate.micro_batch_size == 0 for t in result.trials)  # the global batch never changes
    chosen = next(t for t in measured if t.candidate == result.chosen)
    assert chosen.tokens_per_second * (1 + _MIN_GAIN) ** len(measured) >= max(t.tokens_per_second for t in measured)
    # The winner is measured again, and both of its measurements set the estimate (pooled, or the faster where a
    # loaded host set them further apart than the floor: `pooled`'s own tests).
    assert confirmation.candidate == result.chosen and "again" in confirmation.note
    both = pooled(chosen, confirmation, floor(training_device().type))
    assert result.seconds_per_token == pytest.approx(1.0 / both.tokens_per_second)
    assert result.footing.words.startswith(f"{both.measured_steps} measured steps")
    assert result.startup_seconds > 0 and result.checkpoint_seconds > 0 and result.warmup_excess_seconds >= 0
    assert not list((tmp_path / "run").iterdir())  # the timed checkpoint is cleaned up
    # The process's first calls: the first trial's first-step costs beyond the winner's in a later trial of this
    # process (its own, or its measurement again): what a run in this process does not pay. A CPU sets up nothing.
    later = next(t for t in result.trials[1:] if t.status == "measured" and t.candidate == result.chosen)
    assert result.first_calls_seconds == pytest.approx(
        max(0.0, result.warmup_excess_seconds - later.warmup_excess_seconds))
    assert result.device_setup_seconds == 0.0


def test_a_spent_share_skips_the_remaining_candidates(tmp_path, tiny_model_dir, train_path):
    """plan.calibration_share bounds the search beyond the first candidate; the budget stays the configured one."""
    settings = config(tmp_path, tiny_model_dir, calibration_share=0.0)
    start = Candidate(micro_batch_size=4, gradient_checkpointing=False)
    job = CalibrationJob(train_path, 256, start, train_tokens=1000, work_dir=tmp_path,
                         alternatives=lambda best, knob: [best.model_copy(update={"compile": True})]
                         if knob == "compile" else [])
    result = calibrate(settings, tiny_model_dir, job)
    assert result.chosen == start and result.budget_seconds == 600
    assert [(t.candidate.compile, t.status) for t in result.trials] == [(False, "measured"), (True, "skipped")]
    assert result.first_calls_seconds == result.warmup_excess_seconds  # measured once: a warm run pays none of it
    assert "plan.calibration_share 0 of the estimated" in result.trials[1].note  # the limit that ended the sweep


def measured(tokens_per_second: float, seconds: float, spread: float = 0.02) -> Trial:
    """One candidate's measurement of 4 whole steps."""
    return Trial(candidate=Candidate(micro_batch_size=8, gradient_checkpointing=False), status="measured",
                 tokens_per_second=tokens_per_second, measured_steps=4, micro_batches=2.0, step_micro_batches=2.0,
                 spread=spread, seconds=seconds)


def test_pooled_measurements_average_time_over_steps_and_widen_by_their_difference():
    first, again = measured(100.0, 12.0), measured(90.0, 10.0, spread=0.01)
    both = pooled(first, again, least=0.15)
    assert both.tokens_per_second == pytest.approx(1 / ((1 / 100 + 1 / 90) / 2))  # seconds per token averaged
    assert both.measured_steps == 8 and both.seconds == 22.0
    assert both.spread == pytest.approx((1 / 90 - 1 / 100) / 2 / ((1 / 100 + 1 / 90) / 2))  # the host's move
    assert "measured twice: 100 and 90 tokens/s, pooled" in both.note


def test_measurements_further_apart_than_the_floor_keep_the_faster_and_its_range_reaches_the_slower():
    first, slow_spell = measured(208.0, 20.0), measured(136.0, 23.0)
    for one, other in ((first, slow_spell), (slow_spell, first)):
        kept = pooled(one, other, least=0.15)
        assert kept.tokens_per_second == 208.0 and kept.measured_steps == 4
        assert kept.spread == pytest.approx(208 / 136 - 1)  # the range's top is the slower one's time
        assert kept.footing().high == pytest.approx(208 / 136)
        assert "the faster stands" in kept.note


def test_the_confirmation_starts_within_the_share_and_ends_within_the_budget(tmp_path, tiny_model_dir, train_path):
    """Two candidates measured: the winner is measured again while the share lasts, even where the confirmation
    will end past it (it measures the choice, it tries nothing new), and not once the share is spent."""
    settings = config(tmp_path, tiny_model_dir, calibration_share=0.0)
    start = Candidate(micro_batch_size=8, gradient_checkpointing=False)
    job = CalibrationJob(train_path, 256, start, train_tokens=10**9, work_dir=tmp_path / "run",
                         alternatives=lambda best, knob: [best.model_copy(update={"micro_batch_size": 4})]
                         if knob == "micro_batch" else [])
    with stage_meter("calibration", 3, "trials") as meter:
        session = _Session(settings, tiny_model_dir, job, meter)
        first = session.run(start, *session.first_deadlines())
        deadline = session.sweep_deadline(first)
        other = session.run(start.model_copy(update={"micro_batch_size": 4}), session.budget_deadline)
        assert other.status == "measured" and time.perf_counter() >= deadline  # the share is spent
        assert session.confirm(first, deadline) is first  # a share that ended before the sweep did: none starts
        expected = first.seconds - (first.warmup_excess_seconds or 0.0)
        budget_end, tried = session.budget_deadline, len(session.trials)
        session.budget_deadline = time.perf_counter() + expected / 2  # a budget it would overrun: none starts
        assert session.confirm(first, time.perf_counter() + expected) is first and len(session.trials) == tried
        session.budget_deadline = budget_end
        # A share with half a confirmation left (the time it takes varies with the host; the rule reads only
        # where it starts): it starts.
        measurement = session.confirm(first, time.perf_counter() + expected / 2)
    assert len(session.trials) == tried + 1
    assert session.trials[-1].candidate == start and "again" in session.trials[-1].note
    assert measurement == pooled(first, session.trials[-1], floor(training_device().type))


def test_alternatives_offer_only_what_the_memory_model_admits():
    memory = MemoryModel(FACTS_8B, TrainingShape(weight_bytes=2), trainable=20_000_000, available=50 * GIB)
    propose = memory_alternatives(memory, 16, 2048)
    start = Candidate(micro_batch_size=2, gradient_checkpointing=False)
    smaller = propose(start, "micro_batch")
    assert [c.micro_batch_size for c in smaller] == [1]
    toggled = propose(start, "gradient_checkpointing")
    assert len(toggled) == 1 and toggled[0].gradient_checkpointing
    # Checkpointing frees activations, so a larger micro-batch fits: the toggle takes the largest one.
    assert toggled[0].micro_batch_size > 2
    for candidate in smaller + toggled:
        estimate = memory.micro_batch(candidate.micro_batch_size, 2048, candidate.gradient_checkpointing)
        assert estimate.total_gib <= 50
    assert propose(start, "dataloader_workers")[0].dataloader_workers >= 1
    assert propose(start, "compile")[0].compile


def test_a_trial_stops_at_the_budget_and_measures_what_it_ran(tmp_path, tiny_model_dir, train_path):
    """A deadline already behind it: the trial runs its one unavoidable step and takes its speed from it."""
    import time

    from phase1a.config.schema import MethodConfig
    from phase1a.model.build import build_model, make_optimizer
    from phase1a.plan.calibration import _Steps, _trial
    from phase1a.train.packing import RowBudget, StepBatches, TokenRows, example_stream, token_budget

    method = MethodConfig(batch_size=8, lora={"r": 4, "alpha": 8})
    model = build_model(tiny_model_dir, method, gradient_checkpointing=False)
    order, _ = example_stream(len(TokenRows.load(train_path)), 1.0, seed=0)
    batches = StepBatches(train_path, 256, order, 8, RowBudget(token_budget(4, 256)))
    candidate = Candidate(micro_batch_size=4, gradient_checkpointing=False)
    steps = _Steps(3, deadline=time.perf_counter(), step_tokens=8 * 60)
    trial = _trial(model, make_optimizer(model, method), batches, candidate, steps)
    assert trial.status == "measured" and trial.tokens_per_second > 0, trial.note
    assert trial.note == "cut at the budget after 0 of 3 measured steps; speed from warm-up steps"
    assert trial.warmup_excess_seconds == pytest.approx(0.0, abs=1e-9)
    assert trial.measured_steps == 0 and not trial.footing().firm and trial.footing().high == 1.0


def test_the_first_trial_measures_one_step_by_its_later_deadline_where_its_own_left_none(tmp_path, tiny_model_dir,
                                                                                         train_path):
    """The first trial's deadline already behind it, its first measured step's still ahead: the warm-up step and
    one measured step run (a speed from warm-up steps alone is an upper bound), and no more."""
    import time

    from phase1a.config.schema import MethodConfig
    from phase1a.model.build import build_model, make_optimizer
    from phase1a.plan.calibration import _Steps, _trial
    from phase1a.train.packing import RowBudget, StepBatches, TokenRows, example_stream, token_budget

    method = MethodConfig(batch_size=8, lora={"r": 4, "alpha": 8})
    model = build_model(tiny_model_dir, method, gradient_checkpointing=False)
    order, _ = example_stream(len(TokenRows.load(train_path)), 1.0, seed=0)
    batches = StepBatches(train_path, 256, order, 8, RowBudget(token_budget(4, 256)))
    candidate = Candidate(micro_batch_size=4, gradient_checkpointing=False)
    now = time.perf_counter()
    steps = _Steps(3, deadline=now, step_tokens=8 * 60, first_measured_deadline=now + 600)
    trial = _trial(model, make_optimizer(model, method), batches, candidate, steps)
    assert trial.status == "measured" and trial.measured_steps == 1, trial.note
    assert trial.note.startswith("cut at the budget after 1 of 3 measured steps")
    assert "warm-up" not in trial.note


def test_no_trial_starts_or_runs_past_the_budget(tmp_path, tiny_model_dir, train_path, capsys, caplog):
    """A one-second budget: the sweep ends within it, give or take the one step that crosses it, and prints a
    line per trial; its progress says which trial of how many runs, and what it tries."""
    caplog.set_level("INFO", logger="phase1a")
    settings = config(tmp_path, tiny_model_dir, calibration_budget="1s", calibration_share=1.0)
    start = Candidate(micro_batch_size=8, gradient_checkpointing=False)
    job = CalibrationJob(train_path, 256, start, train_tokens=10**9, work_dir=tmp_path / "run",
                         alternatives=lambda best, knob: [best.model_copy(update={"micro_batch_size": 4})])
    result = calibrate(settings, tiny_model_dir, job)
    assert {t.status for t in result.trials} <= {"measured", "skipped"}
    one_step = max(t.longest_step_seconds for t in result.trials)
    # A start-up past the budget leaves the first trial its one step; 0.2 s: what follows the last step (the notes).
    assert result.seconds <= max(1.0, result.first_step_at_seconds) + one_step + 0.2
    assert re.search(r"calibration trial 1 \(\d+ s of the 1 s budget\): micro 8, checkpointing off",
                     capsys.readouterr().out)
    assert re.search(r"calibration: trial 1 of \d+: micro 8, checkpointing off, compile off, workers 0 \(until \d+ s "
                     r"of the 1 s budget\)", caplog.text)
    assert re.search(rf"calibration: {len(result.trials)} trials in ", caplog.text)
    assert all(t.note.startswith("not tried: ") and t.note.endswith(
        "plan.calibration_budget 1 s, less the checkpoint and validation timings; a larger plan.calibration_budget "
        "lets it run") for t in result.trials if t.status == "skipped")


def test_a_budget_spent_before_the_first_step_runs_that_step_alone_and_says_so(tmp_path, tiny_model_dir,
                                                                                train_path):
    """No budget at all: loading the model spends it, one step still runs (a plan needs a speed), nothing else is
    tried or timed, and the plan's notes say why the calibration ran past its budget."""
    settings = config(tmp_path, tiny_model_dir, calibration_budget="0s", calibration_share=1.0)
    start = Candidate(micro_batch_size=8, gradient_checkpointing=False)
    job = CalibrationJob(train_path, 256, start, train_tokens=10**9, work_dir=tmp_path / "run",
                         alternatives=lambda best, knob: [best.model_copy(update={"micro_batch_size": 4})])
    result = calibrate(settings, tiny_model_dir, job)
    assert [t.status for t in result.trials] == ["measured", "skipped"] and result.trials[0].measured_steps == 0
    assert result.first_step_at_seconds >= result.startup_seconds > 0
    assert result.seconds <= result.first_step_at_seconds + result.trials[0].longest_step_seconds + 0.2
    assert result.checkpoint_seconds is None
    assert any(note.startswith("the budget was spent before the first step (") and note.endswith(
        "one step ran past it, the least that measures a speed") for note in result.notes), result.notes


def test_a_candidate_the_share_of_training_time_leaves_out_names_that_share(tmp_path, tiny_model_dir, train_path):
    """Where `plan.calibration_share` of the estimated training time, not the budget, ends the sweep, the skipped
    candidate's note names it, with its seconds, and the setting that would let the candidate run."""
    settings = config(tmp_path, tiny_model_dir, calibration_budget="600s", calibration_share=0.0)
    start = Candidate(micro_batch_size=8, gradient_checkpointing=False)
    job = CalibrationJob(train_path, 256, start, train_tokens=10**6, work_dir=tmp_path / "run",
                         alternatives=lambda best, knob: [best.model_copy(update={"micro_batch_size": 4})])
    skipped = [t for t in calibrate(settings, tiny_model_dir, job).trials if t.status == "skipped"]
    named = (r"not tried: a trial takes ~\d+ s and 0 s were left of the sweep's limit, plan.calibration_share 0 of "
             r"the estimated \d+ s of training \(0 s\); a larger plan.calibration_share lets it run")
    assert skipped and all(re.fullmatch(named, t.note) for t in skipped), [t.note for t in skipped]


def test_a_full_row_is_predicted_from_the_probes_fixed_and_per_token_costs():
    """A probe's row holds one or two examples; much of such a step is the row's fixed cost (a call through every
    layer). Priced per token, a full row of the run is predicted several times too slow, and a trial under a short
    budget stopped before its first measured step. The probes after the first call give the fixed cost and the
    cost per token; once a real step has run, its own rate predicts the next."""
    from phase1a.plan.calibration import _RowCost, _Timed

    def probe(row_tokens: int, seconds: float) -> _Timed:
        return _Timed(forward_backward=seconds, update=0.1, tokens=row_tokens, row_tokens=row_tokens,
                      micro_batches=1, whole=1, role="probe")

    first_call, one, two = probe(180, 9.0), probe(180, 1.5), probe(360, 2.0)
    cost = _RowCost.of([first_call, one, two])
    assert cost.fixed == pytest.approx(1.0) and cost.per_row_token == pytest.approx(0.5 / 180)
    assert float(cost.rows(np.array([1170]))[0]) == pytest.approx(1.0 + 1170 * 0.5 / 180)  # 4.25 s, not 9.75 s
    assert _RowCost.of([first_call, one]).per_row_token == pytest.approx(1.5 / 180)  # one size: its own rate
    noisy = _RowCost.of([first_call, one, probe(360, 1.4)])  # the larger row timed faster: the dearer rate
    assert noisy.fixed == 0.0 and noisy.per_row_token == pytest.approx(1.5 / 180)
    real = _Timed(forward_backward=4.0, update=0.1, tokens=1000, row_tokens=1170, micro_batches=1, whole=1)
    assert _RowCost.of([first_call, one, two, real]) == _RowCost(0.0, 4.0 / 1170, 0.1)


def test_a_launch_bound_step_is_priced_per_step_at_the_runs_mean_tokens_not_the_trials_mix():
    """On an H200 the eager step took 0.23 s whatever its tokens: four measured steps priced per token gave the
    speed at their own mix (above the run's mean: 7-14 % fast). With the probes' one-example rows beside them the
    fixed part of a row and the part per token are told apart, and the run's step is priced at its mean tokens."""
    from phase1a.plan.calibration import _measured, _RowCost, _Steps, _Timed

    def step(seconds: float, tokens: int, role: str = "measured") -> _Timed:
        return _Timed(forward_backward=seconds, update=0.0, tokens=tokens, row_tokens=tokens, micro_batches=1,
                      whole=1, role=role)

    candidate = Candidate(micro_batch_size=16, gradient_checkpointing=False)
    probes = [step(2.0, 150, "probe"), step(0.2, 150, "probe"), step(0.2, 300, "probe")]  # a first call, then two
    launch_bound = [*probes, step(0.5, 2300, "warmup"), *(step(0.2, n) for n in (2400, 2300, 2200, 2500))]
    trial = _measured(candidate, launch_bound, _Steps(measured=4, deadline=0.0, step_tokens=2000), seconds=4.0)
    assert trial.tokens_per_second == pytest.approx(2000 / 0.2)  # the run's 2,000-token steps at 0.2 s, not 11,750
    assert trial.spread == pytest.approx(0.0, abs=1e-9)  # the tokens explain the per-token rates' spread
    assert trial.warmup_excess_seconds == pytest.approx(1.8 + 0.3)  # the first call's and the first step's

    per_token = [*probes[:1], step(0.015, 150, "probe"), step(0.03, 300, "probe"), step(0.5, 2300, "warmup"),
                 *(step(n / 10_000, n) for n in (2400, 2300, 2200, 2500))]  # a CPU: the time follows the tokens
    cpu = _measured(candidate, per_token, _Steps(measured=4, deadline=0.0, step_tokens=2000), seconds=4.0)
    assert cpu.tokens_per_second == pytest.approx(10_000)
    fitted = _RowCost.fitted(per_token[1:3] + per_token[4:], update=0.0)
    assert fitted.fixed == pytest.approx(0.0, abs=1e-12) and fitted.per_row_token == pytest.approx(1e-4)
    # Steps of one shape cannot tell the parts apart: their speed is the ratio of sums, as without probes.
    assert _RowCost.fitted(launch_bound[4:], update=0.0) is None


def test_static_probes_build_every_row_length_even_when_the_first_example_is_longer_than_some(tmp_path):
    """Static rows (a GPU, a compiled model): the probes build every row length before a step is timed. The probes'
    example is the run's, and where it is longer than a length the run's shortest example takes its place: the
    trial used to fail there ("358 tokens cannot be padded to 320"), and the candidate with it."""
    import pyarrow as pa
    from pyarrow import feather

    from phase1a.plan.calibration import _probes
    from phase1a.train.packing import RowBudget, StepBatches

    lengths = [150, *np.random.default_rng(0).integers(3, 61, 99)]
    ids = [list(range(5, 5 + int(n))) for n in lengths]
    path = tmp_path / "train.arrow"
    feather.write_feather(pa.table({"input_ids": ids, "labels": ids}), path, compression="uncompressed")
    batches = StepBatches(path, None, np.arange(100), 2, RowBudget(512, static=True))
    shape = batches.shape
    assert shape.buckets[0] < 150  # the first example cannot be padded to the shortest length
    rows = [probe.micro_batches[0] for probe in _probes(batches, 0)]
    assert [row.length for row in rows] == [shape.buckets[0], *shape.buckets]  # the first twice: a first call
    assert [row.tokens for row in rows][-1] == 150 and rows[0].tokens == min(lengths)


def test_every_measured_step_counts_in_the_speed_as_in_the_runs_but_a_burst():
    """The run's speed is its tokens over its seconds, slow steps included: so is a trial's. Leaving the slowest
    of four out made the estimate fast (by 1.6 % on the demo's even steps, resampled from a run's step times). A
    burst (a step 1.5x the median's time a token or more: the host busy for a moment) is left out, and named."""
    from phase1a.plan.calibration import _measured, _Steps, _Timed

    def step(seconds: float, tokens: int, role: str = "measured") -> _Timed:
        return _Timed(forward_backward=seconds, update=0.0, tokens=tokens, row_tokens=tokens, micro_batches=1,
                      whole=1, role=role)

    timed = [step(9.0, 400, "warmup"), step(1.0, 400), step(1.1, 420), step(0.9, 380), step(1.3, 410)]
    trial = _measured(Candidate(micro_batch_size=8, gradient_checkpointing=False), timed,
                      _Steps(measured=4, deadline=0.0, step_tokens=400), seconds=13.3)
    assert trial.tokens_per_second == pytest.approx((400 + 420 + 380 + 410) / (1.0 + 1.1 + 0.9 + 1.3))
    assert trial.measured_steps == 4 and trial.note == ""
    rates = [1.0 / 400, 1.1 / 420, 0.9 / 380, 1.3 / 410]
    assert trial.spread == pytest.approx((max(rates) - min(rates)) / 2 / np.mean(rates))  # the slow step's too

    burst = _measured(Candidate(micro_batch_size=8, gradient_checkpointing=False), [*timed[:4], step(6.0, 410)],
                      _Steps(measured=4, deadline=0.0, step_tokens=400), seconds=18.0)
    assert burst.tokens_per_second == pytest.approx((400 + 420 + 380) / (1.0 + 1.1 + 0.9))
    assert burst.measured_steps == 3 and burst.note == "1 step of 6.0 s left out, 5.9x the others' time a token"
    assert burst.footing().low > 0 and burst.footing().words.startswith("3 measured steps")
    # Of two measured steps (a budget cut the trial), the slower 2.2x the other's time a token: a burst too, where
    # against both steps' median (their mean) it was 1.4x and the trial's speed 0.65 of the run's.
    two = _measured(Candidate(micro_batch_size=8, gradient_checkpointing=False), [timed[0], step(1.0, 400),
                    step(2.2, 400)], _Steps(measured=4, deadline=0.0, step_tokens=400), seconds=12.2)
    assert two.tokens_per_second == pytest.approx(400.0) and two.measured_steps == 1
    assert two.note.endswith("1 step of 2.2 s left out, 2.2x the others' time a token")
    assert not two.footing().firm
