"""The live server: the policy behind an OpenAI-compatible API, and the endpoint users' reactions come back to.

    flywheel serve --config configs/serve.toml          # or, in-process: serve_in_thread(LiveServer(...))

    POST /v1/chat/completions  [inference] ──Router: session ──> arm, version ──> that version's Engine
                                            ──> parse tool calls ──> LiveStore.add_completion
                                            ──> response (id = completion id)
    POST /v1/completions       [inference]  a raw prompt, text or token ids; the sampled ids come back
                                            (`flywheel.prompt_token_ids`, `flywheel.token_ids`): token in, token out
    GET  /v1/models            [inference]  the routed name and every served version
    GET  /v1/models/{id}       [inference]  one of them, or 404
    POST /v1/events            [events]     a batch; per event accepted | duplicate | rejected (reason);
                                            200 only after commit
    GET|POST /v1/admin/deployment [admin]   read or change production / candidate / candidate_fraction
    POST /v1/admin/deployment/sync [admin]  re-read the Registry's aliases (after `flywheel registry promote`)
    GET  /v1/admin/orgs        [admin]      the shared deployment, and each organization's own (adapters)
    GET|PUT /v1/admin/orgs/{org}/deployment [admin]  read or change one organization's deployment of its
                                            adapters ({"deployment": null}: back to the shared one); stored in
                                            the live store's org_deployments, which every replica follows
    GET  /dashboard            [dashboard]  HTML: flywheel.report's views, live; polls GET /dashboard/data
    GET  /dashboard/data       [dashboard]  {"html": the page's sections, "data": build_report_data's dict}
    GET  /metrics              [dashboard]  Prometheus text format (flywheel/live/metrics.py): requests, latency
                                            histograms, tokens, per-arm counts, engine in-flight, events
    GET  /health                            no key needed
    GET  /openapi.json                      the OpenAPI document of all of the above (tests fuzz every operation)

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

Several replicas: `store_url` (and `registry_url`) in PostgreSQL let any number of `flywheel serve`
processes share one store, behind any load balancer. What keeps them one service:
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
`top_logprobs` > 0 (the engine returns the sampled token's logprob only),
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
once parsed); the completion is stored before the last chunk,
which carries `flywheel.ttft_ms`, the time from the request to its first token. `stop` sequences
cut the answer where one first appears in the sampled text (`_Call._stopped`): the Completion keeps
the shortest prefix of sampled tokens that holds it, and the text ends before it. A tool call the
model wrote badly is still returned in `tool_calls` (name "?" when it
could not be read) with an extra `error` field, and recorded as invalid: a client answers it with
the error, as the episode runner does, and nothing is dropped.

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

import asyncio
import dataclasses
import hashlib
import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from flywheel.env.toolspec import TOOL_SCHEMAS, ToolCall
from flywheel.live.deploy import Deployment, EngineLoader, NotServed, Router, deployment_from_registry
from flywheel.live.metrics import MeasuredRequests, ServerMetrics
from flywheel.live.monitors import Monitor, MonitorConfig
from flywheel.live.records import BACKGROUND, INTERACTIVE, Completion, CompletionToolCall, Event, storable
from flywheel.live.rewards import RewardConfig, RewardDistiller
from flywheel.live.sessions import SessionMonitor, SessionMonitorConfig, watch
from flywheel.live.store import Ingest, LiveStore
from flywheel.model.chat import IM_END, TOOL_CALL_OPEN, parse_assistant, tools_in_prompt
from flywheel.model.conversation import ConversationEncoder, PromptTooLong
from flywheel.model.engine import Engine, EngineConfig, EngineError, SamplingParams
from flywheel.model.process_engine import start_engine
from flywheel.model.registry import CANDIDATE, Registry
from flywheel.report import build_report_data, dashboard_page, render_body

log = logging.getLogger(__name__)

Scope = Literal["inference", "events", "admin", "dashboard"]
SCOPES: tuple[Scope, ...] = ("inference", "events", "admin", "dashboard")
DASHBOARD_SCOPES = frozenset({"dashboard", "admin"})
_MAX_ID_CHARS = 200
_MAX_CHOICES = 16  # choices of one chat request (n); each is an engine request of its own
_MAX_VERSION = 10**9 - 1
_VERSION_NAME = re.compile(r"v(\d{1,9})")  # 9 digits: int() and SQLite take it
_HEADER_SAFE_ID = re.compile(rf"[!-~]{{1,{_MAX_ID_CHARS}}}")


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
    monitor: MonitorConfig = Field(default_factory=MonitorConfig)
    session_monitor: SessionMonitorConfig = Field(default_factory=SessionMonitorConfig)  # background sessions
    rewards: RewardConfig = Field(default_factory=RewardConfig)


class ServeConfig(BaseModel):
    """`flywheel serve`: where the models and the live data are, who may call, and the request limits."""

    model_config = ConfigDict(extra="forbid")
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)  # 0: any free port
    registry_root: Path = Path("runs/registry")
    run_dir: Path = Path("runs/live")  # live.sqlite (completions, events, deployments) and config.json
    # Where the live store is: None keeps it in run_dir/live.sqlite; `postgresql://USER@HOST:PORT/DB` puts
    # it in a PostgreSQL that several replicas of this server share.
    store_url: str | None = None
    # Where the Registry's index is: None keeps registry_root/registry.sqlite; a PostgreSQL URL shares it
    # between replicas (the checkpoint folders stay under registry_root, which every replica must mount).
    registry_url: str | None = None
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
    # Completions: NORMAL keeps an fsync (1-5 ms) off every response; a completion is still committed
    # before its response is sent, so a crash of the server never loses one a client holds the id of.
    completions_synchronous: Literal["NORMAL", "FULL"] = "NORMAL"
    require_known_completion: bool = True  # refuse events naming a completion this store never served
    threads: int = Field(default=2, ge=1)  # torch threads for the engines
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

    @property
    def store_path(self) -> Path:
        return self.run_dir / "live.sqlite"

    @property
    def store_location(self) -> str | Path:
        """What LiveStore opens: store_url, else the file in run_dir."""
        return self.store_url or self.store_path


# ---- the request schema (OpenAI's chat completions, the parts we serve)


class ApiError(Exception):
    """An error response: status, OpenAI error type and a message that says the fix."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param

    def response(self) -> JSONResponse:
        # A body refused unread stays on the wire: the connection cannot carry another request, and
        # saying so lets the client open a new one instead of finding it reset (draining it instead
        # would let anyone make the server read gigabytes).
        headers = {"connection": "close"} if self.code == "body_too_large" else None
        return JSONResponse({"error": {"message": self.message, "type": self.type, "code": self.code,
                                       "param": self.param}}, status_code=self.status, headers=headers)


class _TextPart(BaseModel):
    type: Literal["text"]
    text: str


class _Function(BaseModel):
    name: str
    arguments: str | dict[str, Any] = "{}"


class _MessageToolCall(BaseModel):
    id: str = ""
    type: Literal["function"] = "function"
    function: _Function


def _message_schema(schema: dict[str, Any]) -> None:
    """ChatMessage's JSON schema says what `_content` checks: content is required except for assistant
    messages, and only they carry tool_calls (so a schema-valid message is a valid message)."""
    props = schema["properties"]
    assistant = {"type": "object", "required": ["role"], "properties": {
        **props, "role": {"const": "assistant"}}}
    other = {"type": "object", "required": ["role", "content"], "properties": {
        **props, "role": {"enum": ["system", "developer", "user", "tool"]},
        "content": {"anyOf": [s for s in props["content"]["anyOf"] if s.get("type") != "null"]},
        "tool_calls": {"type": "null"}}}
    title = schema.get("title", "ChatMessage")
    schema.clear()
    schema.update({"title": title, "oneOf": [assistant, other]})


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", json_schema_extra=_message_schema)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[_TextPart] | None = None
    tool_calls: list[_MessageToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""

    def as_template_message(self) -> dict[str, Any]:
        """The dict `render_messages` takes (developer is OpenAI's newer name for system)."""
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        return message

    @model_validator(mode="after")
    def _content(self) -> ChatMessage:
        if self.role != "assistant" and self.content is None:
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self


class _FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str = ""
    parameters: dict[str, Any] | None = None

    @field_validator("parameters")
    @classmethod
    def _parameters(cls, parameters: dict[str, Any] | None) -> dict[str, Any] | None:
        if parameters is None:
            return None
        properties = parameters.get("properties", {})
        if not isinstance(properties, dict) or not all(isinstance(v, dict) for v in properties.values()):
            raise ValueError("parameters.properties must be an object of JSON schemas")
        required = parameters.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise ValueError("parameters.required must be a list of argument names")
        return parameters


class _ToolSpec(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"]
    function: _FunctionSpec


class _NamedFunction(BaseModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")


class _NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: _NamedFunction


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # other OpenAI fields (penalties, seed, ...) are accepted and ignored
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    # Kept as sent, so the system prompt renders them byte for byte as the client wrote them.
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["auto", "none", "required"] | _NamedToolChoice | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=0)  # the engine returns the sampled token's only
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)  # same seed and request: the same answer
    frequency_penalty: float | None = None  # refused unless 0 (below)
    presence_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    n: int | None = Field(default=1, ge=1, le=_MAX_CHOICES)  # n > 1: a GRPO group in one request
    stop: str | list[str] | None = None
    response_format: dict[str, Any] | None = None
    user: str | None = Field(default=None, max_length=_MAX_ID_CHARS)
    metadata: dict[str, Any] | None = None
    # extra_body; it goes back in the x-session-id header, hence visible ASCII
    # (documented here, checked with the header's and metadata's in `_identity`, whose message says the fix)
    session_id: str | None = Field(default=None, json_schema_extra={"pattern": rf"^[!-~]{{1,{_MAX_ID_CHARS}}}$"})

    @field_validator("tools")
    @classmethod
    def _tools(cls, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for i, tool in enumerate(tools or []):
            try:
                _ToolSpec.model_validate(tool)
            except ValidationError as exc:
                raise ValueError(f"tools[{i}] is not {{'type': 'function', 'function': {{'name', 'parameters'}}}}: "
                                 f"{_first_error(exc)}") from None
        return tools

    @field_validator("stop")
    @classmethod
    def _stop(cls, stop: str | list[str] | None) -> list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop
        if stops is not None and (len(stops) > 4 or not all(0 < len(x) <= 200 for x in stops)):
            raise ValueError("stop takes at most 4 sequences of 1 to 200 characters each")
        return stops or None

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _penalty(cls, value: float | None) -> float | None:
        if value:
            raise ValueError("frequency and presence penalties are not supported (the engine samples from the "
                             "model's distribution, which the Learner's logprobs must match); leave them unset or 0")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value:
            raise ValueError("logit_bias is not supported (the sampled tokens' logprobs must be the model's); "
                             "leave it unset")
        return value

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, fmt: dict[str, Any] | None) -> dict[str, Any] | None:
        if fmt is not None and fmt.get("type", "text") != "text":
            raise ValueError("only response_format {'type': 'text'} is supported")
        return fmt


def _first_error(exc: ValidationError) -> str:
    err = exc.errors(include_url=False)[0]
    where = ".".join(str(p) for p in err["loc"])
    return f"{where}: {err['msg']}" if where else err["msg"]


def _errors(exc: ValidationError, limit: int = 3) -> str:
    parts = []
    for err in exc.errors(include_url=False)[:limit]:
        where = ".".join(str(p) for p in err["loc"])
        parts.append(f"{where}: {err['msg']}" if where else err["msg"])
    more = exc.error_count() - limit
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")


# ---- the response schema (what /openapi.json documents; the fuzz test checks every response against it)


class _ErrorBody(BaseModel):
    message: str
    type: str
    code: str | None
    param: str | None


class ErrorResponse(BaseModel):
    """Every 4xx (and the 503 of a changing deployment): OpenAI's error shape."""

    error: _ErrorBody


class _ReplyToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")  # `error`: why a call the model wrote is invalid
    id: str
    type: Literal["function"]
    function: _Function


class _ReplyMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[_ReplyToolCall] | None = None


class _TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[dict[str, Any]]


class _Logprobs(BaseModel):
    content: list[_TokenLogprob]


class _Choice(BaseModel):
    index: int
    message: _ReplyMessage
    logprobs: _Logprobs | None
    finish_reason: Literal["stop", "length", "tool_calls"]
    completion_id: str | None = None  # n > 1: this choice's Completion (the id its feedback events name)


class _Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class _Served(BaseModel):
    version: int
    arm: str
    session_id: str
    engine_ms: float
    ttft_ms: float | None = None  # streamed: from the request to its first token
    # Declared tools a model trained on flywheel's own (no `tools_in_prompt`) does not know: it never
    # saw their schemas and will not call them.
    unknown_tools: list[str] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[_Choice]
    usage: _Usage
    flywheel: _Served


class _ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[_ModelCard]


class TextCompletionRequest(BaseModel):
    """POST /v1/completions: a raw prompt, as text or as token ids (token in, token out for RL
    frameworks). Not chat-templated: the prompt is exactly the tokens the engine sees."""

    model_config = ConfigDict(extra="ignore")
    model: str
    prompt: str | list[int] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    logprobs: int | None = Field(default=None, ge=0, le=1)  # 1: the sampled token's logprob (no alternatives)
    n: int | None = Field(default=1, ge=1, le=1)
    stream: Literal[False] | None = False
    echo: Literal[False] | None = False
    user: str | None = Field(default=None, max_length=_MAX_ID_CHARS)
    metadata: dict[str, Any] | None = None
    session_id: str | None = Field(default=None, json_schema_extra={"pattern": rf"^[!-~]{{1,{_MAX_ID_CHARS}}}$"})

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, prompt: str | list[int]) -> str | list[int]:
        if isinstance(prompt, list) and any(not 0 <= t < 2**31 for t in prompt):
            raise ValueError("prompt token ids must be non-negative integers below 2**31")
        return prompt


class _TextChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: Literal["stop", "length"]


class _ServedTokens(_Served):
    prompt_token_ids: list[int]
    token_ids: list[int]


class TextCompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[_TextChoice]
    usage: _Usage
    flywheel: _ServedTokens


class _Rejected(BaseModel):
    index: int
    id: str | None
    reason: str


class EventsResponse(BaseModel):
    accepted: list[str]
    duplicate: list[str]
    rejected: list[_Rejected]


class EventBatch(BaseModel):
    """The body of POST /v1/events (documented; the server parses it event by event, see `ingest`)."""

    events: list[dict[str, Any]]


class DeploymentResponse(BaseModel):
    deployment: Deployment
    served_versions: list[int]
    previous: Deployment | None = None


class OrgDeploymentRequest(BaseModel):
    """PUT /v1/admin/orgs/{org}/deployment: the organization's adapters, or null for the shared deployment."""

    model_config = ConfigDict(extra="forbid")
    deployment: Deployment | None


class OrgDeploymentResponse(BaseModel):
    org_id: str
    deployment: Deployment | None  # None: served the shared deployment
    served_versions: list[int]  # the adapters its own Router serves
    adapters: list[int]  # every adapter the Registry holds for it
    previous: Deployment | None = None  # PUT only: what it was served before


class OrgList(BaseModel):
    shared: Deployment
    orgs: list[OrgDeploymentResponse]  # organizations of the [orgs] keys, with a deployment, or with adapters


class Health(BaseModel):
    status: Literal["ok"]


class DashboardData(BaseModel):
    model_config = ConfigDict(extra="allow")  # `data`: build_report_data's dict, unless html_only=1
    generated_at: float
    html: str


def _json_reply(model: type[BaseModel], *errors: int, stream: bool = False) -> dict[int | str, dict[str, Any]]:
    """FastAPI `responses`: 200 with `model` (or SSE too), and each status in `errors` with ErrorResponse."""
    ok: dict[str, Any] = {"model": model}
    if stream:
        # Each server-sent event: `data` holds a chat.completion.chunk as JSON, or [DONE] at the end.
        ok["content"] = {"text/event-stream": {"schema": {
            "type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}}}
    return {200: ok, **{status: {"model": ErrorResponse} for status in errors}}


def _json_body(model: type[BaseModel]) -> dict[str, Any]:
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


_KEY_PARAMETER = {"name": "key", "in": "query", "required": False, "schema": {"type": "string"},
                  "description": "an API key with the dashboard or admin scope (a browser cannot send a header)"}


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
        self._dashboard_lock = threading.Lock()
        self._dashboard: tuple[float, dict[str, Any]] | None = None  # (monotonic time computed, data)
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
        if config.registry_url is None and not (config.registry_root / "registry.sqlite").is_file():
            raise ValueError(f"no registry at {config.registry_root}; run `flywheel bootstrap` first or set "
                             "registry_root")
        registry = Registry(config.registry_root, url=config.registry_url)
        store = open_store(config)
        deployment = deployment_from_registry(registry, _resume_fraction(store, registry, config.candidate_fraction))
        router = Router(registry_loader(registry, config.engine), deployment)
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

    def _follow_deployments(self) -> None:
        while not self._stop.wait(self.config.deployment_poll_s):
            try:
                self.follow_deployment()
                self.follow_org_deployments()
            except Exception:  # noqa: BLE001  (a failed poll is logged and retried; the loop must outlive it)
                log.exception("following the deployment failed; retrying in %s s", self.config.deployment_poll_s)

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

    def _request_org(self, request: Request, meta: dict[str, Any]) -> str:
        """The key's organization, else metadata["org_id"] (popped from `meta`), else ""."""
        claimed, key_org = meta.pop("org_id", None), self.key_org(request)
        if claimed is not None and (not isinstance(claimed, str) or len(claimed) > _MAX_ID_CHARS):
            raise ApiError(400, f"metadata.org_id must be a string of at most {_MAX_ID_CHARS} characters",
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

    def dashboard_data(self) -> dict[str, Any]:
        """What /dashboard shows (`flywheel.report.build_report_data`): the configured run folders, and the
        monitors over this store's completions of the last `horizon_s`. Recomputed at most every `refresh_s`."""
        config = self.config.dashboard
        with self._dashboard_lock:
            if self._dashboard is not None and time.monotonic() - self._dashboard[0] < config.refresh_s:
                return self._dashboard[1]
            now = time.time()
            d = self.deployment
            # The cycle's own window and monitors, per answer and per session (flywheel/live/sessions.py).
            watched = watch(self.store, RewardDistiller(config.rewards), Monitor(config.monitor),
                            SessionMonitor(config.session_monitor), now, config.horizon_s, d.production)
            monitors = watched.report
            live = {"production": f"v{d.production}",
                    "candidate": "none" if d.candidate is None else f"v{d.candidate} ({d.candidate_fraction:.0%} of "
                                                                    "sessions)",
                    "completions": self.store.count_completions(), "events": self.store.count_events()}
            data = build_report_data(config.report_dirs, live=live, title="flywheel dashboard", monitors={
                "source": f"this server's last {config.horizon_s / 3600:g} h ({watched.completions} completions, "
                          f"{watched.sessions} background sessions, "
                          f"{config.monitor.window_s:g} s windows)",
                "series": monitors.series, "alarms": monitors.alarms})
            self._dashboard = (time.monotonic(), data)
            return data

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

    # ---- the work behind the endpoints

    async def complete(self, request: Request, body: bytes) -> Response:
        started, created = time.perf_counter(), time.time()
        req = _parse_chat(body)
        n = req.n or 1
        session_id, user_id, meta = _identity(req, request)
        org_id = self._request_org(request, meta)
        session_kind = meta.pop("session_kind", INTERACTIVE)
        if session_kind not in (INTERACTIVE, BACKGROUND):
            raise ApiError(400, f"metadata.session_kind must be {INTERACTIVE!r} or {BACKGROUND!r} (a long agent "
                           "session judged by one outcome event)", param="metadata")
        pinned = self._pinned_version(req.model)
        router = self._org_routers.get(org_id, self.router) if pinned is None else self.router
        try:
            lease = router.checkout(session_id, pinned)
        except NotServed as exc:
            if pinned is not None:
                raise ApiError(404, f"{exc}; ask for {self.config.model_name!r} to be routed", code="model_not_found",
                               param="model") from None
            raise ApiError(503, f"{exc}; the deployment is changing, retry", "server_error") from None
        released = False
        try:
            tools = req.tools if req.tools and req.tool_choice != "none" else None
            forced = _forced_call(req, tools)
            encoder = self._encoders.get(lease.version)
            if encoder is None:
                served = set(self.router.served_versions())  # retired versions' caches go with them
                self._encoders = {v: e for v, e in self._encoders.items() if v in served}
                encoder = self._encoders[lease.version] = ConversationEncoder(lease.tokenizer)
            max_tokens = self._max_tokens(req)
            # Off the event loop: a large prompt's tokenization must not stall every other request.
            try:
                prompt_ids, fresh = await run_in_threadpool(
                    encoder.encode_request, [m.as_template_message() for m in req.messages],
                    tools if tools_in_prompt(lease.tokenizer) else None, self.config.max_context_tokens - max_tokens)
            except PromptTooLong as exc:
                raise self._too_long(f"at least {exc.at_least}", max_tokens) from None
            # tool_choice "required" or a named function: the assistant turn starts with the call's
            # opening, written by the template (prompt tokens, never trained on), and the model goes on.
            prompt_ids = prompt_ids + (encoder.text(forced) if forced else [])
            sampling = self._sampling(req, len(prompt_ids), lease.tokenizer)
            encoder.remember(fresh)  # only now: a refused request leaves nothing in the cache
            queues: list[asyncio.Queue[tuple[int, float] | None]] = []  # one per choice, when streamed
            loop = asyncio.get_running_loop()

            def streamed(p: SamplingParams) -> SamplingParams:
                """Real streaming: each of the choice's tokens reaches the client as the engine samples it."""
                if not req.stream:
                    return p
                tokens: asyncio.Queue[tuple[int, float] | None] = asyncio.Queue()
                queues.append(tokens)

                def on_token(token_id: int, logprob: float) -> None:
                    try:
                        loop.call_soon_threadsafe(tokens.put_nowait, (token_id, logprob))
                    except RuntimeError:  # the server's loop closed under a request: nobody reads it
                        pass

                return dataclasses.replace(p, on_token=on_token)

            params = streamed(sampling)
            engine_started = time.perf_counter()
            in_flight = self.metrics.in_flight.labels(f"v{lease.version}")
            in_flight.inc()
            try:
                future = asyncio.wrap_future(lease.engine.submit(prompt_ids, params))
            except EngineError as exc:  # the engine's loop died or it was closed: not the request's fault
                in_flight.dec()
                raise self._engine_failed(lease.version, exc) from None
            call = _Call(self, req, lease, session_id, user_id, meta, prompt_ids, params, forced, started, created,
                         engine_started, in_flight, future, router, org_id, session_kind)
            released = True  # from here the call gives the lease back when the engine is done with it
            calls = [call]
            for i in range(1, n):  # the rest of the group: the same session, so the same arm and version
                try:
                    extra = router.checkout(session_id, pinned)
                except NotServed as exc:
                    raise ApiError(503, f"{exc}; the deployment is changing, retry", "server_error") from None
                seeded = streamed(sampling if req.seed is None
                                  else dataclasses.replace(sampling, seed=(req.seed + i) % 2**63))
                in_flight.inc()
                try:
                    future = asyncio.wrap_future(extra.engine.submit(prompt_ids, seeded))
                except EngineError as exc:
                    in_flight.dec()
                    router.release(extra)
                    raise self._engine_failed(extra.version, exc) from None
                calls.append(_Call(self, req, extra, session_id, user_id, meta, prompt_ids, seeded, forced, started,
                                   created, engine_started, in_flight, future, router, org_id, session_kind))
            if req.stream:  # the choices' chunks interleaved as their tokens come, each with its index
                include_usage = bool((req.stream_options or {}).get("include_usage"))
                return StreamingResponse(_stream_choices(calls, queues, include_usage),
                                         media_type="text/event-stream", headers=call.headers())
            generations = [await c.generation() for c in calls]
        finally:
            if not released:
                router.release(lease)
        payloads = [await c.finish(g) for c, g in zip(calls, generations, strict=True)]
        payload = payloads[0]
        if n > 1:  # one response, one Completion per choice (each its own id for feedback)
            payload["choices"] = [{**p["choices"][0], "index": i, "completion_id": p["id"]}
                                  for i, p in enumerate(payloads)]
            completion_tokens = sum(p["usage"]["completion_tokens"] for p in payloads)
            payload["usage"] = {"prompt_tokens": len(prompt_ids), "completion_tokens": completion_tokens,
                                "total_tokens": len(prompt_ids) + completion_tokens}
        return Response(json.dumps(payload), media_type="application/json", headers=call.headers())

    async def complete_text(self, request: Request, body: bytes) -> Response:
        """POST /v1/completions: the prompt's tokens as given (or the text's), the engine's tokens back."""
        started, created = time.perf_counter(), time.time()
        try:
            req = TextCompletionRequest.model_validate_json(body)
        except ValidationError as exc:
            raise ApiError(400, f"invalid completion request: {_errors(exc)}") from None
        session_id, user_id, meta = _identity(req, request)
        pinned = self._pinned_version(req.model)
        try:
            lease = self.router.checkout(session_id, pinned)
        except NotServed as exc:
            status = 404 if pinned is not None else 503
            raise ApiError(status, f"{exc}; retry, or ask for {self.config.model_name!r}", code="model_not_found"
                           if pinned is not None else None, param="model") from None
        try:
            tokenizer = lease.tokenizer
            if isinstance(req.prompt, str):
                prompt_ids = await run_in_threadpool(
                    lambda: tokenizer(req.prompt, add_special_tokens=False)["input_ids"])
            else:
                prompt_ids = list(req.prompt)
            vocab = len(tokenizer)
            if not prompt_ids or max(prompt_ids) >= vocab:
                raise ApiError(400, f"the prompt is empty or holds a token id outside this model's vocabulary of "
                               f"{vocab}; encode it with the served tokenizer", param="prompt")
            max_tokens = req.max_tokens or self.config.default_max_tokens
            if max_tokens > self.config.max_tokens_limit:
                raise ApiError(400, f"max_tokens {max_tokens} exceeds this server's limit "
                               f"{self.config.max_tokens_limit}", param="max_tokens")
            if len(prompt_ids) + max_tokens > self.config.max_context_tokens:
                raise self._too_long(str(len(prompt_ids)), max_tokens)
            params = SamplingParams(temperature=1.0 if req.temperature is None else req.temperature,
                                    top_p=1.0 if req.top_p is None else req.top_p, max_tokens=max_tokens,
                                    stop_token_ids=(tokenizer.convert_tokens_to_ids(IM_END),), seed=req.seed)
            engine_started = time.perf_counter()
            try:
                generation = await asyncio.wrap_future(lease.engine.submit(prompt_ids, params))
            except EngineError as exc:
                raise self._engine_failed(lease.version, exc) from None
            engine_ms = (time.perf_counter() - engine_started) * 1000
        finally:
            self.router.release(lease)
        if generation.finish_reason == "aborted" or set(generation.versions) != {lease.version}:
            raise ApiError(503, f"v{lease.version} stopped or changed weights mid-answer; retry", "server_error",
                           "engine_aborted")
        completion_id = f"cmpl-{uuid.uuid4().hex}"
        text = tokenizer.decode(generation.token_ids, skip_special_tokens=False)
        finish = "length" if generation.finish_reason == "length" else "stop"
        completion = Completion(
            id=completion_id, session_id=session_id, user_id=user_id, version=lease.version, prompt_ids=prompt_ids,
            completion_ids=generation.token_ids, logprobs=generation.logprobs,
            latency_ms=(time.perf_counter() - started) * 1000, content=text.removesuffix(IM_END),
            finish_reason=finish, arm=lease.arm, created_at=created, request_meta={**meta, "endpoint": "completions"},
            temperature=params.temperature, top_p=params.top_p)
        try:
            await run_in_threadpool(self.store.add_completion, completion)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        self.metrics.completion(lease.version, lease.arm, len(prompt_ids), len(generation.token_ids), engine_ms / 1000)
        logprobs = None
        if req.logprobs:
            pieces = [tokenizer.decode([t], skip_special_tokens=False) for t in generation.token_ids]
            offsets = [sum(len(p) for p in pieces[:i]) for i in range(len(pieces))]
            logprobs = {"tokens": pieces, "token_logprobs": generation.logprobs, "top_logprobs": None,
                        "text_offset": offsets}
        payload = {
            "id": completion_id, "object": "text_completion", "created": int(created), "model": req.model,
            "system_fingerprint": f"flywheel-v{lease.version}",
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}],
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(generation.token_ids),
                      "total_tokens": len(prompt_ids) + len(generation.token_ids)},
            "flywheel": {"version": lease.version, "arm": lease.arm, "session_id": session_id,
                         "engine_ms": round(engine_ms, 3), "prompt_token_ids": prompt_ids,
                         "token_ids": generation.token_ids}}
        return Response(json.dumps(payload), media_type="application/json",
                        headers={"x-session-id": session_id, "x-flywheel-version": str(lease.version)})

    def _engine_failed(self, version: int, exc: Exception) -> ApiError:
        log.error("engine for v%d failed: %s", version, exc)
        return ApiError(503, f"the engine serving v{version} failed ({exc}); retry later", "server_error",
                        "engine_failed")

    def ingest(self, body: bytes, org_id: str | None = None) -> dict[str, Any]:
        """Parse a batch, check each event, store the good ones in one transaction, say what became of each.

        `org_id`: the sending key's organization; each event carries it (one naming another is rejected)."""
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:  # RecursionError: absurd nesting
            raise ApiError(400, f"body is not JSON: {exc}; send {{\"events\": [...]}}") from None
        if not isinstance(data, dict) or not isinstance(data.get("events"), list):
            raise ApiError(400, 'body must be {"events": [event, ...]}', param="events")
        items = data["events"]
        if len(items) > self.config.max_events_per_batch:
            raise ApiError(413, f"{len(items)} events in one batch; send at most {self.config.max_events_per_batch}",
                           code="batch_too_large")
        rejected: list[dict[str, Any]] = []
        valid: list[tuple[int, Event]] = []
        for i, item in enumerate(items):
            try:
                event = Event.model_validate(item)
                if org_id is not None and event.org_id not in ("", org_id):
                    rejected.append({"index": i, "id": event.id, "reason": f"this key belongs to organization "
                                     f"{org_id!r}, not {event.org_id!r}; drop org_id or use that organization's key"})
                    continue
                valid.append((i, event.model_copy(update={"org_id": org_id}) if org_id is not None else event))
            except ValidationError as exc:
                event_id = item.get("id") if isinstance(item, dict) and isinstance(item.get("id"), str) else None
                rejected.append({"index": i, "id": event_id, "reason": _errors(exc)})
        accepted, duplicate = [], []
        outcomes = self.store.add_events([e for _, e in valid]) if valid else []
        for (i, event), (outcome, reason) in zip(valid, outcomes, strict=True):
            if outcome == Ingest.ACCEPTED:
                accepted.append(event.id)
            elif outcome == Ingest.DUPLICATE:
                duplicate.append(event.id)
            else:
                rejected.append({"index": i, "id": event.id, "reason": reason})
        rejected.sort(key=lambda r: r["index"])
        self.metrics.ingested(len(accepted), len(duplicate), len(rejected))
        return {"accepted": accepted, "duplicate": duplicate, "rejected": rejected}

    def _pinned_version(self, model: str) -> int | None:
        if model == self.config.model_name:
            return None
        match = _VERSION_NAME.fullmatch(model)
        if match is None:
            raise ApiError(404, f"model {model!r} does not exist; use {self.config.model_name!r} (routed) or a served "
                           f"version: {', '.join(f'v{v}' for v in self.router.served_versions())}",
                           code="model_not_found", param="model")
        return int(match.group(1))

    def _max_tokens(self, req: ChatRequest) -> int:
        max_tokens = req.max_completion_tokens or req.max_tokens or self.config.default_max_tokens
        if max_tokens > self.config.max_tokens_limit:
            raise ApiError(400, f"max_tokens {max_tokens} exceeds this server's limit {self.config.max_tokens_limit}",
                           param="max_tokens")
        return max_tokens

    def _too_long(self, prompt_tokens: str, max_tokens: int) -> ApiError:
        return ApiError(400, f"the prompt ({prompt_tokens} tokens) plus max_tokens ({max_tokens}) exceeds the context "
                        f"of {self.config.max_context_tokens} tokens; shorten the conversation or max_tokens",
                        code="context_length_exceeded", param="messages")

    def _sampling(self, req: ChatRequest, prompt_len: int, tokenizer: Any) -> SamplingParams:
        max_tokens = self._max_tokens(req)
        if prompt_len + max_tokens > self.config.max_context_tokens:
            raise self._too_long(str(prompt_len), max_tokens)
        temperature = 1.0 if req.temperature is None else req.temperature
        return SamplingParams(temperature=temperature, top_p=1.0 if req.top_p is None else req.top_p,
                              max_tokens=max_tokens, stop_token_ids=(tokenizer.convert_tokens_to_ids(IM_END),),
                              seed=req.seed)


def _forced_call(req: ChatRequest, tools: list[dict[str, Any]] | None) -> str:
    """The opening of the assistant turn that `tool_choice` forces ("" for auto and none)."""
    choice = req.tool_choice
    if choice is None or choice in ("auto", "none"):
        return ""
    if not tools:
        raise ApiError(400, "tool_choice asks for a tool call but the request declares no tools; add `tools` or "
                       "leave tool_choice unset", param="tool_choice")
    if choice == "required":
        return f"{TOOL_CALL_OPEN}\n"
    names = [t["function"]["name"] for t in tools]
    if choice.function.name not in names:
        raise ApiError(400, f"tool_choice names {choice.function.name!r}, which is not among the declared tools "
                       f"({', '.join(names)})", param="tool_choice")
    return f'{TOOL_CALL_OPEN}\n{{"name": {json.dumps(choice.function.name)}, "arguments": '


class _Call:
    """One chat completion after its request was checked and handed to the engine: the engine's
    answer, parsed, stored and shaped as OpenAI's response (whole, or streamed token by token)."""

    def __init__(self, server: LiveServer, req: ChatRequest, lease: Any, session_id: str, user_id: str,
                 meta: dict[str, Any], prompt_ids: list[int], params: SamplingParams, forced: str, started: float,
                 created: float, engine_started: float, in_flight: Any, future: asyncio.Future[Any],
                 router: Any = None, org_id: str = "", session_kind: str = INTERACTIVE):
        self.server, self.req, self.lease = server, req, lease
        self.session_id, self.user_id, self.meta = session_id, user_id, meta
        self.prompt_ids, self.params, self.forced = prompt_ids, params, forced
        self.started, self.created, self.engine_started = started, created, engine_started
        self.future = future
        self.org_id, self.session_kind = org_id, session_kind
        router = router or server.router  # an organization's own Router leased it, when it has one
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.first_token_s: float | None = None
        self.engine_ms = 0.0

        def done(_: Any) -> None:  # the engine is done with it, whatever became of the client
            self.engine_ms = (time.perf_counter() - engine_started) * 1000
            in_flight.dec()
            router.release(lease)

        future.add_done_callback(done)

    def headers(self) -> dict[str, str]:
        return {"x-session-id": self.session_id, "x-flywheel-version": str(self.lease.version)}

    async def generation(self) -> Any:
        try:
            generation = await self.future
        except EngineError as exc:  # the engine's loop died or it was closed: not the request's fault
            raise self.server._engine_failed(self.lease.version, exc) from None
        if generation.finish_reason == "aborted" or set(generation.versions) != {self.lease.version}:
            raise ApiError(503, f"v{self.lease.version} stopped or changed weights mid-answer (it was retired); retry",
                           "server_error", "engine_aborted")
        return generation

    def _head(self) -> dict[str, Any]:
        served = {"version": self.lease.version, "arm": self.lease.arm, "session_id": self.session_id,
                  "engine_ms": round(self.engine_ms, 3)}
        if self.first_token_s is not None:
            served["ttft_ms"] = round((self.first_token_s - self.started) * 1000, 3)
        if self.req.tools and not tools_in_prompt(self.lease.tokenizer):
            unknown = sorted({t["function"]["name"] for t in self.req.tools} - TOOL_SCHEMAS.keys())
            if unknown:
                served["unknown_tools"] = unknown
        return {"id": self.id, "created": int(self.created), "model": self.req.model,
                "system_fingerprint": f"flywheel-v{self.lease.version}", "flywheel": served}

    def _stopped(self, generation: Any) -> tuple[Any, str]:
        """(the generation, its text), both cut at the first `stop` sequence in the sampled text.

        The engine knows only stop tokens, so it may sample past a stop string; the record keeps the
        shortest prefix of sampled tokens whose text holds the sequence (exactly those tokens, their
        logprobs and versions: what comes after was never served), and the text ends before it."""
        tokenizer = self.lease.tokenizer
        text = tokenizer.decode(generation.token_ids, skip_special_tokens=False)
        hits = [(i, len(x)) for x in self.req.stop or [] if (i := text.find(x)) >= 0]
        if not hits:
            return generation, text
        at, length = min(hits)
        lo, hi = 1, len(generation.token_ids)  # the fewest tokens whose text reaches past the sequence
        while lo < hi:
            mid = (lo + hi) // 2
            if len(tokenizer.decode(generation.token_ids[:mid], skip_special_tokens=False)) >= at + length:
                hi = mid
            else:
                lo = mid + 1
        cut = dataclasses.replace(generation, token_ids=generation.token_ids[:lo], logprobs=generation.logprobs[:lo],
                                  versions=generation.versions[:lo], finish_reason="stop")
        return cut, text[:at]

    async def finish(self, generation: Any) -> dict[str, Any]:
        """Parse the answer, commit its Completion, and return the chat.completion payload."""
        req, lease, server = self.req, self.lease, self.server
        generation, text = self._stopped(generation)
        answer = self.forced + text
        if req.tool_choice == "none":  # no tool call, whatever the model wrote: its text is the answer
            content, calls = answer.removesuffix(IM_END), []
        else:
            schemas = {t["function"]["name"]: t for t in req.tools or []}
            content, calls = parse_assistant(answer, call_id_prefix=f"call_{self.id[9:21]}", schemas=schemas)
            calls = [_storable_call(c) for c in calls]
        finish = "length" if generation.finish_reason == "length" else ("tool_calls" if calls else "stop")
        completion = Completion(
            id=self.id, session_id=self.session_id, user_id=self.user_id, version=lease.version,
            prompt_ids=self.prompt_ids, completion_ids=generation.token_ids, logprobs=generation.logprobs,
            latency_ms=(time.perf_counter() - self.started) * 1000,
            tool_calls=[CompletionToolCall(name=c.name, arguments=c.arguments, valid=c.valid, error=c.error or "")
                        for c in calls],
            content=content, finish_reason=finish, arm=lease.arm, created_at=self.created, request_meta=self.meta,
            temperature=self.params.temperature, top_p=self.params.top_p, org_id=self.org_id,
            session_kind=self.session_kind,
        )
        # Committed before the response exists: a client can never hold an id the store lacks.
        try:
            await run_in_threadpool(server.store.add_completion, completion)
        except ValueError as exc:  # a value the checks before generation missed: refused, nothing stored
            raise ApiError(400, str(exc)) from None
        server.metrics.completion(lease.version, lease.arm, len(self.prompt_ids), len(generation.token_ids),
                                  self.engine_ms / 1000)
        message: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else "")}
        if calls:
            message["tool_calls"] = [_openai_call(c) for c in calls]
        logprobs = _logprobs(generation.token_ids, generation.logprobs, lease.tokenizer) if req.logprobs else None
        usage = {"prompt_tokens": len(self.prompt_ids), "completion_tokens": len(generation.token_ids),
                 "total_tokens": len(self.prompt_ids) + len(generation.token_ids)}
        return {**self._head(), "object": "chat.completion", "usage": usage,
                "choices": [{"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish}]}

    async def stream(self, tokens: asyncio.Queue[tuple[int, float] | None], index: int = 0,
                     response_id: str | None = None) -> Any:
        """This choice's chunks (`("chunk", chunk)`): the content as its tokens are sampled (cut
        before a tool call's markup), then the calls, the finish reason (with `flywheel.ttft_ms`);
        last `("usage", chunk)`. `response_id`: the id every chunk of an n > 1 response carries
        (each choice then names its own Completion, `completion_id`)."""
        self.future.add_done_callback(lambda _: tokens.put_nowait(None))
        base = {**self._head(), "object": "chat.completion.chunk"}
        own = {"index": index}
        if response_id is not None:
            base["id"], own["completion_id"] = response_id, self.id

        tokenizer, ids, sent = self.lease.tokenizer, [], ""
        pending: list[tuple[int, float]] = []  # sampled since the last chunk: their logprobs go with the next

        def event(delta: dict[str, Any], finish: str | None = None,
                  extra: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
            lp = None
            if self.req.logprobs and pending:
                lp = _logprobs([t for t, _ in pending], [v for _, v in pending], tokenizer)
                pending.clear()
            return "chunk", {**base, **(extra or {}), "choices": [{**own, "delta": delta, "logprobs": lp,
                                                                   "finish_reason": finish}]}

        yield event({"role": "assistant", "content": ""})
        while (item := await tokens.get()) is not None:
            if self.first_token_s is None:
                self.first_token_s = time.perf_counter()
            ids.append(item[0])
            pending.append(item)
            text = self.forced + tokenizer.decode(ids, skip_special_tokens=False)
            visible = text.removesuffix(IM_END)
            if self.req.stop:  # nothing past a stop sequence, nor what may yet become one
                hits = [i for x in self.req.stop if (i := visible.find(x)) >= 0]
                visible = visible[:min(hits)] if hits else visible[:len(visible) - max(map(len, self.req.stop)) + 1]
            if self.req.tool_choice != "none":  # what follows a call's opening is the call, not content
                visible = visible.split(TOOL_CALL_OPEN, 1)[0].rstrip("\n")
            if len(visible) > len(sent) and visible.startswith(sent) and "\ufffd" not in visible[len(sent):]:
                yield event({"content": visible[len(sent):]})
                sent = visible
        try:
            payload = await self.finish(await self.generation())
        except ApiError as exc:  # headers are sent: the error goes in the stream, as OpenAI's does
            yield "chunk", {"error": {"message": exc.message, "type": exc.type, "code": exc.code}}
            return
        choice = payload["choices"][0]
        message = choice["message"]
        content = message["content"] or ""
        if content != sent and content.startswith(sent):
            yield event({"content": content[len(sent):]})
        for i, call in enumerate(message.get("tool_calls") or []):
            yield event({"tool_calls": [{"index": i, **call}]})
        final = {**self._head()}
        yield event({}, choice["finish_reason"], {"flywheel": final["flywheel"]})
        yield "usage", {**base, "choices": [], "usage": payload["usage"]}


async def _stream_choices(calls: list[_Call], queues: list[asyncio.Queue[tuple[int, float] | None]],
                          include_usage: bool) -> Any:
    """Server-sent events of a streamed request: every choice's chunks as its tokens are sampled,
    interleaved in the order they come (each names its choice's `index`, as OpenAI's do), then the
    usage of all choices together (when `stream_options.include_usage`), then [DONE]."""
    merged: asyncio.Queue[tuple[str, dict[str, Any]] | None] = asyncio.Queue()
    response_id = calls[0].id if len(calls) > 1 else None

    async def pump(index: int, call: _Call, tokens: asyncio.Queue[tuple[int, float] | None]) -> None:
        try:
            async for item in call.stream(tokens, index, response_id):
                await merged.put(item)
        finally:
            await merged.put(None)

    pumps = [asyncio.create_task(pump(i, c, q)) for i, (c, q) in enumerate(zip(calls, queues, strict=True))]
    usage: dict[str, Any] | None = None
    running = len(pumps)
    try:
        while running:
            item = await merged.get()
            if item is None:
                running -= 1
                continue
            kind, chunk = item
            if kind == "usage":  # one usage for the response: the prompt once, every choice's tokens
                if usage is None:
                    usage = chunk
                else:
                    counts = usage["usage"]
                    counts["completion_tokens"] += chunk["usage"]["completion_tokens"]
                    counts["total_tokens"] = counts["prompt_tokens"] + counts["completion_tokens"]
                continue
            yield f"data: {json.dumps(chunk)}\n\n".encode()
    finally:
        for task in pumps:
            task.cancel()
    for task in pumps:  # a failure other than the API errors the stream already carries
        if not task.cancelled() and task.exception() is not None:
            raise task.exception()
    if include_usage and usage is not None:
        yield f"data: {json.dumps(usage)}\n\n".encode()
    yield b"data: [DONE]\n\n"


def _parse_chat(body: bytes) -> ChatRequest:
    try:
        return ChatRequest.model_validate_json(body)
    except ValidationError as exc:
        raise ApiError(400, f"invalid chat completion request: {_errors(exc)}") from None


def _identity(req: ChatRequest | TextCompletionRequest, request: Request) -> tuple[str, str, dict[str, Any]]:
    """(session id, user id, request_meta) from the headers, body fields and metadata, in that order."""
    meta = dict(req.metadata or {})
    session_id = request.headers.get("x-session-id") or req.session_id or meta.pop("session_id", None)
    meta.pop("session_id", None)
    user_id = req.user or request.headers.get("x-user-id") or meta.pop("user_id", None)
    meta.pop("user_id", None)
    for name, value in (("session id", session_id), ("user id", user_id)):
        if value is not None and (not isinstance(value, str) or len(value) > _MAX_ID_CHARS):
            raise ApiError(400, f"the {name} must be a string of at most {_MAX_ID_CHARS} characters", param=name)
    # The session id goes back in the `x-session-id` header: visible ASCII only, no spaces or line breaks.
    if session_id is not None and not _HEADER_SAFE_ID.fullmatch(session_id):
        raise ApiError(400, f"the session id {session_id[:40]!r} must be 1 to {_MAX_ID_CHARS} visible ASCII "
                       "characters (no spaces, control characters or non-ASCII); use e.g. a uuid4",
                       param="session_id")
    reason = storable(user_id, "user id") or storable(meta, "metadata")
    if reason is not None:
        raise ApiError(400, f"{reason}; it is stored with the completion", param="metadata")
    return session_id or f"anon-{uuid.uuid4().hex}", user_id or "anonymous", meta


def _storable_call(call: ToolCall) -> ToolCall:
    """The call, or, when the model wrote arguments JSON allows but a record cannot hold (NaN, 1e999,
    integers past 2**53), the same call marked invalid with empty arguments: answered, never dropped."""
    reason = storable(call.arguments, "arguments")
    if reason is None:
        return call
    return ToolCall(call.id, call.name, {}, error=call.error or f"{reason} in the tool call")


def _openai_call(call: Any) -> dict[str, Any]:
    out = {"id": call.id, "type": "function",
           "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}
    if call.error is not None:
        out["error"] = call.error  # not OpenAI's: the reason the call is invalid (answer it with this)
    return out


def _logprobs(token_ids: list[int], logprobs: list[float], tokenizer: Any) -> dict[str, Any]:
    content = []
    for token_id, logprob in zip(token_ids, logprobs, strict=True):
        token = tokenizer.decode([token_id], skip_special_tokens=False)
        content.append({"token": token, "logprob": logprob, "bytes": list(token.encode()), "top_logprobs": []})
    return {"content": content}


def _stream_chunks(head: dict[str, Any], message: dict[str, Any], finish: str, logprobs: dict[str, Any] | None,
                   usage: dict[str, int] | None) -> Iterator[bytes]:
    base = {**head, "object": "chat.completion.chunk"}

    def event(delta: dict[str, Any], finish_reason: str | None = None, lp: dict[str, Any] | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}
        return f"data: {json.dumps({**base, 'choices': [choice]})}\n\n".encode()

    yield event({"role": "assistant", "content": ""})
    if message["content"] or logprobs is not None:
        yield event({"content": message["content"] or ""}, lp=logprobs)
    for i, call in enumerate(message.get("tool_calls", [])):
        yield event({"tool_calls": [{"index": i, **call}]})
    yield event({}, finish)
    if usage is not None:
        yield f"data: {json.dumps({**base, 'choices': [], 'usage': usage})}\n\n".encode()
    yield b"data: [DONE]\n\n"


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
    return LiveStore(config.store_location, synchronous=config.synchronous,
                     completions_synchronous=config.completions_synchronous,
                     require_known_completion=config.require_known_completion)


def registry_loader(registry: Registry, engine: EngineConfig) -> EngineLoader:
    """Load a version from the Registry into its own engine: a LocalEngine, one in a process of its
    own (`engine.separate_process`: its decode loop then never waits on the server's GIL, and still
    streams), or vLLM servers on its checkpoint folder (`engine.backend = "vllm"`)."""

    def load(version: int) -> tuple[Engine, Any]:
        model, tokenizer = registry.load(version)
        if engine.backend == "vllm":
            return start_engine(None, engine, version=version, checkpoint=registry.get(version).path), tokenizer
        return start_engine(model, engine, version=version), tokenizer

    return load


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refusing (413) past `limit` bytes without reading further."""
    length = request.headers.get("content-length")
    if length is not None:
        if not (length.isascii() and length.isdigit()):  # "²".isdigit(), yet int("²") fails
            raise ApiError(400, "Content-Length is not a number")
        if int(length) > limit:
            raise ApiError(413, f"body of {length} bytes exceeds the limit of {limit}; send less per request",
                           code="body_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError(413, f"body exceeds the limit of {limit} bytes; send less per request",
                           code="body_too_large")
    return bytes(body)


class _BugsAsJson:
    """A bug, not a bad request: logged with its traceback, answered as a 500 in the same JSON shape,
    and the connection stays usable. (An `Exception` handler would not do: Starlette re-raises after
    it answers, and uvicorn then closes the connection under the client.)"""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_tracked(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except Exception as exc:
            log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            if started:  # half a response cannot be taken back: the connection has to close
                raise
            await ApiError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error").response()(
                scope, receive, send)


def create_app(server: LiveServer) -> FastAPI:
    app = FastAPI(title="flywheel", version="1", docs_url=None, redoc_url=None, openapi_url="/openapi.json")

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = openapi_document(app)
        return app.openapi_schema

    app.openapi = openapi
    limit = server.config.max_body_bytes

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return ApiError(exc.status_code, str(exc.detail), "invalid_request_error").response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return ApiError(400, f"invalid request: {exc.errors()[:3]}").response()

    app.add_middleware(_BugsAsJson)
    # Outermost, so a bug's 500 is counted too; paths known once every route below is declared.
    known_paths: set[str] = set()
    app.add_middleware(MeasuredRequests, metrics=server.metrics, paths=known_paths)

    @app.get("/health", response_model=None, responses=_json_reply(Health))
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/dashboard", response_model=None, openapi_extra={"parameters": [_KEY_PARAMETER]},
             responses={200: {"content": {"text/html": {"schema": {"type": "string"}}}},
                        401: {"model": ErrorResponse}, 403: {"model": ErrorResponse}})
    async def dashboard(request: Request) -> Response:
        server.authorize_dashboard(request)
        data = await run_in_threadpool(server.dashboard_data)
        page = await run_in_threadpool(dashboard_page, data, "dashboard/data", server.config.dashboard.refresh_s)
        return HTMLResponse(page, headers={"cache-control": "no-store"})

    @app.get("/dashboard/data", response_model=None, responses=_json_reply(DashboardData, 401, 403), openapi_extra={
        "parameters": [_KEY_PARAMETER, {"name": "html_only", "in": "query", "required": False,
                                        "schema": {"type": "string", "enum": ["0", "1"]}}]})
    async def dashboard_data(request: Request) -> Response:
        server.authorize_dashboard(request)
        data = await run_in_threadpool(server.dashboard_data)
        reply = {"generated_at": data["generated_at"], "html": await run_in_threadpool(render_body, data)}
        if request.query_params.get("html_only") != "1":  # the page's polls need only the sections
            reply["data"] = data
        return Response(json.dumps(reply, allow_nan=False), media_type="application/json",
                        headers={"cache-control": "no-store"})

    @app.get("/metrics", response_model=None, openapi_extra={"parameters": [_KEY_PARAMETER]},
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}},
                        401: {"model": ErrorResponse}, 403: {"model": ErrorResponse}})
    async def metrics(request: Request) -> Response:
        # Prometheus scrapes with a bearer token (`authorization.credentials`), a key with the
        # dashboard or admin scope: the counts say how much traffic each version gets.
        server.authorize_dashboard(request)
        return Response(server.metrics.exposition(), media_type=server.metrics.content_type)

    @app.get("/v1/models", response_model=None, responses=_json_reply(ModelList, 401, 403))
    async def models(request: Request) -> dict[str, Any]:
        server.authorize(request, "inference")
        names = [server.config.model_name] + [f"v{v}" for v in server.router.served_versions()]
        return {"object": "list", "data": [{"id": n, "object": "model", "created": 0, "owned_by": "flywheel"}
                                           for n in names]}

    @app.get("/v1/models/{model_id}", response_model=None, responses=_json_reply(_ModelCard, 401, 403, 404))
    async def model(model_id: str, request: Request) -> dict[str, Any]:
        server.authorize(request, "inference")
        names = [server.config.model_name] + [f"v{v}" for v in server.router.served_versions()]
        if model_id not in names:
            raise ApiError(404, f"model {model_id[:80]!r} is not served; GET /v1/models lists {', '.join(names)}",
                           code="model_not_found", param="model")
        return {"id": model_id, "object": "model", "created": 0, "owned_by": "flywheel"}

    @app.post("/v1/completions", response_model=None, openapi_extra=_json_body(TextCompletionRequest),
              responses=_json_reply(TextCompletionResponse, 400, 401, 403, 404, 413, 503))
    async def completions(request: Request) -> Response:
        server.authorize(request, "inference")
        return await server.complete_text(request, await _read_body(request, limit))

    @app.post("/v1/chat/completions", response_model=None, openapi_extra=_json_body(ChatRequest),
              responses=_json_reply(ChatCompletionResponse, 400, 401, 403, 404, 413, 503, stream=True))
    async def chat_completions(request: Request) -> Response:
        server.authorize(request, "inference")
        return await server.complete(request, await _read_body(request, limit))

    @app.post("/v1/events", response_model=None, openapi_extra=_json_body(EventBatch),
              responses=_json_reply(EventsResponse, 400, 401, 403, 413))
    async def events(request: Request) -> Response:
        server.authorize(request, "events")
        body = await _read_body(request, limit)
        # Parsing, validation and the commit run off the event loop, so completions keep flowing.
        result = await run_in_threadpool(server.ingest, body, server.key_org(request))
        return Response(json.dumps(result), media_type="application/json")

    @app.get("/v1/admin/deployment", response_model=None, responses=_json_reply(DeploymentResponse, 401, 403))
    async def get_deployment(request: Request) -> dict[str, Any]:
        server.authorize(request, "admin")
        return {"deployment": server.deployment.model_dump(), "served_versions": server.router.served_versions()}

    @app.post("/v1/admin/deployment", response_model=None, openapi_extra=_json_body(Deployment),
              responses=_json_reply(DeploymentResponse, 400, 401, 403, 404, 413))
    async def post_deployment(request: Request) -> dict[str, Any]:
        server.authorize(request, "admin")
        body = await _read_body(request, limit)
        try:
            deployment = Deployment.model_validate_json(body)
        except ValidationError as exc:
            raise ApiError(400, f"invalid deployment: {_errors(exc)}") from None
        if max(deployment.versions) > _MAX_VERSION:  # SQLite's integers end at 2**63 - 1
            raise ApiError(404, f"no version above {_MAX_VERSION} exists; name a registered version",
                           code="version_not_found")
        try:
            previous = await run_in_threadpool(server.set_deployment, deployment, "admin endpoint")
        except KeyError as exc:  # CheckpointNotFound: a version the registry does not hold
            raise ApiError(404, str(exc), code="version_not_found") from None
        return {"deployment": deployment.model_dump(), "previous": previous.model_dump(),
                "served_versions": server.router.served_versions()}

    @app.post("/v1/admin/deployment/sync", response_model=None,
              responses=_json_reply(DeploymentResponse, 401, 403, 409))
    async def sync_deployment(request: Request) -> dict[str, Any]:
        server.authorize(request, "admin")
        try:
            deployment = await run_in_threadpool(server.sync_from_registry)
        except (KeyError, ValueError) as exc:
            raise ApiError(409, str(exc), code="registry_unusable") from None
        return {"deployment": deployment.model_dump(), "served_versions": server.router.served_versions()}

    # ---- each organization's own deployment of adapters (flywheel/live/orgs.py), admin like the above

    def org_reply(org_id: str, previous: Deployment | None = None) -> dict[str, Any]:
        router = server._org_routers.get(org_id)
        adapters = [c.version for c in server.registry.list() if c.org_id == org_id and c.base is not None] \
            if server.registry is not None else []
        deployment = server.org_deployment(org_id)
        return {"org_id": org_id, "deployment": deployment.model_dump() if deployment else None,
                "served_versions": router.served_versions() if router else [], "adapters": adapters,
                "previous": previous.model_dump() if previous else None}

    def org_param(org_id: str) -> str:
        from flywheel.live.orgs import check_org_id  # noqa: PLC0415  (peft loads only when used)

        try:
            return check_org_id(org_id)
        except ValueError as exc:
            raise ApiError(400, str(exc)[:300], code="invalid_org", param="org_id") from None

    @app.get("/v1/admin/orgs", response_model=None, responses=_json_reply(OrgList, 401, 403))
    async def list_orgs(request: Request) -> dict[str, Any]:
        server.authorize(request, "admin")
        orgs = set(server.config.orgs.values()) | set(server._org_routers)
        if server.registry is not None:
            orgs |= {c.org_id for c in await run_in_threadpool(server.registry.list) if c.base is not None}
        replies = [await run_in_threadpool(org_reply, org) for org in sorted(orgs)]
        return {"shared": server.deployment.model_dump(), "orgs": replies}

    @app.get("/v1/admin/orgs/{org_id}/deployment", response_model=None,
             responses=_json_reply(OrgDeploymentResponse, 400, 401, 403))
    async def get_org_deployment(org_id: str, request: Request) -> dict[str, Any]:
        server.authorize(request, "admin")
        return await run_in_threadpool(org_reply, org_param(org_id))

    @app.put("/v1/admin/orgs/{org_id}/deployment", response_model=None,
             openapi_extra=_json_body(OrgDeploymentRequest),
             responses=_json_reply(OrgDeploymentResponse, 400, 401, 403, 404, 409, 413))
    async def put_org_deployment(org_id: str, request: Request) -> dict[str, Any]:
        server.authorize(request, "admin")
        org = org_param(org_id)
        try:
            wanted = OrgDeploymentRequest.model_validate_json(await _read_body(request, limit)).deployment
        except ValidationError as exc:
            raise ApiError(400, f"invalid organization deployment: {_errors(exc)}") from None
        if wanted is not None and max(wanted.versions) > _MAX_VERSION:
            raise ApiError(404, f"no version above {_MAX_VERSION} exists; name a registered adapter",
                           code="version_not_found")
        if server.registry is None:
            raise ApiError(409, "this server has no Registry to load adapters from", code="registry_unusable")
        previous = server.org_deployment(org)
        try:
            await run_in_threadpool(server.set_org_deployment, org, wanted, "admin endpoint")
        except KeyError as exc:  # CheckpointNotFound: a version the registry does not hold
            raise ApiError(404, str(exc)[:300], code="version_not_found") from None
        except ValueError as exc:  # a full checkpoint, or another organization's adapter
            raise ApiError(400, str(exc)[:300], code="not_an_org_adapter") from None
        return await run_in_threadpool(org_reply, org, previous)

    known_paths.update(route.path for route in app.routes)
    return app


# ---- running it


class RunningServer:
    """A LiveServer's app under uvicorn on a background thread (tests, benchmarks, simulated users)."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn  # noqa: PLC0415  (only what runs a server needs it)

        # IPPROTO_TCP named explicitly: asyncio sets TCP_NODELAY only on sockets whose proto says TCP,
        # and without it every response waits ~40 ms for a delayed ACK (Nagle).
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))  # bound here so the port is known (port 0: any free one) before serving
        self.host, self.port = host, sock.getsockname()[1]
        self._server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="off"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, name="uvicorn",
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn did not start on {host}:{self.port}; see its log above")
            time.sleep(0.01)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout_s: float = 10.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout_s)

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


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
