"""Reward distillation: what users did with the served answers, turned into one reward per completion.

    rewards = RewardDistiller(load_config(RewardConfig, "configs/rewards.toml")).distill(completions, events, now)
    batch = [r for r in rewards if r.trainable]

A reward is the sum of named parts. Two kinds:

- Known when the completion is served, so they always apply, feedback or not:
  `latency`          -latency_cost_per_s per second above latency_threshold_s, at most latency_cost_max
  `invalid_call_penalty`  invalid_tool_call per broken call. Never dropped: a trainer that drops them
                     teaches the policy that a broken call is a free way out of a hard turn. Simulated
                     RL's episodes name their broken-call term the same, so `flywheel.rl.advantages`
                     (broken_calls = "turn") finds it in both loops; the count itself is
                     `Completion.invalid_tool_calls`, never a part.
  `clarify`          -clarify_cost when the completion asked instead of acting (`asked_question`)
  `clarify_refund`   +clarify_cost when the user's behaviour shows the question was needed (below)
- From feedback events, each weighted by the config field of its kind: `edit_persisted`,
  `edit_reverted`, `edit_applied`, `followup_dissatisfied`, `followup_satisfied`, `thumbs_up`,
  `thumbs_down`, and `session_<outcome>` weighted by `session_outcome[outcome]`. A kind counts at
  most once per completion (its largest share, below): paying per event would pay the policy for
  splitting one edit into many.

The clarifying-question rule. The reward never reads `request_meta` (whether the request was
ambiguous is hidden ground truth; only the monitors may look). A question costs clarify_cost and is
refunded only when both: (a) no dissatisfied follow-up answers it, and (b) a later completion of the
same session made an edit that persisted, inside the question's feedback window. (b) alone is not
enough: a clear request would also have ended in a kept edit, only a turn later, so refunding on it
would make needless questions free. A user asked a needless question says so in the reply.

Which completion an event is about:

| event                                   | goes to                                                  |
|-----------------------------------------|----------------------------------------------------------|
| names a completion                      | that completion                                          |
| followup, thumbs without a completion   | the session's last completion before the event (a reply) |
| edit_* without a completion             | session_assignment over the session's completions that   |
|                                         | made an edit (`edit_tools`) before the event             |
| session_end                             | session_assignment over all the session's completions    |
|                                         | before the event                                         |

session_assignment "last" gives the whole event to the last such completion (share 1); "spread"
divides it equally among those still inside their feedback window (share 1/k each).

Windows. Completion c takes feedback until c.created_at + feedback_window_s (event time, set by the
client). Status: window open -> "pending" (provisional reward, not trainable); closed with feedback
-> "final"; closed without any -> "defaulted", with part `no_feedback` = default_reward on top of the
serve-time parts: never silently excluded. Events after the window are late: ignored and counted in
`Reward.ignored["late"]`, so a reward that was trained on never changes afterwards. Duplicate
events (same id) count once; the repeats are counted in `ignored["duplicate"]`. Events that cannot
be placed (unknown completion, no completion earlier in the session) are returned by `unassigned`.
Pass every completion of the sessions concerned, or session-level events land on the wrong one.

Background sessions (`Completion.session_kind == "background"`: a long agent session, many
completions with no user between them) are judged by one `outcome` event (accepted, merged,
ci_green, reverted, abandoned) that may arrive hours after the session's last completion, sent
through the same SDK and /v1/events. Its rules, `RewardConfig.background`:

- Whole-session credit: the session's first on-time outcome gives every one of its completions the
  part `outcome_<name>` = background.outcomes[name] (share 1 each: every turn of the session made
  the result). The serve-time parts stay per completion, so a broken call inside a session that was
  merged still costs its turn `invalid_call_penalty`.
- Horizon: an outcome counts until the session's first completion + background.horizon_s (the
  event's time). Until then the session's rewards are "pending"; later outcomes are "late",
  ignored and counted.
- A session with no outcome at its horizon is "unresolved": background.unresolved = "worst" (the
  default) scores it as the worst outcome's weight (part `outcome_unresolved`), status
  "defaulted". Silence must not be cheaper than a bad outcome: with "neutral" (the naive config,
  default_reward) a policy that stalls until the horizon escapes every negative outcome. For the
  same reason "abandoned" (what a user does with a session that ended "done" having done nothing)
  weighs as much as "reverted" by default: ending early must not be a cheaper way out of a hard
  task than an honest attempt. tests/live/test_sessions.py reproduces both hacks under the naive
  weights and shows the session monitors catching them.
- Per-completion feedback windows do not apply to background completions; the session's horizon does.
Which sessions a cycle gathers and how long it waits for their outcomes: flywheel/live/sessions.py.

The two naive flags reproduce known reward hacks for the scenarios, and are off by default:
`drop_invalid` marks completions with an invalid tool call "dropped" (policy learns to break calls
to escape bad turns); `score_questions = false` gives every question reward 0 (policy learns to ask
instead of risking a reverted edit).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from flywheel.agent.trajectory import INVALID_CALL_PENALTY
from flywheel.api.events import OUTCOMES, Event, EventType
from flywheel.live.records import BACKGROUND, Completion
from flywheel.live.store import LiveStore

EDIT_TOOLS = ("edit_file",)


def made_edit(completion: Completion, edit_tools: Sequence[str] = EDIT_TOOLS) -> bool:
    """Did the completion make a (valid) call to an edit tool. The one definition of "an edit"."""
    return any(call.valid and call.name in edit_tools for call in completion.tool_calls)


class SessionAssignment(StrEnum):
    LAST = "last"
    SPREAD = "spread"


class RewardStatus(StrEnum):
    FINAL = "final"  # window closed, feedback received
    PENDING = "pending"  # window open; provisional, not trainable yet
    DEFAULTED = "defaulted"  # window closed without feedback; default_reward applied
    DROPPED = "dropped"  # excluded from the batch (only under the naive drop_invalid config)


class Reward(BaseModel):
    completion_id: str
    session_id: str
    version: int
    arm: str
    reward: float
    parts: dict[str, float]
    status: RewardStatus
    # The on-time feedback assigned to the completion: kind -> its share in (0, 1]. Independent of
    # the weights, so the A/B analysis can count outcomes without knowing the reward config.
    signals: dict[str, float] = Field(default_factory=dict)
    ignored: dict[str, int] = Field(default_factory=dict)  # reason -> events not used: late, duplicate, ...

    @property
    def trainable(self) -> bool:
        return self.status in (RewardStatus.FINAL, RewardStatus.DEFAULTED)


class BackgroundConfig(BaseModel):
    """How a background session's outcome becomes its completions' reward (module docstring)."""

    model_config = ConfigDict(extra="forbid")
    # outcome -> the reward every completion of the session gets. All five must be given: an
    # outcome the SDK may send must never be silently unscored.
    outcomes: dict[str, float] = Field(default_factory=lambda: {
        "accepted": 1.0, "merged": 1.0, "ci_green": 0.5, "reverted": -1.0, "abandoned": -1.0})
    # Outcomes count until the session's first completion + horizon_s. Longer hears more late
    # outcomes, at the cost of training on sessions that old (a cycle waits at most
    # batch.outcome_wait_s for them; the rest are left out, flywheel/live/sessions.py).
    horizon_s: float = Field(8 * 3600.0, gt=0)
    # A session with no outcome by its horizon: "worst" scores it as the lowest of `outcomes`;
    # "neutral" gives it default_reward (naive: stalling past the horizon escapes every bad outcome).
    unresolved: Literal["worst", "neutral"] = "worst"

    @model_validator(mode="after")
    def _every_outcome(self) -> BackgroundConfig:
        if set(self.outcomes) != set(OUTCOMES):
            raise ValueError(f"background.outcomes must give a weight to exactly {list(OUTCOMES)}; got "
                             f"{sorted(self.outcomes)}")
        return self


class RewardConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # How long after a completion its feedback is accepted. Must exceed the client's persistence
    # horizon (when it reports edit_persisted), or persisted edits always arrive late. Longer
    # windows hear more feedback, at the cost of staler on-policy batches.
    feedback_window_s: float = Field(900.0, gt=0)
    # The reward of a completion nobody reacted to. 0 = neutral; silence is weak evidence either way.
    default_reward: float = 0.0
    edit_persisted: float = 1.0
    edit_reverted: float = Field(-1.0, le=0)
    edit_applied: float = 0.0  # the editor applied it; says nothing yet about whether it was good
    followup_dissatisfied: float = Field(-0.5, le=0)
    followup_satisfied: float = 0.0
    thumbs_up: float = 0.5
    thumbs_down: float = Field(-0.5, le=0)
    # session_end outcome -> weight. An outcome not listed here is ignored and counted in
    # Reward.ignored["unknown_outcome"]; add it here to score it.
    session_outcome: dict[str, float] = Field(
        default_factory=lambda: {"success": 0.5, "unhappy": -0.5, "abandoned": -0.25})
    latency_threshold_s: float = Field(10.0, ge=0)
    latency_cost_per_s: float = Field(0.02, ge=0)
    latency_cost_max: float = Field(0.5, ge=0)  # bounded, so one slow answer cannot outweigh its outcome
    # Per broken tool call. Must be a penalty: zero makes broken calls free, positive rewards them.
    # And no smaller than a reverted edit: otherwise, on a task the policy expects to fail, one
    # broken call is the cheaper way out than an honest attempt.
    invalid_tool_call: float = Field(-1.0, lt=0)
    # What a question costs unless refunded (module docstring). Set above what a guess risks on a
    # clear request and below what a reverted edit costs, so asking pays only when it is needed.
    clarify_cost: float = Field(0.3, ge=0)
    session_assignment: SessionAssignment = SessionAssignment.LAST
    background: BackgroundConfig = Field(default_factory=BackgroundConfig)
    edit_tools: list[str] = Field(default_factory=lambda: list(EDIT_TOOLS), min_length=1)
    # Naive behaviours, kept only to reproduce reward hacks; the defaults prevent them.
    drop_invalid: bool = False  # true: completions with an invalid call are "dropped" (the Composer hack)
    score_questions: bool = True  # false: a question gets reward 0, never penalized (the asking hack)


@dataclass(frozen=True)
class _Share:
    kind: str
    share: float
    time: float


@dataclass
class _Assignment:
    shares: dict[str, list[_Share]]  # completion id -> on-time feedback
    ignored: dict[str, Counter[str]]  # completion id -> reason -> count
    unassigned: list[Event]
    outcomes: dict[str, _Share] = field(default_factory=dict)  # background session id -> its on-time outcome
    session_start: dict[str, float] = field(default_factory=dict)  # background session id -> first completion


_REPLIES = (EventType.FOLLOWUP, EventType.THUMBS)
_EDIT_OUTCOMES = (EventType.EDIT_APPLIED, EventType.EDIT_PERSISTED, EventType.EDIT_REVERTED)


class RewardDistiller:
    def __init__(self, config: RewardConfig | None = None) -> None:
        self.config = config or RewardConfig()

    def distill(self, completions: Sequence[Completion], events: Sequence[Event], now: float) -> list[Reward]:
        """One reward per completion, in the order given."""
        assignment = self._assign(completions, events)
        by_session: dict[str, list[Completion]] = defaultdict(list)
        for c in completions:
            by_session[c.session_id].append(c)
        return [self._reward(c, assignment, by_session[c.session_id], now) for c in completions]

    def unassigned(self, completions: Sequence[Completion], events: Sequence[Event]) -> list[Event]:
        """Events no completion can take: unknown completion id, or nothing earlier in the session."""
        return self._assign(completions, events).unassigned

    # -- events -> completions

    def _kind(self, event: Event) -> tuple[str | None, str]:
        """(signal kind, "") or (None, why the event cannot be scored)."""
        payload = event.payload
        match event.type:
            case EventType.FOLLOWUP:
                if not isinstance(payload.get("dissatisfied"), bool):
                    return None, "malformed"
                return ("followup_dissatisfied" if payload["dissatisfied"] else "followup_satisfied"), ""
            case EventType.THUMBS:
                if not isinstance(payload.get("up"), bool):
                    return None, "malformed"
                return ("thumbs_up" if payload["up"] else "thumbs_down"), ""
            case EventType.SESSION_END:
                outcome = payload.get("outcome")
                if not isinstance(outcome, str):
                    return None, "malformed"
                if outcome not in self.config.session_outcome:
                    return None, "unknown_outcome"
                return f"session_{outcome}", ""
            case _:
                return event.type.value, ""

    def _weight(self, kind: str) -> float:
        if kind.startswith("outcome_"):
            return self.config.background.outcomes[kind.removeprefix("outcome_")]
        if kind.startswith("session_"):
            return self.config.session_outcome[kind.removeprefix("session_")]
        return getattr(self.config, kind)

    def _targets(self, event: Event, by_id: dict[str, Completion],
                 by_session: dict[str, list[Completion]]) -> list[tuple[Completion, float]]:
        """(completion, share) pairs the event is about, before the window check."""
        if event.completion_id is not None:
            c = by_id.get(event.completion_id)
            return [(c, 1.0)] if c is not None else []
        earlier = [c for c in by_session.get(event.session_id, []) if c.created_at <= event.time]
        if event.type in _REPLIES:
            return [(earlier[-1], 1.0)] if earlier else []
        if event.type in _EDIT_OUTCOMES:
            earlier = [c for c in earlier if made_edit(c, self.config.edit_tools)]
        if not earlier:
            return []
        if self.config.session_assignment is SessionAssignment.LAST:
            return [(earlier[-1], 1.0)]
        open_ = [c for c in earlier if event.time <= self._window_end(c)]
        if not open_:  # late for all of them: counted on the last
            return [(earlier[-1], 1.0)]
        return [(c, 1.0 / len(open_)) for c in open_]

    def _assign(self, completions: Sequence[Completion], events: Sequence[Event]) -> _Assignment:
        by_id = {c.id: c for c in completions}
        by_session: dict[str, list[Completion]] = defaultdict(list)
        for c in sorted(completions, key=lambda c: c.created_at):
            by_session[c.session_id].append(c)
        result = _Assignment(defaultdict(list), defaultdict(Counter), [])
        for session, cs in by_session.items():
            if cs and cs[0].session_kind == BACKGROUND:
                result.session_start[session] = cs[0].created_at
        seen: set[str] = set()
        # In time order, so of two copies of an event the earlier one counts.
        for event in sorted(events, key=lambda e: e.time):
            if event.type == EventType.OUTCOME:
                self._assign_outcome(event, by_session.get(event.session_id, []), result, seen)
                continue
            targets = self._targets(event, by_id, by_session)
            if not targets:
                if event.id not in seen:
                    result.unassigned.append(event)
                seen.add(event.id)
                continue
            if event.id in seen:
                result.ignored[targets[-1][0].id]["duplicate"] += 1
                continue
            seen.add(event.id)
            kind, why = self._kind(event)
            for c, share in targets:
                if kind is None:
                    result.ignored[c.id][why] += 1
                elif event.time > self._window_end(c):
                    result.ignored[c.id]["late"] += 1
                else:
                    result.shares[c.id].append(_Share(kind, share, event.time))
        return result

    def _assign_outcome(self, event: Event, session: list[Completion], result: _Assignment, seen: set[str]) -> None:
        """A background session's outcome: the first on-time one is the session's (module docstring)."""
        start = result.session_start.get(event.session_id)
        if start is None:  # no completion of the session passed, or not a background session
            if event.id not in seen:
                result.unassigned.append(event)
            seen.add(event.id)
            return
        last = session[-1].id
        outcome = event.payload.get("outcome")
        if event.id in seen:
            result.ignored[last]["duplicate"] += 1
        elif outcome not in self.config.background.outcomes:
            result.ignored[last]["unknown_outcome"] += 1
        elif event.time > start + self.config.background.horizon_s:
            result.ignored[last]["late"] += 1
        elif event.session_id in result.outcomes:
            result.ignored[last]["second_outcome"] += 1
        else:
            result.outcomes[event.session_id] = _Share(f"outcome_{outcome}", 1.0, event.time)
        seen.add(event.id)

    # -- one completion's reward

    def _window_end(self, c: Completion) -> float:
        return c.created_at + self.config.feedback_window_s

    def _refunded(self, question: Completion, assignment: _Assignment, session: list[Completion]) -> bool:
        if any(s.kind == "followup_dissatisfied" for s in assignment.shares.get(question.id, [])):
            return False
        end = self._window_end(question)
        return any(s.kind == "edit_persisted" and s.time <= end
                   for c in session if c.created_at > question.created_at
                   for s in assignment.shares.get(c.id, []))

    def _reward(self, c: Completion, assignment: _Assignment, session: list[Completion], now: float) -> Reward:
        cfg = self.config
        signals: dict[str, float] = {}
        for s in assignment.shares.get(c.id, []):
            signals[s.kind] = max(signals.get(s.kind, 0.0), s.share)
        background = c.session_id in assignment.session_start
        outcome = assignment.outcomes.get(c.session_id) if background else None
        if outcome is not None:
            signals[outcome.kind] = 1.0
        if background:  # the session's horizon, not the completion's window (module docstring)
            closed = outcome is not None or now >= assignment.session_start[c.session_id] + cfg.background.horizon_s
        else:
            closed = now >= self._window_end(c)
        parts: dict[str, float] = {}
        if cfg.drop_invalid and c.invalid_tool_calls:
            status = RewardStatus.DROPPED
        elif not cfg.score_questions and c.asked_question:
            status = RewardStatus.FINAL if closed else RewardStatus.PENDING
        else:
            refunded = False
            if c.latency_ms / 1000 > cfg.latency_threshold_s and cfg.latency_cost_per_s > 0:
                over = c.latency_ms / 1000 - cfg.latency_threshold_s
                parts["latency"] = -min(cfg.latency_cost_max, cfg.latency_cost_per_s * over)
            if c.invalid_tool_calls:
                parts[INVALID_CALL_PENALTY] = cfg.invalid_tool_call * c.invalid_tool_calls
            if c.asked_question and cfg.clarify_cost > 0:
                parts["clarify"] = -cfg.clarify_cost
                refunded = self._refunded(c, assignment, session)
                if refunded:
                    parts["clarify_refund"] = cfg.clarify_cost
            for kind, share in signals.items():
                if self._weight(kind) != 0.0:
                    parts[kind] = self._weight(kind) * share
            if not closed:
                status = RewardStatus.PENDING
            elif signals or refunded:
                status = RewardStatus.FINAL
            elif background and cfg.background.unresolved == "worst":
                status = RewardStatus.DEFAULTED
                parts["outcome_unresolved"] = min(cfg.background.outcomes.values())
            else:
                status = RewardStatus.DEFAULTED
                parts["no_feedback"] = cfg.default_reward
        return Reward(completion_id=c.id, session_id=c.session_id, version=c.version, arm=c.arm,
                      reward=math.fsum(parts.values()), parts=parts, status=status, signals=signals,
                      ignored=dict(assignment.ignored.get(c.id, {})))


def distill_sessions(distiller: RewardDistiller, store: LiveStore, completions: Sequence[Completion],
                     now: float) -> dict[str, Reward]:
    """Rewards of `completions` (by completion id), distilled with every completion and event of their
    sessions from `store`, as `distill` requires: a session-level event (a session_end, an edit without
    a completion id) goes to the right completion only when all of the session's are passed."""
    sessions = sorted({c.session_id for c in completions})
    context = {c.id: c for s in sessions for c in store.completions(session_id=s)}
    context.update({c.id: c for c in completions})
    events = [e for s in sessions for e in store.events_for_session(s)]
    return {r.completion_id: r for r in distiller.distill(list(context.values()), events, now)}
