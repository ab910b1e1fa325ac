"""The live server: the policy behind an OpenAI-compatible API, and the endpoint users' reactions come back to.

    flywheel serve --config configs/serve.toml          # or, in-process: serve_in_thread(LiveServer(...))

    POST /v1/chat/completions  [inference] ──Router: session ──> arm, version ──> that version's Engine
                                            ──> parse tool calls ──> LiveStore.add_completion
                                            ──> response (id = completion id)
    POST /v1/completions       [inference]  a raw prompt, text or token ids: token in, token out
    GET  /v1/models[/{id}]     [inference]  the routed name and every served version
    POST /v1/events            [events]     a batch; per event accepted | duplicate | rejected (reason);
                                            200 only after commit
    GET|POST /v1/admin/deployment[/sync]    [admin]  what is served; re-read the Registry's aliases
    GET  /v1/admin/loop                     [admin]  the live loop's settings (flywheel/live/settings.py)
    GET  /v1/admin/orgs, GET|PUT /v1/admin/orgs/{org}/deployment  [admin]  organizations' adapters
    GET  /dashboard, /dashboard/data, /metrics  [dashboard]  the live dashboard, Prometheus metrics
    GET  /health                            readiness, no key needed: 503 while the store or the Registry's
                                            index cannot be reached (the process reconnects by itself)
    GET  /openapi.json                      the OpenAPI document of all of the above (tests fuzz every operation)

Here: the server's state (`LiveServer`: the Router and the engines it serves, the LiveStore, the
keys, the deployment every replica follows, organizations' own Routers), its config, and the app
that puts the routes together. The routes, one module per audience, each opening with its own
endpoints in detail: flywheel/live/openai_routes.py [inference], event_routes.py [events],
admin_routes.py [admin], dashboard_routes.py [dashboard]. The wire itself (OpenAI's request and
response records, errors, streaming chunks, body limits) is flywheel/api, which the harness server
(flywheel/live/harness.py) speaks too.

Keys: `Authorization: Bearer KEY`; each key has scopes (`inference`, `events`, `admin`, `dashboard`)
from the config's `[keys]` table. No or unknown key: 401; a key without the endpoint's scope: 403.
The dashboard takes a key with the `dashboard` (read only) or `admin` scope, also as `?key=KEY`,
because a browser opening a URL cannot send a header: open http://HOST:PORT/dashboard?key=KEY. It
shows behaviour metrics, not completions' text, and it is never readable without a key. Errors are
JSON in OpenAI's shape `{"error": {"message", "type", "code", "param"}}`, always 4xx for a bad
request (too large: 413; not JSON or not the schema: 400), never 500; a bug's 500 has the same shape
and, like every error, leaves the connection open for the next request.

What a request may hold is checked before anything is computed or stored: every value that reaches
the store passes `records.storable` (valid Unicode, finite numbers, integers within +-2**53), the
session id, which goes back in the `x-session-id` header, is 1-200 visible ASCII characters, and
numbers that become SQLite integers or version names are bounded. Events are judged one by one.

Who is asking: the session id comes from the `X-Session-Id` header, else a `session_id` body field
(`extra_body={"session_id": ...}` in the openai client), else `metadata["session_id"]`; a request
without one gets a fresh id (so it is routed at random) returned in the response. The user id is the
OpenAI `user` field, else `X-User-Id`, else `metadata["user_id"]`. The rest of `metadata` is kept as
the completion's `request_meta` (task family, ambiguous: what the monitors group by). Sessions are
routed by the current `Deployment` (sticky A/B split, see flywheel/live/deploy.py); a request whose
`model` is a served version ("v3") is pinned to it and recorded with arm `pinned`.

Several replicas: `loop.store.url` (and `loop.store.registry_url`) in PostgreSQL let any number of
`flywheel serve` processes share one store, behind any load balancer. What keeps them one service:
- Routing is a pure function of (deployment, session id): replicas serving the same deployment send
  a session to the same arm, whichever replica a request reaches.
- A deployment change made through one replica (admin endpoint, sync) is written to the store's
  deployments table; every replica polls the table's newest row every `deployment_poll_s` and
  serves it, so all replicas serve the change within deployment_poll_s + the time to load a
  version they do not serve yet (~1 s + load; tests/live/test_replicas.py measures it). In that
  window a session may be answered by the previous deployment on a replica not yet switched.
- Events are idempotent on their ids across replicas (LiveStore), so a client retrying a batch
  against another replica stores it once.

Every completion is committed to the LiveStore before its response is sent, and the response's `id`
is the completion's id: the id clients put in their events. Responses also carry a `flywheel` field
(version, arm, session_id) that strict clients ignore.

Departures from OpenAI's API, each refused with a 400 that says so rather than silently ignored:
`top_logprobs` > 0 with streaming or without `logprobs`,
frequency / presence penalties and `logit_bias` (the sampled tokens' logprobs must be the model's,
for the Learner), `response_format` other than text, images. `seed` gives the request its own
random stream: the same seed and request sample the same tokens. `n` > 1 (up to 16, a GRPO group
in one request) samples each choice as its own engine request (seeded `seed + i`) and stores one
Completion per choice: the response's `id` is the first one's, and each choice names its own in
`completion_id`. `tool_choice` "required" or a named function starts the assistant turn with the
call's opening (`<tool_call>` and, when named, `{"name": ..., "arguments": `), written as prompt
tokens, so the Completion's prompt ids end with it and only the model's own tokens are trained on.
Streaming is real: the engine hands each token to the server as it samples it
(`SamplingParams.on_token`; a `ProcessEngine` relays it from its child), and with `n` > 1 the
choices' chunks are interleaved as their tokens come, each naming its `index` and its own
`completion_id` under the response's one `id`, the usage chunk counting them all. Each token
becomes a content chunk (text before a tool call's markup; the calls follow as tool_call deltas
once parsed); the completion is stored before the last chunk, which carries `flywheel.ttft_ms`,
the time from the request to its first token. `stop` sequences cut the answer where one first
appears in the sampled text (openai_routes.py's `_Call._stopped`): the Completion keeps the
shortest prefix of sampled tokens that holds it, and the text ends before it. Only calls a client
can dispatch come back in `tool_calls`: one the model wrote badly (unparsable, cut at max_tokens,
naming a tool the request did not declare, arguments its schema refuses) comes back as text after
the prose, with finish reason `stop` or `length` (standard clients, the OpenAI Agents SDK among
them, end a run on an undeclared tool), and the Completion records it as an invalid call, which
costs its reward the broken-call penalty: nothing is dropped (`ChatFormat.client_view` in flywheel/model/chat.py).

A client that leaves before its answer costs nothing: its engine requests are cancelled, nothing is
stored (a generation nobody received is no training turn), and /metrics counts a 499, not a 500.
The store being unreachable (PostgreSQL restarting) is a 503 with Retry-After, and /health answers
503 until it is back; the store reconnects by itself (flywheel/live/store.py).

`tool_choice: "none"` leaves the tools out of the prompt and returns whatever the model writes as
its text, with no tool call. The Completion records the temperature and top-p it was sampled with.

The prompt is rendered from the messages with the chat template on every request (the API is
stateless); the Completion stores exactly the prompt ids the engine saw, so the Learner trains on
the tokens that were served. Control tokens come from the template alone: text a client sends,
"<|im_start|>" included, is tokenized as text (`ConversationEncoder`), so no one can forge a turn in a
prompt the Learner trains on. Tokenization runs off the event loop, and its cache is filled only by
requests that are served.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import tempfile
import threading
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from flywheel.api.errors import ApiError, install_error_handlers
from flywheel.api.events import EventBatch
from flywheel.api.http import RunningServer, json_reply
from flywheel.api.records import MAX_ID_CHARS, ChatRequest, TextCompletionRequest
from flywheel.config import include_file, refuse_moved
from flywheel.live.admin_routes import admin_router
from flywheel.live.dashboard_routes import DashboardView, dashboard_router
from flywheel.live.deploy import Deployment, EngineLoader, NotServed, Router, deployment_from_registry
from flywheel.live.event_routes import events_router
from flywheel.live.metrics import MeasuredRequests, ServerMetrics
from flywheel.live.openai_routes import openai_router
from flywheel.live.settings import MOVED_LOOP_KEYS, MOVED_STORE_KEYS, MOVED_WHY, LoopConfig
from flywheel.live.store import LiveStore
from flywheel.model.conversation import ConversationEncoder
from flywheel.model.engine import Engine, EngineConfig
from flywheel.model.process_engine import start_engine
from flywheel.model.registry import CANDIDATE, Registry
from flywheel.store.database import StoreUnavailable

log = logging.getLogger(__name__)

Scope = Literal["inference", "events", "admin", "dashboard"]
SCOPES: tuple[Scope, ...] = ("inference", "events", "admin", "dashboard")
DASHBOARD_SCOPES = frozenset({"dashboard", "admin"})


class DashboardConfig(BaseModel):
    """`/dashboard`: the run folders it shows next to the live monitors, and how often it refreshes."""

    model_config = ConfigDict(extra="forbid")
    # Simulated-RL runs (metrics.jsonl, eval.jsonl) and real-time RL cycle reports (cycle-NNNN/report.json),
    # found up to three folders down; a folder that does not exist yet shows as "no data yet".
    report_dirs: list[Path] = Field(default_factory=list)
    # The page polls this often; the data is recomputed at most this often, however many pages are open.
    refresh_s: float = Field(default=5.0, ge=0.5)
    # The monitors read every completion of this last stretch (and its sessions') on each recomputation:
    # longer shows more history at a cost that grows with the traffic.
    horizon_s: float = Field(default=6 * 3600.0, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data: Any) -> Any:
        refuse_moved(data, MOVED_LOOP_KEYS, MOVED_WHY)
        return data


class ServeConfig(BaseModel):
    """`flywheel serve`: the live loop's settings it shares with `flywheel live` (where the data is,
    the rewards and monitors its dashboard shows), who may call, and the request limits.

    `loop_file` names a TOML file of a LoopConfig (configs/loop.toml, which configs/live.toml names
    too); a `[loop]` table here overrides its values key by key."""

    model_config = ConfigDict(extra="forbid")
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)  # 0: any free port
    loop_file: Path | None = None
    # The store (its folder also gets this server's config.json), the Registry, rewards and monitors.
    loop: LoopConfig = Field(default_factory=LoopConfig)
    # How often this replica re-reads the deployment other replicas may have changed. Lower serves a
    # change sooner at the cost of one indexed query per interval per replica.
    deployment_poll_s: float = Field(default=1.0, gt=0)
    model_name: str = "flywheel"  # the name clients pass as `model` to be routed by the deployment
    # API key -> scopes. The repo's serve.toml holds development keys only; a real deployment writes
    # its own file (keys are compared by SHA-256 digest, never logged, and left out of config.json).
    keys: dict[str, list[Scope]] = Field(default_factory=dict)
    # API key -> organization id: every completion and event sent with that key carries it (a request
    # naming another org in its metadata gets 403). Keys not listed may name one in metadata["org_id"].
    orgs: dict[str, str] = Field(default_factory=dict)
    # Share of sessions routed to the Registry's `candidate` at start, unless the live store recorded
    # a later choice for that same candidate (then that choice stands).
    candidate_fraction: float = Field(default=0.1, ge=0.0, le=1.0)
    max_body_bytes: int = Field(default=4 << 20, ge=1024)  # larger requests get 413
    max_events_per_batch: int = Field(default=5000, ge=1)  # larger batches get 413; the SDK splits and resends
    default_max_tokens: int = Field(default=256, ge=1)
    max_tokens_limit: int = Field(default=2048, ge=1)  # a request asking for more gets 400
    max_context_tokens: int = Field(default=8192, ge=16)  # prompt + max_tokens; the model's position limit
    # FULL fsyncs each commit: an acknowledged event survives power loss. NORMAL survives a crash of
    # the server only and saves about 1 ms per committed batch.
    synchronous: Literal["NORMAL", "FULL"] = "FULL"
    # Completions are committed before their response is sent, concurrent ones in one commit (group
    # commit, flywheel/live/store.py). None: what makes a 200 survive a kill -9 of the server or the
    # database, per backend: FULL on PostgreSQL (NORMAL there is synchronous_commit off, which lost
    # answered completions when PostgreSQL was killed), NORMAL on SQLite (FULL also survives a power
    # loss, at an fsync per commit: ~1-4 ms of latency, fewer completions/s at low concurrency).
    completions_synchronous: Literal["NORMAL", "FULL"] | None = None
    require_known_completion: bool = True  # refuse events naming a completion this store never served
    threads: int = Field(default=2, ge=1)  # torch threads for the engines
    # The served weights in memory: bfloat16 halves a pretrained model's memory and its decode's reads,
    # at the cost of logprobs that differ from a float32 Learner's (the cycle trains in float32).
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    engine: EngineConfig = Field(default_factory=EngineConfig)
    dashboard: DashboardConfig = Field(default_factory=DashboardConfig)

    @field_validator("keys")
    @classmethod
    def _keys(cls, keys: dict[str, list[Scope]]) -> dict[str, list[Scope]]:
        for key, scopes in keys.items():
            if not key.strip():
                raise ValueError("an API key is empty; use a long random string, e.g. `python -c 'import secrets; "
                                 "print(secrets.token_urlsafe(24))'`")
            if not scopes:
                raise ValueError(f"a key has no scopes; give it some of {list(SCOPES)}")
        return keys

    @model_validator(mode="after")
    def _limits(self) -> ServeConfig:
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError(f"default_max_tokens {self.default_max_tokens} exceeds max_tokens_limit "
                             f"{self.max_tokens_limit}; lower the first or raise the second")
        return self

    @model_validator(mode="before")
    @classmethod
    def _include_loop(cls, data: Any) -> Any:
        refuse_moved(data, {**MOVED_STORE_KEYS, "run_dir": "loop.store.path (the folder's live.sqlite)"}, MOVED_WHY)
        return include_file(data, "loop", "loop_file")


class Health(BaseModel):
    """GET /health: 200 when the live store and the Registry's index answer, else 503 (a load
    balancer takes the replica out until they do; the process reconnects by itself)."""

    status: Literal["ok", "unavailable"]
    store: str  # "ok", or why it cannot be reached
    registry: str  # "ok", "none" (a server without a Registry), or why its index cannot be reached


def openapi_document(app: FastAPI) -> dict[str, Any]:
    """The API's OpenAPI 3.1 document, served at /openapi.json.

    The endpoints read their bodies themselves (a size limit while streaming in, one reason per bad
    event), so FastAPI cannot see the request models: they are added here, with the bearer scheme."""
    from fastapi.openapi.utils import get_openapi  # noqa: PLC0415  (built once, on the first request)

    doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                      description="flywheel's live server: an OpenAI-compatible chat completions API over the "
                                  "served policy versions, and the endpoint users' reactions come back to. Errors are "
                                  '{"error": {"message", "type", "code", "param"}}.')
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for model in (ChatRequest, TextCompletionRequest, EventBatch, Deployment):
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    doc["security"] = [{"bearer": []}]
    doc["paths"]["/health"]["get"]["security"] = []
    return doc


# ---- the server


class LiveServer:
    """The server's state: the Router (deployment + engines), the LiveStore, keys and limits.

    `app` is the FastAPI application; run it with `serve_in_thread` (tests, simulated users) or
    `run_forever` (the CLI). The Python methods (`set_deployment`, `sync_from_registry`) do what the
    admin endpoints do.
    """

    def __init__(self, config: ServeConfig, router: Router, store: LiveStore | None = None,
                 registry: Registry | None = None):
        """`store` defaults to the config's (run_dir/live.sqlite); `registry`, if given, gets the aliases moved."""
        if not config.keys:
            raise ValueError("no API keys configured: add a [keys] table to the serve config, e.g. "
                             '`"my-long-random-key" = ["inference", "events"]`')
        self.config = config
        self.router = router
        self.store = store or open_store(config)
        self.registry = registry
        self._scopes = {hashlib.sha256(k.encode()).digest(): frozenset(v) for k, v in config.keys.items()}
        self._orgs = {hashlib.sha256(k.encode()).digest(): org for k, org in config.orgs.items()}
        # Organizations with adapters deployed: each its own Router over adapter versions
        # (flywheel/live/orgs.py); every other request goes to `router`.
        self._org_routers: dict[str, Router] = {}
        self._org_lock = threading.RLock()
        # Per organization, the org_deployments row this replica serves (0: none yet, so a restarted
        # server serves what the store says at its first poll).
        self._org_seqs: dict[str, int] = {}
        self._encoders: dict[int, ConversationEncoder] = {}  # by version: a checkpoint's tokenizer never changes
        self.dashboard = DashboardView(self)  # what /dashboard shows, recomputed at most every refresh_s
        # The deployments row this replica serves; a newer one was written by another replica.
        self._deploy_lock = threading.Lock()
        latest = self.store.latest_deployment()
        self._deployment_seq = latest["seq"] if latest else 0
        self._stop = threading.Event()
        self._follower = threading.Thread(target=self._follow_deployments, name="deployment-follower", daemon=True)
        self._follower.start()
        self.metrics = ServerMetrics()  # GET /metrics (flywheel/live/metrics.py)
        self.app = create_app(self)

    @classmethod
    def from_config(cls, config: ServeConfig) -> LiveServer:
        """Open the Registry and the live store, and serve the Registry's production (and candidate)."""
        where = config.loop.store
        if where.registry_url is None and not (where.registry_root / "registry.sqlite").is_file():
            raise ValueError(f"no registry at {where.registry_root}; run `flywheel bootstrap` first or set "
                             "loop.store.registry_root")
        registry = Registry(where.registry_root, url=where.registry_url)
        store = open_store(config)
        deployment = deployment_from_registry(registry, _resume_fraction(store, registry, config.candidate_fraction))
        router = Router(registry_loader(registry, config.engine, config.dtype), deployment)
        store.record_deployment(deployment.production, deployment.candidate, deployment.candidate_fraction,
                                "serve start", replica_name(config))
        return cls(config, router, store, registry)

    @property
    def deployment(self) -> Deployment:
        return self.router.deployment

    def set_deployment(self, deployment: Deployment, note: str = "") -> Deployment:
        """Serve `deployment` now (loading and unloading engines); returns the previous one.

        Moves the Registry's aliases too, when the server has a Registry, and records the change."""
        with self._deploy_lock:
            previous = self.router.deploy(deployment, self.registry)
            self._deployment_seq = self.store.record_deployment(deployment.production, deployment.candidate,
                                                                deployment.candidate_fraction, note,
                                                                replica_name(self.config))
        return previous

    def follow_deployment(self) -> bool:
        """Serve the store's newest deployment if another replica wrote it; True if this changed what is served."""
        latest = self.store.latest_deployment()
        if latest is None or latest["seq"] <= self._deployment_seq:
            return False
        with self._deploy_lock:
            if latest["seq"] <= self._deployment_seq:  # this replica's own change, recorded meanwhile
                return False
            wanted = Deployment(production=latest["production"], candidate=latest["candidate"],
                                candidate_fraction=latest["fraction"])
            changed = wanted != self.deployment
            if changed:  # the replica that wrote it has moved the Registry's aliases already
                self.router.deploy(wanted)
                log.info("serving v%s / %s as deployment #%s says (%s)", wanted.production, wanted.candidate,
                         latest["seq"], latest["note"])
            self._deployment_seq = latest["seq"]
            return changed

    def readiness(self) -> dict[str, str]:
        """What GET /health reports: whether the live store and the Registry's index answer now."""
        report = {"status": "ok", "store": "ok", "registry": "none" if self.registry is None else "ok"}
        for name, part in (("store", self.store), ("registry", self.registry)):
            if part is None:
                continue
            try:
                part.ping()
            except StoreUnavailable as exc:
                report[name], report["status"] = str(exc), "unavailable"
        return report

    def _follow_deployments(self) -> None:
        down = False
        while not self._stop.wait(self.config.deployment_poll_s):
            try:
                self.follow_deployment()
                self.follow_org_deployments()
                if down:
                    log.info("the store answers again: following the deployment")
                down = False
            except StoreUnavailable as exc:  # an outage: said once, polled on (the store reconnects)
                if not down:
                    log.warning("cannot follow the deployment while the store is unavailable: %s", exc)
                down = True
            except Exception:  # noqa: BLE001  (a failed poll is logged and retried; the loop must outlive it)
                log.exception("following the deployment failed; retrying in %s s", self.config.deployment_poll_s)

    def router_for(self, org_id: str) -> Router:
        """The Router that serves `org_id`: its own, when it has adapters deployed, else the shared one."""
        return self._org_routers.get(org_id, self.router)

    def org_router(self, org_id: str) -> Router | None:
        """The organization's own Router, or None (it is served the shared deployment)."""
        return self._org_routers.get(org_id)

    def served_orgs(self) -> list[str]:
        """The organizations served their own deployment of adapters."""
        return list(self._org_routers)

    def encoder(self, version: int, tokenizer: Any) -> ConversationEncoder:
        """Version `version`'s ConversationEncoder, whose cache of encoded messages outlives a request."""
        encoder = self._encoders.get(version)
        if encoder is None:
            served = set(self.router.served_versions())  # retired versions' caches go with them
            self._encoders = {v: e for v, e in self._encoders.items() if v in served}
            encoder = self._encoders[version] = ConversationEncoder(tokenizer)
        return encoder

    def org_deployment(self, org_id: str) -> Deployment | None:
        """The organization's own deployment of adapters, or None (it is served the shared one)."""
        router = self._org_routers.get(org_id)
        return router.deployment if router is not None else None

    def set_org_deployment(self, org_id: str, deployment: Deployment | None, note: str = "") -> None:
        """Serve `org_id` its adapters per `deployment` (versions are adapters of the served base;
        A/B split by session within the organization's traffic), or with None the shared deployment
        again (a rollback of the organization alone). Needs a Registry (the adapters live there).

        Every version must be an adapter registered for this organization, except that production
        may be a full checkpoint (its base, for the A/B test of its first adapter) (ValueError names
        the one that is not; a version the Registry lacks raises CheckpointNotFound). The Registry's aliases
        `production-<org>` / `candidate-<org>` move with it, and the change is written to the store's
        org_deployments, which every replica follows (`follow_org_deployments`)."""
        if self.registry is None:
            raise ValueError("this server has no Registry to load adapters from; build it with LiveServer.from_config")
        from flywheel.live.orgs import check_org_id, sync_org_aliases  # noqa: PLC0415  (peft loads only when used)

        check_org_id(org_id)
        for version in sorted(deployment.versions) if deployment is not None else []:
            checkpoint = self.registry.get(version)
            if checkpoint.base is None and deployment is not None and version == deployment.production:
                continue  # a base as the production arm: what an organization's first adapter is tested against
            if checkpoint.base is None or checkpoint.org_id != org_id:
                what = "a full checkpoint" if checkpoint.base is None else f"an adapter of {checkpoint.org_id!r}"
                raise ValueError(f"v{version} is {what}, not an adapter of {org_id!r}; name that organization's "
                                 "adapter versions (GET /v1/admin/orgs lists them; a full checkpoint only as "
                                 "production), or null for the shared deployment")
        with self._org_lock:
            self._serve_org(org_id, deployment, note)
            sync_org_aliases(self.registry, org_id, deployment)
            self._org_seqs[org_id] = self.store.record_org_deployment(
                org_id, *_deployment_row(deployment), note=note, origin=replica_name(self.config))

    def follow_org_deployments(self) -> list[str]:
        """Serve each organization's newest row of the store's org_deployments that another replica
        wrote (or that a restarted server served before); returns the organizations changed."""
        if self.registry is None:
            return []  # no adapters to load: organizations are served the shared deployment
        changed = []
        for org_id, row in self.store.latest_org_deployments().items():
            with self._org_lock:
                if row["seq"] <= self._org_seqs.get(org_id, 0):
                    continue
                wanted = None if row["production"] is None else Deployment(
                    production=row["production"], candidate=row["candidate"], candidate_fraction=row["fraction"])
                if wanted != self.org_deployment(org_id):  # the writer moved the Registry's aliases already
                    self._serve_org(org_id, wanted, f"as org deployment #{row['seq']} says ({row['note']})")
                    changed.append(org_id)
                self._org_seqs[org_id] = row["seq"]
        return changed

    def _serve_org(self, org_id: str, deployment: Deployment | None, note: str) -> None:
        """Route `org_id` per `deployment` (None: the shared deployment); under `_org_lock`."""
        from flywheel.live.orgs import adapter_loader  # noqa: PLC0415  (peft loads only when used)

        assert self.registry is not None
        current = self._org_routers.get(org_id)
        if deployment is None:
            if current is not None:
                del self._org_routers[org_id]
                current.close()
        elif current is None:
            def served_base(version: int) -> Any:
                try:
                    return getattr(self.router.engine(version), "model", None)
                except NotServed:
                    return None
            self._org_routers[org_id] = Router(adapter_loader(self.registry, served_base, self.config.engine),
                                               deployment)
        else:
            current.deploy(deployment)
        log.info("organization %s: %s (%s)", org_id, deployment or "shared deployment", note)

    def sync_from_registry(self, candidate_fraction: float | None = None) -> Deployment:
        """Serve what the Registry's aliases say now (someone ran `flywheel registry promote`)."""
        if self.registry is None:
            raise ValueError("this server has no Registry to sync from; call set_deployment instead")
        if candidate_fraction is None:  # keep the current split, or start one at the configured share
            current = self.deployment
            candidate_fraction = (current.candidate_fraction if current.candidate is not None
                                  else self.config.candidate_fraction)
        deployment = deployment_from_registry(self.registry, candidate_fraction)
        self.set_deployment(deployment, "synced from registry")
        return deployment

    def authorize(self, request: Request, scope: Scope) -> None:
        header = request.headers.get("authorization", "")
        kind, _, key = header.partition(" ")
        if kind.lower() != "bearer" or not key.strip():
            raise ApiError(401, "missing API key: send `Authorization: Bearer KEY`", "authentication_error",
                           "missing_api_key")
        scopes = self._key_scopes(key)
        if scope not in scopes:
            raise ApiError(403, f"this key lacks the {scope!r} scope (it has {sorted(scopes)}); use a key with it",
                           "permission_error", "insufficient_scope")

    def authorize_dashboard(self, request: Request) -> None:
        """A key with the `dashboard` or `admin` scope, as `?key=` (a browser) or a bearer header."""
        kind, _, key = request.headers.get("authorization", "").partition(" ")
        key = request.query_params.get("key") or (key if kind.lower() == "bearer" else "")
        if not key.strip():
            raise ApiError(401, "missing API key: open /dashboard?key=KEY with a key that has the `dashboard` or "
                           "`admin` scope", "authentication_error", "missing_api_key")
        scopes = self._key_scopes(key)
        if not scopes & DASHBOARD_SCOPES:
            raise ApiError(403, f"this key lacks the 'dashboard' and 'admin' scopes (it has {sorted(scopes)}); use a "
                           "key with one of them", "permission_error", "insufficient_scope")

    def key_org(self, request: Request) -> str | None:
        """The organization the request's (authorized) API key carries, or None."""
        key = request.headers.get("authorization", "").partition(" ")[2]
        return self._orgs.get(hashlib.sha256(key.strip().encode()).digest())

    def request_org(self, request: Request, meta: dict[str, Any]) -> str:
        """The key's organization, else metadata["org_id"] (popped from `meta`), else ""."""
        claimed, key_org = meta.pop("org_id", None), self.key_org(request)
        if claimed is not None and (not isinstance(claimed, str) or len(claimed) > MAX_ID_CHARS):
            raise ApiError(400, f"metadata.org_id must be a string of at most {MAX_ID_CHARS} characters",
                           param="metadata")
        if key_org is not None and claimed not in (None, key_org):
            raise ApiError(403, f"this key belongs to organization {key_org!r}, not {claimed!r}; drop "
                           "metadata.org_id or use that organization's key", "permission_error", "wrong_org")
        return key_org if key_org is not None else (claimed or "")

    def _key_scopes(self, key: str) -> frozenset[str]:
        scopes = self._scopes.get(hashlib.sha256(key.strip().encode()).digest())
        if scopes is None:
            raise ApiError(401, "invalid API key", "authentication_error", "invalid_api_key")
        return scopes

    def close(self) -> None:
        self._stop.set()
        self._follower.join(timeout=10)
        self.router.close()
        for router in self._org_routers.values():
            router.close()
        self.store.close()
        if self.registry is not None:
            self.registry.close()

    def __enter__(self) -> LiveServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()



def _resume_fraction(store: LiveStore, registry: Registry, default: float) -> float:
    """The fraction last chosen for the current candidate, if the store has one; else `default`."""
    history = store.deployments()
    if not history:
        return default
    try:
        candidate = registry.get(CANDIDATE).version
    except KeyError:  # CheckpointNotFound: no candidate alias
        return default
    last = history[-1]
    return last["fraction"] if last["candidate"] == candidate else default


def _deployment_row(deployment: Deployment | None) -> tuple[int | None, int | None, float]:
    """(production, candidate, fraction) as a deployments row holds them; None: (None, None, 0.0)."""
    if deployment is None:
        return None, None, 0.0
    return deployment.production, deployment.candidate, deployment.candidate_fraction


def replica_name(config: ServeConfig) -> str:
    """Who this server is, in the deployments history of a store several replicas share."""
    return f"{socket.gethostname()}:{config.port} pid {os.getpid()}"


def open_store(config: ServeConfig) -> LiveStore:
    return LiveStore(config.loop.store.location, synchronous=config.synchronous,
                     completions_synchronous=config.completions_synchronous,
                     require_known_completion=config.require_known_completion)


def registry_loader(registry: Registry, engine: EngineConfig, dtype: str = "float32") -> EngineLoader:
    """Load a version from the Registry into its own engine: a LocalEngine, one in a process of its
    own (`engine.separate_process`: its decode loop then never waits on the server's GIL, and still
    streams), or vLLM servers on its checkpoint folder (`engine.backend = "vllm"`; a LoRA version's
    folder holds only its adapter, so vLLM gets it merged onto its base, written out once)."""

    def load(version: int) -> tuple[Engine, Any]:
        model, tokenizer = registry.load(version, dtype=dtype)  # a LoRA version comes merged onto its base
        if engine.backend == "vllm":
            checkpoint = registry.get(version)
            folder = checkpoint.path
            if checkpoint.base is not None:
                from flywheel.model.adapters import export_merged  # noqa: PLC0415  (peft only when asked)

                folder = export_merged(registry, version, Path(tempfile.mkdtemp(prefix=f"flywheel-v{version}-")) / "m")
            return start_engine(None, engine, version=version, checkpoint=folder), tokenizer
        return start_engine(model, engine, version=version), tokenizer

    return load


def create_app(server: LiveServer) -> FastAPI:
    """The server's app: the routes of each audience (the modules named in this module's docstring),
    the errors in OpenAI's shape (flywheel/api/errors.py), every request measured for /metrics."""
    app = FastAPI(title="flywheel", version="1", docs_url=None, redoc_url=None, openapi_url="/openapi.json")

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = openapi_document(app)
        return app.openapi_schema

    app.openapi = openapi
    install_error_handlers(app)
    # Outermost, so a bug's 500 is counted too; paths known once every route below is declared.
    known_paths: set[str] = set()
    app.add_middleware(MeasuredRequests, metrics=server.metrics, paths=known_paths)

    @app.get("/health", response_model=None, responses={**json_reply(Health), 503: {"model": Health}})
    async def health() -> JSONResponse:
        report = await run_in_threadpool(server.readiness)
        return JSONResponse(report, status_code=200 if report["status"] == "ok" else 503,
                            headers=None if report["status"] == "ok" else {"retry-after": "1"})

    routers = [dashboard_router(server, server.dashboard), openai_router(server), events_router(server),
               admin_router(server)]
    for router in routers:
        app.include_router(router)
    # The app's own routes (/health, /openapi.json) and each router's (an included router is one entry of app.routes).
    known_paths.update(path for r in (app.router, *routers) for route in r.routes
                       if (path := getattr(route, "path", None)) is not None)
    return app


# ---- running it


def serve_in_thread(server: LiveServer, host: str = "127.0.0.1", port: int = 0) -> RunningServer:
    """Start `server` on loopback in this process; `.url` is its base URL (append /v1 for openai)."""
    return RunningServer(server.app, host, port)


def run_forever(server: LiveServer) -> None:
    """Serve on the configured host and port until SIGINT/SIGTERM, then close the server."""
    import uvicorn  # noqa: PLC0415

    try:
        uvicorn.run(server.app, host=server.config.host, port=server.config.port, log_level="info",
                    access_log=False, lifespan="off")
    finally:
        server.close()
