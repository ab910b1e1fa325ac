"""The live loop's settings are one (flywheel/live/settings.py): the dashboard and the cycle score
the same completions identically, and a cycle refuses a server whose settings differ, in one
process and over HTTP. Real SQLite, the real server on loopback, the real cycle's monitors."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
from tiny_serving import KEYS
from tiny_serving import make_registry as tiny_registry

from flywheel.api.events import Event, EventType
from flywheel.live.cycle import CycleState, HttpControl, LiveConfig, LiveCycle, ServerControl
from flywheel.live.monitors import Monitor, MonitorConfig
from flywheel.live.records import Completion, CompletionToolCall
from flywheel.live.rewards import RewardConfig, RewardDistiller
from flywheel.live.server import DashboardConfig, LiveServer, ServeConfig, serve_in_thread
from flywheel.live.sessions import SessionMonitor, watch
from flywheel.live.settings import LoopConfig, StoreConfig, check_same_loop
from flywheel.live.store import LiveStore

HOUR = 3600.0


def edits_and_late_feedback(store_path, start: float) -> None:
    """120 edits over two hours; each kept edit is reported persisted 60 s after its answer: inside
    a 900 s feedback window, late for a 30 s one. So two windows give these answers two rewards."""
    with LiveStore(store_path) as store:
        events = []
        for i in range(120):
            created = start + 60.0 * i
            store.add_completion(Completion(
                id=f"c{i}", session_id=f"s{i}", user_id="u", version=0, prompt_ids=[1, 2], completion_ids=[3, 4],
                logprobs=[-0.1, -0.2], latency_ms=50.0, created_at=created,
                tool_calls=[CompletionToolCall(name="edit_file", arguments={"path": "a.py"})]))
            kind = EventType.EDIT_PERSISTED if i % 3 else EventType.EDIT_REVERTED
            events.append(Event(id=f"e{i}", type=kind, session_id=f"s{i}", completion_id=f"c{i}", time=created + 60.0))
        store.add_events(events)


def cycle_config(tmp_path, loop: LoopConfig) -> LiveConfig:
    return LiveConfig(loop=loop, run_dir=tmp_path / "cycles", monitor_lookback_s=6 * HOUR, threads=1)


def test_the_dashboard_and_the_cycle_score_the_same_completions_identically(tmp_path):
    tiny_registry(tmp_path / "registry").close()
    loop = LoopConfig.at(tmp_path / "live.sqlite", tmp_path / "registry", rewards=RewardConfig(feedback_window_s=30.0),
                         monitor=MonitorConfig(window_s=1800.0))
    window = loop.monitor.window_s  # four whole windows of 30 answers, a third of them reverted
    edits_and_late_feedback(loop.store.path, (time.time() - 4 * HOUR) // window * window + 1.0)
    serve = ServeConfig(loop=loop, keys=KEYS, threads=1, dashboard=DashboardConfig(horizon_s=6 * HOUR))
    server = LiveServer.from_config(serve)
    with serve_in_thread(server) as running:
        reply = httpx.get(f"{running.url}/dashboard/data", headers={"authorization": "Bearer admin-key"}, timeout=60)
        assert reply.status_code == 200, reply.text
        cycle = LiveCycle(cycle_config(tmp_path, serve.loop), ServerControl(server), log=lambda m: None)
        state = CycleState(cycle=1, trigger="manual", started_at=time.time(), production=0, first_production=0,
                           since=0.0, events_at_start=0)
        with LiveStore(loop.store.path) as store:
            cycle._watch(state, store)
    server.close()

    def points(series) -> dict[tuple, tuple]:
        return {(p["metric"], p["version"], p["window_start"]): (p["n"], round(p["value"], 9)) for p in series
                if p["value"] is not None}

    dashboard = points(reply.json()["data"]["monitors"]["series"])
    cycle_series = points(p.model_dump() for p in state.monitor.series)
    assert dashboard == cycle_series
    # Both scored with the loop's 30 s window: every report came 60 s after its answer, late, so each
    # answer has the default reward. Under the reward config's own 900 s (what /dashboard used when
    # it had settings of its own) the same answers score 1 (kept) and -1 (reverted).
    rewards = {key: value for key, (_, value) in cycle_series.items() if key[0] == "reward_mean"}
    assert len(rewards) == 4 and set(rewards.values()) == {0.0}
    with LiveStore(loop.store.path) as store:
        other = watch(store, RewardDistiller(RewardConfig(feedback_window_s=900.0)), Monitor(loop.monitor),
                      SessionMonitor(loop.session_monitor), time.time(), 6 * HOUR, 0)
    assert {key: value for key, (_, value) in points(p.model_dump() for p in other.report.series).items()
            if key[0] == "reward_mean"} == dict.fromkeys(rewards, round(1 / 3, 9))


def test_a_cycle_refuses_a_server_whose_loop_settings_differ(tmp_path):
    tiny_registry(tmp_path / "registry").close()
    loop = LoopConfig.at(tmp_path / "live.sqlite", tmp_path / "registry", rewards=RewardConfig(feedback_window_s=30.0))
    LiveStore(loop.store.path).close()
    server = LiveServer.from_config(ServeConfig(loop=loop, keys=KEYS, threads=1))
    other = loop.model_copy(update={"rewards": RewardConfig(feedback_window_s=900.0)})
    with serve_in_thread(server) as running:
        # In one process: the cycle reads the server's settings directly.
        with pytest.raises(ValueError, match=r"loop\.rewards\.feedback_window_s: cycle 900\.0, server 30\.0"):
            LiveCycle(cycle_config(tmp_path, other), ServerControl(server), log=lambda m: None)
        # Next to `flywheel serve`: over its admin endpoint.
        control = HttpControl(running.url, "admin-key")
        try:
            with pytest.raises(ValueError, match=r"same loop_file"):
                LiveCycle(cycle_config(tmp_path, other), control, log=lambda m: None)
            LiveCycle(cycle_config(tmp_path, loop), control, log=lambda m: None)  # the same settings: it starts
            assert control.loop() == loop.shareable()
        finally:
            control.close()
    server.close()


def test_what_a_server_tells_of_its_loop_settings_holds_no_password_and_matches_across_replicas():
    url = "postgresql://flywheel:secret@db.internal:5432/flywheel"
    loop = LoopConfig(store=StoreConfig(path=Path("runs/a/live.sqlite"), url=url, registry_url=url))
    shared = loop.shareable()
    assert "secret" not in json.dumps(shared)
    assert shared["store"]["url"] == shared["store"]["registry_url"] == "postgresql://flywheel:***@db.internal:5432/flywheel"
    # Replicas on one PostgreSQL keep their config.json apart (path); their loop is still one.
    replica = LoopConfig(store=loop.store.model_copy(update={"path": Path("runs/b/live.sqlite")}))
    check_same_loop(replica, shared)
    with pytest.raises(ValueError, match=r"loop\.store\.path"):
        check_same_loop(LoopConfig.at(Path("runs/a/live.sqlite")),
                        LoopConfig.at(Path("runs/b/live.sqlite")).shareable())
