"""The store interface on both backends: schema versions and migrations, and events stored once when
two stores (as two replicas would) ingest the same batches at the same moment on one PostgreSQL.

The old stores are made the way an older flywheel made them: today's live schema written with plain
sqlite3 and no version table (SQLite), or a PostgreSQL store stopped at schema version 1."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from flywheel.api.events import Event, EventType
from flywheel.live.records import Completion
from flywheel.live.store import LIVE_SCHEMA, SCHEMA, Ingest, LiveStore
from flywheel.model.registry import REGISTRY_SCHEMA, Registry
from flywheel.model.registry import SCHEMA as REGISTRY_V1
from flywheel.store.database import (
    IntegrityError,
    Schema,
    SchemaError,
    connect_url,
    ensure_schema,
    parse_url,
    schema_version,
)

REPO = Path(__file__).resolve().parents[2]


def completion(cid: str, session: str = "s") -> Completion:
    return Completion(id=cid, session_id=session, user_id="u", version=0, prompt_ids=[1], completion_ids=[2],
                      logprobs=[-0.5], latency_ms=1.0, created_at=100.0)


def flywheel(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flywheel.cli", *args], capture_output=True, text=True, timeout=60,
                          cwd=REPO)


def test_urls_pick_the_backend_and_bad_ones_say_the_fix(tmp_path):
    assert parse_url(tmp_path / "a.sqlite").target == str(tmp_path / "a.sqlite")
    assert parse_url("sqlite:///abs/x.sqlite").target == "/abs/x.sqlite"
    assert parse_url("sqlite:rel/x.sqlite").target == "rel/x.sqlite"
    assert parse_url("postgresql://u:secret@h/db").dialect == "postgresql"
    assert "secret" not in str(parse_url("postgresql://u:secret@h/db"))
    with pytest.raises(ValueError, match="postgresql://USER@HOST"):
        parse_url("mysql://h/db")
    with pytest.raises(ConnectionError, match="cannot connect to PostgreSQL"):
        LiveStore("postgresql://nobody@127.0.0.1:1/none?connect_timeout=2")


def test_a_sqlite_store_of_an_older_flywheel_is_upgraded_in_place(tmp_path):
    path = tmp_path / "live.sqlite"
    old = sqlite3.connect(path)  # what flywheel wrote before schema versions: these tables, no version row
    for statement in SCHEMA:
        old.execute(statement)
    old.execute("INSERT INTO completions VALUES ('c1', 's', 'u', 0, 'production', 100.0, ?)",
                (completion("c1").model_dump_json(),))
    old.commit()
    old.close()
    with LiveStore(path) as store:
        assert store.completion("c1") == completion("c1")
        assert store.add_events([Event(id="e1", type=EventType.THUMBS, session_id="s", completion_id="c1", time=1.0,
                                       payload={"up": True})]) == [(Ingest.ACCEPTED, "")]
    db = sqlite3.connect(path)
    assert db.execute("SELECT version FROM flywheel_schema WHERE name = 'live'").fetchone() == (LIVE_SCHEMA.latest,)
    assert "origin" in [column[1] for column in db.execute("PRAGMA table_info(deployments)")]  # migration 2


def test_an_old_registry_index_is_adopted(tmp_path):
    old = sqlite3.connect(tmp_path / "registry.sqlite")
    for statement in REGISTRY_V1:
        old.execute(statement)
    old.close()
    with Registry(tmp_path) as registry:
        assert registry.list() == []
    assert sqlite3.connect(tmp_path / "registry.sqlite").execute(
        "SELECT name, version FROM flywheel_schema").fetchall() == [("registry", REGISTRY_SCHEMA.latest)]


def test_an_older_postgresql_store_is_refused_until_migrated(pg_url):
    db = connect_url(pg_url)
    ensure_schema(db, Schema("live", "completions", LIVE_SCHEMA.migrations[:1]), migrate=True)  # an older flywheel
    db.close()
    latest = LIVE_SCHEMA.latest
    with pytest.raises(SchemaError, match=rf"at schema version 1; this flywheel needs {latest}.*store migrate"):
        LiveStore(pg_url)
    done = flywheel("store", "migrate", pg_url)
    assert done.returncode == 0, done.stderr
    applied = ", ".join(f"v{v}" for v in range(2, latest + 1))
    assert f"live: schema v1 -> v{latest} (applied {applied})" in done.stdout
    with LiveStore(pg_url) as store:
        store.add_completion(completion("c1"))
    again = flywheel("store", "migrate", pg_url)
    assert f"live: schema v{latest} -> v{latest} (already current)" in again.stdout


def test_a_store_newer_than_this_flywheel_is_refused(store_url):
    LiveStore(store_url).close()
    db = connect_url(store_url)
    with db.transaction():
        db.execute("UPDATE flywheel_schema SET version = 99 WHERE name = 'live'")
    assert schema_version(db, LIVE_SCHEMA) == 99
    db.close()
    with pytest.raises(SchemaError, match=f"newer than this flywheel's {LIVE_SCHEMA.latest}: upgrade flywheel"):
        LiveStore(store_url)
    bad = flywheel("store", "migrate", store_url)
    assert bad.returncode == 2 and "newer than this flywheel" in bad.stderr


def test_two_replicas_store_each_retried_event_once(pg_url):
    """Two stores on one PostgreSQL receive the same batches at once (a client retrying against the
    other replica): every event is stored once, and exactly one of the two calls reports it accepted."""
    with LiveStore(pg_url) as setup:
        for i in range(4):
            setup.add_completion(completion(f"c{i}", f"s{i}"))
    replicas = [LiveStore(pg_url), LiveStore(pg_url)]
    batches = [[Event(id=f"b{b}-e{j}", type=EventType.FOLLOWUP, session_id=f"s{j % 4}", completion_id=f"c{j % 4}",
                      time=float(j), payload={"dissatisfied": j % 3 == 0}) for j in range(200)] for b in range(20)]
    outcomes: list[list[list[tuple[Ingest, str]]]] = [[], []]
    start = threading.Barrier(2)

    def ingest(r: int) -> None:
        start.wait()
        for batch in batches:
            outcomes[r].append(replicas[r].add_events(batch))

    threads = [threading.Thread(target=ingest, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for b, batch in enumerate(batches):
        for j, _ in enumerate(batch):
            pair = sorted((outcomes[0][b][j][0], outcomes[1][b][j][0]))
            assert pair == [Ingest.ACCEPTED, Ingest.DUPLICATE], (b, j, pair)
    assert replicas[0].count_events() == 20 * 200
    for replica in replicas:
        replica.close()


def test_a_savepoint_rolls_back_alone_on_both_backends(store_url):
    """One savepoint text for SQLite and PostgreSQL: a refused row inside it undoes only the block,
    and the enclosing transaction commits the rest (PostgreSQL's aborted transaction is usable again)."""
    db = connect_url(store_url, "FULL")
    try:
        with db.transaction():
            db.execute(db.ddl("CREATE TABLE t (k TEXT PRIMARY KEY, v INTEGER NOT NULL)"))
            db.execute("INSERT INTO t (k, v) VALUES (?, ?)", ("kept", 1))
            with pytest.raises(IntegrityError), db.savepoint("row"):
                db.execute("INSERT INTO t (k, v) VALUES (?, ?)", ("undone", 2))
                db.execute("INSERT INTO t (k, v) VALUES (?, ?)", ("kept", 3))  # duplicate key: refused
            with db.savepoint("row"):  # the same name again, after the rollback released it
                db.execute("INSERT INTO t (k, v) VALUES (?, ?)", ("after", 4))
        assert sorted((r[0], r[1]) for r in db.query("SELECT k, v FROM t")) == [("after", 4), ("kept", 1)]
        with pytest.raises(ValueError, match="savepoint name"), db.transaction(), db.savepoint("x; DROP TABLE t"):
            pass
        assert db.has_table("t")
    finally:
        db.close()
