import numpy as np
import pytest

from phase1a.plan.window import WindowError, Workload, fit_window

# 1000 examples of 100..1099 tokens; 1 ms a token; 60 s of evaluation and start-up.
LENGTHS = np.arange(100, 1100)
HOUR = 3600.0


def work(epochs: float = 3.0) -> Workload:
    return Workload(lengths=LENGTHS, epochs=epochs, max_seq_length=1152, model_max_length=8192,
                    seconds_per_token=1e-3, fixed_seconds=60.0)


def test_fits_without_adjustment():
    w = work()
    assert w.seconds(3.0, 1152) == pytest.approx(3 * LENGTHS.sum() * 1e-3 + 60)
    assert fit_window(w, budget=2 * HOUR, profile="balanced", min_epochs=1.0) == (3.0, 1152, "balanced", [])


def test_fits_after_cutting_epochs_to_what_the_window_allows():
    epochs, length, profile, adjustments = fit_window(work(), budget=0.5 * HOUR, profile="balanced", min_epochs=1.0)
    assert [a.step for a in adjustments] == ["profile", "epochs"] and profile == "fast"
    assert 1.0 <= epochs < 3.0 and work().seconds(epochs, length) <= 0.5 * HOUR
    assert work().seconds(epochs + 0.01, length) > 0.5 * HOUR  # the most epochs that fit, to 3 figures


def test_a_window_that_holds_a_small_share_of_a_large_set_trains_that_share_not_one_step():
    many = Workload(lengths=np.full(500_000, 400), epochs=1.0, max_seq_length=512, model_max_length=8192,
                    seconds_per_token=1 / 3000, fixed_seconds=20.0)  # an epoch: 66,667 s
    epochs, length, _, adjustments = fit_window(many, budget=400.0, profile="custom", min_epochs=1e-6)
    assert [a.step for a in adjustments] == ["epochs"] and length == 512
    assert epochs == pytest.approx(0.0057)  # (400 - 20) / 66,667 s: 0.0057, where 0.01 steps made it 0
    assert many.seconds(epochs, length) <= 400.0 < many.seconds(epochs + 1e-5, length)


def test_fits_after_truncation_at_the_epoch_floor():
    budget = work().seconds(1.0, 1024) + 1.0  # one epoch fits only when truncated at the p90 length
    epochs, length, _, adjustments = fit_window(work(), budget, profile="balanced", min_epochs=1.0)
    assert [a.step for a in adjustments][-1] == "truncation" and epochs >= 1.0 and length < 1152
    assert work().seconds(epochs, length) <= budget


def test_quality_never_truncates_and_nothing_fits_is_an_error():
    budget = work().seconds(1.0, 1152) * 0.9
    with pytest.raises(WindowError, match=r"nothing fits the time window: even 1 epochs at max_seq_length 1152"):
        fit_window(work(), budget, profile="quality", min_epochs=1.0)
    with pytest.raises(WindowError, match="nothing fits"):
        fit_window(work(), budget=30.0, profile="balanced", min_epochs=1.0)
