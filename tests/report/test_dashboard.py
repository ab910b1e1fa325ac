"""The live dashboard: `flywheel serve`'s /dashboard over real HTTP on loopback, and in a real headless Chromium.

The server's store holds a day's traffic as the simulated users make it: production v0 edits in
most answers, candidate v1 stopped editing halfway (the reward hack the monitors watch for). Its
dashboard must show the configured run folder (a simulated-RL run and two cycles) and the monitors
it computes from its own store, with the candidate's alarm marked. In Chromium the page's inline
script must have polled /dashboard/data and redrawn every view with data points.

Chromium: Debian's `chromium` (.ci/run installs it). Without it the browser test is skipped with a
reason, except in CI (FLYWHEEL_CI=1), where it fails: CI must never pass by skipping it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from concurrent.futures import Future
from html.parser import HTMLParser

import httpx
import pytest
from run_folders import write_demo_folder

from flywheel.api.events import Event, EventType
from flywheel.live.deploy import Deployment, Router
from flywheel.live.monitors import MonitorConfig
from flywheel.live.records import Completion, CompletionToolCall
from flywheel.live.server import DashboardConfig, LiveServer, ServeConfig, serve_in_thread
from flywheel.live.settings import LoopConfig
from flywheel.live.store import LiveStore

KEYS = {"inference-key": ["inference"], "dashboard-key": ["dashboard"], "admin-key": ["inference", "events", "admin"]}
WINDOW_S = 60.0


class IdleEngine:
    """The Engine protocol, never asked to generate: these tests read the dashboard only."""

    def __init__(self, version: int):
        self.version = version

    def submit(self, prompt_ids, params) -> Future:
        raise AssertionError("the dashboard tests make no completions")

    def update_weights(self, weights, version: int, timeout_s: float = 60.0) -> None:
        raise AssertionError("the dashboard tests change no weights")

    def close(self) -> None:
        pass


def traffic(store: LiveStore, now: float) -> None:
    """Five windows of answers per version; v1 edits in 70% of answers, then from window 3 on in 10%."""
    edit = [CompletionToolCall(name="edit_file", arguments={"path": "a.py", "old": "-", "new": "+"})]
    for w in range(5):
        start = (now // WINDOW_S - 5 + w) * WINDOW_S
        for version in (0, 1):
            edit_share = 0.1 if version == 1 and w >= 3 else 0.7
            for i in range(40):
                cid = f"c-{version}-{w}-{i}"
                edits = i < edit_share * 40
                store.add_completion(Completion(
                    id=cid, session_id=f"s-{version}-{w}-{i}", user_id="u", version=version, prompt_ids=[1, 2, 3],
                    completion_ids=[4] * (20 + i % 7), logprobs=[-0.1] * (20 + i % 7), latency_ms=50.0,
                    tool_calls=edit if edits else [], content="" if edits else "Which file do you mean?",
                    arm="candidate" if version == 1 else "production", created_at=start + i,
                    request_meta={"ambiguous": False}))
                if edits:
                    store.add_events([Event(id=f"e-{cid}", type=EventType.EDIT_PERSISTED,
                                            session_id=f"s-{version}-{w}-{i}",
                                            completion_id=cid, time=start + i + 5)])


@pytest.fixture(scope="module")
def dashboard(tmp_path_factory):
    root = tmp_path_factory.mktemp("dashboard")
    demo = write_demo_folder(root / "demo")
    config = ServeConfig(loop=LoopConfig.at(root / "live" / "live.sqlite", monitor=MonitorConfig(window_s=WINDOW_S)),
                         keys=KEYS, dashboard=DashboardConfig(report_dirs=[demo, root / "not-yet"], refresh_s=1.0))
    router = Router(lambda version: (IdleEngine(version), None),
                    Deployment(production=0, candidate=1, candidate_fraction=0.5))
    server = LiveServer(config, router, LiveStore(config.loop.store.path))
    traffic(server.store, time.time())
    with serve_in_thread(server) as running:
        yield running.url
    server.close()


def test_the_dashboard_needs_a_dashboard_or_admin_key(dashboard):
    assert httpx.get(f"{dashboard}/dashboard").status_code == 401
    assert httpx.get(f"{dashboard}/dashboard?key=wrong").status_code == 401
    refused = httpx.get(f"{dashboard}/dashboard/data", headers={"Authorization": "Bearer inference-key"})
    assert refused.status_code == 403 and "dashboard" in refused.json()["error"]["message"]
    assert httpx.get(f"{dashboard}/dashboard?key=admin-key").status_code == 200
    assert httpx.get(f"{dashboard}/dashboard/data",
                     headers={"Authorization": "Bearer dashboard-key"}).status_code == 200
    # a dashboard key reads the dashboard only
    assert httpx.get(f"{dashboard}/v1/admin/deployment",
                     headers={"Authorization": "Bearer dashboard-key"}).status_code == 403


def test_the_data_endpoint_has_the_run_folders_and_the_stores_monitors(dashboard):
    reply = httpx.get(f"{dashboard}/dashboard/data?key=dashboard-key")
    assert reply.headers["content-type"] == "application/json"
    data = reply.json()["data"]
    assert [r["name"] for r in data["training"]] == ["demo/train"] and len(data["cycles"]) == 2
    assert data["live"]["production"] == "v0" and data["live"]["completions"] == 2 * 5 * 40
    assert any("not-yet" in p for p in data["problems"])
    assert data["monitors"]["source"].startswith("this server's")
    alarms = [(a["metric"], a["version"], a["severity"]) for a in data["monitors"]["alarms"]]
    assert ("edit_rate", 1, "critical") in alarms
    assert {p["version"] for p in data["monitors"]["series"] if p["metric"] == "edit_rate"} == {0, 1}
    polled = httpx.get(f"{dashboard}/dashboard/data?key=dashboard-key&html_only=1").json()  # what the page asks for
    assert set(polled) == {"generated_at", "html"} and 'id="monitors"' in polled["html"]


class Dom(HTMLParser):
    """The rendered DOM: the body's attributes, and per <section> id the classes of its elements."""

    def __init__(self, page: str):
        super().__init__()
        self.body: dict[str, str] = {}
        self.classes: dict[str, list[str]] = {}
        self._sections: list[str] = []
        self.feed(page)

    def handle_starttag(self, tag, attrs):
        attributes = {k: v or "" for k, v in attrs}
        if tag == "body":
            self.body = attributes
        if tag == "section":
            self._sections.append(attributes.get("id", ""))
        if self._sections:
            self.classes.setdefault(self._sections[-1], []).extend(attributes.get("class", "").split())

    def handle_endtag(self, tag):
        if tag == "section":
            self._sections.pop()

    def count(self, section: str, css_class: str) -> int:
        return self.classes.get(section, []).count(css_class)


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        if os.environ.get("FLYWHEEL_CI") == "1":
            pytest.fail("chromium is not installed, and CI must run the browser test: .ci/run installs it with "
                        "`apt-get install -y chromium`; check that step")
        pytest.skip("chromium is not installed: `apt-get install -y chromium` to run the dashboard's browser test")
    return path


def test_chromium_renders_the_dashboard_with_data_after_polling(dashboard, tmp_path):
    browser = chromium()
    # --virtual-time-budget runs the page's timers (its polls) without waiting for them in real time;
    # it pauses while a fetch is in flight, so the polls complete. --no-sandbox: CI runs as root.
    command = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
               "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=4000",
               "--dump-dom", f"{dashboard}/dashboard?key=dashboard-key"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=90)
    assert result.returncode == 0, result.stderr[-2000:]
    dom = Dom(result.stdout)
    assert int(dom.body.get("data-polls", "0")) >= 1, f"the page's script never refreshed: {dom.body}"
    assert "data-error" not in dom.body, dom.body["data-error"]
    # simulated RL: reward (6 steps), held-out pass rate (3 evals x 3 lines) with its band, staleness, throughput,
    # the draw's frontier share and its estimated and measured pass rates, the engine's decode and prefill
    # tokens/s; each step's anatomy in stacked bars
    assert dom.count("training", "point") == 6 + 3 * 3 + 6 + 6 + 6 + 2 * 6 + 2 * 6
    assert dom.count("training", "band") == 1
    assert dom.count("training", "bar") == 2 and dom.count("training", "stacked") > 0
    # cycles: the gate across cycles and the latest cycle's gate and A/B intervals
    assert dom.count("cycles", "interval") >= 2 * 2 + 2 + 2
    # monitors from the store: every metric a line per version, the candidate's alarm marked
    # (edit_rate, tool_use_rate, clarify_rate_clear, invalid_call_rate, response_length; no reward is final yet)
    assert dom.count("monitors", "line") == 5 * 2 and dom.count("monitors", "point") == 5 * 2 * 5
    assert dom.count("monitors", "alarm") >= 1
    assert "empty" not in dom.classes.get("monitors", []) and "empty" not in dom.classes.get("training", [])


def test_the_dashboard_page_is_self_contained(dashboard):
    page = httpx.get(f"{dashboard}/dashboard?key=admin-key").text
    assert page.startswith("<!DOCTYPE html>") and "fetch(" in page
    for external in ("<script src", "<link", "@import", "https://"):
        assert external not in page
