"""The store interface: one way to open a database by URL and talk to it, whichever engine holds it.

    open_database(url, schema) ──parse_url──> SqliteDatabase    "runs/live/live.sqlite", "sqlite:///abs/path"
                                          └──> PostgresDatabase  "postgresql://user@host:5432/db"
                               ──> check the schema version ──> upgrade in place | refuse with the command

    db.transaction()  write, commits as a whole      db.query(sql, args) -> rows (by index or by name)
    db.snapshot()     read-only, one consistent view db.execute / executemany / savepoint
    db.insert_new(table, columns, key, rows) -> the keys it inserted; a key already there is skipped

Callers (LiveStore, Registry) write one portable SQL: `?` placeholders, SQLite's type names in DDL
(INTEGER, REAL, TEXT, `INTEGER PRIMARY KEY AUTOINCREMENT`), `ON CONFLICT`, `RETURNING`. Each backend
translates what differs (flywheel/store/sqlite.py, flywheel/store/postgres.py); no SQL outside the
backend modules names one engine. Where the dialects cannot share text (the events table's insertion
order: SQLite's rowid, PostgreSQL's `seq` column), a `Migration` carries a PostgreSQL variant.

Errors: a row the database refuses (constraint, type, range, a NUL in PostgreSQL text) raises
`RowRefused` (`IntegrityError` for a key or constraint), whatever the driver, so callers catch one thing.
A database that cannot be reached raises `StoreUnavailable`; the backend reconnects by itself on a
later call (PostgreSQL: flywheel/store/postgres.py), so a process outlives its database's restarts.
`ping()` says whether the database answers now (the server's /health).

Schema versions: every store keeps its version in `flywheel_schema` (one row per schema name, so the
live store and the registry may share one PostgreSQL database). A store written before versions
existed (its tables are there, no row) is version 1. Opening a store older than this flywheel:
SQLite (embedded, one owner) is upgraded in place under the write lock; PostgreSQL (shared by
replicas that may run older code) is refused with the command that upgrades it,
`flywheel store migrate URL`, unless `migrate=True`. A store newer than this flywheel is refused.
Migrations run in one transaction each (DDL is transactional in both engines), under a lock
(SQLite's write lock, a PostgreSQL advisory lock), so two processes opening one store never both
apply them.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from flywheel.extras import require

Synchronous = Literal["OFF", "NORMAL", "FULL", "EXTRA"]
Dialect = Literal["sqlite", "postgresql"]
VERSION_TABLE = "flywheel_schema"
_SAVEPOINT_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")


class RowRefused(Exception):
    """The database refused a row's values (a constraint, a type, a range); the rest of the work can go on."""


class StoreUnavailable(ConnectionError):
    """The database cannot be reached now (PostgreSQL restarting, a connection cut, SQLite's file
    locked past the busy timeout). Nothing of the failed call is known to be committed: the caller
    answers "retry" (the server: 503 with Retry-After), and the backend reconnects by itself on a
    later call, at most once per `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class IntegrityError(RowRefused):
    """A key or constraint violation (a second completion with the same id)."""


class SchemaError(ValueError):
    """The store's schema version is not this flywheel's: the message says the command that fixes it."""


@dataclass(frozen=True)
class Migration:
    """One step of a schema: the statements that take it from `version - 1` to `version`."""

    version: int
    note: str
    statements: tuple[str, ...]
    postgresql: tuple[str, ...] | None = None  # when PostgreSQL needs other text than the portable one

    def for_dialect(self, dialect: Dialect) -> tuple[str, ...]:
        return self.postgresql if dialect == "postgresql" and self.postgresql is not None else self.statements


@dataclass(frozen=True)
class Schema:
    name: str  # its row in flywheel_schema
    marker_table: str  # a table only this schema makes: present without a version row means version 1
    migrations: tuple[Migration, ...] = field(default=())

    def __post_init__(self) -> None:
        if [m.version for m in self.migrations] != list(range(1, len(self.migrations) + 1)):
            raise ValueError(f"schema {self.name!r}: migrations must be numbered 1, 2, ... in order")

    @property
    def latest(self) -> int:
        return len(self.migrations)


class Row(Protocol):
    def __getitem__(self, key: int | str) -> Any: ...
    def keys(self) -> Sequence[str]: ...


class Database(Protocol):
    """What LiveStore and Registry use; `SqliteDatabase` and `PostgresDatabase` implement it."""

    dialect: Dialect
    url: str  # for messages: a PostgreSQL password is masked
    insertion_order: str  # a column that orders a table's rows as they were inserted ("rowid" / "seq")

    def transaction(self, synchronous: Synchronous | None = None) -> AbstractContextManager[Database]: ...
    def snapshot(self) -> AbstractContextManager[Database]: ...
    def savepoint(self, name: str) -> AbstractContextManager[None]: ...
    def query(self, sql: str, args: Sequence[Any] = ()) -> list[Row]: ...
    def execute(self, sql: str, args: Sequence[Any] = ()) -> int: ...
    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None: ...
    def insert_new(self, table: str, columns: Sequence[str], key: str, rows: Sequence[Sequence[Any]]) -> set[Any]: ...
    def has_table(self, name: str) -> bool: ...
    def ddl(self, statement: str) -> str: ...
    def advisory_lock(self, name: str) -> None: ...
    def ping(self) -> None: ...  # StoreUnavailable unless the database answers now
    def close(self) -> None: ...


@contextmanager
def savepoint(db: Database, name: str) -> Iterator[None]:
    """A nested transaction inside the caller's: rolled back alone if the block raises, the caller's
    transaction going on. One text for both engines: SQLite accepts PostgreSQL's `ROLLBACK TO
    SAVEPOINT` / `RELEASE SAVEPOINT`. Each backend's `savepoint` method is this function."""
    if not _SAVEPOINT_NAME.fullmatch(name):
        raise ValueError(f"savepoint name {name!r} must match [a-z_][a-z0-9_]{{0,62}} (it is written into the SQL)")
    db.execute(f"SAVEPOINT {name}")
    try:
        yield
    except BaseException:
        # After a refused row PostgreSQL's transaction is aborted; rolling back to the savepoint is
        # the one statement it still accepts, and it makes the transaction usable again.
        db.execute(f"ROLLBACK TO SAVEPOINT {name}")
        db.execute(f"RELEASE SAVEPOINT {name}")
        raise
    db.execute(f"RELEASE SAVEPOINT {name}")


@dataclass(frozen=True)
class StoreUrl:
    dialect: Dialect
    target: str  # a file path (SQLite) or the libpq connection URL (PostgreSQL)

    def __str__(self) -> str:
        return self.target if self.dialect == "sqlite" else mask_password(self.target)


def parse_url(url: str | Path) -> StoreUrl:
    """`postgresql://...` / `postgres://...`, `sqlite:///abs/path`, `sqlite:rel/path`, or a plain file path."""
    text = str(url)
    if text.startswith(("postgresql://", "postgres://")):
        return StoreUrl("postgresql", text)
    if text.startswith("sqlite:"):
        path = text.removeprefix("sqlite:")
        path = path[2:] if path.startswith("//") else path  # sqlite:///abs -> /abs
        if not path:
            raise ValueError(f"store URL {text!r} names no file; write sqlite:///absolute/path or sqlite:relative/path")
        return StoreUrl("sqlite", path)
    if "://" in text:
        raise ValueError(f"store URL {text!r}: unknown scheme; use postgresql://USER@HOST:PORT/DB, "
                         "sqlite:///path/to/file.sqlite or a plain file path")
    return StoreUrl("sqlite", text)


def mask_password(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    auth, at, host = rest.rpartition("@")
    if not sep or not at or ":" not in auth:
        return url
    return f"{scheme}://{auth.split(':', 1)[0]}:***@{host}"


def connect_url(url: str | Path, synchronous: Synchronous = "NORMAL") -> Database:
    """A connection to the database at `url`, no schema applied (`open_database` applies one)."""
    parsed = parse_url(url)
    if parsed.dialect == "postgresql":
        require("psycopg", "a postgresql:// database")
        from flywheel.store.postgres import PostgresDatabase  # noqa: PLC0415  (psycopg only where it is used)

        return PostgresDatabase(parsed.target, synchronous=synchronous)
    from flywheel.store.sqlite import SqliteDatabase  # noqa: PLC0415  (the two backends import this module)

    return SqliteDatabase(Path(parsed.target), synchronous=synchronous)


def open_database(url: str | Path, schema: Schema, synchronous: Synchronous = "NORMAL",
                  migrate: bool | None = None) -> Database:
    """Connect and bring `schema` to its latest version (module docstring: when it upgrades, when it refuses).

    migrate: None upgrades SQLite in place and refuses an older PostgreSQL store; True upgrades either.
    """
    db = connect_url(url, synchronous)
    try:
        ensure_schema(db, schema, migrate=(db.dialect == "sqlite") if migrate is None else migrate)
    except BaseException:
        db.close()
        raise
    return db


def schema_version(db: Database, schema: Schema) -> int:
    """The version the store holds: its row, else 1 if its tables predate versions, else 0 (empty)."""
    if db.has_table(VERSION_TABLE):
        rows = db.query(f"SELECT version FROM {VERSION_TABLE} WHERE name = ?", (schema.name,))
        if rows:
            return int(rows[0][0])
    return 1 if db.has_table(schema.marker_table) else 0


def ensure_schema(db: Database, schema: Schema, migrate: bool) -> list[int]:
    """Apply the migrations the store lacks (all of them to an empty store); returns the versions applied."""
    with db.transaction("FULL"):
        db.advisory_lock(f"schema:{schema.name}")  # PostgreSQL; SQLite's transaction already holds the write lock
        db.execute(db.ddl(f"CREATE TABLE IF NOT EXISTS {VERSION_TABLE} (name TEXT PRIMARY KEY, "
                          "version INTEGER NOT NULL, migrated_at REAL NOT NULL)"))
        current = schema_version(db, schema)
        if current > schema.latest:
            raise SchemaError(f"the {schema.name} store at {db.url} is at schema version {current}, newer than this "
                              f"flywheel's {schema.latest}: upgrade flywheel (every replica) before opening it")
        if current == schema.latest:
            if not db.query(f"SELECT 1 FROM {VERSION_TABLE} WHERE name = ?", (schema.name,)):
                _record_version(db, schema)  # a store from before versions, already at the latest: say so
            return []
        if current > 0 and not migrate:
            raise SchemaError(f"the {schema.name} store at {db.url} is at schema version {current}; this flywheel "
                              f"needs {schema.latest}. Stop the replicas that use it, then run `flywheel store "
                              f"migrate {db.url}` (it upgrades in place, in one transaction per step)")
        applied = []
        for migration in schema.migrations[current:]:
            for statement in migration.for_dialect(db.dialect):
                db.execute(db.ddl(statement))
            applied.append(migration.version)
        _record_version(db, schema)
        return applied


def _record_version(db: Database, schema: Schema) -> None:
    db.execute(f"INSERT INTO {VERSION_TABLE} (name, version, migrated_at) VALUES (?, ?, ?) ON CONFLICT (name) "
               "DO UPDATE SET version = excluded.version, migrated_at = excluded.migrated_at",
               (schema.name, schema.latest, time.time()))


def migrate_url(url: str | Path, schemas: Sequence[Schema]) -> Iterator[tuple[str, int, list[int]]]:
    """`flywheel store migrate URL`: upgrade every schema whose tables the store holds.

    Yields (schema name, version before, versions applied); a schema the store has no table of is
    left out (the server or the registry creates it when first opened)."""
    db = connect_url(url, "FULL")
    try:
        for schema in schemas:
            before = schema_version(db, schema)
            if before == 0:
                continue
            yield schema.name, before, ensure_schema(db, schema, migrate=True)
    finally:
        db.close()
