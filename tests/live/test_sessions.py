"""Background sessions: an outcome hours later credits the whole session (broken calls still cost),
the horizon resolves silent sessions, a cycle gathers only sessions its version served and says what
it left out, the session monitors catch the two delayed-outcome hacks, and the organization id and
the outcome travel through the real server and SDK.

Time is simulated with the records' own timestamps (hours apart), never by sleeping."""

from __future__ import annotations

import random
import sqlite3

import openai
import pytest
from tiny_serving import KEYS

from flywheel.api.events import Event, EventType
from flywheel.client import EventClient
from flywheel.live.batch import on_policy_batch
from flywheel.live.cycle import CycleState, LiveConfig, LiveCycle
from flywheel.live.deploy import PINNED, Deployment
from flywheel.live.records import BACKGROUND, Completion, CompletionToolCall
from flywheel.live.rewards import BackgroundConfig, RewardConfig, RewardDistiller, RewardStatus
from flywheel.live.server import LiveServer, ServeConfig, serve_in_thread
from flywheel.live.sessions import SessionMonitor, SessionMonitorConfig, gather_background, session_summaries
from flywheel.live.settings import LoopConfig
from flywheel.live.store import LIVE_SCHEMA, LiveStore
from flywheel.model.chat import SYSTEM_PROMPT
from flywheel.model.registry import Registry

H = 3600.0
T0 = 1_000_000.0
EDIT = CompletionToolCall(name="edit_file", arguments={"path": "a.py", "old": "x", "new": "y"})
READ = CompletionToolCall(name="read_file", arguments={"path": "a.py"})
BROKEN = CompletionToolCall(name="edit_file", arguments={"path": "a.py"}, valid=False, error="missing new")


def turn(session: str, i: int, start: float, version: int = 0, calls=(READ,), arm: str = "production",
         org: str = "", family: str = "bugfix") -> Completion:
    return Completion(id=f"{session}-{i}", session_id=session, user_id="u", version=version, prompt_ids=[1, 2],
                      completion_ids=[3, 4], logprobs=[-0.1, -0.2], latency_ms=50.0, tool_calls=list(calls),
                      arm=arm, created_at=start + 60.0 * i, session_kind=BACKGROUND, org_id=org,
                      request_meta={"family": family})


def session(name: str, start: float, n: int = 6, **kw) -> list[Completion]:
    """n turns a minute apart: reads, an edit at turn 2, and a final answer without tools ("done")."""
    calls = [(READ,)] * n
    calls[min(2, n - 1)] = (EDIT,)
    calls[-1] = ()
    return [turn(name, i, start, calls=calls[i], **kw) for i in range(n)]


def outcome(session: str, what: str, at: float, event_id: str | None = None) -> Event:
    return Event(id=event_id or f"out-{session}", type=EventType.OUTCOME, session_id=session, time=at,
                 payload={"outcome": what})


def test_an_outcome_hours_later_credits_every_turn_and_broken_calls_still_cost():
    turns = session("s", T0, n=5)
    turns[3] = turns[3].model_copy(update={"tool_calls": [BROKEN]})
    distiller = RewardDistiller(RewardConfig())
    before = distiller.distill(turns, [], now=T0 + 2 * H)
    assert {r.status for r in before} == {RewardStatus.PENDING}  # open: no outcome, horizon (8 h) not reached
    merged = [outcome("s", "merged", T0 + 3 * H)]
    rewards = distiller.distill(turns, merged, now=T0 + 3.5 * H)
    assert [r.status for r in rewards] == [RewardStatus.FINAL] * 5
    assert all(r.parts["outcome_merged"] == 1.0 and r.signals["outcome_merged"] == 1.0 for r in rewards)
    assert rewards[3].parts["invalid_call_penalty"] == -1.0 and rewards[3].reward == 0.0
    assert [r.reward for i, r in enumerate(rewards) if i != 3] == [1.0] * 4
    # The per-answer feedback window (900 s) does not apply: the outcome came 3 h after the session.
    reverted = distiller.distill(turns, [outcome("s", "reverted", T0 + 3 * H)], now=T0 + 4 * H)
    assert [r.reward for r in reverted] == [-1.0, -1.0, -1.0, -2.0, -1.0]


def test_the_horizon_resolves_a_silent_session_and_late_outcomes_are_counted():
    turns = session("s", T0)
    late = [outcome("s", "merged", T0 + 9 * H)]  # past the 8 h horizon
    worst = RewardDistiller(RewardConfig()).distill(turns, late, now=T0 + 10 * H)
    assert {r.status for r in worst} == {RewardStatus.DEFAULTED}
    assert all(r.parts == {"outcome_unresolved": -1.0} for r in worst)
    assert worst[-1].ignored == {"late": 1}
    naive = RewardConfig(background=BackgroundConfig(unresolved="neutral"))
    assert {r.reward for r in RewardDistiller(naive).distill(turns, late, now=T0 + 10 * H)} == {0.0}
    # Only the first on-time outcome counts; a second one is counted, not scored.
    two = [outcome("s", "reverted", T0 + H, "a"), outcome("s", "merged", T0 + 2 * H, "b")]
    rewards = RewardDistiller().distill(turns, two, now=T0 + 3 * H)
    assert {r.reward for r in rewards} == {-1.0} and rewards[-1].ignored == {"second_outcome": 1}
    with pytest.raises(ValueError, match="exactly"):
        BackgroundConfig(outcomes={"merged": 1.0})


def test_a_cycle_gathers_only_its_versions_resolved_sessions_and_says_why_it_left_the_rest(tmp_path):
    store = LiveStore(tmp_path / "live.sqlite")
    plan = {"merged": session("merged", T0), "silent": session("silent", T0 + 60),
            "mixed": session("mixed", T0 + 120), "pinned": session("pinned", T0 + 180, arm=PINNED),
            "open": session("open", T0 + 5 * H), "before": session("before", T0 - H)}
    plan["mixed"][-1] = plan["mixed"][-1].model_copy(update={"version": 1})  # the deployment changed mid-session
    for turns in plan.values():
        for c in turns:
            store.add_completion(c)
    store.add_events([outcome("merged", "merged", T0 + 4 * H)])
    distiller = RewardDistiller(RewardConfig())
    now = T0 + 9 * H  # "silent" passed its horizon; "open" started 4 h ago
    got = gather_background(store, distiller, version=0, since=T0 - 1, end=T0 + 6 * H, now=now)
    assert got.sessions == 2 and got.outcomes == {"merged": 1, "unresolved": 1}
    assert got.left_out == {"other_version": 1, "pinned": 1, "open": 1}
    assert {c.session_id for c in got.completions} == {"merged", "silent"}
    batch = on_policy_batch(got.completions, list(got.rewards.values()), version=0)
    assert len(batch.trajectories) == 12 and batch.excluded == {}
    assert sorted({t.reward for t in batch.trajectories}) == [-1.0, 1.0]
    # Later, the open session's outcome has arrived and it is in.
    store.add_events([outcome("open", "reverted", T0 + 12 * H)])
    later = gather_background(store, distiller, version=0, since=T0 - 1, end=T0 + 6 * H, now=T0 + 12.5 * H)
    assert later.outcomes == {"merged": 1, "unresolved": 1, "reverted": 1} and "open" not in later.left_out
    store.close()


def policy_sessions(version: int, behaviour: str, n: int, start: float, rng: random.Random,
                    ) -> tuple[list[Completion], list[Event]]:
    """n sessions of a scripted policy: half easy tasks, half hard. "honest" edits and finishes
    (merged on easy tasks 90% of the time, reverted on hard ones 80%); "stall" reads until the
    horizon and never finishes, so no outcome comes; "early_done" says done at once on hard tasks,
    which its users abandon."""
    completions, events = [], []
    for k in range(n):
        name, t, hard = f"v{version}-{behaviour}-{k}", start + k * 300.0, k % 2 == 1
        family = "hard" if hard else "easy"
        if behaviour == "stall" and hard:
            turns = [turn(name, i, t, version, calls=(READ,), family=family) for i in range(40)]
            completions += turns
            continue
        if behaviour == "early_done" and hard:
            completions.append(turn(name, 0, t, version, calls=(), family=family))
            events.append(outcome(name, "abandoned", t + 2 * H))
            continue
        turns = [turn(name, i, t, version, calls=c, family=family) for i, c in enumerate([(READ,), (EDIT,), ()])]
        completions += turns
        good = rng.random() < (0.2 if hard else 0.9)
        events.append(outcome(name, "merged" if good else "reverted", t + rng.uniform(1, 6) * H))
    return completions, events


NAIVE = RewardConfig(background=BackgroundConfig(unresolved="neutral", outcomes={
    "accepted": 1.0, "merged": 1.0, "ci_green": 0.5, "reverted": -1.0, "abandoned": -0.25}))


@pytest.mark.parametrize("hack", ["stall", "early_done"])
def test_the_delayed_outcome_hacks_pay_under_naive_rewards_and_the_session_monitors_catch_them(hack):
    rng = random.Random(0)
    honest, honest_events = policy_sessions(0, "honest", 60, T0, rng)
    hacked, hacked_events = policy_sessions(1, hack, 60, T0, rng)
    completions, events, now = honest + hacked, honest_events + hacked_events, T0 + 30 * H

    def hard_session_reward(config: RewardConfig, version: int) -> float:
        """Mean per-session reward on hard tasks: what the advantage compares within the family."""
        rewards = {r.completion_id: r for r in RewardDistiller(config).distill(completions, events, now)}
        by_session: dict[str, list[float]] = {}
        for c in completions:
            if c.version == version and c.request_meta["family"] == "hard":
                by_session.setdefault(c.session_id, []).append(rewards[c.id].reward)
        return sum(sum(v) / len(v) for v in by_session.values()) / len(by_session)

    # Naive: escaping judgement beats an honest attempt at a hard task, so training would learn it.
    assert hard_session_reward(NAIVE, 1) > hard_session_reward(NAIVE, 0) + 0.3
    # Default: silence and an empty "done" score as the worst outcome, never above an honest try.
    assert hard_session_reward(RewardConfig(), 1) <= hard_session_reward(RewardConfig(), 0)

    summaries = session_summaries(completions, events, now, horizon_s=8 * H)
    assert len(summaries) == 120
    report = SessionMonitor(SessionMonitorConfig(window_s=48 * H)).run(summaries, baseline_version=0)
    critical = {a.metric for a in report.alarms if a.version == 1 and a.severity == "critical"}
    caught, other = (("unresolved_rate", "done_without_edit_rate") if hack == "stall"
                     else ("done_without_edit_rate", "unresolved_rate"))
    assert caught in critical and other not in critical
    assert report.blocking(0) == []
    lengths = {s.version: [] for s in summaries}
    for s in summaries:
        lengths[s.version].append(s.length)
    longer = sum(lengths[1]) / 60 > sum(lengths[0]) / 60
    assert longer == (hack == "stall")


def test_org_and_session_kind_travel_with_requests_and_outcome_events(registry_root, tmp_path):
    keys = {**KEYS, "acme-key": ["inference", "events"]}
    config = ServeConfig(loop=LoopConfig.at(tmp_path / "live.sqlite", registry_root), keys=keys,
                         orgs={"acme-key": "acme"}, threads=1, candidate_fraction=0.0)
    server = LiveServer.from_config(config)
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "Fix the failing test."}]
    with serve_in_thread(server) as running:
        acme = openai.OpenAI(base_url=f"{running.url}/v1", api_key="acme-key", max_retries=0, timeout=60)
        other = openai.OpenAI(base_url=f"{running.url}/v1", api_key="inference-key", max_retries=0, timeout=60)
        ids = [acme.chat.completions.create(model="flywheel", messages=messages, max_tokens=4,
                                            extra_body={"session_id": "bg-1",
                                                        "metadata": {"session_kind": BACKGROUND}}).id
               for _ in range(2)]
        plain = other.chat.completions.create(model="flywheel", messages=messages, max_tokens=4,
                                              extra_body={"session_id": "i-1", "metadata": {"org_id": "globex"}})
        with pytest.raises(openai.PermissionDeniedError, match="belongs to organization 'acme'"):
            acme.chat.completions.create(model="flywheel", messages=messages, max_tokens=4,
                                         extra_body={"metadata": {"org_id": "globex"}})
        with pytest.raises(openai.BadRequestError, match="session_kind"):
            acme.chat.completions.create(model="flywheel", messages=messages, max_tokens=4,
                                         extra_body={"metadata": {"session_kind": "batch"}})
        with EventClient(running.url, "acme-key", flush_interval_s=0.01) as client:
            client.emit("outcome", session_id="bg-1", payload={"outcome": "ci_green"}, at=T0)
            client.emit("outcome", session_id="bg-1", payload={"outcome": "shipped"})
            client.record(Event(id="spoof", type=EventType.THUMBS, session_id="bg-1", time=T0,
                                payload={"up": True}, org_id="globex"))
            assert client.flush(timeout_s=60)
            assert client.stats.accepted == 1 and client.stats.rejected == 2
            reasons = " | ".join(r["reason"] for r in client.rejections)
            assert "one of ['accepted', 'merged', 'ci_green', 'reverted', 'abandoned']" in reasons
            assert "belongs to organization 'acme'" in reasons
    stored = [server.store.completion(i) for i in ids]
    assert all(c.org_id == "acme" and c.session_kind == BACKGROUND and "org_id" not in c.request_meta
               for c in stored)
    unkeyed = server.store.completion(plain.id)
    assert (unkeyed.org_id, unkeyed.session_kind) == ("globex", "interactive")
    assert [c.id for c in server.store.completions(org_id="acme")] == ids
    (event,) = server.store.events_for_session("bg-1")
    assert (event.type, event.org_id, event.payload) == (EventType.OUTCOME, "acme", {"outcome": "ci_green"})
    server.close()


def test_a_store_written_before_org_ids_gains_the_column_and_keeps_its_rows(tmp_path):
    path = tmp_path / "old.sqlite"
    db = sqlite3.connect(path)
    for statement in LIVE_SCHEMA.migrations[0].statements:  # version 1, as stores were written before org ids
        db.execute(statement)
    old = turn("old", 0, T0)
    db.execute("INSERT INTO completions VALUES (?, ?, ?, ?, ?, ?, ?)",
               (old.id, old.session_id, old.user_id, 0, "production", T0, old.model_dump_json()))
    db.execute("INSERT INTO events VALUES ('e', 'outcome', 'old', NULL, 1.0, 1.0, '{\"outcome\": \"merged\"}')")
    db.commit()
    db.close()
    with LiveStore(path) as store:
        assert store.completion("old-0") == old and store.events_for_session("old")[0].org_id == ""
        store.add_completion(turn("new", 0, T0, org="acme"))
        assert [c.id for c in store.completions(org_id="acme")] == ["new-0"]


class _Clock:
    """Simulated time for the cycle: each sleep moves it on, and events due by then arrive."""

    def __init__(self, start: float, store: LiveStore, arrivals: list[Event]):
        self.now, self.store, self.arrivals, self.sleeps = start, store, sorted(arrivals, key=lambda e: e.time), 0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.sleeps += 1
        due = [e for e in self.arrivals if e.time <= self.now]
        self.arrivals = self.arrivals[len(due):]
        if due:
            self.store.add_events(due)


def test_the_cycle_waits_its_late_arrival_window_for_outcomes_and_reports_what_it_left_out(tmp_path):
    store = LiveStore(tmp_path / "live.sqlite")
    for name, start in (("early", T0), ("waited", T0 + 600), ("slow", T0 + 1200), ("mixed", T0 + 1800)):
        for c in session(name, start, version=1 if name == "mixed" else 0):
            store.add_completion(c)
    store.add_events([outcome("early", "merged", T0 + 2 * H)])
    arrivals = [outcome("waited", "ci_green", T0 + 4.5 * H),  # inside the 2 h wait after the batch is full
                outcome("slow", "reverted", T0 + 7.5 * H)]  # after the wait: the next cycle has started
    Registry(tmp_path / "registry").close()
    config = LiveConfig(loop=LoopConfig.at(tmp_path / "live.sqlite", tmp_path / "registry"), run_dir=tmp_path / "run",
                        batch={"min_completions": 6, "outcome_wait_s": 2 * H, "poll_s": 600, "max_wait_s": 24 * H})

    class Control:
        def current(self) -> Deployment:
            return Deployment(production=0)

        def apply(self, deployment: Deployment, note: str) -> None:
            raise AssertionError("gathering changes no deployment")

        def loop(self) -> None:
            return None  # no server to compare live-loop settings with

    clock = _Clock(T0 + 3 * H, store, arrivals)
    cycle = LiveCycle(config, Control(), log=lambda m: None, clock=clock, sleep=clock.sleep)
    state = CycleState(cycle=1, trigger="test", started_at=T0, production=0, first_production=0, since=0.0,
                       events_at_start=0)
    batch, _ = cycle._gather(state, store)
    # Full at once ("early"), then waited 2 h: "waited" came in, "slow" did not.
    assert clock.now == T0 + 5 * H and clock.sleeps == 12
    assert state.batch["background"] == {"sessions": 2, "completions": 12, "outcomes": {"merged": 1, "ci_green": 1},
                                         "left_out": {"open": 1, "other_version": 1}}
    assert {c.session_id for c in batch.completions} == {"early", "waited"}
    assert state.cutoff == T0 + 3 * H - config.loop.rewards.feedback_window_s
    store.close()
