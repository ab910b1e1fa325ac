"""The live store under kills at random moments: no acknowledged completion is lost, and the store
serves again by itself within seconds of PostgreSQL's return.

A real PostgreSQL 15 (a throwaway cluster of this module's own, since it is killed) takes SIGKILL of
its postmaster and every backend at random moments while writer threads commit completions; a
SQLite store's host process is SIGKILLed at random moments the same way. "Acknowledged" is what a
client could hold: `add_completion` returned (the server sends its 200 only then).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from flywheel.live.records import Completion
from flywheel.live.store import LiveStore
from flywheel.store.database import StoreUnavailable
from flywheel.store.pg_cluster import ThrowawayCluster, server_binaries
from flywheel.store.postgres import PostgresDatabase

REPO = Path(__file__).resolve().parents[2]


def completion(cid: str) -> Completion:
    return Completion(id=cid, session_id="s", user_id="u", version=0, prompt_ids=list(range(32)),
                      completion_ids=list(range(8)), logprobs=[-0.1] * 8, latency_ms=1.0, created_at=time.time())


@pytest.fixture(scope="module")
def cluster():
    if server_binaries() is None:
        pytest.skip("no PostgreSQL server binaries: `apt-get install -y postgresql`")
    with ThrowawayCluster() as cluster:
        yield cluster


class Writers:
    """Threads committing completions through one LiveStore (as the server's request threads do),
    each recording the ids whose commit returned and when."""

    def __init__(self, store: LiveStore, threads: int = 4):
        self.store, self.acked, self.refused = store, [], 0
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._threads = [threading.Thread(target=self._write, daemon=True) for _ in range(threads)]
        for t in self._threads:
            t.start()

    def _write(self) -> None:
        while not self._stop.is_set():
            cid = uuid.uuid4().hex
            try:
                self.store.add_completion(completion(cid))
            except StoreUnavailable:
                with self._lock:
                    self.refused += 1
                time.sleep(0.01)
                continue
            with self._lock:
                self.acked.append((cid, time.monotonic()))

    def first_ack_after(self, moment: float, timeout_s: float) -> float | None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                later = [at for _, at in self.acked if at > moment]
            if later:
                return min(later)
            time.sleep(0.01)
        return None

    def stop(self) -> list[str]:
        self._stop.set()
        for t in self._threads:
            t.join(30)
        return [cid for cid, _ in self.acked]


def test_postgresql_killed_at_random_moments_loses_no_acknowledged_completion_and_is_reconnected(cluster):
    rng = random.Random(46)
    url = cluster.new_schema_url()
    store = LiveStore(url)
    writers = Writers(store)
    recoveries, refusals = [], []
    for _ in range(4):
        time.sleep(rng.uniform(0.05, 0.5))  # a random moment of the writers' commit cycle
        cluster.kill()
        # During the outage a call is refused at once, not after a timeout.
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailable):
            store.ping()
        refusals.append(time.monotonic() - t0)
        time.sleep(rng.uniform(0.1, 0.4))
        cluster.restart()
        back = time.monotonic()
        first = writers.first_ack_after(back, timeout_s=10)
        assert first is not None, "no completion was committed within 10 s of PostgreSQL's return"
        recoveries.append(first - back)
    acked = writers.stop()
    store.close()
    with LiveStore(url) as fresh:
        stored = {c.id for c in fresh.completions()}
    missing = [cid for cid in acked if cid not in stored]
    print(f"postgresql kill -9 x4: {len(acked)} acknowledged, {len(missing)} lost, {writers.refused} refused; "
          f"refused in max {max(refusals) * 1000:.0f} ms; committing again {max(recoveries):.2f} s after restart")
    assert missing == [] and len(acked) > 20
    assert max(refusals) < 1.0 and max(recoveries) < 5.0


def test_readiness_says_how_postgresql_is_now_even_within_the_reconnect_throttle(cluster):
    """A store nothing else uses (the Registry's index between two deployment polls) must not be
    reported down after the server's return because its last refused attempt was recent."""
    db = PostgresDatabase(cluster.new_schema_url(), retry_after_s=60.0)
    try:
        cluster.kill()
        for _ in range(2):  # the second is within the throttle: refused at once, still not cached
            with pytest.raises(StoreUnavailable):
                db.ping()
        with pytest.raises(StoreUnavailable, match="unreachable"):
            db.query("SELECT 1")  # an ordinary call keeps the throttle
        cluster.restart()
        db.ping()  # answers now, not 60 s later
        assert db.query("SELECT 2")[0][0] == 2
    finally:
        db.close()


_SQLITE_WRITER = """
import sys, threading, time, uuid
from flywheel.live.records import Completion
from flywheel.live.store import LiveStore
store = LiveStore(sys.argv[1])
out = threading.Lock()
def write():
    while True:
        cid = uuid.uuid4().hex
        store.add_completion(Completion(id=cid, session_id="s", user_id="u", version=0, prompt_ids=[1, 2],
                                        completion_ids=[3], logprobs=[-0.1], latency_ms=1.0, created_at=time.time()))
        with out:
            print(cid, flush=True)
for _ in range(4):
    threading.Thread(target=write, daemon=True).start()
threading.Event().wait()
"""


def test_sqlite_host_process_killed_at_random_moments_loses_no_acknowledged_completion(tmp_path):
    rng = random.Random(46)
    path = tmp_path / "live.sqlite"
    LiveStore(path).close()  # the schema, before writers race to create it
    acked: list[str] = []
    for _ in range(3):
        proc = subprocess.Popen([sys.executable, "-c", _SQLITE_WRITER, str(path)], cwd=REPO, stdout=subprocess.PIPE,
                                text=True, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
        assert proc.stdout is not None
        acked.append(proc.stdout.readline().strip())  # writing has started
        time.sleep(rng.uniform(0.05, 0.5))
        proc.kill()  # SIGKILL: no handler, no flush of anything not yet written
        acked += [line.strip() for line in proc.stdout if line.strip()]
        proc.wait()
    with LiveStore(path) as store:
        stored = {c.id for c in store.completions()}
    missing = [cid for cid in acked if cid not in stored]
    print(json.dumps({"sqlite_kills": 3, "acknowledged": len(acked), "lost": len(missing)}))
    assert missing == [] and len(acked) > 3
