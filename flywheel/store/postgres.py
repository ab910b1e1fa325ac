"""PostgreSQL, the store interface's backend for a database a team already runs (psycopg 3).

    PostgresDatabase("postgresql://flywheel@db.internal:5432/flywheel")

What differs from SQLite, and how this module hides it:
- Placeholders: callers write `?`; each statement is rewritten to psycopg's `%s` once (cached).
- DDL: SQLite's type names become PostgreSQL's (`INTEGER` -> BIGINT, since versions and counts must
  not stop at 2**31; `REAL` -> DOUBLE PRECISION, PostgreSQL's REAL being 4 bytes;
  `INTEGER PRIMARY KEY AUTOINCREMENT` -> BIGSERIAL PRIMARY KEY).
- Durability: `synchronous` maps to `synchronous_commit`: FULL -> on (a commit returns once its WAL
  is flushed to disk on the server: it survives a crash of the server and of flywheel, and a power
  loss), NORMAL -> off (survives a crash of flywheel, which is all the caller's process needs; a
  crash of PostgreSQL itself may lose the last few hundred ms). Concurrent commits share one WAL
  flush (PostgreSQL's group commit), so replicas committing at once do not each pay an fsync.
- Concurrency: `transaction` is READ COMMITTED, not a table lock like SQLite's BEGIN IMMEDIATE.
  What must not race is written to need no lock: `insert_new` is one `INSERT ... SELECT FROM
  json_populate_recordset(...) ON CONFLICT DO NOTHING RETURNING key` (one statement per batch: the
  throughput path), so two replicas inserting the same event id store it once and each learns which
  rows were its own.
  Schema migrations take an advisory lock.
- `snapshot` is REPEATABLE READ READ ONLY: every query inside it sees one instant of the database.

Reconnection: a lost connection (PostgreSQL restarted or killed, a network cut) fails the call in
flight with `StoreUnavailable` and is dropped; the next call opens a new one, at most one attempt
per `retry_after_s` (so an outage costs each request one refused connect, or nothing within that
window: the server answers 503 with Retry-After in well under a second; `ping`, readiness, always
tries). Before a call starts a transaction on a connection that sat idle, the socket is checked (one
poll, no round trip): a peer that closed it means the server restarted, and a new connection is
opened first, so the first request after the database's return succeeds. A call that failed
mid-transaction is rolled back by PostgreSQL; one that failed in COMMIT has an unknown outcome,
which the caller's retry resolves (events are idempotent on their ids; a completion id is the
server's, and its response was never sent). TCP keepalives and `tcp_user_timeout` bound how long a
call waits on a peer that vanished without closing the connection. One connection per store object,
shared by its threads under the caller's lock: a replica's writes are serialised, and throughput
comes from batching (a request's events in one statement, concurrent completions in one commit) and
from running more replicas.
"""

from __future__ import annotations

import functools
import json
import re
import select
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg import errors as pg_errors

from flywheel.store.database import (
    IntegrityError,
    RowRefused,
    StoreUnavailable,
    Synchronous,
    mask_password,
    savepoint,
)

# What a lost or refused connection raises (OperationalError also covers the server shutting down,
# "the database system is starting up", a cancelled statement): the connection is dropped and the
# call answered StoreUnavailable; a later call reconnects.
_LOST = (psycopg.OperationalError, psycopg.InterfaceError)
# libpq's keepalives and TCP_USER_TIMEOUT (ms): a peer that vanished without closing the socket (a
# host gone, a network cut) fails a call within ~10 s instead of the kernel's ~15 minutes.
_TCP = {"keepalives": 1, "keepalives_idle": 5, "keepalives_interval": 2, "keepalives_count": 3,
        "tcp_user_timeout": 10_000}
_ROW_ERRORS = (psycopg.DataError, UnicodeEncodeError, OverflowError)
_SYNCHRONOUS_COMMIT = {"OFF": "off", "NORMAL": "off", "FULL": "on", "EXTRA": "on"}
_DDL_TYPES = [
    (re.compile(r"\bINTEGER\s+PRIMARY\s+KEY\s+AUTOINCREMENT\b", re.I), "BIGSERIAL PRIMARY KEY"),
    (re.compile(r"\bINTEGER\b", re.I), "BIGINT"),
    (re.compile(r"\bREAL\b", re.I), "DOUBLE PRECISION"),
]


class PgRow(tuple):
    """A result row read by index (`row[0]`) or by column name (`row["id"]`), as sqlite3.Row is."""

    _index: dict[str, int]

    def __new__(cls, values: Sequence[Any], index: dict[str, int]) -> PgRow:
        row = super().__new__(cls, values)
        row._index = index
        return row

    def __getitem__(self, key: Any) -> Any:
        return super().__getitem__(self._index[key] if isinstance(key, str) else key)

    def keys(self) -> list[str]:
        return list(self._index)


def _row_factory(cursor: psycopg.Cursor[Any]) -> Any:
    index = {column.name: i for i, column in enumerate(cursor.description or ())}
    return lambda values: PgRow(values, index)


@functools.lru_cache(maxsize=512)
def _pg_sql(sql: str) -> str:
    # Callers' SQL holds no string literal with a `?` or `%` (they pass values as parameters).
    return sql.replace("%", "%%").replace("?", "%s")


class PostgresDatabase:
    dialect = "postgresql"
    insertion_order = "seq"

    def __init__(self, url: str, synchronous: Synchronous = "NORMAL", connect_timeout_s: int = 10,
                 retry_after_s: float = 0.5):
        """connect_timeout_s: the first connection's (a reconnect waits at most 2 s, libpq's least);
        retry_after_s: the least time between two reconnect attempts while the server is down."""
        self.url = mask_password(url)
        self._target, self.retry_after_s = url, retry_after_s
        self.synchronous: Synchronous = synchronous
        self._synchronous_now: str | None = None
        self._depth = 0  # inside a transaction or snapshot: statements use the connection as it is
        self._next_attempt, self._down_reason = 0.0, ""
        try:
            self._conn: psycopg.Connection[Any] | None = self._connect(connect_timeout_s)
        except psycopg.OperationalError as exc:
            raise ConnectionError(f"cannot connect to PostgreSQL at {self.url}: {str(exc).strip()}; check the URL, "
                                  "that the server runs and that this user may log in (pg_hba.conf)") from exc

    @contextmanager
    def transaction(self, synchronous: Synchronous | None = None) -> Iterator[PostgresDatabase]:
        conn = self._connection()
        with self._lost("BEGIN"):
            self._set_synchronous(conn, synchronous or self.synchronous)
            conn.execute("BEGIN")
        self._depth += 1
        try:
            yield self
        except BaseException:
            self._rollback()
            raise
        finally:
            self._depth -= 1
        with self._lost("COMMIT (its outcome is unknown)"):
            self._live().execute("COMMIT")

    @contextmanager
    def snapshot(self) -> Iterator[PostgresDatabase]:
        conn = self._connection()
        with self._lost("BEGIN"):
            conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        self._depth += 1
        try:
            yield self
        finally:
            self._depth -= 1
            self._rollback()  # nothing was written

    savepoint = savepoint  # flywheel/store/database.py: one text for both engines

    def query(self, sql: str, args: Sequence[Any] = ()) -> list[PgRow]:
        conn = self._statement_connection()
        with self._lost(), _row_errors():
            cursor = conn.execute(_pg_sql(sql), tuple(args))
            return cursor.fetchall() if cursor.description else []

    def execute(self, sql: str, args: Sequence[Any] = ()) -> int:
        conn = self._statement_connection()
        with self._lost(), _row_errors():
            return conn.execute(_pg_sql(sql), tuple(args)).rowcount

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        conn = self._statement_connection()
        with self._lost(), _row_errors(), conn.cursor() as cursor:
            cursor.executemany(_pg_sql(sql), rows)

    def insert_new(self, table: str, columns: Sequence[str], key: str, rows: Sequence[Sequence[Any]]) -> set[Any]:
        """Insert `rows` in one statement, skipping keys that exist (or arrive from another session at
        the same moment); returns the keys this call inserted."""
        if not rows:
            return set()
        # The whole batch as one JSON parameter that PostgreSQL unpacks into rows of the table's own
        # types. One typed array per column (unnest) makes psycopg dump every element in Python: client
        # CPU per 1,000-event batch 15 ms with arrays, 9 ms with JSON (medians of 6, alternated, one run).
        names = ", ".join(columns)
        sql = (f"INSERT INTO {table} ({names}) SELECT {names} FROM json_populate_recordset(NULL::{table}, %s) "
               f"ON CONFLICT ({key}) DO NOTHING RETURNING {key}")
        try:
            batch = json.dumps([dict(zip(columns, row, strict=True)) for row in rows], ensure_ascii=False,
                               allow_nan=False)
        except ValueError as exc:  # a NaN or infinity: no JSON, and no row either
            raise RowRefused(f"{exc}; send finite numbers") from exc
        conn = self._statement_connection()
        with self._lost(), _row_errors():
            cursor = conn.execute(sql, (batch,))
            return {row[0] for row in cursor.fetchall()}

    def has_table(self, name: str) -> bool:
        return bool(self.query("SELECT to_regclass(?) IS NOT NULL", (name,))[0][0])

    def ddl(self, statement: str) -> str:
        for pattern, replacement in _DDL_TYPES:
            statement = pattern.sub(replacement, statement)
        return statement

    def advisory_lock(self, name: str) -> None:
        """Held until the transaction ends; the same name in another session waits."""
        self.query("SELECT pg_advisory_xact_lock(hashtext(?))", (name,))

    def ping(self) -> None:
        """StoreUnavailable unless the server answers a statement now (reconnecting if it must).

        Readiness is asked rarely and must say how things are now, so a ping tries to reconnect
        even within `retry_after_s` of a refused attempt: a store that nothing else used since the
        server's return (the Registry's index between two deployment polls) is not reported down."""
        if not self._depth:
            self._next_attempt = 0.0
        self.query("SELECT 1")

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    # ---- the connection

    def _connect(self, timeout_s: int) -> psycopg.Connection[Any]:
        conn = psycopg.connect(self._target, autocommit=True, row_factory=_row_factory, connect_timeout=timeout_s,
                               **_TCP)
        self._synchronous_now = None  # a new session starts at the server's default
        return conn

    def _connection(self) -> psycopg.Connection[Any]:
        """The connection for a call that starts outside a transaction: the open one if its peer is
        still there, else a new one (StoreUnavailable if the server refuses, or refused less than
        `retry_after_s` ago)."""
        conn = self._conn
        if conn is not None and not conn.closed and not _peer_closed(conn):
            return conn
        self._drop()
        now = time.monotonic()
        if now < self._next_attempt:
            raise StoreUnavailable(f"PostgreSQL at {self.url} is unreachable ({self._down_reason}); retry",
                                   self.retry_after_s)
        try:
            self._conn = self._connect(2)
        except psycopg.OperationalError as exc:
            self._next_attempt = now + self.retry_after_s
            self._down_reason = " ".join(str(exc).split())[:300]
            raise StoreUnavailable(f"PostgreSQL at {self.url} is unreachable ({self._down_reason}); retry",
                                   self.retry_after_s) from exc
        return self._conn

    def _statement_connection(self) -> psycopg.Connection[Any]:
        return self._live() if self._depth else self._connection()

    def _live(self) -> psycopg.Connection[Any]:
        """The connection a transaction runs on (StoreUnavailable if it was lost inside it)."""
        if self._conn is None:
            raise StoreUnavailable(f"the connection to PostgreSQL at {self.url} was lost in this transaction; retry",
                                   self.retry_after_s)
        return self._conn

    @contextmanager
    def _lost(self, what: str = "") -> Iterator[None]:
        try:
            yield
        except _LOST as exc:
            self._drop()
            reason = " ".join(str(exc).split())[:300]
            raise StoreUnavailable(f"PostgreSQL at {self.url} failed{' in ' + what if what else ''}: "
                                   f"{type(exc).__name__}: {reason}; retry", self.retry_after_s) from exc

    def _drop(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except _LOST:  # already broken: nothing left to close
                pass
            self._conn = None

    def _rollback(self) -> None:
        conn = self._conn
        if conn is None or conn.closed:
            return
        try:
            if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                conn.execute("ROLLBACK")
        except _LOST:  # the connection went with the transaction; PostgreSQL rolls it back
            self._drop()

    def _set_synchronous(self, conn: psycopg.Connection[Any], mode: Synchronous) -> None:
        setting = _SYNCHRONOUS_COMMIT[mode]
        if setting != self._synchronous_now:
            conn.execute(f"SET synchronous_commit = {setting}")
            self._synchronous_now = setting


def _peer_closed(conn: psycopg.Connection[Any]) -> bool:
    """Whether an idle connection's socket has something to read: between calls nothing should
    arrive, so it is the server's end of the connection closing (it restarted or was killed)."""
    try:
        readable, _, _ = select.select([conn.fileno()], [], [], 0)
    except (OSError, ValueError, psycopg.OperationalError):  # a closed descriptor
        return True
    return bool(readable)


@contextmanager
def _row_errors() -> Iterator[None]:
    try:
        yield
    except pg_errors.IntegrityError as exc:
        raise IntegrityError(str(exc).strip()) from exc
    except _ROW_ERRORS as exc:
        raise RowRefused(f"{type(exc).__name__}: {str(exc).strip()}") from exc
