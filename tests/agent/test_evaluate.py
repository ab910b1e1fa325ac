"""The eval report's arithmetic: pass rates, pass@k and the intervals with several samples per task."""

from __future__ import annotations

import pytest

from flywheel.agent.evaluate import clustered_interval, paired_lift, summarize
from flywheel.agent.trajectory import Status, Trajectory
from flywheel.env.outcome import TestOutcome
from flywheel.stats import wilson_interval


def episode(task: str, family: str, won: bool) -> Trajectory:
    return Trajectory(task_id=task, family=family, tokens=[], loss_mask=[], logprobs=[], versions=[], prompt_len=0,
                      status=Status.FINISHED, reward=float(won),
                      reward_parts={"all_passed_bonus": float(won)}, turns=1, tool_calls=1, invalid_tool_calls=0,
                      asked_question=False,
                      outcome=TestOutcome(tests_passed_frac=float(won), all_passed=won, timed_out=False,
                                          visible_tests_modified=False))


def test_one_sample_per_task_reports_wilson_intervals_and_no_pass_at_k():
    report = summarize([episode(f"t{i}", "bugfix", i < 3) for i in range(10)])
    assert report["pass_rate"] == 0.3 and report["pass_rate_ci"] == list(wilson_interval(3, 10))
    assert "pass_at_k" not in report and "pass_at_k" not in report["per_family"]["bugfix"]


def test_several_samples_per_task_add_pass_at_k_and_intervals_across_tasks():
    # 4 tasks x 4 samples: a passes 4/4, b 1/4, c 0/4, d 1/4 (implement: a, b; bugfix: c, d)
    wins = {"a": [1, 1, 1, 1], "b": [1, 0, 0, 0], "c": [0, 0, 0, 0], "d": [0, 0, 1, 0]}
    family = {"a": "implement", "b": "implement", "c": "bugfix", "d": "bugfix"}
    report = summarize([episode(t, family[t], bool(w)) for t, ws in wins.items() for w in ws])
    assert report["pass_rate"] == pytest.approx(6 / 16)
    assert report["samples_per_task"] == 4
    assert report["pass_at_k"] == pytest.approx(3 / 4)
    assert report["pass_rate_ci"] == list(clustered_interval([1.0, 0.25, 0.0, 0.25]))
    assert report["per_family"]["implement"]["pass_at_k"] == 1.0
    assert report["per_family"]["bugfix"]["pass_at_k"] == 0.5
    # Samples of one task move together: the interval across tasks is wider than one over 16
    # independent episodes would be.
    lo, hi = report["pass_rate_ci"]
    wlo, whi = wilson_interval(6, 16)
    assert hi - lo > whi - wlo


def test_clustered_interval_by_hand():
    lo, hi = clustered_interval([0.0, 1.0, 0.5, 0.5, 0.5])
    # mean 0.5, sample sd sqrt(1/8), n 5: half width t(0.975, df 4) * sqrt(1/8) / sqrt(5), t = 2.776445
    half = 2.776445 * (1 / 8) ** 0.5 / 5**0.5
    assert (lo, hi) == pytest.approx((0.5 - half, 0.5 + half), abs=1e-3)
    assert clustered_interval([0.0, 1.0]) == (0.0, 1.0)  # clipped to what a pass rate can be
    assert clustered_interval([1.0, 1.0, 1.0]) == (1.0, 1.0)
    assert clustered_interval([0.5]) == (0.0, 1.0)


def test_per_task_results_give_a_paired_lift_with_its_interval():
    before = summarize([episode(f"t{i}", "bugfix", i < 10) for i in range(40)])
    after = summarize([episode(f"t{i}", "bugfix", i < 22) for i in range(40)])
    assert before["per_task"]["t3"] == 1.0 and before["per_task"]["t30"] == 0.0
    lift = paired_lift(before, after)
    assert (lift["before"], lift["after"], lift["tasks"], lift["gained"], lift["lost"]) == (0.25, 0.55, 40, 12, 0)
    assert lift["diff"] == pytest.approx(0.3) and 0 < lift["ci"][0] < 0.3 < lift["ci"][1] and lift["significant"]
    # one task gained, one lost: no change, and an interval on both sides of it
    swapped = summarize([episode(f"t{i}", "bugfix", 1 <= i < 11) for i in range(40)])
    tie = paired_lift(before, swapped)
    assert tie["diff"] == 0 and tie["ci"][0] < 0 < tie["ci"][1] and not tie["significant"]


def test_paired_lift_is_none_without_shared_per_task_results():
    report = summarize([episode("t0", "bugfix", True)])
    assert paired_lift({"pass_rate": 0.5}, report) is None
    assert paired_lift(summarize([episode("other", "bugfix", True)]), report) is None
