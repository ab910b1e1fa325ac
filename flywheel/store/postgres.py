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

What it does not do: reconnect. A dropped connection (PostgreSQL restarted, a network cut) fails
each later call with psycopg's OperationalError; restart the flywheel process (its clients retry
unacknowledged batches, so nothing acknowledged is lost). One connection per store object, shared
by its threads under the caller's lock: a replica's writes are serialised, and throughput comes from
batching (a request's events in one statement) and from running more replicas.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg import errors as pg_errors

from flywheel.store.database import IntegrityError, RowRefused, Synchronous, mask_password, savepoint

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

    def __init__(self, url: str, synchronous: Synchronous = "NORMAL", connect_timeout_s: int = 10):
        self.url = mask_password(url)
        try:
            self._conn = psycopg.connect(url, autocommit=True, row_factory=_row_factory,
                                         connect_timeout=connect_timeout_s)
        except psycopg.OperationalError as exc:
            raise ConnectionError(f"cannot connect to PostgreSQL at {self.url}: {str(exc).strip()}; check the URL, "
                                  "that the server runs and that this user may log in (pg_hba.conf)") from exc
        self.synchronous: Synchronous = synchronous
        self._synchronous_now: str | None = None

    @contextmanager
    def transaction(self, synchronous: Synchronous | None = None) -> Iterator[PostgresDatabase]:
        self._set_synchronous(synchronous or self.synchronous)
        self._conn.execute("BEGIN")
        try:
            yield self
        except BaseException:
            self._rollback()
            raise
        self._conn.execute("COMMIT")

    @contextmanager
    def snapshot(self) -> Iterator[PostgresDatabase]:
        self._conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        try:
            yield self
        finally:
            self._rollback()  # nothing was written

    savepoint = savepoint  # flywheel/store/database.py: one text for both engines

    def query(self, sql: str, args: Sequence[Any] = ()) -> list[PgRow]:
        with _row_errors():
            cursor = self._conn.execute(_pg_sql(sql), tuple(args))
            return cursor.fetchall() if cursor.description else []

    def execute(self, sql: str, args: Sequence[Any] = ()) -> int:
        with _row_errors():
            return self._conn.execute(_pg_sql(sql), tuple(args)).rowcount

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        with _row_errors(), self._conn.cursor() as cursor:
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
        with _row_errors():
            cursor = self._conn.execute(sql, (batch,))
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

    def close(self) -> None:
        self._conn.close()

    def _rollback(self) -> None:
        if self._conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            self._conn.execute("ROLLBACK")

    def _set_synchronous(self, mode: Synchronous) -> None:
        setting = _SYNCHRONOUS_COMMIT[mode]
        if setting != self._synchronous_now:
            self._conn.execute(f"SET synchronous_commit = {setting}")
            self._synchronous_now = setting


@contextmanager
def _row_errors() -> Iterator[None]:
    try:
        yield
    except pg_errors.IntegrityError as exc:
        raise IntegrityError(str(exc).strip()) from exc
    except _ROW_ERRORS as exc:
        raise RowRefused(f"{type(exc).__name__}: {str(exc).strip()}") from exc
