"""Checkpoints and the Registry: every model version the flywheel produced, and which one serves.

    root/
      registry.sqlite          the index: versions, parents, metrics, aliases (the source of truth),
                               unless `url` puts it in PostgreSQL (several servers sharing one registry)
      write.lock               held (flock) by whoever is registering
      checkpoints/v0/          config.json, model.safetensors, generation_config.json,
      checkpoints/v1/          tokenizer files with the chat template, flywheel.json
      checkpoints/.tmp-v2-...  a registration in progress

A checkpoint folder is a plain HF model directory: `AutoModelForCausalLM.from_pretrained(path)` and
`AutoTokenizer.from_pretrained(path)` load it without flywheel. `flywheel.json` records version,
parent, time, note and the metrics at registration; later metrics and the aliases live only in
the index, so a folder never disagrees with the index about what is production.

Writes are atomic, in three steps under the write lock:

    write files into .tmp-vN-*, fsync ──> rename to vN, fsync dir ──> one index transaction
                                                                       (row + aliases, FULL sync)

A crash before the rename leaves only a temp folder; a crash between rename and commit leaves a
folder the index does not know. Both are removed the next time the lock is free (on open and before
each registration), so a killed write leaves the previous state exactly as it was. Readers only
ever see versions whose commit finished.

Adapters: a version may be a LoRA adapter instead of full weights (peft's adapter_model.safetensors
and adapter_config.json in its folder): `base` names the full version it applies on and `org_id`
the organization it specializes for (flywheel/live/orgs.py trains, registers and loads them). Both
are columns of the index (schema version 2) and in flywheel.json.

Aliases (`production`, `candidate`, or any [a-z0-9_-]+ name) point at one version each; moving one
is a single UPDATE, so there is no moment where `production` resolves to nothing.

The index goes through the store interface (flywheel/store/database.py): `Registry(root)` keeps it
in root/registry.sqlite; `Registry(root, url="postgresql://...")` keeps it in PostgreSQL, next to
the live store, while the checkpoint folders stay under `root` (a filesystem every replica mounts).
The write lock is a flock on root/write.lock either way, so registrations from processes on one
machine (or on a filesystem with working flock) are serialised.

torch and transformers are imported only by `load` and `state_dict`, so `flywheel registry list`
starts instantly.
"""

from __future__ import annotations

import fcntl
import json
import re
import shutil
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict

from flywheel.store.database import Database, Migration, Schema, open_database
from flywheel.store.files import publish_folder

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

PRODUCTION = "production"
CANDIDATE = "candidate"
METADATA_FILE = "flywheel.json"
_ALIAS = re.compile(r"[a-z0-9_-]+")
# ASCII digits only (re's \d also takes "٠", an Arabic-Indic zero, which int() reads as 0), and no
# more than a version can have (int() refuses 4,300 digits; such a ref is looked up as an alias).
_VERSION_REF = re.compile(r"v?([0-9]{1,18})")
_TMP_PREFIX = ".tmp-"

SCHEMA = [
    """CREATE TABLE IF NOT EXISTS checkpoints (
        version    INTEGER PRIMARY KEY,
        parent     INTEGER REFERENCES checkpoints(version),
        created_at REAL NOT NULL,
        path       TEXT NOT NULL,              -- relative to the registry root, so the root can move
        metrics    TEXT NOT NULL DEFAULT '{}', -- JSON {name: float}
        note       TEXT NOT NULL DEFAULT ''
    )""",
    """CREATE TABLE IF NOT EXISTS aliases (
        alias      TEXT PRIMARY KEY,
        version    INTEGER NOT NULL REFERENCES checkpoints(version),
        updated_at REAL NOT NULL
    )""",
]
REGISTRY_SCHEMA = Schema("registry", marker_table="checkpoints", migrations=(
    Migration(1, "checkpoints and aliases", tuple(SCHEMA)),
    # Adapters (module docstring): the full version an adapter applies on, and its organization.
    Migration(2, "checkpoints.base, checkpoints.org_id", (
        "ALTER TABLE checkpoints ADD COLUMN base INTEGER REFERENCES checkpoints(version)",
        "ALTER TABLE checkpoints ADD COLUMN org_id TEXT NOT NULL DEFAULT ''")),
))


class Checkpoint(BaseModel):
    """One registered model version; `path` is a folder `from_pretrained` loads."""

    model_config = ConfigDict(extra="forbid")
    version: int
    parent: int | None
    created_at: float
    path: Path
    metrics: dict[str, float]
    aliases: list[str]
    note: str = ""
    base: int | None = None  # an adapter's base version (module docstring); None: full weights
    org_id: str = ""  # the organization an adapter specializes for


class CheckpointNotFound(KeyError):
    """A version or alias the registry does not hold. Prints its message without KeyError's quotes."""

    def __str__(self) -> str:
        return str(self.args[0])


class Registry:
    def __init__(self, root: str | Path, url: str | None = None, migrate: bool | None = None):
        """`url`: where the index lives (default root/registry.sqlite); `migrate` as `open_database` takes it."""
        self.root = Path(root)
        self.checkpoints_dir = self.root / "checkpoints"
        db_path = self.root / "registry.sqlite"
        if url is None and not db_path.exists() and self.checkpoints_dir.is_dir() and any(self._version_dirs()):
            raise ValueError(
                f"{db_path} is missing but {self.checkpoints_dir} holds checkpoint folders; restore the "
                "index file, or move the checkpoints folder away to start an empty registry"
            )
        self.checkpoints_dir.mkdir(parents=True, exist_ok=True)
        self._db: Database = open_database(db_path if url is None else url, REGISTRY_SCHEMA, synchronous="FULL",
                                           migrate=migrate)
        self._db_lock = threading.RLock()  # one connection shared by all threads
        self._write_lock = threading.Lock()  # one registration at a time in this process
        with self._file_lock(blocking=False) as held:
            if held:  # otherwise another process is registering; it cleans up before it writes
                self._discard_unfinished()

    # ---- reading

    def get(self, ref: int | str) -> Checkpoint:
        """A version (3 or "v3") or an alias ("production")."""
        version = self._resolve(ref)
        with self._db_lock:
            rows = self._db.query("SELECT * FROM checkpoints WHERE version = ?", (version,))
            aliases = [r[0] for r in self._db.query(
                "SELECT alias FROM aliases WHERE version = ? ORDER BY alias", (version,))]
        row = rows[0] if rows else None
        if row is None:
            raise CheckpointNotFound(f"no checkpoint {_show(ref)} in the registry at {self.root}; {self._inventory()}")
        return self._record(row, aliases)

    def list(self) -> list[Checkpoint]:
        with self._db_lock:
            rows = self._db.query("SELECT * FROM checkpoints ORDER BY version")
            aliases = self._aliases()
        by_version: dict[int, list[str]] = {}
        for alias, version in sorted(aliases.items()):
            by_version.setdefault(version, []).append(alias)
        return [self._record(row, by_version.get(row["version"], [])) for row in rows]

    def info(self, ref: int | str) -> dict[str, Any]:
        """The version's flywheel.json: what was recorded at registration (an import's source and chat format)."""
        return json.loads((self.get(ref).path / METADATA_FILE).read_text())

    def load(self, ref: int | str,
             dtype: torch.dtype | str | None = None) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
        """The version as a plain model (in `dtype`; None: float32) and its tokenizer. A general LoRA
        adapter version comes merged onto its base (flywheel/model/adapters.py); an organization's
        adapter is refused: it is served on its base by the organization's own router."""
        from flywheel.model.factory import load_pretrained  # noqa: PLC0415  (keeps torch out of `registry list`)

        checkpoint = self.get(ref)
        if checkpoint.base is not None:
            if checkpoint.org_id:
                raise ValueError(f"v{checkpoint.version} is a LoRA adapter of v{checkpoint.base} for "
                                 f"{checkpoint.org_id!r}, not full weights; apply it on its base "
                                 "(flywheel.model.adapters.load_adapted)")
            from flywheel.model.adapters import load_adapted, merged  # noqa: PLC0415  (peft only when asked)

            adapter, tokenizer = load_adapted(self, checkpoint.version, dtype=dtype)
            return merged(adapter), tokenizer
        return load_pretrained(checkpoint.path, dtype=dtype)

    def state_dict(self, ref: int | str) -> dict[str, torch.Tensor]:
        """Weights keyed as `model.state_dict()` is, ready for `Engine.update_weights`.

        Read through `from_pretrained` rather than straight from model.safetensors: transformers
        stores MoE experts one tensor per expert on disk but fuses them (`experts.gate_up_proj`) in
        memory, and writes tied embeddings once; only the loader knows how to map one to the other.
        """
        model, _ = self.load(ref)
        return model.state_dict()

    # ---- writing

    def register(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        parent: int | None = None,
        metrics: Mapping[str, float] | None = None,
        aliases: Sequence[str] = (),
        note: str = "",
        base: int | None = None,
        org_id: str = "",
        metadata: Mapping[str, Any] | None = None,
    ) -> Checkpoint:
        """Write `model` and `tokenizer` as the next version and point `aliases` at it. With `base`,
        `model` is an adapter (a peft model, which saves only its adapter) on that version, for `org_id`.
        `metadata`: more for flywheel.json (an imported model's source and chat format); `info` reads it."""
        metrics = {name: float(value) for name, value in (metrics or {}).items()}
        for alias in aliases:
            _check_alias(alias)
        with self._write_lock, self._file_lock(blocking=True):
            self._discard_unfinished()
            for ref in (parent, base):
                if ref is not None:
                    self.get(ref)  # fail before writing anything
            with self._db_lock:
                version = self._db.query("SELECT COALESCE(MAX(version) + 1, 0) FROM checkpoints")[0][0]
            created_at = time.time()
            final = self.checkpoints_dir / f"v{version}"
            tmp = self.checkpoints_dir / f"{_TMP_PREFIX}v{version}-{uuid.uuid4().hex[:8]}"
            tmp.mkdir()
            record = {"version": version, "parent": parent, "created_at": created_at, "metrics": metrics,
                      "note": note}
            if base is not None:
                record |= {"base": base, "org_id": org_id}
            self._write_files(tmp, model, tokenizer, {**(metadata or {}), **record})
            publish_folder(tmp, final)  # fsynced, then renamed: the folder appears whole or not at all
            self._index(version, parent, created_at, final, metrics, note, aliases, base, org_id)
        return self.get(version)

    def set_alias(self, alias: str, version: int) -> None:
        """Point `alias` at `version`, replacing where it pointed before, in one statement."""
        _check_alias(alias)
        version = self.get(version).version
        with self._db_lock, self._db.transaction():
            self._db.execute(
                "INSERT INTO aliases (alias, version, updated_at) VALUES (?, ?, ?) "
                "ON CONFLICT(alias) DO UPDATE SET version = excluded.version, updated_at = excluded.updated_at",
                (alias, version, time.time()),
            )

    def remove_alias(self, alias: str) -> None:
        with self._db_lock, self._db.transaction():
            if self._db.execute("DELETE FROM aliases WHERE alias = ?", (alias,)) == 0:
                raise CheckpointNotFound(f"no alias {alias!r} in the registry at {self.root}; {self._inventory()}")

    def update_metrics(self, version: int, metrics: Mapping[str, float]) -> None:
        """Merge `metrics` into the version's metrics (eval results arrive after registration)."""
        version = self.get(version).version
        with self._db_lock, self._db.transaction():
            row = self._db.query("SELECT metrics FROM checkpoints WHERE version = ?", (version,))[0]
            merged = json.loads(row[0]) | {name: float(value) for name, value in metrics.items()}
            self._db.execute("UPDATE checkpoints SET metrics = ? WHERE version = ?", (json.dumps(merged), version))

    def ping(self) -> None:
        """StoreUnavailable unless the index answers now (it reconnects by itself: flywheel/store)."""
        with self._db_lock:
            self._db.ping()

    def close(self) -> None:
        with self._db_lock:
            self._db.close()

    def __enter__(self) -> Registry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the steps of a registration (separate so a test can kill a process between them)

    def _write_files(self, tmp: Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                     metadata: dict[str, Any]) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / METADATA_FILE).write_text(json.dumps(metadata, indent=2))

    def _index(self, version: int, parent: int | None, created_at: float, path: Path,
               metrics: dict[str, float], note: str, aliases: Sequence[str], base: int | None = None,
               org_id: str = "") -> None:
        with self._db_lock, self._db.transaction():
            self._db.execute(
                "INSERT INTO checkpoints (version, parent, created_at, path, metrics, note, base, org_id) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (version, parent, created_at, str(path.relative_to(self.root)), json.dumps(metrics), note, base,
                 org_id),
            )
            for alias in aliases:
                self._db.execute(
                    "INSERT INTO aliases (alias, version, updated_at) VALUES (?, ?, ?) "
                    "ON CONFLICT(alias) DO UPDATE SET version = excluded.version, updated_at = excluded.updated_at",
                    (alias, version, created_at),
                )

    # ---- internals

    def _discard_unfinished(self) -> None:
        """Remove what a killed registration left. Call only while holding the write lock."""
        with self._db_lock:
            next_version = self._db.query("SELECT COALESCE(MAX(version) + 1, 0) FROM checkpoints")[0][0]
        for entry in self.checkpoints_dir.iterdir():
            if entry.name.startswith(_TMP_PREFIX):
                shutil.rmtree(entry)
        # A crash between rename and commit can only leave the next version; any other unindexed
        # folder was not made by a registration, so it is left alone (and never listed).
        orphan = self.checkpoints_dir / f"v{next_version}"
        if orphan.is_dir():
            shutil.rmtree(orphan)

    @contextmanager
    def _file_lock(self, blocking: bool) -> Iterator[bool]:
        """The cross-process write lock. The OS drops it when its holder dies, even by SIGKILL."""
        with open(self.root / "write.lock", "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            try:
                yield True
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def _resolve(self, ref: int | str) -> int:
        if isinstance(ref, bool) or not isinstance(ref, int | str):
            raise TypeError(f"checkpoint ref must be a version (3, 'v3') or an alias, got {ref!r}")
        if isinstance(ref, int):
            return ref
        match = _VERSION_REF.fullmatch(ref)
        if match:
            return int(match.group(1))
        version = self._aliases().get(ref)
        if version is None:
            raise CheckpointNotFound(f"no checkpoint {_show(ref)} in the registry at {self.root}; {self._inventory()}")
        return version

    def _aliases(self) -> dict[str, int]:
        with self._db_lock:
            return {alias: version for alias, version in self._db.query("SELECT alias, version FROM aliases")}

    def _inventory(self) -> str:
        with self._db_lock:
            versions = [r[0] for r in self._db.query("SELECT version FROM checkpoints ORDER BY version")]
        if not versions:
            return "it is empty (register a checkpoint first)"
        shown = ", ".join(f"v{v}" for v in versions[:20]) + (", ..." if len(versions) > 20 else "")
        aliases = ", ".join(f"{a} -> v{v}" for a, v in sorted(self._aliases().items())) or "none"
        return f"versions: {shown}; aliases: {aliases}"

    def _record(self, row: Any, aliases: list[str]) -> Checkpoint:
        return Checkpoint(
            version=row["version"],
            parent=row["parent"],
            created_at=row["created_at"],
            path=self.root / row["path"],
            metrics=json.loads(row["metrics"]),
            aliases=aliases,
            note=row["note"],
            base=row["base"],
            org_id=row["org_id"],
        )

    def _version_dirs(self) -> Iterator[Path]:
        return (p for p in self.checkpoints_dir.iterdir() if p.is_dir() and re.fullmatch(r"v[0-9]+", p.name))


def _show(ref: int | str) -> str:
    return f"v{ref}" if isinstance(ref, int) else repr(ref)


def _check_alias(alias: str) -> None:
    if not _ALIAS.fullmatch(alias):
        raise ValueError(f"alias {alias!r} must match [a-z0-9_-]+, e.g. {PRODUCTION!r} or {CANDIDATE!r}")
    if re.fullmatch(r"v?[0-9]+", alias):  # any length: a ref of too many digits must not find an alias
        raise ValueError(f"alias {alias!r} reads as a version number; pick a name, e.g. {CANDIDATE!r}")

