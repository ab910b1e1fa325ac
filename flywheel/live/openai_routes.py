"""The OpenAI audience of the live server: chat completions, raw completions and the model list.

    POST /v1/chat/completions  ──Router: session ──> arm, version ──> that version's Engine
                               ──> parse tool calls ──> LiveStore.add_completion ──> response (id = completion id)
    POST /v1/completions       a raw prompt, text or token ids; the sampled ids come back
                               (`flywheel.prompt_token_ids`, `flywheel.token_ids`): token in, token out
    GET  /v1/models            the routed name and every served version
    GET  /v1/models/{id}       one of them, or 404

All need a key with the `inference` scope. The wire (the request and response records, their
parsing, the chunks of a stream, body limits) is flywheel/api's; what is here is what serving
means for flywheel: who is asking (`_identity`), which version answers (the Router), the prompt's
tokens (`ConversationEncoder`), sampling, and the Completion committed before the response exists.
flywheel/live/server.py's docstring says how each part of OpenAI's API is served and where it
departs from it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import time
import uuid
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response, StreamingResponse

from flywheel.api.errors import ApiError
from flywheel.api.http import json_body, json_reply, read_body, unless_client_left
from flywheel.api.records import (
    MAX_ID_CHARS,
    ChatCompletionResponse,
    ChatRequest,
    ModelCard,
    ModelList,
    TextCompletionRequest,
    TextCompletionResponse,
    chat_logprobs,
    model_card,
    openai_tool_call,
    parse_chat,
    parse_text_completion,
    usage,
)
from flywheel.api.streaming import DONE, sse
from flywheel.env.toolspec import TOOL_SCHEMAS, ToolCall
from flywheel.live.deploy import NotServed
from flywheel.live.records import BACKGROUND, INTERACTIVE, Completion, CompletionToolCall, storable
from flywheel.model.chat import ChatFormat, tools_in_prompt
from flywheel.model.conversation import PromptTooLong
from flywheel.model.engine import EngineError, SamplingParams
from flywheel.model.formats import format_of, stop_ids
from flywheel.store.database import StoreUnavailable

if TYPE_CHECKING:
    from flywheel.live.server import LiveServer, ServeConfig

log = logging.getLogger(__name__)

# ASCII digits only (re's \d also takes "٠", an Arabic-Indic zero, which int() reads as 0); 9 digits:
# int() and SQLite take it.
_VERSION_NAME = re.compile(r"v([0-9]{1,9})")
_HEADER_SAFE_ID = re.compile(rf"[!-~]{{1,{MAX_ID_CHARS}}}")


def openai_router(server: LiveServer) -> APIRouter:
    """The routes of the `inference` scope, served by `server`."""
    router = APIRouter()
    limit = server.config.max_body_bytes

    def names() -> list[str]:
        return [server.config.model_name] + [f"v{v}" for v in server.router.served_versions()]

    @router.get("/v1/models", response_model=None, responses=json_reply(ModelList, 401, 403))
    async def models(request: Request) -> dict[str, Any]:
        server.authorize(request, "inference")
        return {"object": "list", "data": [model_card(n) for n in names()]}

    @router.get("/v1/models/{model_id}", response_model=None, responses=json_reply(ModelCard, 401, 403, 404))
    async def model(model_id: str, request: Request) -> dict[str, Any]:
        server.authorize(request, "inference")
        if model_id not in names():
            raise ApiError(404, f"model {model_id[:80]!r} is not served; GET /v1/models lists {', '.join(names())}",
                           code="model_not_found", param="model")
        return model_card(model_id)

    @router.post("/v1/completions", response_model=None, openapi_extra=json_body(TextCompletionRequest),
                 responses=json_reply(TextCompletionResponse, 400, 401, 403, 404, 413, 503))
    async def completions(request: Request) -> Response:
        server.authorize(request, "inference")
        return await complete_text(server, request, await read_body(request, limit))

    @router.post("/v1/chat/completions", response_model=None, openapi_extra=json_body(ChatRequest),
                 responses=json_reply(ChatCompletionResponse, 400, 401, 403, 404, 413, 503, stream=True))
    async def chat_completions(request: Request) -> Response:
        server.authorize(request, "inference")
        return await complete_chat(server, request, await read_body(request, limit))

    return router


async def complete_chat(server: LiveServer, request: Request, body: bytes) -> Response:
    """POST /v1/chat/completions: route, encode, sample (streamed or whole), store, answer."""
    started, created = time.perf_counter(), time.time()
    req = parse_chat(body)
    n = req.n or 1
    if req.top_logprobs and (req.stream or not req.logprobs):
        raise ApiError(400, "top_logprobs > 0 needs logprobs: true and is not supported with stream; set logprobs, "
                       "or leave stream unset", param="top_logprobs")
    session_id, user_id, meta = _identity(req, request)
    org_id = server.request_org(request, meta)
    session_kind = meta.pop("session_kind", INTERACTIVE)
    if session_kind not in (INTERACTIVE, BACKGROUND):
        raise ApiError(400, f"metadata.session_kind must be {INTERACTIVE!r} or {BACKGROUND!r} (a long agent "
                       "session judged by one outcome event)", param="metadata")
    pinned = pinned_version(server, req.model)
    router = server.router_for(org_id) if pinned is None else server.router
    try:
        lease = router.checkout(session_id, pinned)
    except NotServed as exc:
        if pinned is not None:
            raise ApiError(404, f"{exc}; ask for {server.config.model_name!r} to be routed", code="model_not_found",
                           param="model") from None
        raise ApiError(503, f"{exc}; the deployment is changing, retry", "server_error") from None
    released = False
    try:
        tools = req.tools if req.tools and req.tool_choice != "none" else None
        encoder = server.encoder(lease.version, lease.tokenizer)
        forced = _forced_call(req, tools, encoder.format)
        max_tokens = requested_max_tokens(server.config, req)
        # Off the event loop: a large prompt's tokenization must not stall every other request.
        try:
            prompt_ids, fresh = await run_in_threadpool(
                encoder.encode_request, [m.as_template_message() for m in req.messages],
                tools if tools_in_prompt(lease.tokenizer) else None, server.config.max_context_tokens - max_tokens)
        except PromptTooLong as exc:
            raise context_too_long(server.config, f"at least {exc.at_least}", max_tokens) from None
        # tool_choice "required" or a named function: the assistant turn starts with the call's
        # opening, written by the template (prompt tokens, never trained on), and the model goes on.
        prompt_ids = prompt_ids + (encoder.text(forced) if forced else [])
        sampling = sampling_params(server.config, req, len(prompt_ids), lease.tokenizer)
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
        in_flight = server.metrics.in_flight.labels(f"v{lease.version}")
        in_flight.inc()
        try:
            future = asyncio.wrap_future(lease.engine.submit(prompt_ids, params))
        except EngineError as exc:  # the engine's loop died or it was closed: not the request's fault
            in_flight.dec()
            raise engine_failed(lease.version, exc) from None
        call = _Call(server, req, lease, session_id, user_id, meta, prompt_ids, params, forced, started, created,
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
                raise engine_failed(extra.version, exc) from None
            calls.append(_Call(server, req, extra, session_id, user_id, meta, prompt_ids, seeded, forced, started,
                               created, engine_started, in_flight, future, router, org_id, session_kind))
        if req.stream:  # the choices' chunks interleaved as their tokens come, each with its index
            include_usage = bool((req.stream_options or {}).get("include_usage"))
            return StreamingResponse(_stream_choices(calls, queues, include_usage),
                                     media_type="text/event-stream", headers=call.headers())
        # A client that leaves before its answer cancels the engine requests (the engine drops them at
        # its next step): a generation nobody received is never stored, so never a training turn.
        generations = await unless_client_left(request, asyncio.gather(*(c.generation() for c in calls)),
                                               lambda: [c.future.cancel() for c in calls])
    finally:
        if not released:
            router.release(lease)
    payloads = [await c.finish(g) for c, g in zip(calls, generations, strict=True)]
    payload = payloads[0]
    if n > 1:  # one response, one Completion per choice (each its own id for feedback)
        payload["choices"] = [{**p["choices"][0], "index": i, "completion_id": p["id"]}
                              for i, p in enumerate(payloads)]
        completion_tokens = sum(p["usage"]["completion_tokens"] for p in payloads)
        payload["usage"] = usage(len(prompt_ids), completion_tokens)
    return Response(json.dumps(payload), media_type="application/json", headers=call.headers())


async def complete_text(server: LiveServer, request: Request, body: bytes) -> Response:
    """POST /v1/completions: the prompt's tokens as given (or the text's), the engine's tokens back."""
    started, created = time.perf_counter(), time.time()
    req = parse_text_completion(body)
    session_id, user_id, meta = _identity(req, request)
    pinned = pinned_version(server, req.model)
    try:
        lease = server.router.checkout(session_id, pinned)
    except NotServed as exc:
        status = 404 if pinned is not None else 503
        raise ApiError(status, f"{exc}; retry, or ask for {server.config.model_name!r}", code="model_not_found"
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
        max_tokens = req.max_tokens or server.config.default_max_tokens
        if max_tokens > server.config.max_tokens_limit:
            raise ApiError(400, f"max_tokens {max_tokens} exceeds this server's limit "
                           f"{server.config.max_tokens_limit}", param="max_tokens")
        if len(prompt_ids) + max_tokens > server.config.max_context_tokens:
            raise context_too_long(server.config, str(len(prompt_ids)), max_tokens)
        params = SamplingParams(temperature=1.0 if req.temperature is None else req.temperature,
                                top_p=1.0 if req.top_p is None else req.top_p, max_tokens=max_tokens,
                                stop_token_ids=stop_ids(tokenizer), seed=req.seed)
        engine_started = time.perf_counter()
        try:
            generation = await asyncio.wrap_future(lease.engine.submit(prompt_ids, params))
        except EngineError as exc:
            raise engine_failed(lease.version, exc) from None
        engine_ms = (time.perf_counter() - engine_started) * 1000
    finally:
        server.router.release(lease)
    if generation.finish_reason == "aborted" or set(generation.versions) != {lease.version}:
        raise ApiError(503, f"v{lease.version} stopped or changed weights mid-answer; retry", "server_error",
                       "engine_aborted")
    completion_id = f"cmpl-{uuid.uuid4().hex}"
    text = tokenizer.decode(generation.token_ids, skip_special_tokens=False)
    finish = "length" if generation.finish_reason == "length" else "stop"
    completion = Completion(
        id=completion_id, session_id=session_id, user_id=user_id, version=lease.version, prompt_ids=prompt_ids,
        completion_ids=generation.token_ids, logprobs=generation.logprobs,
        latency_ms=(time.perf_counter() - started) * 1000, content=format_of(tokenizer).strip_end(text),
        finish_reason=finish, arm=lease.arm, created_at=created, request_meta={**meta, "endpoint": "completions"},
        temperature=params.temperature, top_p=params.top_p)
    try:
        await run_in_threadpool(server.store.add_completion, completion)
    except ValueError as exc:
        raise ApiError(400, str(exc)) from None
    server.metrics.completion(lease.version, lease.arm, len(prompt_ids), len(generation.token_ids), engine_ms / 1000)
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
        "usage": usage(len(prompt_ids), len(generation.token_ids)),
        "flywheel": {"version": lease.version, "arm": lease.arm, "session_id": session_id,
                     "engine_ms": round(engine_ms, 3), "prompt_token_ids": prompt_ids,
                     "token_ids": generation.token_ids}}
    return Response(json.dumps(payload), media_type="application/json",
                    headers={"x-session-id": session_id, "x-flywheel-version": str(lease.version)})


def engine_failed(version: int, exc: Exception) -> ApiError:
    """503: the engine's loop died or it was closed, which is not the request's fault."""
    log.error("engine for v%d failed: %s", version, exc)
    return ApiError(503, f"the engine serving v{version} failed ({exc}); retry later", "server_error",
                    "engine_failed")


def pinned_version(server: LiveServer, model: str) -> int | None:
    """The version `model` names ("v3"), or None for the routed name; 404 for any other."""
    if model == server.config.model_name:
        return None
    match = _VERSION_NAME.fullmatch(model)
    if match is None:
        raise ApiError(404, f"model {model!r} does not exist; use {server.config.model_name!r} (routed) or a served "
                       f"version: {', '.join(f'v{v}' for v in server.router.served_versions())}",
                       code="model_not_found", param="model")
    return int(match.group(1))


def requested_max_tokens(config: ServeConfig, req: ChatRequest) -> int:
    max_tokens = req.max_completion_tokens or req.max_tokens or config.default_max_tokens
    if max_tokens > config.max_tokens_limit:
        raise ApiError(400, f"max_tokens {max_tokens} exceeds this server's limit {config.max_tokens_limit}",
                       param="max_tokens")
    return max_tokens


def context_too_long(config: ServeConfig, prompt_tokens: str, max_tokens: int) -> ApiError:
    return ApiError(400, f"the prompt ({prompt_tokens} tokens) plus max_tokens ({max_tokens}) exceeds the context "
                    f"of {config.max_context_tokens} tokens; shorten the conversation or max_tokens",
                    code="context_length_exceeded", param="messages")


def sampling_params(config: ServeConfig, req: ChatRequest, prompt_len: int, tokenizer: Any) -> SamplingParams:
    max_tokens = requested_max_tokens(config, req)
    if prompt_len + max_tokens > config.max_context_tokens:
        raise context_too_long(config, str(prompt_len), max_tokens)
    temperature = 1.0 if req.temperature is None else req.temperature
    return SamplingParams(temperature=temperature, top_p=1.0 if req.top_p is None else req.top_p,
                          max_tokens=max_tokens, stop_token_ids=stop_ids(tokenizer),
                          seed=req.seed, top_logprobs=req.top_logprobs or 0)


def _forced_call(req: ChatRequest, tools: list[dict[str, Any]] | None, chat_format: ChatFormat) -> str:
    """The opening of the assistant turn that `tool_choice` forces ("" for auto and none)."""
    choice = req.tool_choice
    if choice is None or choice in ("auto", "none"):
        return ""
    if not tools:
        raise ApiError(400, "tool_choice asks for a tool call but the request declares no tools; add `tools` or "
                       "leave tool_choice unset", param="tool_choice")
    if choice == "required":
        return chat_format.forced_call(None)
    names = [t["function"]["name"] for t in tools]
    if choice.function.name not in names:
        raise ApiError(400, f"tool_choice names {choice.function.name!r}, which is not among the declared tools "
                       f"({', '.join(names)})", param="tool_choice")
    return chat_format.forced_call(choice.function.name)


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
        self.format = format_of(lease.tokenizer)  # the served model's chat format: how its calls are written
        self.first_token_s: float | None = None
        self.engine_ms = 0.0
        self.invalid_calls: int | None = None  # once parsed: the calls the client got as text, not tool_calls

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
            raise engine_failed(self.lease.version, exc) from None
        if generation.finish_reason == "aborted" or set(generation.versions) != {self.lease.version}:
            raise ApiError(503, f"v{self.lease.version} stopped or changed weights mid-answer (it was retired); retry",
                           "server_error", "engine_aborted")
        return generation

    def _head(self) -> dict[str, Any]:
        served = {"version": self.lease.version, "arm": self.lease.arm, "session_id": self.session_id,
                  "engine_ms": round(self.engine_ms, 3)}
        if self.first_token_s is not None:
            served["ttft_ms"] = round((self.first_token_s - self.started) * 1000, 3)
        if self.invalid_calls is not None:
            served["invalid_tool_calls"] = self.invalid_calls
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
                                  versions=generation.versions[:lo], finish_reason="stop",
                                  top_logprobs=generation.top_logprobs and generation.top_logprobs[:lo])
        return cut, text[:at]

    async def finish(self, generation: Any) -> dict[str, Any]:
        """Parse the answer, commit its Completion, and return the chat.completion payload."""
        req, lease, server = self.req, self.lease, self.server
        generation, text = self._stopped(generation)
        answer = self.forced + text
        if req.tool_choice == "none":  # no tool call, whatever the model wrote: its text is the answer
            content, calls = self.format.strip_end(answer), []
        else:
            schemas = {t["function"]["name"]: t for t in req.tools or []}
            content, calls = self.format.parse(answer, call_id_prefix=f"call_{self.id[9:21]}", schemas=schemas)
            calls = [_storable_call(c) for c in calls]
        # The client is sent only calls it can dispatch; the record keeps every call (client_view says why).
        content, sent_calls = self.format.client_view(answer, content, calls) if calls else (content, [])
        self.invalid_calls = len(calls) - len(sent_calls)
        finish = "length" if generation.finish_reason == "length" else ("tool_calls" if sent_calls else "stop")
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
        except StoreUnavailable as exc:  # as an ApiError, so a stream carries it as its last chunk
            raise ApiError.store_unavailable(exc) from None
        server.metrics.completion(lease.version, lease.arm, len(self.prompt_ids), len(generation.token_ids),
                                  self.engine_ms / 1000)
        message: dict[str, Any] = {"role": "assistant", "content": content or (None if sent_calls else "")}
        if sent_calls:
            message["tool_calls"] = [openai_tool_call(c) for c in sent_calls]
        if req.top_logprobs and generation.top_logprobs is None:
            raise ApiError(400, f"v{lease.version}'s engine does not return top_logprobs; leave top_logprobs unset",
                           param="top_logprobs")
        logprobs = (chat_logprobs(generation.token_ids, generation.logprobs, lease.tokenizer, generation.top_logprobs)
                    if req.logprobs else None)
        return {**self._head(), "object": "chat.completion",
                "usage": usage(len(self.prompt_ids), len(generation.token_ids)),
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
                lp = chat_logprobs([t for t, _ in pending], [v for _, v in pending], tokenizer)
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
            visible = self.format.strip_end(text)
            if self.req.stop:  # nothing past a stop sequence, nor what may yet become one
                hits = [i for x in self.req.stop if (i := visible.find(x)) >= 0]
                visible = visible[:min(hits)] if hits else visible[:len(visible) - max(map(len, self.req.stop)) + 1]
            if self.req.tool_choice != "none":  # what follows a call's opening is the call, not content
                visible = self.format.visible_content(visible)
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
            yield sse(chunk)
    finally:
        for task in pumps:
            task.cancel()
        for call in calls:  # the client left mid-stream: its engine requests stop (done ones are unaffected)
            call.future.cancel()
    for task in pumps:  # a failure other than the API errors the stream already carries
        if not task.cancelled() and task.exception() is not None:
            raise task.exception()
    if include_usage and usage is not None:
        yield sse(usage)
    yield DONE


def _identity(req: ChatRequest | TextCompletionRequest, request: Request) -> tuple[str, str, dict[str, Any]]:
    """(session id, user id, request_meta) from the headers, body fields and metadata, in that order."""
    meta = dict(req.metadata or {})
    session_id = request.headers.get("x-session-id") or req.session_id or meta.pop("session_id", None)
    meta.pop("session_id", None)
    user_id = req.user or request.headers.get("x-user-id") or meta.pop("user_id", None)
    meta.pop("user_id", None)
    for name, value in (("session id", session_id), ("user id", user_id)):
        if value is not None and (not isinstance(value, str) or len(value) > MAX_ID_CHARS):
            raise ApiError(400, f"the {name} must be a string of at most {MAX_ID_CHARS} characters", param=name)
    # The session id goes back in the `x-session-id` header: visible ASCII only, no spaces or line breaks.
    if session_id is not None and not _HEADER_SAFE_ID.fullmatch(session_id):
        raise ApiError(400, f"the session id {session_id[:40]!r} must be 1 to {MAX_ID_CHARS} visible ASCII "
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
