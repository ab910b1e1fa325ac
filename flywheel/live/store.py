"""The live store: every `Completion` the server returned and every `Event` users sent, in SQLite or PostgreSQL.

    server ──add_completion (before the response leaves)──> completions ──┐
    client ──/v1/events──> check_event ──add_events (one transaction)──> events ──┴──> RewardDistiller
                                                                          deployments (history of routing)

Why one store for both: feedback is joined to the completion it is about by id, and an event that
names a completion this store never served is a client bug, refused at ingestion
(`require_known_completion`) rather than found later as a reward with nothing to attach to.

Durability: `add_events` returns only after its transaction commits; the server acknowledges a
batch only then. With `synchronous="FULL"` (the default) the commit is fsynced, so an acknowledged
event survives a kill -9 of the server, of PostgreSQL, and a power loss; "NORMAL" survives a crash
of the server only (PostgreSQL: `synchronous_commit` off, so a kill -9 of the database can lose the
last few hundred ms) and saves an fsync (1-5 ms) per batch. Completions are committed the same way
before their response is sent, so a 200 means stored: no completion whose id a client holds is lost
to a kill -9 of the server or of PostgreSQL. `completions_synchronous` defaults per backend to the
least that guarantees it: PostgreSQL FULL (`synchronous_commit` on: with it off, a kill -9 of the
database lost acknowledged completions, 8 of ~2,600 in two kills), SQLite NORMAL (a kill -9 of the
server, SQLite's host process, loses nothing in WAL mode: the frames are in the OS's page cache;
FULL adds survival of a power loss, at an fsync per commit). Commits stay cheap by group commit:
completions that arrive while a commit is in flight wait for the next one, which stores them all
(`_GroupCommit`), so a burst of N concurrent requests pays one or two commits (fsyncs), not N
(bench/live.py's `completions` part measures it against the one-commit-each, synchronous-off way
completions were stored before, and counts acknowledged completions lost under kill -9).
Ingestion is idempotent on the client's event id: a second event with a known id is reported
`duplicate` and the first one stands, whatever the second holds.

Outages: a database that cannot be reached raises `StoreUnavailable` from any call (the server
answers 503 with Retry-After; `ping` is its readiness check), and the backend reconnects by itself
on a later call (flywheel/store/postgres.py), so the same process serves again within a second or
so of the database's return.

Nothing stored breaks a later read: every client-supplied value passes `records.storable` (valid
Unicode, finite numbers, bounded integers and nesting) before it is written, a completion's record
is parsed back before its insert, and events are judged one by one: a bad event is rejected with its
reason and the rest of its batch is stored. Should an insert still fail (a check this store lacks),
the batch is retried row by row under savepoints and only the rows the database refuses are rejected.

Readers in other processes (the distiller, `flywheel` reports) open their own `LiveStore` on the
same URL: SQLite's WAL mode, and PostgreSQL, let them read while the server writes. One connection
per `LiveStore`, shared by its threads under a lock. `snapshot()` gives a reader one consistent view
of all three tables (the live cycle joins completions to events and to the deployment they ran under).

Backends (flywheel/store/database.py): a file path or `sqlite:///path` is SQLite, `postgresql://...`
is PostgreSQL. Several server replicas share one store: on PostgreSQL, two replicas receiving the
same retried batch store each event once (`insert_new` is INSERT ... ON CONFLICT DO NOTHING; the
replica whose insert lost reports `duplicate`), and the deployments table is how a deployment
change made through one replica reaches the others (`latest_deployment`, polled by the server).
The durability levels map to PostgreSQL's `synchronous_commit` (FULL: on, NORMAL: off).
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import Any

from flywheel.api.events import OUTCOMES, Event, EventType, followup_text_problem
from flywheel.live.records import Completion, storable
from flywheel.store.database import (
    Database,
    Migration,
    RowRefused,
    Schema,
    StoreUnavailable,
    Synchronous,
    open_database,
)

# Schema version 1: the tables as flywheel wrote them before schema versions existed (a store
# without a version row and with these tables is at version 1). PostgreSQL's events table has a
# `seq` column where SQLite has its implicit rowid: the order events were committed in.
SCHEMA = [
    """CREATE TABLE IF NOT EXISTS completions (
        id         TEXT PRIMARY KEY,
        session_id TEXT NOT NULL,
        user_id    TEXT NOT NULL,
        version    INTEGER NOT NULL,
        arm        TEXT NOT NULL,
        created_at REAL NOT NULL,
        record     TEXT NOT NULL              -- the whole Completion as JSON
    )""",
    "CREATE INDEX IF NOT EXISTS completions_by_version ON completions (version, created_at)",
    "CREATE INDEX IF NOT EXISTS completions_by_time ON completions (created_at)",
    "CREATE INDEX IF NOT EXISTS completions_by_session ON completions (session_id, created_at)",
    """CREATE TABLE IF NOT EXISTS events (
        id            TEXT PRIMARY KEY,       -- the client's id: the idempotency key
        type          TEXT NOT NULL,
        session_id    TEXT NOT NULL,
        completion_id TEXT,
        time          REAL NOT NULL,          -- when it happened, by the client's clock
        received_at   REAL NOT NULL,          -- when it was committed here
        payload       TEXT NOT NULL           -- JSON
    )""",
    "CREATE INDEX IF NOT EXISTS events_by_completion ON events (completion_id)",
    "CREATE INDEX IF NOT EXISTS events_by_session ON events (session_id, time)",
    "CREATE INDEX IF NOT EXISTS events_by_received ON events (received_at)",
    """CREATE TABLE IF NOT EXISTS deployments (
        seq        INTEGER PRIMARY KEY AUTOINCREMENT,
        production INTEGER NOT NULL,
        candidate  INTEGER,
        fraction   REAL NOT NULL,
        changed_at REAL NOT NULL,
        note       TEXT NOT NULL DEFAULT ''
    )""",
]


def _with_event_seq(statements: list[str]) -> list[str]:
    """PostgreSQL's version 1: the events table with `seq`, its insertion order."""
    last_column = "payload       TEXT NOT NULL           -- JSON"
    if sum(last_column in statement for statement in statements) != 1:
        raise AssertionError(f"the events table's last column is no longer {last_column!r}; update _with_event_seq")
    return [statement.replace(last_column, "payload       TEXT NOT NULL,          -- JSON\n        seq           "
                              "BIGSERIAL") for statement in statements]


_PG_SCHEMA = _with_event_seq(SCHEMA)
LIVE_SCHEMA = Schema("live", marker_table="completions", migrations=(
    Migration(1, "completions, events, deployments", tuple(SCHEMA), tuple(_PG_SCHEMA)),
    # Which replica changed the routing: with several servers on one store, the history says who.
    # (No new index on events: each costs every ingested event, ~10% of the rate per index.)
    Migration(2, "deployments.origin", ("ALTER TABLE deployments ADD COLUMN origin TEXT NOT NULL DEFAULT ''",)),
    # The organization a completion or event came from ('' = none: every row written before).
    Migration(3, "completions.org_id, events.org_id", (
        "ALTER TABLE completions ADD COLUMN org_id TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE events ADD COLUMN org_id TEXT NOT NULL DEFAULT ''",
        "CREATE INDEX IF NOT EXISTS completions_by_org ON completions (org_id, version, created_at)")),
    # Each organization's own deployment of adapters (flywheel/live/orgs.py), a history like
    # deployments: replicas follow its newest row per organization. production NULL: the organization
    # is served the shared deployment again (its rollback).
    Migration(4, "org_deployments", ("""CREATE TABLE IF NOT EXISTS org_deployments (
        seq        INTEGER PRIMARY KEY AUTOINCREMENT,
        org_id     TEXT NOT NULL,
        production INTEGER,
        candidate  INTEGER,
        fraction   REAL NOT NULL,
        changed_at REAL NOT NULL,
        note       TEXT NOT NULL DEFAULT '',
        origin     TEXT NOT NULL DEFAULT ''
    )""",)),
))
INSERT_COMPLETION = ("INSERT INTO completions (id, session_id, user_id, version, arm, created_at, record, org_id) "
                     "VALUES (?, ?, ?, ?, ?, ?, ?, ?)")
EVENT_COLUMNS = ("id", "type", "session_id", "completion_id", "time", "received_at", "payload", "org_id")

# Types whose event is about one answer: an edit comes from a completion.
_NEEDS_COMPLETION = {EventType.EDIT_APPLIED, EventType.EDIT_PERSISTED, EventType.EDIT_REVERTED}
_SESSION_OUTCOMES = {"success", "unhappy", "abandoned"}
_MAX_ID_CHARS = 200
_IN_CHUNK = 500  # ids per IN (...) list; SQLite allows 32766 bound parameters, older builds 999
# What one row can cause (the backends raise RowRefused for any driver's). Not a failing database
# (disk full, I/O, locked, connection lost): that fails the batch, which the client retries, where
# rejecting its events would lose them (rejections are not retried).
_ROW_ERRORS = (RowRefused, OverflowError, UnicodeEncodeError)


class Ingest(StrEnum):
    ACCEPTED = "accepted"
    DUPLICATE = "duplicate"
    REJECTED = "rejected"


def check_event(event: Event) -> str | None:
    """Why `event` cannot be stored (beyond its types, which the `Event` model checks), or None."""
    if not event.id or len(event.id) > _MAX_ID_CHARS:
        return f"id must be 1 to {_MAX_ID_CHARS} characters; use e.g. a uuid4 per event"
    for name in ("id", "session_id", "completion_id"):
        reason = storable(getattr(event, name), name) or _text_column(getattr(event, name), name)
        if reason is not None:
            return reason
    if event.completion_id is not None and len(event.completion_id) > _MAX_ID_CHARS:
        return f"completion_id is longer than {_MAX_ID_CHARS} characters; send the `id` of a chat completion"
    if len(event.session_id) > _MAX_ID_CHARS:
        return (f"session_id is longer than {_MAX_ID_CHARS} characters; send the session id the completion request "
                "carried")
    reason = storable(event.payload, "payload")
    if reason is not None:
        return reason
    if not math.isfinite(event.time):
        return f"time must be a finite unix time in seconds, got {event.time}"
    if not event.session_id:
        return "session_id is empty; send the session id the completion request carried"
    if event.type in _NEEDS_COMPLETION and not event.completion_id:
        return f"a {event.type} event must name the completion that made the edit (completion_id)"
    payload = event.payload
    if event.type == EventType.FOLLOWUP and not isinstance(payload.get("dissatisfied"), bool):
        return 'a followup event needs payload {"dissatisfied": true|false}'
    if event.type == EventType.FOLLOWUP and (reason := followup_text_problem(payload)) is not None:
        return reason
    if event.type == EventType.THUMBS and not isinstance(payload.get("up"), bool):
        return 'a thumbs event needs payload {"up": true|false}'
    if event.type == EventType.SESSION_END and payload.get("outcome") not in _SESSION_OUTCOMES:
        return f'a session_end event needs payload {{"outcome": one of {sorted(_SESSION_OUTCOMES)}}}'
    if event.type == EventType.OUTCOME and payload.get("outcome") not in OUTCOMES:
        return f'an outcome event needs payload {{"outcome": one of {list(OUTCOMES)}}}'
    reason = storable(event.org_id, "org_id") or _text_column(event.org_id, "org_id")
    if reason is not None or len(event.org_id) > _MAX_ID_CHARS:
        return reason or f"org_id is longer than {_MAX_ID_CHARS} characters"
    return None


def _text_column(value: str | None, name: str) -> str | None:
    # PostgreSQL's text cannot hold NUL; refused on SQLite too, so a store can move between backends.
    if value is not None and "\x00" in value:
        return f"{name} contains a NUL character (\\u0000); send text without it"
    return None


class LiveStore:
    """Completions, events and the deployment history in one database (a SQLite file or PostgreSQL)."""

    def __init__(self, url: str | Path, synchronous: Synchronous = "FULL",
                 completions_synchronous: Synchronous | None = None, require_known_completion: bool = True,
                 migrate: bool | None = None):
        """`url`: a file path, `sqlite:///path` or `postgresql://...`; `migrate` as `open_database` takes it.
        `completions_synchronous` None: per backend, what survives a kill -9 (module docstring)."""
        self.url = str(url)
        self.require_known_completion = require_known_completion
        self._db: Database = open_database(url, LIVE_SCHEMA, synchronous=synchronous, migrate=migrate)
        self.synchronous = synchronous
        self.completions_synchronous: Synchronous = completions_synchronous or (
            "NORMAL" if self._db.dialect == "sqlite" else "FULL")
        # One connection shared by the server's threads; reentrant so a `snapshot` can hold it across reads.
        self._lock = threading.RLock()
        self._completions = _GroupCommit(self._commit_completions)

    @property
    def dialect(self) -> str:
        return self._db.dialect

    # ---- writing

    def add_completion(self, completion: Completion) -> None:
        """Store `completion`; returns after the commit (a group commit: module docstring). A second
        completion with the same id fails with IntegrityError.

        ValueError, and nothing stored, if its record would not read back (module docstring)."""
        self._completions.commit(self.completion_row(completion))

    def completion_row(self, completion: Completion) -> tuple[Any, ...]:
        """The completions row `add_completion` commits for `completion`, checked: ValueError if its
        record would not read back (bench/live.py commits it the way completions were stored before)."""
        for name in ("id", "session_id", "user_id", "arm", "content", "finish_reason", "org_id"):
            reason = storable(getattr(completion, name), name) or (
                _text_column(getattr(completion, name), name) if name in ("id", "session_id", "user_id", "arm",
                                                                          "org_id")
                else None)
            if reason is not None:
                raise ValueError(f"completion {completion.id!r} not stored: {reason}")
        reason = storable(completion.request_meta, "request_meta")
        if reason is not None:
            raise ValueError(f"completion {completion.id!r} not stored: {reason}")
        record = completion.model_dump_json()
        Completion.model_validate_json(record)  # what every later read does; raises before anything is written
        return (completion.id, completion.session_id, completion.user_id, completion.version, completion.arm,
                completion.created_at, record, completion.org_id)

    def _commit_completions(self, rows: list[tuple[Any, ...]]) -> list[Exception | None]:
        """One transaction for `rows` (the group commit's batch); per row None (stored) or the error
        of a row the database refused (an id stored before), the others stored all the same."""
        try:
            with self._lock, self._db.transaction(self.completions_synchronous):
                self._db.executemany(INSERT_COMPLETION, rows)
            return [None] * len(rows)
        except _ROW_ERRORS:  # rolled back whole: again row by row, each refused row alone
            pass
        errors: list[Exception | None] = [None] * len(rows)
        with self._lock, self._db.transaction(self.completions_synchronous):
            for i, row in enumerate(rows):
                try:
                    with self._db.savepoint("completion"):
                        self._db.execute(INSERT_COMPLETION, row)
                except _ROW_ERRORS as exc:
                    errors[i] = exc
        return errors

    def add_events(self, events: Sequence[Event]) -> list[tuple[Ingest, str]]:
        """Store a batch in one transaction; per event (accepted | duplicate | rejected, reason).

        Returns after the commit, so every `accepted` or `duplicate` is durable when the caller sees it.
        Known completions are looked up inside the transaction; which ids exist is decided by the
        insert itself (ON CONFLICT DO NOTHING), so a replica committing the same id at the same moment
        makes this one report `duplicate`, never a second copy.
        """
        received = time.time()
        results: list[tuple[Ingest, str]] = []
        rows = []
        # Checked before any lookup: an id the database cannot bind must not fail the batch's queries.
        own_reasons = [check_event(e) for e in events]
        checked = [e for e, reason in zip(events, own_reasons, strict=True) if reason is None]
        with self._lock:
            with self._db.transaction(self.synchronous):
                # One set lookup per batch instead of a statement per event: 5x the ingest rate.
                sessions = self._completion_sessions({e.completion_id for e in checked if e.completion_id is not None})
                seen: set[str] = set()  # this batch's ids: a second event with one is a duplicate
                for event, own_reason in zip(events, own_reasons, strict=True):
                    reason = own_reason or self._check_reference(event, sessions)
                    if reason is not None:
                        results.append((Ingest.REJECTED, reason))
                    elif event.id in seen:
                        results.append((Ingest.DUPLICATE, ""))
                    else:
                        seen.add(event.id)
                        results.append((Ingest.ACCEPTED, ""))
                        rows.append((len(results) - 1, (event.id, event.type.value, event.session_id,
                                                        event.completion_id, event.time, received,
                                                        json.dumps(event.payload, allow_nan=False),
                                                        event.org_id)))
                try:
                    with self._db.savepoint("batch"):
                        inserted = self._db.insert_new("events", EVENT_COLUMNS, "id", [row for _, row in rows])
                except _ROW_ERRORS:
                    inserted = self._insert_one_by_one(rows, results)
                # Not inserted: the id was stored before (or by another replica a moment ago).
                for index, row in rows:
                    if row[0] not in inserted and results[index][0] == Ingest.ACCEPTED:
                        results[index] = (Ingest.DUPLICATE, "")
        return results

    def _insert_one_by_one(self, rows: list[tuple[int, tuple[Any, ...]]],
                           results: list[tuple[Ingest, str]]) -> set[str]:
        """The batch's rows each under its own savepoint; a row the database refuses is rejected alone.

        Returns the ids inserted. Caller holds the lock."""
        inserted: set[str] = set()
        for index, row in rows:
            try:
                with self._db.savepoint("event"):
                    inserted |= self._db.insert_new("events", EVENT_COLUMNS, "id", [row])
            except _ROW_ERRORS as exc:
                results[index] = (Ingest.REJECTED, f"the store refused this event ({type(exc).__name__}: {exc}); "
                                                    "check its strings and numbers")
        return inserted

    def record_deployment(self, production: int, candidate: int | None, fraction: float, note: str = "",
                          origin: str = "") -> int:
        """Append to the routing history; returns the row's `seq` (what `latest_deployment` orders by).

        origin: who made the change (the server writes its host, port and pid)."""
        with self._lock, self._db.transaction(self.synchronous):
            return self._db.query(
                "INSERT INTO deployments (production, candidate, fraction, changed_at, note, origin) "
                "VALUES (?, ?, ?, ?, ?, ?) RETURNING seq", (production, candidate, fraction, time.time(), note,
                                                             origin))[0][0]

    def latest_deployment(self) -> dict[str, Any] | None:
        """The last row of the routing history (seq, production, candidate, fraction, changed_at, note, origin)."""
        rows = self._query("SELECT * FROM deployments ORDER BY seq DESC LIMIT 1")
        return dict(rows[0]) if rows else None

    def record_org_deployment(self, org_id: str, production: int | None, candidate: int | None, fraction: float,
                              note: str = "", origin: str = "") -> int:
        """Append to an organization's routing history (production None: back to the shared
        deployment); returns the row's `seq`, which `org_deployments` rows are ordered by."""
        with self._lock, self._db.transaction(self.synchronous):
            return self._db.query(
                "INSERT INTO org_deployments (org_id, production, candidate, fraction, changed_at, note, origin) "
                "VALUES (?, ?, ?, ?, ?, ?, ?) RETURNING seq",
                (org_id, production, candidate, fraction, time.time(), note, origin))[0][0]

    def latest_org_deployments(self, after_seq: int = 0) -> dict[str, dict[str, Any]]:
        """Organization -> the newest row of its routing history, for the organizations whose newest
        row has seq > `after_seq` (what a replica has not served yet)."""
        rows = self._query("SELECT * FROM org_deployments WHERE seq IN (SELECT MAX(seq) FROM org_deployments "
                           "GROUP BY org_id) AND seq > ? ORDER BY org_id", (after_seq,))
        return {r["org_id"]: dict(r) for r in rows}

    @contextmanager
    def snapshot(self) -> Iterator[LiveStore]:
        """Every read inside sees the store at one instant (other threads of this store wait)."""
        with self._lock, self._db.snapshot():
            yield self

    # ---- reading (what the reward distiller, the A/B analysis and the monitors need)

    def completion(self, completion_id: str) -> Completion | None:
        rows = self._query("SELECT record FROM completions WHERE id = ?", (completion_id,))
        return Completion.model_validate_json(rows[0][0]) if rows else None

    def completions(self, version: int | None = None, start: float | None = None, end: float | None = None,
                    arm: str | None = None, session_id: str | None = None,
                    limit: int | None = None, org_id: str | None = None) -> list[Completion]:
        """Completions in time order, filtered by version, arm, session, organization and
        `start <= created_at < end`."""
        where, args = _filters(version=version, arm=arm, session_id=session_id, org_id=org_id, start=start, end=end,
                               column="created_at")
        sql = f"SELECT record FROM completions{where} ORDER BY created_at, id" + (" LIMIT ?" if limit else "")
        rows = self._query(sql, (*args, limit) if limit else args)
        return [Completion.model_validate_json(r[0]) for r in rows]

    def count_completions(self, version: int | None = None, arm: str | None = None) -> int:
        where, args = _filters(version=version, arm=arm)
        return self._query(f"SELECT COUNT(*) FROM completions{where}", args)[0][0]

    def events_for_completion(self, completion_id: str) -> list[Event]:
        return self.events_for_completions([completion_id]).get(completion_id, [])

    def events_for_completions(self, completion_ids: Iterable[str]) -> dict[str, list[Event]]:
        """Events by completion id, each list in event-time order; ids without events are absent."""
        ids = list(dict.fromkeys(completion_ids))
        out: dict[str, list[Event]] = {}
        for chunk in range(0, len(ids), 500):  # SQLite caps the number of bound parameters
            part = ids[chunk : chunk + 500]
            rows = self._query(f"SELECT * FROM events WHERE completion_id IN ({','.join('?' * len(part))}) "
                               "ORDER BY time, id", part)
            for row in rows:
                out.setdefault(row["completion_id"], []).append(_event(row))
        return out

    def events_for_session(self, session_id: str) -> list[Event]:
        return [_event(r) for r in self._query("SELECT * FROM events WHERE session_id = ? ORDER BY time, id",
                                               (session_id,))]

    def events(self, types: Sequence[EventType | str] | None = None, start: float | None = None,
               end: float | None = None) -> list[Event]:
        """Events received (committed here) in `start <= received_at < end`, in that order."""
        where, args = _filters(start=start, end=end, column="received_at")
        if types:
            where += (" AND " if where else " WHERE ") + f"type IN ({','.join('?' * len(types))})"
            args = (*args, *(str(t) for t in types))
        order = self._db.insertion_order
        return [_event(r) for r in self._query(f"SELECT * FROM events{where} ORDER BY received_at, {order}", args)]

    def has_event(self, event_id: str) -> bool:
        return bool(self._query("SELECT 1 FROM events WHERE id = ?", (event_id,)))

    def count_events(self) -> int:
        return self._query("SELECT COUNT(*) FROM events")[0][0]

    def deployments(self) -> list[dict[str, Any]]:
        """The routing history, oldest first: production, candidate, fraction, changed_at, note."""
        return [dict(r) for r in self._query("SELECT * FROM deployments ORDER BY seq")]

    def ping(self) -> None:
        """StoreUnavailable unless the database answers now (reconnecting if it must): readiness."""
        with self._lock:
            self._db.ping()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> LiveStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals

    def _check_reference(self, event: Event, sessions: dict[str, str]) -> str | None:
        if not self.require_known_completion or event.completion_id is None:
            return None
        session = sessions.get(event.completion_id)
        if session is None:
            return (f"unknown completion_id {event.completion_id!r}: send the `id` of a chat completion this "
                    "server returned")
        if session != event.session_id:
            return f"completion {event.completion_id!r} belongs to session {session!r}, not {event.session_id!r}"
        return None

    def _completion_sessions(self, ids: set[str]) -> dict[str, str]:
        if not self.require_known_completion:
            return {}
        return dict(self._in("SELECT id, session_id FROM completions WHERE id IN ({})", ids))

    def _in(self, sql: str, values: set[str]) -> list[Any]:
        """`sql` with its IN list filled, in chunks under SQLite's bound-parameter limit. Caller holds the lock."""
        items, rows = list(values), []
        for start in range(0, len(items), _IN_CHUNK):
            part = items[start : start + _IN_CHUNK]
            rows += self._db.query(sql.format(",".join("?" * len(part))), part)
        return rows

    def _query(self, sql: str, args: Sequence[Any] = ()) -> list[Any]:
        with self._lock:
            return self._db.query(sql, args)


class _GroupCommit:
    """Rows from concurrent callers committed together: each `commit(row)` returns once a transaction
    holding its row has committed (or raises its row's error, or the transaction's).

    No thread of its own: a caller that finds no commit in flight leads: it commits its row and every
    row waiting (up to `max_rows`), wakes their callers, and hands the lead to the first row that
    arrived meanwhile, whose caller commits the next batch. One caller alone pays one commit, as
    before; a burst of N concurrent callers pays about N / (rows per commit) commits (fsyncs). Each
    caller waits on its own event: a commit wakes only the callers it concerns.

        caller ──row──> (no commit in flight) lead: write(own row + waiting rows) ──> wake each, hand off
                   └──> (a commit in flight) wait: done (return / raise) | handed the lead
    """

    def __init__(self, write: Any, max_rows: int = 512):
        self._write, self._max_rows = write, max_rows
        self._lock = threading.Lock()
        self._pending: list[_Row] = []
        self._committing = False

    def commit(self, values: tuple[Any, ...]) -> None:
        row = _Row(values)
        with self._lock:
            lead = not self._committing
            if lead:
                self._committing = True
            else:
                self._pending.append(row)
        if not lead:
            row.wake.wait()
            if row.done:
                row.raise_error()
                return
        with self._lock:  # leading: its own row and what waits, up to max_rows
            batch = [row, *self._pending[: self._max_rows - 1]]
            self._pending = self._pending[self._max_rows - 1 :]
        errors: list[Exception | None] = []
        try:
            errors = self._write([r.values for r in batch])
        except Exception as exc:  # noqa: BLE001  (the whole transaction failed: every row of it hears why)
            errors = [exc] * len(batch)
        finally:
            for i, r in enumerate(batch):  # an interrupted write leaves no caller waiting forever
                r.error = errors[i] if i < len(errors) else RuntimeError("the commit was interrupted")
                r.done = True
                if r is not row:
                    r.wake.set()
            with self._lock:
                if self._pending:
                    self._pending.pop(0).wake.set()  # not done: its caller leads the next commit
                else:
                    self._committing = False
        row.raise_error()


class _Row:
    __slots__ = ("done", "error", "values", "wake")

    def __init__(self, values: tuple[Any, ...]):
        self.values, self.done, self.error = values, False, None
        self.wake = threading.Event()

    def raise_error(self) -> None:
        error = self.error
        if error is None:
            return
        if isinstance(error, StoreUnavailable):  # each waiting thread raises its own instance
            raise StoreUnavailable(str(error), error.retry_after_s) from error
        if isinstance(error, RowRefused):
            raise type(error)(str(error)) from error
        raise RuntimeError(f"the commit of this completion failed: {type(error).__name__}: {error}") from error


def _filters(column: str = "created_at", start: float | None = None, end: float | None = None,
             **equal: Any) -> tuple[str, tuple[Any, ...]]:
    clauses, args = [], []
    for name, value in equal.items():
        if value is not None:
            clauses.append(f"{name} = ?")
            args.append(value)
    if start is not None:
        clauses.append(f"{column} >= ?")
        args.append(start)
    if end is not None:
        clauses.append(f"{column} < ?")
        args.append(end)
    return (" WHERE " + " AND ".join(clauses) if clauses else ""), tuple(args)


def _event(row: Any) -> Event:
    return Event(id=row["id"], type=EventType(row["type"]), session_id=row["session_id"],
                 completion_id=row["completion_id"], time=row["time"], payload=json.loads(row["payload"]),
                 org_id=row["org_id"])
