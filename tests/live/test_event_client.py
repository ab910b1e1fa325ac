"""The EventClient against a real server on loopback: batches arrive, flush waits for them, a full
queue drops its oldest events while the server is down and delivery resumes when it is back, an
oversized batch is split, and close gives up after its timeout with every event accounted for."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from tiny_serving import KEYS, ScriptedEngine, free_port

from flywheel.api.http import RunningServer
from flywheel.client import EventClient
from flywheel.live.deploy import Deployment, Router
from flywheel.live.server import LiveServer, ServeConfig, serve_in_thread
from flywheel.live.settings import LoopConfig


def events_server(tmp_path: Path, **config) -> LiveServer:
    # Only the events endpoint is exercised here; a scripted engine stands in for the unused model.
    router = Router(lambda version: (ScriptedEngine([1], version), None), Deployment(production=0))
    return LiveServer(ServeConfig(loop=LoopConfig.at(tmp_path / "live.sqlite"), keys=KEYS,
                                  require_known_completion=False, **config),
                      router)


@pytest.fixture
def server(tmp_path):
    with events_server(tmp_path) as s, serve_in_thread(s) as running:
        yield s, running.url


def test_batches_arrive_and_flush_waits_for_them(server):
    live, url = server
    with EventClient(url, "events-key", batch_size=100, flush_interval_s=0.01) as client:
        ids = [client.emit("followup", session_id=f"s{i % 7}", completion_id=f"c{i}",
                           payload={"dissatisfied": i % 3 == 0})
               for i in range(1234)]
        assert client.flush(timeout_s=60)
        stats = client.stats
        assert (stats.emitted, stats.accepted, stats.queued, stats.failed) == (1234, 1234, 0, 0)
        client.emit("thumbs", session_id="s0", payload={})  # no "up": refused by the server, not retried
        assert client.flush(timeout_s=60)
        assert client.stats.rejected == 1 and client.stats.retries == 0 and '"up"' in client.rejections[0]["reason"]
    assert len(set(ids)) == 1234 and live.store.count_events() == 1234
    assert live.store.events_for_completion("c3")[0].payload == {"dissatisfied": True}
    with pytest.raises(RuntimeError, match="closed"):
        client.emit("thumbs", session_id="s0", payload={"up": True})


def test_a_full_queue_drops_the_oldest_while_the_server_is_down(tmp_path):
    port = free_port()  # nothing listens here yet
    client = EventClient(f"http://127.0.0.1:{port}", "events-key", batch_size=5, max_queue=10,
                         backoff_s=0.02, max_backoff_s=0.1, max_retries=1000, concurrency=1)
    ids = [client.emit("thumbs", session_id="s", payload={"up": True}, event_id=f"e{i}") for i in range(1, 6)]
    deadline = time.monotonic() + 10
    # The sender takes the first batch and retries it against the closed port. Wait for a retry,
    # not only for the queue to empty: under load the check could land between the two.
    while (client.stats.queued or not client.stats.retries) and time.monotonic() < deadline:
        time.sleep(0.005)
    ids += [client.emit("thumbs", session_id="s", payload={"up": True}, event_id=f"e{i}") for i in range(6, 31)]
    stats = client.stats  # every emit returned although nothing listens: emit never waits on the network
    assert (stats.queued, stats.dropped) == (10, 15) and stats.retries > 0
    with events_server(tmp_path) as live, RunningServer(live.app, port=port):
        assert client.flush(timeout_s=60)
        client.close()
        stored = {i for i in ids if live.store.has_event(i)}
    expected = {f"e{i}" for i in [*range(1, 6), *range(21, 31)]}  # e6..e20, the oldest queued, were dropped
    assert stored == expected
    assert client.stats.accepted == 15 and client.stats.settled == 30


def test_an_oversized_batch_is_split(tmp_path):
    with events_server(tmp_path, max_events_per_batch=50) as live, serve_in_thread(live) as running:
        with EventClient(running.url, "events-key", batch_size=120) as client:
            for _ in range(120):
                client.emit("thumbs", session_id="s", payload={"up": True})
            assert client.flush(timeout_s=60)
            assert (client.stats.accepted, client.stats.failed) == (120, 0)
        assert live.store.count_events() == 120


def test_close_gives_up_after_its_timeout_and_counts_what_it_gave_up():
    client = EventClient(f"http://127.0.0.1:{free_port()}", "events-key", batch_size=2, backoff_s=0.05,
                         max_retries=1000)
    for _ in range(3):
        client.emit("thumbs", session_id="s", payload={"up": True})
    started = time.monotonic()
    assert client.close(timeout_s=0.3) is False
    assert time.monotonic() - started < 10
    stats = client.stats
    assert stats.failed == 3 and stats.settled == stats.emitted == 3
    assert "ConnectError" in client.last_error


def test_a_wrong_key_fails_fast(server):
    _, url = server
    with EventClient(url, "inference-key") as client:
        client.emit("thumbs", session_id="s", payload={"up": True})
        assert client.flush(timeout_s=30)
        assert client.stats.failed == 1 and client.stats.retries == 0 and client.last_error.startswith("403")


def test_an_event_that_is_not_json_is_refused_by_emit_and_loses_nothing(server):
    live, url = server
    with EventClient(url, "events-key", batch_size=10, flush_interval_s=0.01) as client:
        client.emit("thumbs", session_id="s0", payload={"up": True})
        for bad in [{"up": True, "tags": {"a", "b"}}, {"up": True, "score": float("nan")}]:
            with pytest.raises(ValueError, match="not JSON"):
                client.emit("thumbs", session_id="s0", payload=bad)
        client.emit("thumbs", session_id="s0", payload={"up": False})
        assert client.flush(timeout_s=60)
        stats = client.stats
        assert (stats.emitted, stats.accepted, stats.failed, stats.rejected) == (2, 2, 0, 0)
    assert [e.payload["up"] for e in live.store.events_for_session("s0")] == [True, False]
