"""SQLite, the embedded default backend of the store interface (flywheel/store/database.py).

A file opened in WAL mode (readers never block the writer, so `flywheel registry list` works while a
run registers checkpoints). `transaction` takes the write lock up front (`BEGIN IMMEDIATE`), so a
read-then-write sequence cannot be interleaved with another writer's, and commits or rolls back as
a whole: a process killed inside it leaves the database as it was before. `snapshot` is a deferred
read transaction: in WAL mode every read inside it sees the database as of its first read.

synchronous: NORMAL is durable against a process crash, and in WAL mode may lose only the last
commits on power loss; FULL also survives power loss at the cost of an fsync per commit. The PRAGMA
cannot change inside a transaction, so `transaction(synchronous)` sets it before BEGIN.

The connection is opened with `check_same_thread=False`; callers that share it between threads
serialise access with a lock (or open one connection per thread).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from flywheel.store.database import IntegrityError, RowRefused, StoreUnavailable, Synchronous, savepoint

# What one row's values can cause. Not OperationalError (disk full, I/O, locked): that is the
# database failing, not the row, and callers must fail the whole operation.
_ROW_ERRORS = (sqlite3.DataError, sqlite3.InterfaceError, OverflowError, UnicodeEncodeError)


class SqliteDatabase:
    dialect = "sqlite"
    insertion_order = "rowid"

    def __init__(self, path: Path, synchronous: Synchronous = "NORMAL", busy_timeout_s: float = 10.0):
        """busy_timeout_s: how long a writer waits for another process's write lock before failing."""
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.url = path, str(path)
        # isolation_level=None: no implicit transactions; writes that belong together use `transaction`.
        self._conn = sqlite3.connect(str(path), timeout=busy_timeout_s, isolation_level=None,
                                     check_same_thread=False)
        self._conn.row_factory = sqlite3.Row
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")
        self._conn.execute("PRAGMA foreign_keys=ON")
        self.synchronous: Synchronous = synchronous
        self._synchronous_now: Synchronous | None = None
        self._set_synchronous(synchronous)

    @contextmanager
    def transaction(self, synchronous: Synchronous | None = None) -> Iterator[SqliteDatabase]:
        """All statements inside commit together or not at all; `synchronous` for this commit only."""
        self._set_synchronous(synchronous or self.synchronous)
        with _unavailable():
            self._conn.execute("BEGIN IMMEDIATE")
        try:
            yield self
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        with _unavailable():
            self._conn.execute("COMMIT")

    @contextmanager
    def snapshot(self) -> Iterator[SqliteDatabase]:
        self._conn.execute("BEGIN")
        try:
            yield self
        finally:
            self._conn.execute("COMMIT")  # nothing was written: ends the read transaction

    savepoint = savepoint  # flywheel/store/database.py: one text for both engines

    def query(self, sql: str, args: Sequence[Any] = ()) -> list[sqlite3.Row]:
        with _row_errors():
            return self._conn.execute(sql, tuple(args)).fetchall()

    def execute(self, sql: str, args: Sequence[Any] = ()) -> int:
        with _row_errors():
            return self._conn.execute(sql, tuple(args)).rowcount

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        with _row_errors():
            self._conn.executemany(sql, rows)

    def insert_new(self, table: str, columns: Sequence[str], key: str, rows: Sequence[Sequence[Any]]) -> set[Any]:
        """Insert `rows`, skipping those whose `key` exists; returns the keys inserted. Inside a transaction."""
        if not rows:
            return set()
        at = list(columns).index(key)
        sql = (f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))}) "
               f"ON CONFLICT ({key}) DO NOTHING")
        before = self._conn.total_changes
        try:
            with self.savepoint("insert_new"):
                self.executemany(sql, rows)
                if self._conn.total_changes - before == len(rows):  # the usual case: the caller checked the keys
                    return {row[at] for row in rows}
                raise _Partial
        except _Partial:
            pass
        # Some keys existed (the caller did not check them first): undone above, now row by row.
        return {row[at] for row in rows if self.execute(sql, row)}

    def has_table(self, name: str) -> bool:
        return bool(self.query("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (name,)))

    def ddl(self, statement: str) -> str:
        return statement  # the portable DDL is SQLite's

    def advisory_lock(self, name: str) -> None:
        """Nothing to take: a `transaction` already holds SQLite's one write lock."""

    def ping(self) -> None:
        """StoreUnavailable unless the file answers a read now."""
        with _unavailable():
            self._conn.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchall()

    def close(self) -> None:
        self._conn.close()

    def _set_synchronous(self, mode: Synchronous) -> None:
        if mode != self._synchronous_now:
            self._conn.execute(f"PRAGMA synchronous={mode}")
            self._synchronous_now = mode


class _Partial(Exception):
    """Raised inside insert_new's savepoint to roll its rows back."""


# sqlite3.OperationalError messages of a database that cannot serve now, not of a statement's bug
# (a missing table, bad SQL): answered as StoreUnavailable, so the caller says "retry".
_UNAVAILABLE = ("database is locked", "database is busy", "disk i/o error", "unable to open database", "disk is full")


@contextmanager
def _unavailable() -> Iterator[None]:
    try:
        yield
    except sqlite3.OperationalError as exc:
        if any(m in str(exc).lower() for m in _UNAVAILABLE):
            raise StoreUnavailable(f"SQLite: {exc}; retry") from exc
        raise


@contextmanager
def _row_errors() -> Iterator[None]:
    try:
        with _unavailable():
            yield
    except sqlite3.IntegrityError as exc:
        raise IntegrityError(str(exc)) from exc
    except _ROW_ERRORS as exc:
        raise RowRefused(f"{type(exc).__name__}: {exc}") from exc
