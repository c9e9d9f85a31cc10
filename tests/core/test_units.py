"""Time spans and their interval arithmetic (`phase1a/core/units.py`): one definition for train and plan."""
from __future__ import annotations

import pytest

from phase1a.core.units import Clock, Interval, parse_duration_seconds, parse_interval


def test_parse_spans_and_counts():
    assert parse_interval("30m") == Interval(seconds=1800)
    assert parse_interval("2h,100steps") == Interval(seconds=7200, steps=100)
    assert parse_interval("500ba") == Interval(steps=500)
    assert parse_interval("2000000tok") == Interval(tokens=2_000_000)
    assert parse_interval("0.5ep,1h") == Interval(seconds=3600, epochs=0.5)
    assert parse_interval("never") == Interval()
    assert parse_duration_seconds("12h") == 43200
    assert str(parse_interval("30m,500steps")) == "1800s,500steps"


@pytest.mark.parametrize("text", ["500steps", "30m,5steps", "10tok", "1ep", "soon"])
def test_duration_must_be_wall_time(text):
    with pytest.raises(ValueError):
        parse_duration_seconds(text)


@pytest.mark.parametrize("text, message", [("1.5steps", "whole number"), ("3 fortnights", "not a time unit"),
                                           ("2.5tok", "whole number")])
def test_bad_spans_name_the_part(text, message):
    with pytest.raises(ValueError, match=message):
        parse_interval(text)


def test_due_when_any_limit_is_spent():
    interval = parse_interval("30m,500steps")
    assert interval.due(Clock(seconds=1800))
    assert interval.due(Clock(seconds=1, steps=500))
    assert not interval.due(Clock(seconds=1799, steps=499, tokens=10**9))
    assert parse_interval("1000tok").due(Clock(tokens=1000))
    assert parse_interval("0.5ep").due(Clock(epochs=0.5)) and not parse_interval("0.5ep").due(Clock(epochs=0.4))
    assert not Interval().due(Clock(seconds=1e9, steps=10**9, tokens=10**9))


def test_count_excludes_the_final_step():
    # 10 steps at every 3rd: checkpoints after steps 3, 6 and 9; a run of 9 ends with its final save instead.
    assert parse_interval("3steps").count(Clock(steps=10)) == 3
    assert parse_interval("3steps").count(Clock(steps=9)) == 2
    assert parse_interval("30m").count(Clock(seconds=3 * 1800 + 1)) == 3
    # whichever limit fires more often decides
    assert parse_interval("30m,2steps").count(Clock(seconds=3600.5, steps=5)) == 2
    assert parse_interval("30m,2steps").count(Clock(seconds=36000, steps=5)) == 19
    assert parse_interval("1ep").count(Clock(epochs=3)) == 2  # after epochs 1 and 2; the third ends the run
    assert parse_interval("0.5ep").count(Clock(epochs=1.2)) == 2
    assert Interval().count(Clock(seconds=1e9, steps=10**9)) == 0


def test_rate_per_token():
    # a token takes 0.01 s and a step holds 1000 tokens: every 60 s is every 6000 tokens, every 2 steps 2000
    per_token = Clock(seconds=0.01, steps=1 / 1000, tokens=1, epochs=1 / 100_000)
    assert parse_interval("1m").rate(per_token) == pytest.approx(1 / 6000)
    assert parse_interval("1m,2steps").rate(per_token) == pytest.approx(1 / 2000)
    assert parse_interval("500tok").rate(per_token) == pytest.approx(1 / 500)
    assert parse_interval("1ep").rate(per_token) == pytest.approx(1 / 100_000)
    assert Interval().rate(per_token) == 0.0
