"""GET /metrics: the live server's Prometheus metrics, read back with prometheus_client's own parser
after real completions (a real tiny model over HTTP on loopback) and a batch of events."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tiny_serving import KEYS

from flywheel.live.server import LiveServer, ServeConfig, serve_in_thread
from flywheel.live.settings import LoopConfig
from flywheel.model.chat import SYSTEM_PROMPT

MESSAGES = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "Fix the failing test."}]


@pytest.fixture(scope="module")
def live(registry_root, tmp_path_factory):
    config = ServeConfig(loop=LoopConfig.at(tmp_path_factory.mktemp("live") / "live.sqlite", registry_root), keys=KEYS,
                         candidate_fraction=0.5, threads=1)
    server = LiveServer.from_config(config)
    with serve_in_thread(server) as running:
        yield server, running.url
    server.close()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_count_requests_latency_tokens_arms_and_events(live):
    server, url = live
    auth = {"authorization": "Bearer inference-key"}
    ids, usage = [], {"prompt": 0, "completion": 0}
    with httpx.Client(base_url=url, timeout=60) as http:
        for i in range(3):
            reply = http.post("/v1/chat/completions", headers={**auth, "x-session-id": f"metrics-{i}"},
                              json={"model": "flywheel", "messages": MESSAGES, "max_tokens": 4}).json()
            ids.append((reply["id"], reply["flywheel"]["arm"], reply["flywheel"]["version"]))
            usage["prompt"] += reply["usage"]["prompt_tokens"]
            usage["completion"] += reply["usage"]["completion_tokens"]
        assert http.post("/v1/chat/completions", headers=auth, json={"model": "flywheel"}).status_code == 400
        events = [{"id": "e1", "completion_id": ids[0][0], "session_id": "metrics-0", "type": "thumbs",
                   "time": 1.0, "payload": {"up": True}},
                  {"id": "e2", "completion_id": "chatcmpl-never-served", "session_id": "metrics-0", "type": "thumbs",
                   "time": 1.0, "payload": {"up": True}}]
        assert http.post("/v1/events", headers={"authorization": "Bearer events-key"},
                         json={"events": events}).status_code == 200
        assert http.get("/metrics", headers=auth).status_code == 403  # the inference scope does not read it
        assert http.get("/nowhere", headers=auth).status_code == 404
        text = http.get("/metrics", headers={"authorization": "Bearer admin-key"}).text
    got = samples(text)
    assert got[("flywheel_requests_total", (("route", "/v1/chat/completions"), ("status", "200")))] == 3
    assert got[("flywheel_requests_total", (("route", "/v1/chat/completions"), ("status", "400")))] == 1
    assert got[("flywheel_requests_total", (("route", "other"), ("status", "404")))] == 1
    assert got[("flywheel_request_seconds_count", (("route", "/v1/chat/completions"),))] == 4
    assert got[("flywheel_tokens_total", (("kind", "prompt"),))] == usage["prompt"]
    assert got[("flywheel_tokens_total", (("kind", "completion"),))] == usage["completion"]
    by_arm: dict[tuple[str, str], int] = {}
    for _, arm, version in ids:
        by_arm[(arm, f"v{version}")] = by_arm.get((arm, f"v{version}"), 0) + 1
    for (arm, version), n in by_arm.items():
        assert got[("flywheel_completions_total", (("arm", arm), ("version", version)))] == n
    assert sum(v for (name, _), v in got.items() if name == "flywheel_engine_seconds_count") == 3
    assert all(v == 0 for (name, _), v in got.items() if name == "flywheel_engine_requests_in_flight")
    assert got[("flywheel_events_total", (("outcome", "accepted"),))] == 1
    assert got[("flywheel_events_total", (("outcome", "rejected"),))] == 1
