"""A/B analysis on seeded synthetic traffic with known effects, through the real reward distiller."""

from __future__ import annotations

import random
from functools import cache

import pytest

from flywheel.api.events import Event, EventType
from flywheel.live.abtest import ABConfig, analyze, compare
from flywheel.live.records import Completion, CompletionToolCall
from flywheel.live.rewards import RewardDistiller
from flywheel.stats import fisher_tails, newcombe_interval, t_quantile, welch_interval

NOW = 1e6  # every feedback window closed


@cache  # the production arm is shared by every case
def traffic(arm: str, n: int, seed: int, persist: float = 0.5, unhappy: float = 0.1, latency_s: float = 4.0,
            invalid: float = 0.02) -> tuple[list[Completion], list[Event]]:
    """n one-answer sessions in one arm: 70% edits (kept with prob `persist`, else reverted)."""
    rng = random.Random(f"{arm}-{seed}")
    completions, events = [], []
    for i in range(n):
        cid = f"{arm}-{i}"
        calls = [CompletionToolCall(name="edit_file" if rng.random() < 0.7 else "read_file", arguments={})]
        if rng.random() < invalid:
            calls.append(CompletionToolCall(name="grep", valid=False, error="bad json"))
        completions.append(Completion(
            id=cid, session_id=cid, user_id="u", version=1 if arm == "production" else 2, prompt_ids=[1],
            completion_ids=[2], logprobs=[-0.1], latency_ms=1000 * max(0.1, rng.gauss(latency_s, 1.5)),
            tool_calls=calls, arm=arm, created_at=float(i)))
        if calls[0].name == "edit_file":
            kept = rng.random() < persist
            events.append(Event(id=f"e-{cid}", type=EventType.EDIT_PERSISTED if kept else EventType.EDIT_REVERTED,
                                session_id=cid, completion_id=cid, time=i + 60.0))
        events.append(Event(id=f"f-{cid}", type=EventType.FOLLOWUP, session_id=cid, completion_id=cid,
                            time=i + 30.0, payload={"dissatisfied": rng.random() < unhappy}))
    return completions, events


def run(n: int, seed: int, config: ABConfig | None = None, **candidate):
    pc, pe = traffic("production", n, seed)
    cc, ce = traffic("candidate", n, seed, **candidate)  # an effect-free candidate draws other numbers
    rewards = RewardDistiller().distill(pc + cc, pe + ce, NOW)
    return analyze(pc + cc, rewards, config)


@pytest.mark.parametrize("name,n,candidate,decision,verdicts", [
    ("better persistence is promoted", 1000, {"persist": 0.65}, "promote",
     {"persistence": "better", "reward": "better"}),
    ("no effect is not promoted", 1000, {}, "rollback", {"persistence": "no_difference", "reward": "no_difference"}),
    ("better but much slower is rolled back", 1000, {"persist": 0.65, "latency_s": 6.0}, "rollback",
     {"persistence": "better", "latency": "worse"}),
    ("better but more unhappy follow-ups is rolled back", 1000, {"persist": 0.65, "unhappy": 0.2}, "rollback",
     {"dissatisfied": "worse"}),
    ("better but breaks tool calls is rolled back", 1000, {"persist": 0.65, "invalid": 0.08}, "rollback",
     {"invalid_calls": "worse"}),
    ("too few answers: wait", 100, {"persist": 0.9}, "wait", {"persistence": "better"}),
])
def test_decisions(name, n, candidate, decision, verdicts):
    report = run(n, seed=0, **candidate)
    assert report.decision == decision, report.reason
    for metric, verdict in verdicts.items():
        m = report.metrics[metric]
        assert m.verdict == verdict, (metric, m)
    assert report.versions == {"production": [1], "candidate": [2]}
    assert report.model_validate_json(report.model_dump_json()) == report  # serializable for reports


def test_fewer_unhappy_follow_ups_promote_only_where_configured_a_success():
    # Persistence and reward unchanged, half the dissatisfied follow-ups: by default dissatisfied is a
    # guardrail, which can only roll back; listed as a success metric, the same traffic promotes.
    fewer = {"unhappy": 0.05}
    default = run(2000, seed=0, **fewer)
    assert default.metrics["dissatisfied"].verdict == "better" and default.decision == "rollback", default.reason
    as_success = ABConfig(success_metrics=["persistence", "reward", "dissatisfied"],
                          guardrails=["latency", "invalid_calls"])
    promoted = run(2000, seed=0, config=as_success, **fewer)
    assert promoted.decision == "promote" and "dissatisfied" in promoted.reason, promoted.reason
    worse = run(2000, seed=0, config=as_success, unhappy=0.2)  # a success metric that got worse rolls back
    assert worse.decision == "rollback" and "dissatisfied" in worse.reason, worse.reason
    with pytest.raises(ValueError, match="both a success metric and a guardrail"):
        ABConfig(success_metrics=["persistence", "dissatisfied"])


def test_no_effect_rarely_promotes():
    promoted = sum(run(250, seed, ABConfig(min_per_arm=100)).decision == "promote" for seed in range(1, 9))
    assert promoted <= 1  # bound: 2 success metrics x 2.5% = 5% per run


def test_intervals_contain_the_true_difference():
    m = run(1000, seed=0, persist=0.65).metrics["persistence"]
    assert m.ci_low < 0.15 < m.ci_high and m.production_ci[0] < 0.5 < m.production_ci[1]


@pytest.mark.parametrize("name,production,candidate,verdict", [
    ("rate up, higher is better", [0.0] * 60 + [1.0] * 40, [0.0] * 30 + [1.0] * 70, "better"),
    ("rate same", [0.0, 1.0] * 50, [1.0, 0.0] * 50, "no_difference"),
    ("one sample", [1.0], [0.0, 1.0], "insufficient"),
])
def test_compare(name, production, candidate, verdict):
    assert compare("persistence", production, candidate, 0.95).verdict == verdict


def test_other_arms_are_left_out_and_counted():
    pc, pe = traffic("production", 300, 0)
    cc, ce = traffic("candidate", 300, 0)
    pinned = [c.model_copy(update={"id": f"pin-{c.id}", "arm": "pinned"}) for c in pc[:7]]
    report = analyze(pc + cc + pinned, RewardDistiller().distill(pc + cc + pinned, pe + ce, NOW))
    assert report.outside == {"pinned": 7} and report.closed == {"production": 300, "candidate": 300}


def test_missing_reward_is_an_error():
    pc, _ = traffic("production", 3, 0)
    with pytest.raises(ValueError, match="no reward"):
        analyze(pc, [])


@pytest.mark.parametrize("name,got,want", [
    # Newcombe 1998, example 56/70 - 48/80, method 10: 0.0524 to 0.3339
    ("newcombe", tuple(newcombe_interval(56, 70, 48, 80)[1:]), (0.0524, 0.3339)),
    ("fisher tea tasting, one-sided", fisher_tails(3, 4, 1, 4)[1], 0.2429),
    ("fisher, lower tail", fisher_tails(1, 20, 9, 20)[0], 0.00418),
    ("t 0.975, df 10", t_quantile(0.975, 10), 2.2281),
    ("t 0.95, df 4", t_quantile(0.95, 4), 2.1318),
    ("t 0.975, df 1 (exact)", t_quantile(0.975, 1), 12.706),
    ("welch, equal groups", tuple(welch_interval([1.0, 2.0, 3.0], [1.0, 2.0, 3.0])), (0.0, -2.2666, 2.2666)),  # df 4
])
def test_statistics_match_reference_values(name, got, want):
    assert got == pytest.approx(want, abs=1e-3)


def test_fisher_tails_rejects_counts_outside_their_group():
    with pytest.raises(ValueError, match="between 0 and their group's size"):
        fisher_tails(5, 4, 0, 4)


@pytest.mark.parametrize("value", [0.1, 0.2, 0.7, -0.35, 0.45, 1 / 3, 1e6 / 7, 0.0])
def test_identical_constant_arms_never_differ(value):
    """Both arms' every value the same constant: their means differ in the last bit (0.1 summed 2
    and 12 times), and Welch's zero-variance interval, e.g. [4.7e-18, 2.3e-17], once promoted."""
    for n_production in range(2, 30):
        for n_candidate in range(2, 30):
            for name in ("reward", "latency"):
                m = compare(name, [value] * n_production, [value] * n_candidate, 0.95)
                assert m.verdict == "no_difference", (name, value, n_production, n_candidate, m.ci_low, m.ci_high)


def test_a_real_difference_of_constant_arms_still_counts():
    """The rounding guard hides only rounding: a difference of 1e-9 between constant arms is significant."""
    assert compare("reward", [0.1] * 2, [0.1 + 1e-9] * 12, 0.95).verdict == "better"
    assert compare("latency", [0.1] * 2, [0.1 + 1e-9] * 12, 0.95).verdict == "worse"


def test_identical_zero_variance_arms_do_not_promote():
    """Through analyze: every answer on both arms has the same reward (no edits, no feedback), in
    arm sizes whose float means differ in the last bit; the candidate is rolled back, not promoted."""
    completions = [Completion(id=f"{arm}-{i}", session_id=f"{arm}-{i}", user_id="u", version=1 if arm == "production"
                              else 2, prompt_ids=[1], completion_ids=[2], logprobs=[-0.1], latency_ms=1000.0,
                              arm=arm, created_at=float(i))
                   for arm, n in (("production", 2), ("candidate", 12)) for i in range(n)]
    rewards = RewardDistiller().distill(completions, [], NOW)
    rewards = [r.model_copy(update={"reward": 0.1}) for r in rewards]
    report = analyze(completions, rewards, ABConfig(min_per_arm=2, success_metrics=["reward"], guardrails=["latency"]))
    assert report.metrics["reward"].verdict == "no_difference" and report.decision == "rollback", report.reason


def session_traffic(arm: str, sessions: int, unhappy_sessions: int, answers: int = 5):
    """`sessions` sessions of `answers` answers each in one arm; every answer of the first
    `unhappy_sessions` sessions draws an unhappy follow-up (one user's mood spans the session)."""
    completions, events = [], []
    for s in range(sessions):
        for a in range(answers):
            cid = f"{arm}-{s}-{a}"
            completions.append(Completion(
                id=cid, session_id=f"{arm}-{s}", user_id=f"u{s}", version=1 if arm == "production" else 2,
                prompt_ids=[1], completion_ids=[2], logprobs=[-0.1], latency_ms=1000.0 + 500 * (s % 3) + a,
                tool_calls=[CompletionToolCall(name="read_file", arguments={})], arm=arm, created_at=float(a)))
            events.append(Event(id=f"f-{cid}", type=EventType.FOLLOWUP, session_id=f"{arm}-{s}", completion_id=cid,
                                time=30.0 + a, payload={"dissatisfied": s < unhappy_sessions}))
    return completions, events


def test_answers_of_one_session_count_as_one_draw_not_as_five():
    """20 sessions of 5 answers an arm, the mood of each session shared by its answers: unhappy in 4
    sessions against 1. Counted answer by answer (100 against 100) the candidate looks significantly
    better; the split randomized sessions, and 4 of 20 against 1 of 20 is not significant. The
    design effect is about the session size."""
    pc, pe = session_traffic("production", 20, 4)
    cc, ce = session_traffic("candidate", 20, 1)
    rewards = RewardDistiller().distill(pc + cc, pe + ce, NOW)
    config = ABConfig(success_metrics=["persistence", "reward", "dissatisfied"], guardrails=["latency"],
                      min_per_arm=20)
    by_answer = analyze(pc + cc, rewards, config.model_copy(update={"cluster_by": "answer"}))
    by_session = analyze(pc + cc, rewards, config)
    assert by_answer.metrics["dissatisfied"].verdict == "better" and by_answer.decision == "promote"
    clustered = by_session.metrics["dissatisfied"]
    assert clustered.verdict == "no_difference" and by_session.decision == "rollback", by_session.reason
    assert clustered.diff == by_answer.metrics["dissatisfied"].diff  # the rates are the same; only the width
    assert all(4.5 < d < 6.5 for d in clustered.design_effect), clustered.design_effect
    assert by_answer.metrics["dissatisfied"].design_effect == (1.0, 1.0)


def test_one_answer_sessions_are_analysed_as_before():
    """Every answer its own session (the cases above): the clustered analysis is the per-answer one."""
    by_session = run(1000, seed=0, persist=0.65)
    by_answer = run(1000, seed=0, config=ABConfig(cluster_by="answer"), persist=0.65)
    assert by_session.metrics == by_answer.metrics
