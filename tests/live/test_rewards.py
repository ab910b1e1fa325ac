"""Reward distillation: every rule, the window (pending, defaulted, late), duplicates, session-level
assignment, and the two naive configs that reproduce reward hacks."""

from __future__ import annotations

from pathlib import Path

import pytest

from flywheel.api.events import Event, EventType
from flywheel.config import load_config
from flywheel.live.batch import completion_trajectory
from flywheel.live.records import Completion, CompletionToolCall
from flywheel.live.rewards import RewardConfig, RewardDistiller, RewardStatus
from flywheel.rl.advantages import broken_call_penalty, outcome_reward

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
WINDOW = 900.0
LATER = 10_000.0  # every window closed


def completion(cid: str, t: float = 0.0, calls: str = "read", latency_s: float = 1.0, session: str = "s",
               meta: dict | None = None) -> Completion:
    """calls: "read" | "edit" | "question" | "invalid" (one broken call) | "invalid2" (two)."""
    tool_calls = {
        "read": [CompletionToolCall(name="read_file", arguments={"path": "a.py"})],
        "edit": [CompletionToolCall(name="edit_file", arguments={"path": "a.py", "old": "x", "new": "y"})],
        "question": [],
        "invalid": [CompletionToolCall(name="edit_file", valid=False, error="bad json")],
        "invalid2": [CompletionToolCall(name="edit_file", valid=False, error="bad json")] * 2,
    }[calls]
    return Completion(id=cid, session_id=session, user_id="u", version=1, prompt_ids=[1], completion_ids=[2, 3],
                      logprobs=[-0.1, -0.2], latency_ms=latency_s * 1000, tool_calls=tool_calls,
                      content="Which file do you mean?" if calls == "question" else "", created_at=t,
                      request_meta=meta or {})


def event(eid: str, kind: EventType, t: float, cid: str | None = None, session: str = "s", **payload) -> Event:
    return Event(id=eid, type=kind, session_id=session, completion_id=cid, time=t, payload=payload)


P, R, F, T, S, A = (EventType.EDIT_PERSISTED, EventType.EDIT_REVERTED, EventType.FOLLOWUP, EventType.THUMBS,
                    EventType.SESSION_END, EventType.EDIT_APPLIED)
FINAL, PENDING, DEFAULTED, DROPPED = (RewardStatus.FINAL, RewardStatus.PENDING, RewardStatus.DEFAULTED,
                                      RewardStatus.DROPPED)

# (name, config overrides, completions, events, now, {completion id: (reward, status)})
CASES = [
    ("persisted edit", {}, [completion("c", calls="edit")], [event("e", P, 300, "c")], LATER, {"c": (1.0, FINAL)}),
    ("reverted edit", {}, [completion("c", calls="edit")], [event("e", R, 60, "c")], LATER, {"c": (-1.0, FINAL)}),
    ("dissatisfied follow-up", {}, [completion("c")], [event("e", F, 30, "c", dissatisfied=True)], LATER,
     {"c": (-0.5, FINAL)}),
    ("satisfied follow-up is feedback worth 0", {}, [completion("c")], [event("e", F, 30, "c", dissatisfied=False)],
     LATER, {"c": (0.0, FINAL)}),
    ("thumbs up", {}, [completion("c")], [event("e", T, 30, "c", up=True)], LATER, {"c": (0.5, FINAL)}),
    ("latency above threshold", {}, [completion("c", latency_s=15)], [event("e", T, 30, "c", up=True)], LATER,
     {"c": (0.5 - 5 * 0.02, FINAL)}),
    ("latency cost is capped", {}, [completion("c", latency_s=500)], [event("e", T, 30, "c", up=True)], LATER,
     {"c": (0.0, FINAL)}),
    ("invalid tool calls cost per call", {}, [completion("c", calls="invalid2")],
     [event("e", F, 30, "c", dissatisfied=False)], LATER, {"c": (-2.0, FINAL)}),
    ("no feedback: defaulted to default_reward", {"default_reward": -0.1}, [completion("c")], [], LATER,
     {"c": (-0.1, DEFAULTED)}),
    ("no feedback keeps the serve-time parts", {}, [completion("c", calls="invalid", latency_s=20)], [], LATER,
     {"c": (-1.0 - 0.2, DEFAULTED)}),
    ("window open: pending", {}, [completion("c", calls="edit")], [event("e", P, 300, "c")], 600.0,
     {"c": (1.0, PENDING)}),
    ("window open, no feedback yet: pending, not defaulted", {}, [completion("c")], [], WINDOW - 1,
     {"c": (0.0, PENDING)}),
    ("late event ignored", {}, [completion("c", calls="edit")], [event("e", P, WINDOW + 1, "c")], LATER,
     {"c": (0.0, DEFAULTED)}),
    ("duplicate id counts once, the earlier copy", {}, [completion("c")],
     [event("e", T, 20, "c", up=False), event("e", T, 10, "c", up=True)], LATER, {"c": (0.5, FINAL)}),
    ("unknown session outcome ignored", {}, [completion("c")], [event("e", S, 30, outcome="meh")], LATER,
     {"c": (0.0, DEFAULTED)}),
    # session-level: the persisted edit goes to the last completion that edited, not the later read
    ("session-level edit -> last editing completion", {},
     [completion("a", 0, "edit"), completion("b", 10, "edit"), completion("c", 20, "read")],
     [event("e", P, 300)], LATER, {"a": (0.0, DEFAULTED), "b": (1.0, FINAL), "c": (0.0, DEFAULTED)}),
    ("session-level edit spread over editing completions", {"session_assignment": "spread"},
     [completion("a", 0, "edit"), completion("b", 10, "edit"), completion("c", 20, "read")],
     [event("e", P, 300)], LATER, {"a": (0.5, FINAL), "b": (0.5, FINAL), "c": (0.0, DEFAULTED)}),
    ("session end -> last completion before it", {},
     [completion("a", 0), completion("b", 10), completion("c", 500)], [event("e", S, 100, outcome="unhappy")],
     LATER, {"a": (0.0, DEFAULTED), "b": (-0.5, FINAL), "c": (0.0, DEFAULTED)}),
    ("session end spread over completions inside their window", {"session_assignment": "spread"},
     [completion("a", 0), completion("b", 10), completion("c", 20), completion("d", 1000)],
     [event("e", S, 910, outcome="success")], LATER,
     {"a": (0.0, DEFAULTED), "b": (0.25, FINAL), "c": (0.25, FINAL), "d": (0.0, DEFAULTED)}),
    ("session-level follow-up -> the answer it replies to", {"session_assignment": "spread"},
     [completion("a", 0), completion("b", 10)], [event("e", F, 15, dissatisfied=True)], LATER,
     {"a": (0.0, DEFAULTED), "b": (-0.5, FINAL)}),
    # invalid tool calls: never dropped by default, dropped by the naive config
    ("invalid call penalized, kept", {}, [completion("c", calls="invalid")], [event("e", T, 5, "c", up=True)],
     LATER, {"c": (-0.5, FINAL)}),
    ("naive: invalid call dropped", {"drop_invalid": True}, [completion("c", calls="invalid")],
     [event("e", T, 5, "c", up=True)], LATER, {"c": (0.0, DROPPED)}),
    # clarifying questions
    ("needless question: costed, and the annoyed reply too", {},
     [completion("q", 0, "question"), completion("d", 60, "edit")],
     [event("f", F, 30, "q", dissatisfied=True), event("p", P, 400, "d")], LATER,
     {"q": (-0.3 - 0.5, FINAL), "d": (1.0, FINAL)}),
    ("needed question: refunded after a calm reply and a kept edit", {},
     [completion("q", 0, "question"), completion("d", 60, "edit")],
     [event("f", F, 30, "q", dissatisfied=False), event("p", P, 400, "d")], LATER,
     {"q": (0.0, FINAL), "d": (1.0, FINAL)}),
    ("question refund needs the edit to persist", {},
     [completion("q", 0, "question"), completion("d", 60, "edit")],
     [event("f", F, 30, "q", dissatisfied=False), event("r", R, 400, "d")], LATER,
     {"q": (-0.3, FINAL), "d": (-1.0, FINAL)}),
    ("unanswered question: costed, defaulted", {}, [completion("q", calls="question")], [], LATER,
     {"q": (-0.3, DEFAULTED)}),
    ("naive edits-only: needless question free", {"score_questions": False},
     [completion("q", 0, "question"), completion("d", 60, "edit")],
     [event("f", F, 30, "q", dissatisfied=True), event("p", P, 400, "d")], LATER,
     {"q": (0.0, FINAL), "d": (1.0, FINAL)}),
]


@pytest.mark.parametrize("name,overrides,completions,events,now,expected", CASES, ids=[c[0] for c in CASES])
def test_rules(name, overrides, completions, events, now, expected):
    rewards = RewardDistiller(RewardConfig(**overrides)).distill(completions, events, now)
    got = {r.completion_id: (r.reward, r.status) for r in rewards}
    assert [r.completion_id for r in rewards] == [c.id for c in completions]
    for cid, (reward, status) in expected.items():
        assert got[cid][0] == pytest.approx(reward), \
            f"{cid}: parts {rewards[[c.id for c in completions].index(cid)].parts}"
        assert got[cid][1] == status, cid
        assert sum(next(r for r in rewards if r.completion_id == cid).parts.values()) == pytest.approx(reward)


@pytest.mark.parametrize("events,reason,count", [
    ([event("e", P, WINDOW + 1, "c")], "late", 1),
    ([event("e", T, 10, "c", up=True)] * 3, "duplicate", 2),
    ([event("e", S, 10, outcome="meh")], "unknown_outcome", 1),
    ([event("e", F, 10, "c")], "malformed", 1),  # no "dissatisfied" in the payload
])
def test_ignored_events_are_counted(events, reason, count):
    (reward,) = RewardDistiller().distill([completion("c", calls="edit")], events, LATER)
    assert reward.ignored == {reason: count}


def test_events_without_a_completion_are_reported():
    events = [event("x", P, 10, "nope"), event("y", S, 10, session="other", outcome="success"),
              event("z", T, 10, up=True)]
    unplaced = RewardDistiller().unassigned([completion("c", t=50)], events)
    assert [e.id for e in unplaced] == ["x", "y", "z"]  # z came before the session's first completion


def test_reward_never_reads_request_meta():
    def run(ambiguous: bool) -> list[float]:
        cs = [completion("q", 0, "question", meta={"ambiguous": ambiguous}), completion("d", 60, "edit")]
        es = [event("f", F, 30, "q", dissatisfied=False), event("p", P, 400, "d")]
        return [r.reward for r in RewardDistiller().distill(cs, es, LATER)]

    assert run(True) == run(False)


def test_signals_are_the_weight_free_outcomes():
    cfg = RewardConfig(edit_persisted=0.0)
    (reward,) = RewardDistiller(cfg).distill([completion("c", calls="edit")], [event("e", P, 10, "c")], LATER)
    assert reward.signals == {"edit_persisted": 1.0} and reward.parts == {} and reward.status is FINAL


@pytest.mark.parametrize("name,drop_invalid,score_questions", [
    ("rewards.toml", False, True),
    ("rewards_naive_drop_invalid.toml", True, True),
    ("rewards_naive_edits_only.toml", False, False),
])
def test_config_files(name, drop_invalid, score_questions):
    cfg = load_config(RewardConfig, CONFIGS / name)
    assert (cfg.drop_invalid, cfg.score_questions) == (drop_invalid, score_questions)


@pytest.mark.parametrize("field,value", [("invalid_tool_call", 0.0), ("edit_reverted", 0.5),
                                         ("feedback_window_s", 0), ("clarify_cost", -1)])
def test_config_rejects_values_that_invite_hacks(field, value):
    with pytest.raises(ValueError, match=field):
        RewardConfig(**{field: value})


def test_default_broken_call_never_beats_an_honest_failed_edit():
    """The hack's incentive: on a task it expects to fail, a policy compares one broken call
    with an edit that gets reverted. Under the defaults the broken call must not be cheaper."""
    broken, failed = RewardDistiller(load_config(RewardConfig, CONFIGS / "rewards.toml")).distill(
        [completion("b", calls="invalid", session="s1"), completion("f", calls="edit", session="s2")],
        [event("e", R, 60, "f", session="s2")], LATER)
    assert broken.reward <= failed.reward < 0


def test_a_served_broken_call_is_charged_to_its_turn_like_a_simulated_one():
    # The live reward names its broken-call term as the episode runner does, so broken_calls = "turn"
    # finds it: the completion's tokens carry the cost on top of its outcome advantage.
    broken, clean = completion("b", calls="invalid2"), completion("c", calls="read")
    distiller = RewardDistiller(RewardConfig(feedback_window_s=WINDOW))
    rewards = {r.completion_id: r for r in distiller.distill([broken, clean], [], LATER)}
    trajectories = [completion_trajectory(c, rewards[c.id], "all") for c in (broken, clean)]
    for t in trajectories:
        assert sum(t.reward_parts.values()) == pytest.approx(t.reward)
    assert trajectories[0].invalid_tool_calls == 2
    assert broken_call_penalty(trajectories[0]) == pytest.approx(-2 * RewardConfig().invalid_tool_call)
    assert outcome_reward(trajectories[0]) == pytest.approx(outcome_reward(trajectories[1]))
    assert broken_call_penalty(trajectories[1]) == 0.0
