"""SQLite, the embedded default store: one way to open a database, one way to write to it.

`connect` opens a file in WAL mode (readers never block the writer, so `flywheel registry list`
works while a run registers checkpoints) and applies the caller's schema idempotently
(`CREATE ... IF NOT EXISTS`). `transaction` takes the write lock up front (`BEGIN IMMEDIATE`), so
a read-then-write sequence cannot be interleaved with another writer's, and commits or rolls back
as a whole: a process killed inside it leaves the database as it was before.

The connection is opened with `check_same_thread=False`; callers that share it between threads
serialise access with a lock (or open one connection per thread).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

Synchronous = Literal["OFF", "NORMAL", "FULL", "EXTRA"]


def connect(
    path: str | Path,
    schema: Sequence[str] = (),
    synchronous: Synchronous = "NORMAL",
    busy_timeout_s: float = 10.0,
) -> sqlite3.Connection:
    """Open (creating if needed) the database at `path` and apply `schema`.

    synchronous: NORMAL is durable against a process crash, and in WAL mode may lose only the last
    commits on power loss; FULL also survives power loss at the cost of an fsync per commit. Use
    FULL where a lost commit would contradict files already on disk (the checkpoint index).
    busy_timeout_s: how long a writer waits for another process's write lock before failing.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # isolation_level=None: no implicit transactions; writes that belong together use `transaction`.
    conn = sqlite3.connect(str(path), timeout=busy_timeout_s, isolation_level=None, check_same_thread=False)
    conn.row_factory = sqlite3.Row
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute(f"PRAGMA synchronous={synchronous}")
    conn.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")
    conn.execute("PRAGMA foreign_keys=ON")
    with transaction(conn):
        for statement in schema:
            conn.execute(statement)
    return conn


@contextmanager
def transaction(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """All statements inside commit together or not at all."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
