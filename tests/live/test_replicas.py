"""Two `flywheel serve` processes on loopback sharing one real PostgreSQL (store and registry index),
as replicas behind a load balancer would: a session gets the same arm from either, a deployment
change made through one is served by the other within the stated time, and a batch of events sent to
both is stored once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from tiny_serving import free_port, make_registry

from flywheel.live.store import LiveStore

REPO = Path(__file__).resolve().parents[2]
POLL_S = 0.5
# What ServeConfig.deployment_poll_s promises: a change is served everywhere within the poll interval
# plus the time to load a version the replica does not serve yet (the tiny model loads in well under 5 s).
WITHIN_S = POLL_S + 5.0
ADMIN = {"authorization": "Bearer dev-admin-key"}
MESSAGES = [{"role": "user", "content": "Fix the failing test."}]


def start_replica(tmp_path: Path, name: str, registry_root: Path, url: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    settings = {"loop.store.registry_root": str(registry_root), "loop.store.path": str(tmp_path / name / "live.sqlite"),
                "loop.store.url": url, "loop.store.registry_url": url, "port": port, "threads": 1,
                "deployment_poll_s": POLL_S, "candidate_fraction": 0.5}
    cmd = [sys.executable, "-m", "flywheel.cli", "serve", "--config", str(REPO / "configs" / "serve.toml")]
    for key, value in settings.items():
        cmd += ["--set", f"{key}={json.dumps(value)}"]
    log = open(tmp_path / f"{name}.log", "w")  # noqa: SIM115  (closed with the process)
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    return proc, f"http://127.0.0.1:{port}"


def wait_healthy(proc: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, "replica did not come up: " + log.read_text()
        time.sleep(0.2)


def arms(http: httpx.Client, url: str, sessions: list[str]) -> list[tuple[str, int]]:
    out = []
    for session in sessions:
        r = http.post(f"{url}/v1/chat/completions", headers={"authorization": "Bearer dev-inference-key"},
                      json={"model": "flywheel", "messages": MESSAGES, "max_tokens": 1, "session_id": session})
        assert r.status_code == 200, r.text
        out.append((r.json()["flywheel"]["arm"], r.json()["flywheel"]["version"]))
    return out


@pytest.fixture
def replicas(tmp_path, pg_url):
    make_registry(tmp_path / "registry", url=pg_url).close()
    procs = [start_replica(tmp_path, name, tmp_path / "registry", pg_url) for name in ("a", "b")]
    try:
        for (proc, url), name in zip(procs, ("a", "b"), strict=True):
            wait_healthy(proc, url, tmp_path / f"{name}.log")
        yield [url for _, url in procs], [proc.pid for proc, _ in procs], pg_url
    finally:
        for proc, _ in procs:
            proc.terminate()
        for proc, _ in procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.mark.slow  # 28 s on the shared 2-core machine (load ~10)
def test_replicas_on_one_postgresql_route_alike_follow_deployments_and_store_events_once(replicas):
    (a, b), procs_pids, pg_url = replicas
    sessions = [f"user-{i}" for i in range(16)]
    with httpx.Client(timeout=60) as http:
        before = arms(http, a, sessions)
        assert arms(http, b, sessions) == before  # sticky across replicas
        assert {arm for arm, _ in before} == {"production", "candidate"}  # a real split at 0.5

        # A deployment change through replica a: v1 becomes production, v0 the candidate at 0.25.
        changed_at = time.monotonic()
        r = http.post(f"{a}/v1/admin/deployment", headers=ADMIN,
                      json={"production": 1, "candidate": 0, "candidate_fraction": 0.25})
        assert r.status_code == 200, r.text
        wanted = r.json()["deployment"]
        with LiveStore(pg_url) as store:  # the history says which replica made the change
            latest = store.latest_deployment()
        assert latest["note"] == "admin endpoint" and latest["origin"].endswith(f":{a.rsplit(':', 1)[1]} "
                                                                                 f"pid {procs_pids[0]}")
        while http.get(f"{b}/v1/admin/deployment", headers=ADMIN).json()["deployment"] != wanted:
            assert time.monotonic() - changed_at < WITHIN_S, "replica b did not follow the deployment in time"
            time.sleep(0.05)
        seen_after_s = time.monotonic() - changed_at
        after = arms(http, a, sessions)
        assert arms(http, b, sessions) == after
        assert {version for _, version in after} <= {0, 1} and after != before

        # One batch to both replicas (a client retrying elsewhere): stored once.
        completion_id = http.post(f"{a}/v1/chat/completions", headers={"authorization": "Bearer dev-inference-key"},
                                  json={"model": "flywheel", "messages": MESSAGES, "max_tokens": 1,
                                        "session_id": "retry"}).json()["id"]
        batch = {"events": [{"id": f"r{i}", "type": "thumbs", "session_id": "retry", "completion_id": completion_id,
                             "time": 1.0, "payload": {"up": True}} for i in range(50)]}
        first = http.post(f"{a}/v1/events", headers={"authorization": "Bearer dev-events-key"}, json=batch).json()
        second = http.post(f"{b}/v1/events", headers={"authorization": "Bearer dev-events-key"}, json=batch).json()
        assert len(first["accepted"]) == 50 and len(second["duplicate"]) == 50, (first, second)
    print(f"deployment change seen by the other replica after {seen_after_s:.2f} s (poll {POLL_S} s)")
