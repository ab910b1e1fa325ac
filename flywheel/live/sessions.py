"""Background sessions: long agent sessions judged by one outcome hours later, gathered on-policy.

    gathered = gather_background(store, distiller, version=production, since=since, end=cutoff, now=now)
    gathered.completions, gathered.left_out         # what a cycle trains on; what it could not, by reason
    summaries = session_summaries(completions, events)
    report = SessionMonitor(SessionMonitorConfig()).run(summaries, baseline_version=production)
    watched = watch(store, distiller, Monitor(...), SessionMonitor(...), now, lookback_s, baseline)  # both kinds

A background session is a run of completions with `session_kind = "background"` (the client says
so in the request's metadata) and one session id: the agent reads, edits and runs tests for many
turns with no user in between, and the user judges the whole result at the end, often hours later,
with one `outcome` event (accepted, merged, ci_green, reverted, abandoned) through the same SDK and
/v1/events. flywheel/live/rewards.py turns it into reward (whole-session credit, turn penalties
kept, the horizon and what an unresolved session scores); this module says which sessions a cycle
may train on and watches sessions as wholes.

On-policy despite the delay (`gather_background`). A cycle training version v takes the background
sessions that started in its window [since, end) and whose every completion v served on a user-routed
arm. Each is then either in (outcome arrived in time, or the horizon passed: the session is
resolved) or left out, with its reason counted:

| reason            | what it means                                                           |
|-------------------|-------------------------------------------------------------------------|
| `other_version`   | another version served some of its turns (a deployment changed mid-session) |
| `pinned`          | a turn was pinned to a version: an eval, not user traffic               |
| `open`            | no outcome yet and its horizon not reached, at the end of the wait      |

A cycle waits up to `batch.outcome_wait_s` (the late-arrival window, flywheel/live/cycle.py) for
open sessions to resolve, then trains without them. Sessions left out `open` are not trained on by
a later cycle either: that cycle starts its window at this one's cutoff, and usually trains another
version, on which those sessions would be off-policy. So the wait trades staleness (the cycle starts
later) against the share of outcomes used; `bench/live_orgs.py` measures the share that arrived in time.

Session-level monitors (`SessionMonitor`): per version and window (by session start), as the
per-answer monitors in flywheel/live/monitors.py do, with the same tests and alarm rule:

| metric                 | per session                                        | test    | bad  |
|------------------------|----------------------------------------------------|---------|------|
| session_length         | completions in the session                         | Welch z | none |
| turns_before_edit      | completions before the first valid edit (if any)   | Welch z | none |
| positive_outcome_rate  | outcome accepted / merged / ci_green (resolved)    | Fisher  | down |
| unresolved_rate        | no outcome by the horizon (resolved sessions)      | Fisher  | up   |
| done_without_edit_rate | ended (its last answer called no tool) with no edit | Fisher  | up   |

The last two catch the two hacks of delayed outcomes: a policy that stalls until the horizon so that
no outcome attaches (unresolved rate up, sessions longer), and one that declares "done" early,
before it did anything a reviewer could reject (done without edit up, sessions shorter). Length
and turns before the first edit are tested and alarm as warnings either way: a change of
either is worth a look, but neither is bad in itself.

One window for the cycle and the dashboard (`watch`): the per-answer monitors over `monitor_window`
and the session monitors over `session_window` (the background sessions that started in the same
lookback, each with all its completions and events), one report of both kinds of series and alarms.
The live cycle's report.json and the server's /dashboard both call it, so they cannot disagree.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from flywheel.api.events import Event, EventType
from flywheel.live.deploy import PINNED
from flywheel.live.monitors import Alarm, MetricPoint, Monitor, MonitorReport, change_p_value, monitor_window
from flywheel.live.records import BACKGROUND, Completion
from flywheel.live.rewards import EDIT_TOOLS, Reward, RewardDistiller, distill_sessions, made_edit
from flywheel.live.store import LiveStore
from flywheel.stats import Moments, z_quantile

POSITIVE_OUTCOMES = ("accepted", "merged", "ci_green")
LEFT_OUT_REASONS = ("other_version", "pinned", "open")


# ---- gathering on-policy background sessions


@dataclass
class GatheredSessions:
    """The background sessions a cycle may train on, and those it may not, by reason."""

    completions: list[Completion]  # of the sessions in, in time order
    rewards: dict[str, Reward]  # completion id -> reward, for `completions`
    sessions: int  # sessions in
    left_out: dict[str, int] = field(default_factory=dict)  # reason -> sessions
    outcomes: dict[str, int] = field(default_factory=dict)  # of the sessions in: outcome (or "unresolved") -> n

    def summary(self) -> dict[str, int | dict[str, int]]:
        return {"sessions": self.sessions, "completions": len(self.completions), "left_out": dict(self.left_out),
                "outcomes": dict(self.outcomes)}


def session_outcome(rewards: Sequence[Reward]) -> str | None:
    """The outcome a session's rewards carry ("unresolved" when its horizon passed without one), or
    None while the session is open."""
    for r in rewards:
        for kind in r.signals:
            if kind.startswith("outcome_"):
                return kind.removeprefix("outcome_")
    return "unresolved" if rewards and all(r.trainable for r in rewards) else None


def gather_background(store: LiveStore, distiller: RewardDistiller, version: int, since: float, end: float,
                      now: float, org_id: str | None = None) -> GatheredSessions:
    """Background sessions that started in [since, end), served wholly by `version` on user-routed
    arms, resolved at `now` (module docstring); `org_id` restricts them to one organization."""
    started = [c for c in store.completions(start=since, end=end, org_id=org_id) if c.session_kind == BACKGROUND]
    candidates = sorted({c.session_id for c in started})
    left_out: Counter[str] = Counter()
    whole: dict[str, list[Completion]] = {}
    for session in candidates:
        turns = store.completions(session_id=session)
        if turns[0].created_at < since:
            continue  # started before the window: an earlier cycle's (in or left out there)
        if any(c.arm == PINNED for c in turns):
            left_out["pinned"] += 1
        elif any(c.version != version for c in turns):
            left_out["other_version"] += 1
        else:
            whole[session] = turns
    flat = [c for turns in whole.values() for c in turns]
    rewards = distill_sessions(distiller, store, flat, now) if flat else {}
    kept: list[Completion] = []
    outcomes: Counter[str] = Counter()
    for turns in whole.values():
        outcome = session_outcome([rewards[c.id] for c in turns])
        if outcome is None or not all(rewards[c.id].trainable for c in turns):
            left_out["open"] += 1
            continue
        outcomes[outcome] += 1
        kept += turns
    kept.sort(key=lambda c: (c.created_at, c.id))
    return GatheredSessions(completions=kept, rewards={c.id: rewards[c.id] for c in kept},
                            sessions=sum(outcomes.values()), left_out=dict(left_out), outcomes=dict(outcomes))


# ---- sessions as wholes


class SessionSummary(BaseModel):
    session_id: str
    version: int  # of its first completion
    org_id: str
    started_at: float
    ended_at: float  # its last completion
    length: int  # completions
    turns_before_edit: int | None  # completions before the first valid edit; None without an edit
    done_without_edit: bool  # its last answer called no tool, and no turn edited
    outcome: str | None  # accepted | ... | abandoned, "unresolved" past the horizon, None while open
    outcome_delay_s: float | None  # outcome time - last completion, where an outcome came


def session_summaries(completions: Sequence[Completion], events: Sequence[Event], now: float,
                      horizon_s: float, edit_tools: Sequence[str] = EDIT_TOOLS) -> list[SessionSummary]:
    """One summary per background session of `completions` (pass every completion of each session),
    with its first on-time outcome from `events`; "unresolved" once `now` is past start + horizon_s."""
    by_session: dict[str, list[Completion]] = defaultdict(list)
    for c in sorted(completions, key=lambda c: (c.created_at, c.id)):
        if c.session_kind == BACKGROUND:
            by_session[c.session_id].append(c)
    first_outcome: dict[str, Event] = {}
    for e in sorted(events, key=lambda e: e.time):
        if e.type == EventType.OUTCOME and e.session_id in by_session and e.session_id not in first_outcome:
            if e.time <= by_session[e.session_id][0].created_at + horizon_s:
                first_outcome[e.session_id] = e
    out = []
    for session, turns in by_session.items():
        edits = [i for i, c in enumerate(turns) if made_edit(c, edit_tools)]
        event = first_outcome.get(session)
        start = turns[0].created_at
        outcome = str(event.payload.get("outcome")) if event else ("unresolved" if now > start + horizon_s else None)
        out.append(SessionSummary(
            session_id=session, version=turns[0].version, org_id=turns[0].org_id, started_at=start,
            ended_at=turns[-1].created_at, length=len(turns), turns_before_edit=edits[0] if edits else None,
            done_without_edit=not edits and not turns[-1].tool_calls, outcome=outcome,
            outcome_delay_s=event.time - turns[-1].created_at if event else None))
    return sorted(out, key=lambda s: (s.started_at, s.session_id))


def _resolved(s: SessionSummary) -> bool:
    return s.outcome is not None


SESSION_METRICS: dict[str, tuple[Literal["rate", "mean"], Literal["up", "down"] | None, object]] = {
    "session_length": ("mean", None, lambda s: float(s.length)),
    "turns_before_edit": ("mean", None, lambda s: None if s.turns_before_edit is None else float(s.turns_before_edit)),
    "positive_outcome_rate": ("rate", "down", lambda s: float(s.outcome in POSITIVE_OUTCOMES) if _resolved(s)
                              else None),
    "unresolved_rate": ("rate", "up", lambda s: float(s.outcome == "unresolved") if _resolved(s) else None),
    "done_without_edit_rate": ("rate", "up", lambda s: float(s.done_without_edit)),
}


class SessionMonitorConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # Window of session starts. Sessions are fewer than answers: windows are longer than the
    # per-answer monitor's to hold enough of them.
    window_s: float = Field(6 * 3600.0, gt=0)
    alarm_p: float = Field(1e-4, gt=0, lt=0.5)  # per test, as flywheel/live/monitors.py
    min_rate_count: int = Field(10, ge=1)
    min_count: int = Field(30, ge=4)  # sessions per side for the Welch tests


class SessionMonitor:
    """Each version's sessions against a baseline version's (or the version's earlier windows)."""

    def __init__(self, config: SessionMonitorConfig | None = None) -> None:
        self.config = config or SessionMonitorConfig()

    def run(self, sessions: Sequence[SessionSummary], baseline_version: int | None = None) -> MonitorReport:
        cfg = self.config
        cells: dict[tuple[int, int], list[SessionSummary]] = defaultdict(list)
        for s in sessions:
            cells[(s.version, math.floor(s.started_at / cfg.window_s))].append(s)
        stats = {(key, name): Moments.of([x for x in (sample(s) for s in ss) if x is not None])  # type: ignore[operator]
                 for key, ss in cells.items() for name, (_, _, sample) in SESSION_METRICS.items()}
        series = [MetricPoint(metric=name, version=v, window_start=w * cfg.window_s,
                              window_end=(w + 1) * cfg.window_s, n=m.n, value=m.mean)
                  for ((v, w), name), m in sorted(stats.items()) if m.n > 0]
        pooled = {name: sum((m for ((v, _), n), m in stats.items() if v == baseline_version and n == name), Moments())
                  for name in SESSION_METRICS}
        alarms, tests = [], 0
        for v in sorted({v for v, _ in cells}):
            earlier = {name: Moments() for name in SESSION_METRICS}
            for w in sorted(w for u, w in cells if u == v):
                for name, (kind, bad, _) in SESSION_METRICS.items():
                    window = stats[((v, w), name)]
                    against = baseline_version is not None and v != baseline_version
                    base = pooled[name] if against else earlier[name]
                    earlier[name] = earlier[name] + window
                    need = cfg.min_rate_count if kind == "rate" else cfg.min_count
                    if window.n < need or base.n < need:
                        continue
                    p = change_p_value(kind, window, base)
                    if p is None:
                        continue
                    tests += 1
                    if p < cfg.alarm_p:
                        up = window.mean > base.mean
                        critical = bad is not None and (bad == "up") == up
                        alarms.append(Alarm(
                            metric=name, version=v, window_start=w * cfg.window_s, window_end=(w + 1) * cfg.window_s,
                            baseline=f"version {baseline_version}" if against else "earlier windows",
                            baseline_value=base.mean, value=window.mean, n=window.n, baseline_n=base.n,
                            score=math.copysign(-z_quantile(max(p / 2, 1e-300)), 1.0 if up else -1.0), p_value=p,
                            severity="critical" if critical else "warning", blocks_promotion=critical))
        return MonitorReport(series=series, alarms=alarms, tests=tests)



# ---- the window the cycle and the dashboard monitor


def session_window(store: LiveStore, now: float, lookback_s: float | None, horizon_s: float,
                   edit_tools: Sequence[str] = EDIT_TOOLS) -> list[SessionSummary]:
    """The background sessions (user-routed) that started in the last `lookback_s` (None: all),
    summarized with every completion and event of each, as of `now`."""
    start = None if lookback_s is None else now - lookback_s
    sessions = sorted({c.session_id for c in store.completions(start=start)
                       if c.session_kind == BACKGROUND and c.arm != PINNED})
    turns = {s: store.completions(session_id=s) for s in sessions}
    started = [s for s in sessions if start is None or turns[s][0].created_at >= start]
    return session_summaries([c for s in started for c in turns[s]],
                             [e for s in started for e in store.events_for_session(s)], now, horizon_s, edit_tools)


@dataclass
class Watched:
    """What `watch` saw: one report of both monitors, the baseline they compared with (None where
    the asked one had no traffic in the window: each version is compared with its own earlier
    windows), and how many answers and background sessions the window held."""

    report: MonitorReport
    baseline_version: int | None
    completions: int
    sessions: int


def watch(store: LiveStore, distiller: RewardDistiller, monitor: Monitor, session_monitor: SessionMonitor, now: float,
          lookback_s: float | None, baseline_version: int | None) -> Watched:
    """Both monitors over the last `lookback_s` (module docstring), against `baseline_version`."""
    completions, rewards = monitor_window(store, distiller, now, lookback_s)
    sessions = session_window(store, now, lookback_s, distiller.config.background.horizon_s,
                              monitor.config.edit_tools)
    if baseline_version not in {c.version for c in completions}:
        baseline_version = None
    answers = monitor.run(completions, rewards, baseline_version=baseline_version) if completions else MonitorReport(
        series=[], alarms=[], tests=0)
    # Sessions are fewer: a baseline with answers but no background session is no session baseline.
    whole = session_monitor.run(sessions, baseline_version=baseline_version
                                if any(s.version == baseline_version for s in sessions) else None)
    report = MonitorReport(series=answers.series + whole.series, alarms=answers.alarms + whole.alarms,
                           tests=answers.tests + whole.tests)
    return Watched(report, baseline_version, completions=len(completions), sessions=len(sessions))

