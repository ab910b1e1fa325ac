"""Which model version answers a session: the `Deployment` record and the `Router` that applies it.

    Deployment(production=3, candidate=4, candidate_fraction=0.1)
        route(session) ──hash(candidate, session) < 0.1──> candidate v4
                       └─otherwise──────────────────────> production v3

    Router.deploy(new) ──load engines new versions need (slow, outside the lock)──> swap the record
                       ──> retire engines no arm uses (each closes when its last request finishes)

A deployment is production plus at most one candidate that gets a sticky share of sessions. The
split is sticky by hashing the session id with the candidate's version: a session stays on its arm
for as long as that candidate is deployed at that fraction; raising the fraction only moves
sessions from production to the candidate, never back; a new candidate draws a new split, so the
same users are not always the ones who try new versions.

The Router holds one engine per served version and leases it per request (`checkout` / `release`).
Route and lease happen under one lock that `deploy` also takes, so a request never leases an engine
that a concurrent deployment change has already retired; a retired engine finishes the requests it
has, then closes. The Router keeps the Registry's `production` / `candidate` aliases in step with
the record (`deploy(..., registry=...)`), so every other component reads the same deployment.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from flywheel.model.engine import Engine
from flywheel.model.registry import CANDIDATE, PRODUCTION, CheckpointNotFound, Registry

# (engine, tokenizer) for a version; the server's default loads it from the Registry.
EngineLoader = Callable[[int], tuple[Engine, Any]]
PINNED = "pinned"  # the arm of a request that named a version itself (evals), outside the A/B split


class Deployment(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    production: int = Field(ge=0)
    candidate: int | None = Field(default=None, ge=0)
    # Share of sessions the candidate answers. Higher gives the A/B test power sooner at the cost of
    # more users seeing an unproven version.
    candidate_fraction: float = Field(default=0.0, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _consistent(self) -> Deployment:
        if self.candidate is None and self.candidate_fraction > 0:
            raise ValueError(f"candidate_fraction is {self.candidate_fraction} but there is no candidate; "
                             "name a candidate version or set candidate_fraction to 0")
        if self.candidate is not None and self.candidate == self.production:
            raise ValueError(f"v{self.candidate} is both production and candidate; an A/B test needs two versions "
                             "(set candidate to another version, or to null)")
        return self

    @property
    def versions(self) -> set[int]:
        return {self.production} | ({self.candidate} if self.candidate is not None else set())

    def route(self, session_id: str) -> tuple[str, int]:
        """(arm, version) for a session; the same session gets the same answer while this record holds."""
        if self.candidate is not None and _unit_hash(f"{self.candidate}:{session_id}") < self.candidate_fraction:
            return CANDIDATE, self.candidate
        return PRODUCTION, self.production


def _unit_hash(text: str) -> float:
    """A uniform number in [0, 1) from `text`, the same in every process (unlike `hash`)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") / 2**64


@dataclass
class _Served:
    engine: Engine
    tokenizer: Any
    in_flight: int = 0
    retiring: bool = False


@dataclass
class Lease:
    """One request's hold on an engine; give it back with `Router.release`."""

    arm: str
    version: int
    engine: Engine
    tokenizer: Any
    _served: _Served = field(repr=False)


class NotServed(LookupError):
    pass


class Router:
    def __init__(self, load: EngineLoader, deployment: Deployment):
        self._load = load
        self._lock = threading.Lock()
        self._served: dict[int, _Served] = {}
        self._deployment = deployment
        self._loading = threading.Lock()  # one deployment change at a time
        for version in sorted(deployment.versions):
            self._served[version] = self._make(version)

    @property
    def deployment(self) -> Deployment:
        return self._deployment

    def served_versions(self) -> list[int]:
        with self._lock:
            return sorted(self._served)

    def engine(self, version: int) -> Engine:
        """The engine serving `version` (benchmarks compare it with the server around it)."""
        with self._lock:
            served = self._served.get(version)
        if served is None:
            raise NotServed(f"v{version} is not served; served: {self.served_versions()}")
        return served.engine

    def tokenizer(self, version: int) -> Any:
        with self._lock:
            served = self._served.get(version)
        if served is None:
            raise NotServed(f"v{version} is not served; served: {self.served_versions()}")
        return served.tokenizer

    def checkout(self, session_id: str, version: int | None = None) -> Lease:
        """Route `session_id` (or take `version` as asked, arm `pinned`) and lease that engine."""
        with self._lock:
            if version is None:
                arm, version = self._deployment.route(session_id)
            else:
                arm = PINNED
            served = self._served.get(version)
            if served is None:
                raise NotServed(f"v{version} is not served; served: {', '.join(f'v{v}' for v in sorted(self._served))}")
            served.in_flight += 1
        return Lease(arm, version, served.engine, served.tokenizer, served)

    def release(self, lease: Lease) -> None:
        with self._lock:
            served = lease._served
            served.in_flight -= 1
            close = served.retiring and served.in_flight == 0
        if close:
            _close_in_background(served.engine)

    def deploy(self, deployment: Deployment, registry: Registry | None = None) -> Deployment:
        """Serve `deployment`: load what it needs, switch, retire the rest. Returns the previous one.

        Loading happens before the switch, so a version that fails to load leaves the deployment as
        it was. With `registry`, its production/candidate aliases are moved first for the same reason.
        """
        with self._loading:
            with self._lock:
                missing = [v for v in sorted(deployment.versions) if v not in self._served]
            loaded = {v: self._make(v) for v in missing}
            if registry is not None:
                sync_aliases(registry, deployment)
            to_close = []
            with self._lock:
                previous, self._deployment = self._deployment, deployment
                self._served.update(loaded)
                for version in [v for v in self._served if v not in deployment.versions]:
                    # Out of the table now; leases still hold it, and the last release closes it.
                    served = self._served.pop(version)
                    served.retiring = True
                    if served.in_flight == 0:
                        to_close.append(served.engine)
            for engine in to_close:
                _close_in_background(engine)
            return previous

    def close(self) -> None:
        with self._lock:
            served, self._served = list(self._served.values()), {}
        for s in served:
            s.engine.close()

    def _make(self, version: int) -> _Served:
        engine, tokenizer = self._load(version)
        if engine.version != version:
            engine.close()
            raise ValueError(f"the engine loader returned an engine at version {engine.version} for v{version}; "
                             "build the LocalEngine with version=the checkpoint's version")
        return _Served(engine, tokenizer)


def _close_in_background(engine: Engine) -> None:
    # Closing joins the engine's thread; never do that on the server's event loop.
    threading.Thread(target=engine.close, name="engine-close", daemon=True).start()


def sync_aliases(registry: Registry, deployment: Deployment) -> None:
    """Point the Registry's production/candidate aliases at the deployment's versions."""
    registry.set_alias(PRODUCTION, deployment.production)
    if deployment.candidate is not None:
        registry.set_alias(CANDIDATE, deployment.candidate)
        return
    try:
        registry.remove_alias(CANDIDATE)
    except CheckpointNotFound:
        pass  # there was no candidate alias to remove


def deployment_from_registry(registry: Registry, candidate_fraction: float) -> Deployment:
    """Production and candidate as the Registry's aliases say, with `candidate_fraction` if a candidate exists."""
    try:
        production = registry.get(PRODUCTION).version
    except CheckpointNotFound as exc:
        raise ValueError(f"the registry at {registry.root} has no {PRODUCTION!r} alias; run `flywheel bootstrap` or "
                         f"`flywheel registry promote V --alias {PRODUCTION}` first") from exc
    try:
        candidate: int | None = registry.get(CANDIDATE).version
    except CheckpointNotFound:
        candidate = None
    if candidate == production:
        candidate = None
    return Deployment(production=production, candidate=candidate,
                      candidate_fraction=candidate_fraction if candidate is not None else 0.0)
