"""Monitors: alarms on injected behaviour changes, quiet (at the documented rate) on noise."""

from __future__ import annotations

import random
from functools import cache

import pytest

from flywheel.api.events import Event, EventType
from flywheel.live.deploy import PINNED
from flywheel.live.monitors import Monitor, MonitorConfig, monitor_window
from flywheel.live.records import Completion, CompletionToolCall
from flywheel.live.rewards import Reward, RewardConfig, RewardDistiller, RewardStatus
from flywheel.live.store import LiveStore

EDIT = CompletionToolCall(name="edit_file", arguments={})
READ = CompletionToolCall(name="read_file", arguments={})
BROKEN = CompletionToolCall(name="grep", valid=False, error="bad json")
WINDOW = 3600.0
NORMAL = {"edit": 0.6, "clarify_clear": 0.05, "clarify_ambiguous": 0.6, "invalid": 0.03, "length": 80,
          "reward_tracks_tests": True}


def answers(version: int, window: int, n: int, seed: object, **behaviour) -> tuple[list[Completion], list[Reward]]:
    """n answers of one version in one window; a quarter of the requests ambiguous."""
    b = {**NORMAL, **behaviour}
    rng = random.Random(str(seed))
    completions, rewards = [], []
    for i in range(n):
        ambiguous = rng.random() < 0.25
        if rng.random() < b["clarify_ambiguous" if ambiguous else "clarify_clear"]:
            calls, content = [], "Which one do you mean?"
        else:
            calls, content = [EDIT if rng.random() < b["edit"] else READ], ""
            if rng.random() < b["invalid"]:
                calls.append(BROKEN)
        passed = rng.random() < 0.5
        cid = f"{version}-{window}-{i}-{seed}"
        # model_construct: thousands of records per test, already valid by construction
        completions.append(Completion.model_construct(
            id=cid, session_id=cid, user_id="u", version=version, prompt_ids=[1],
            completion_ids=[0] * max(1, round(rng.gauss(b["length"], 20))), logprobs=[], latency_ms=1000.0,
            tool_calls=calls, content=content, arm="production", created_at=window * WINDOW + i,
            request_meta={"ambiguous": ambiguous, "tests_passed": passed}))
        signal = float(passed) if b["reward_tracks_tests"] else float(rng.random() < 0.5)
        rewards.append(Reward.model_construct(completion_id=cid, session_id=cid, version=version, arm="production",
                                              reward=signal + rng.gauss(0, 0.5), parts={}, status=RewardStatus.FINAL,
                                              signals={}, ignored={}))
    return completions, rewards


def history(spec: list[tuple[int, int, int, dict]], seed: int = 0) -> tuple[list[Completion], list[Reward]]:
    """spec: (version, window, n, behaviour) per cell."""
    cs, rs = [], []
    for version, window, n, behaviour in spec:
        c, r = answers(version, window, n, (seed, version, window), **behaviour)
        cs += c
        rs += r
    return cs, rs


PRODUCTION = [(1, w, 200, {}) for w in range(10)]  # 2,000 answers of the production version


@cache
def null_history() -> tuple[list[Completion], list[Reward]]:
    return history(PRODUCTION + [(2, w, 50, {}) for w in range(10, 210)], seed=1)


@pytest.mark.parametrize("name,candidate,metric,severity", [
    ("edit rate collapses 60% -> 20%", {"edit": 0.2}, "edit_rate", "critical"),
    ("asks on clear requests", {"clarify_clear": 0.5}, "clarify_rate_clear", "critical"),
    ("stops asking on ambiguous requests", {"clarify_ambiguous": 0.05}, "clarify_rate_ambiguous", "critical"),
    ("breaks tool calls", {"invalid": 0.25}, "invalid_call_rate", "critical"),
    ("answers grow", {"length": 160}, "response_length", "critical"),
    ("reward stops tracking the tests", {"reward_tracks_tests": False}, "reward_outcome_corr", "critical"),
    ("edits more: noted, not blocking", {"edit": 0.95, "clarify_clear": 0.0}, "edit_rate", "warning"),
])
def test_alarms_against_production(name, candidate, metric, severity):
    cs, rs = history(PRODUCTION + [(2, 10, 100, candidate), (2, 11, 100, candidate)])
    report = Monitor().run(cs, rs, baseline_version=1)
    fired = [a for a in report.alarms if a.metric == metric and a.version == 2]
    assert len(fired) == 2 and {a.severity for a in fired} == {severity}, report.alarms
    assert all(a.baseline == "version 1" and a.blocks_promotion == (severity == "critical") for a in fired)
    assert all((a in report.blocking(2)) == (severity == "critical") for a in fired)
    assert not report.blocking(1)


def test_alarm_on_a_change_within_one_version():
    cs, rs = history([(1, w, 100, {}) for w in range(8)] + [(1, 8, 100, {"edit": 0.2})])
    report = Monitor().run(cs, rs)
    (alarm,) = [a for a in report.alarms]
    assert (alarm.metric, alarm.window_start, alarm.baseline) == ("edit_rate", 8 * WINDOW, "earlier windows")
    assert alarm.value < 0.3 < 0.45 < alarm.baseline_value and alarm.score < -5


@pytest.mark.parametrize("alarm_p,slack", [(1e-4, 1), (0.01, 2.0)])
def test_false_alarm_rate_on_null_windows(alarm_p, slack):
    # 200 windows of a candidate that behaves exactly like production. alarm_p = 1e-4: the documented
    # bound is 7e-4 per window, so 0 or (unluckily) 1 of 200 windows may alarm. alarm_p = 0.01: the
    # per-test rate itself must stay near its level (within `slack` times, for sampling noise).
    cs, rs = null_history()
    report = Monitor(MonitorConfig(alarm_p=alarm_p)).run(cs, rs, baseline_version=1)
    assert report.tests > 200 * 5  # most metrics were tested in most windows
    if alarm_p == 1e-4:
        assert len({a.window_start for a in report.alarms}) <= 1
    else:
        assert len(report.alarms) <= slack * alarm_p * report.tests


def test_series_has_every_metric_per_window():
    cs, rs = history([(1, 0, 60, {}), (2, 1, 60, {"edit": 0.2})])
    report = Monitor().run(cs, rs)
    cells = {(p.version, p.window_start) for p in report.series}
    assert cells == {(1, 0.0), (2, WINDOW)}
    edit = {p.version: p.value for p in report.series if p.metric == "edit_rate"}
    assert edit[1] > 0.4 > 0.25 > edit[2]
    assert {p.metric for p in report.series} >= {"reward_mean", "reward_outcome_corr", "tests_passed_rate"}


def test_unknown_baseline_version_is_an_error():
    cs, rs = history([(2, 0, 20, {})])
    with pytest.raises(ValueError, match="baseline version 1"):
        Monitor().run(cs, rs, baseline_version=1)


def test_the_monitors_window_distills_with_every_completion_of_its_sessions(tmp_path):
    """The cycle and the dashboard read the window through `monitor_window`: a session that began
    before the window still shares its session_end with its earlier answer, as the distiller's rule
    says, and requests pinned to a version (evals) are not watched."""
    now, lookback = 10_000.0, 50.0
    config = RewardConfig(session_assignment="spread", feedback_window_s=1000.0)

    def completion(cid: str, session: str, at: float, arm: str = "production") -> Completion:
        return Completion(id=cid, session_id=session, user_id="u", version=1, prompt_ids=[1], completion_ids=[2],
                          logprobs=[-0.1], latency_ms=100.0, tool_calls=[EDIT], arm=arm, created_at=at)

    before, inside = completion("a", "s", now - 100), completion("b", "s", now - 10)
    end = Event(id="e1", type=EventType.SESSION_END, session_id="s", time=now - 5,
                payload={"outcome": "unhappy", "tests_passed": False})
    with LiveStore(tmp_path / "live.sqlite") as store:
        for c in (before, inside, completion("p", "eval", now - 10, arm=PINNED)):
            store.add_completion(c)
        store.add_events([end])
        completions, rewards = monitor_window(store, RewardDistiller(config), now, lookback)
    assert [c.id for c in completions] == ["b"] and completions[0].request_meta["tests_passed"] is False
    whole_session = RewardDistiller(config).distill([before, inside], [end], now)[1]
    assert rewards == [whole_session] and rewards[0].parts["session_unhappy"] == pytest.approx(-0.25)
    # Distilled from the window's completions alone (the dashboard's old way), b took all of it.
    assert RewardDistiller(config).distill([inside], [end], now)[0].parts["session_unhappy"] == pytest.approx(-0.5)
