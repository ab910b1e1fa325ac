"""The live loop's settings: what `flywheel serve`, `flywheel live` and the dashboard must agree on.

    configs/loop.toml ──loop_file──> ServeConfig.loop   the server writes the store; /dashboard
                      ──loop_file──> LiveConfig.loop    distils and monitors what it holds
                                                        the cycle reads the same store, distils
                                                        and monitors the same way

Where the data is (`StoreConfig`: the live store and the Registry's index), how feedback becomes
rewards (`RewardConfig`) and what the monitors watch (`MonitorConfig`, `SessionMonitorConfig`) are
one `LoopConfig`, defined once and referenced by both commands' configs, so the dashboard and the
cycle's report cannot score the same completions differently, nor look at different stores. The
shipped serve.toml and live.toml both name configs/loop.toml (a test checks that they resolve to
the same settings); in one process (`flywheel demo`, scenarios, benchmarks) the server and the
cycle are given the same object, and the cycle refuses to run against a server whose loop settings
differ (flywheel/live/cycle.py).

These keys lived in ServeConfig (and its `dashboard` table) and LiveConfig before; a config that
still sets one gets an error naming its new place (`MOVED_STORE_KEYS`, `MOVED_LOOP_KEYS`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from flywheel.config import include_file
from flywheel.live.monitors import MonitorConfig
from flywheel.live.rewards import RewardConfig
from flywheel.live.sessions import SessionMonitorConfig
from flywheel.store.database import mask_password

# Keys that moved into LoopConfig from ServeConfig (and its dashboard table) and LiveConfig: a config
# that still sets one is told its new place (`flywheel.config.refuse_moved`), not "extra inputs".
MOVED_WHY = "the live loop's settings, shared by serve, live and the dashboard: flywheel/live/settings.py"
MOVED_STORE_KEYS = {"registry_root": "loop.store.registry_root", "registry_url": "loop.store.registry_url",
                    "store_url": "loop.store.url"}
MOVED_LOOP_KEYS = {"rewards": "loop.rewards", "monitor": "loop.monitor", "session_monitor": "loop.session_monitor"}


class StoreConfig(BaseModel):
    """Where the live loop's data is: the live store (completions, events, deployments) and the Registry."""

    model_config = ConfigDict(extra="forbid")
    # The live store's SQLite file, used when `url` is None. The server's config.json goes beside it.
    path: Path = Path("runs/live/live.sqlite")
    # `postgresql://USER@HOST:PORT/DB`: the store in a PostgreSQL that several server replicas (and
    # the cycle) share; None keeps it in `path`.
    url: str | None = None
    registry_root: Path = Path("runs/registry")  # the checkpoints' folders, which every replica must mount
    # Where the Registry's index is: None keeps registry_root/registry.sqlite; a PostgreSQL URL shares
    # it between replicas.
    registry_url: str | None = None

    @property
    def location(self) -> str | Path:
        """What LiveStore opens: url, else the file at path."""
        return self.url or self.path


class LoopConfig(BaseModel):
    """The settings the live server (its dashboard) and the real-time cycle share.

    `rewards_file` names a TOML file of a RewardConfig; a `[rewards]` table here overrides its
    values key by key (e.g. a shorter feedback window for a demo)."""

    model_config = ConfigDict(extra="forbid")
    store: StoreConfig = Field(default_factory=StoreConfig)
    rewards_file: Path | None = None
    rewards: RewardConfig = Field(default_factory=RewardConfig)
    monitor: MonitorConfig = Field(default_factory=MonitorConfig)
    # Background sessions as wholes (flywheel/live/sessions.py): length, turns before the first edit,
    # the outcome mix; their series and alarms join the per-answer monitors'.
    session_monitor: SessionMonitorConfig = Field(default_factory=SessionMonitorConfig)

    @model_validator(mode="before")
    @classmethod
    def _include_rewards(cls, data: Any) -> Any:
        return include_file(data, "rewards", "rewards_file")

    @classmethod
    def at(cls, store_path: Path, registry_root: Path = Path("runs/registry"), **settings: Any) -> LoopConfig:
        """The loop's settings with its data at `store_path` (SQLite) and `registry_root`."""
        return cls(store=StoreConfig(path=store_path, registry_root=registry_root), **settings)

    def shareable(self) -> dict[str, Any]:
        """The settings as JSON, store URLs' passwords masked: what a server tells an admin
        (GET /v1/admin/loop) and what two configs are compared by."""
        data = self.model_dump(mode="json")
        store = data["store"]
        if store["url"] is not None:
            store["path"] = None  # unused, the store is at url: replicas may each keep their config.json apart
        for key in ("url", "registry_url"):
            if store[key] is not None:
                store[key] = mask_password(store[key])
        return data


def check_same_loop(cycle: LoopConfig, server: dict[str, Any] | None) -> None:
    """Refuse to run a cycle whose loop settings differ from its server's (`server`: the server's
    `shareable()`, None when there is no server to ask), naming each setting that differs."""
    if server is None:
        return
    differ = _differences(cycle.shareable(), server, "loop")
    if differ:
        shown = "; ".join(f"{key}: cycle {mine!r}, server {theirs!r}" for key, mine, theirs in differ[:5])
        more = f" (and {len(differ) - 5} more)" if len(differ) > 5 else ""
        raise ValueError(f"the cycle's live-loop settings differ from the server's ({shown}{more}): the dashboard and "
                         "the cycle would score completions differently, or read different stores; give `flywheel "
                         "serve` and `flywheel live` the same loop_file and no [loop] overrides of their own")


def _differences(mine: Any, theirs: Any, where: str) -> list[tuple[str, Any, Any]]:
    if isinstance(mine, dict) and isinstance(theirs, dict):
        return [d for key in sorted(mine.keys() | theirs.keys())
                for d in _differences(mine.get(key), theirs.get(key), f"{where}.{key}")]
    return [] if mine == theirs else [(where, mine, theirs)]
