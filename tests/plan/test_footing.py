"""The estimate's range: what each part's speed rests on (phase1a/plan/footing.py) and how Estimate adds them."""
import pytest

from phase1a.plan import footing
from phase1a.plan.result import Estimate


def test_timed_evaluation_widens_a_few_passes_and_keeps_a_wide_spread():
    one = footing.timed_evaluation(passes=1, spread=0.0)  # one pass says nothing of the host's drift: 10 % x 2
    assert (one.low, one.high) == pytest.approx((0.8, 1.2)) and one.words == "1 timed pass, ±20%"
    two = footing.timed_evaluation(passes=2, spread=0.3)  # the passes' own spread, widened by sqrt(4 / 2)
    assert two.high == pytest.approx(1 + 0.3 * 2 ** 0.5) and two.words == "2 timed passes, ±42%"
    many = footing.timed_evaluation(passes=4, spread=0.02)
    assert (many.low, many.high) == pytest.approx((0.9, 1.1)) and many.firm and not two.firm


def test_evaluation_derived_from_the_training_speed_says_so_and_is_wide():
    derived = footing.derived_evaluation()
    assert derived.source == "derived" and not derived.firm and (derived.low, derived.high) == (0.67, 1.5)
    assert "not timed" in derived.words


def estimate(**footings) -> Estimate:
    return Estimate(startup_seconds=2.0, steady_seconds=100.0, warmup_seconds=3.0, checkpoints=1,
                    checkpoint_seconds=1.0, evaluation_seconds=40.0, evaluations_during_training=5,
                    eval_during_training_seconds=20.0, train_seconds=124.0, total_seconds=166.0).with_range(**footings)


def test_each_part_of_a_stage_moves_with_its_own_footing():
    training, evaluation = footing.measured(4, 8, 8, 0.0), footing.timed_evaluation(1, 0.0)  # ±5 %, ±20 %
    e = estimate(footing=training, evaluation=evaluation)
    # The train stage: 100 s of steady steps at ±5 %, 20 s of evaluations at ±20 %; the rest is fixed.
    assert e.train_range() == pytest.approx((124 - 5 - 4, 124 + 5 + 4))
    assert e.evaluation_range() == pytest.approx((40 - 8, 40 + 8))
    assert (e.low_total_seconds, e.high_total_seconds) == pytest.approx((166 - 5 - 12, 166 + 5 + 12))
    # A plan written before evaluation had its own footing: every part at the training speed's.
    old = estimate(footing=training)
    assert old.evaluation_footing is None and old.evaluation_range() == pytest.approx((38, 42))


def test_a_cpu_measurement_is_ranged_by_the_hosts_drift_a_gpus_by_its_steps():
    """Calibration's steps on a CPU cannot see how the host's speed moves over minutes (a run's steps at 0.80-1.20 of
    its calibration's speed in 18 fresh runs on this project's 2-core VM): at least ±22 % there."""
    cpu, gpu = footing.floor("cpu"), footing.floor("cuda")
    assert footing.measured(4, 8, 8, 0.02, cpu).words == "4 measured steps, ±22%"
    assert footing.measured(4, 8, 8, 0.02, gpu).words == "4 measured steps, ±5%"
    assert footing.measured(1, 8, 8, 0.0, cpu).high == pytest.approx(1 + 0.22 * 2)  # widened as a thin one is
    assert footing.timed_evaluation(2, 0.0, cpu).high == pytest.approx(1 + 0.22 * 2 ** 0.5)


def test_steps_that_spread_by_more_than_their_mean_keep_a_lower_bound_above_zero():
    """A range of ±112 % (a calibrated demo whose one step the host slowed 6.6x) gave a negative lower bound, a
    time no run can take; the lower bound stops at warm-up's, a tenth of the estimate."""
    wide = footing.measured(4, 1.0, 1.0, spread=1.12, least=0.15)
    assert wide.low == pytest.approx(0.1) and wide.high == pytest.approx(2.12) and wide.words.endswith("±112%")
