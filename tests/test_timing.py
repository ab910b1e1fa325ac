"""The one timer (`flywheel.timing`): a block's seconds added under its name, a failed block's too,
and counters read twice turned into what happened between the readings."""

from __future__ import annotations

import time

import pytest

from flywheel.timing import delta, timed


def test_timed_adds_each_blocks_seconds_under_its_name_even_when_it_raises():
    seconds: dict[str, float] = {"other_s": 1.0}
    with timed(seconds, "sleep_s"):
        time.sleep(0.02)
    with timed(seconds, "sleep_s"):  # a stage that runs twice counts both
        time.sleep(0.02)
    with pytest.raises(RuntimeError), timed(seconds, "failed_s"):
        time.sleep(0.01)
        raise RuntimeError("the block failed")
    assert 0.04 <= seconds["sleep_s"] < 1.0 and 0.01 <= seconds["failed_s"] < 1.0 and seconds["other_s"] == 1.0


def test_delta_is_what_happened_between_two_readings_and_restarts_count_from_zero():
    assert delta({"tokens": 10.0, "s": 2.5}, {"tokens": 4.0, "s": 1.0}) == {"tokens": 6.0, "s": 1.5}
    assert delta({"tokens": 10.0}, None) == {"tokens": 10.0}
    assert delta({"tokens": 3.0, "s": 0.5}, {"tokens": 4.0, "s": 0.1}) == {"tokens": 3.0, "s": 0.5}  # restarted
