"""`flywheel tinker serve`: the Tinker API over flywheel, for the official `tinker` SDK unmodified.

    TINKER_BASE_URL=http://127.0.0.1:8100 TINKER_API_KEY=tml-dev-train-key python my_tinker_script.py

Supported SDK: tinker 0.38 (its wire: JSON requests under /api/v1, forward_backward as protobuf,
results fetched through /api/v1/retrieve_future, protobuf for forward_backward and sample results;
the `X-API-Key` header). What it serves, what it refuses and why: docs/tinker.md. The work itself
is flywheel/tinker/service.py; this module is the wire and the keys.

Keys: `X-API-Key: tml-...` (the SDK refuses keys without the `tml-` prefix). Each key has scopes
from the config's `[keys]` table, as the live server's: `training` (create and train models, save
and load their checkpoints) and `sampling` (samplers and samples). No or unknown key: 401; a key
without the endpoint's scope: 403. What a key made, no other key sees (404).

The client config the server hands out (`/api/v1/client/config`) keeps the SDK on the paths this
server implements: fwd/bwd chunks of one call sent one after another, custom losses computed on the
client, no zstd bodies, per-request futures.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from flywheel.api.errors import ApiError
from flywheel.api.http import read_body
from flywheel.extras import require
from flywheel.model.engine import EngineConfig, SamplingParams
from flywheel.model.registry import Registry
from flywheel.tinker.losses import LossInputError, check_loss
from flywheel.tinker.service import NotFound, Outcome, TinkerService, UserError, owner_of
from flywheel.tinker.wire import FEATURE, WireError, decode_forward_backward

Scope = Literal["training", "sampling"]
PROTO = "application/x-protobuf"


class TinkerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    host: str = "127.0.0.1"
    port: int = 8100
    registry: Path = Path("runs/registry")  # the Registry the base models come from and adapters go to
    registry_url: str | None = None  # its index database (None: SQLite in the folder)
    root: Path = Path("runs/tinker")  # save_state checkpoints and sampler markers, per model
    # Tinker base model name -> Registry ref ("v0", "production"). Empty: every full version is
    # served under its own refs (v0, v1, ..., and its aliases).
    models: dict[str, str] = Field(default_factory=dict)
    # API key -> scopes. Keys start with "tml-" (the SDK refuses others). Compared by SHA-256 digest.
    keys: dict[str, list[Scope]] = Field(default_factory=dict)
    # Padded tokens per forward: bounds activation memory, does not change the gradient.
    micro_batch_tokens: int = Field(4096, gt=0)
    # Sampler engines kept (least recently used closed first; its sampler rebuilds one when used
    # again). Each holds a copy of its adapted weights and its KV cache.
    max_engines: int = Field(4, ge=1)
    default_max_tokens: int = Field(256, ge=1)
    max_tokens_limit: int = Field(4096, ge=1)
    max_body_bytes: int = Field(64 * 1024 * 1024, gt=0)  # one forward_backward chunk (the SDK sends <= ~5 MB)
    # How long retrieve_future waits for a result before answering try_again: longer means fewer
    # polls per request; it must stay under the SDK's 45 s read timeout.
    long_poll_s: float = Field(20.0, gt=0, lt=40)
    threads: int = Field(2, ge=1)
    engine: EngineConfig = Field(default_factory=EngineConfig)

    @field_validator("keys")
    @classmethod
    def _keys(cls, keys: dict[str, list[Scope]]) -> dict[str, list[Scope]]:
        for key, scopes in keys.items():
            if not key.startswith("tml-"):
                raise ValueError("a Tinker API key must start with 'tml-' (the SDK refuses any other)")
            if not scopes:
                raise ValueError("a key has no scopes; give it 'training', 'sampling' or both")
        return keys


def create_app(service: TinkerService, config: TinkerConfig) -> FastAPI:
    """The Tinker API's routes over `service`, keyed by `config.keys`."""
    types = require("tinker.types", FEATURE)
    scopes = {hashlib.sha256(k.encode()).hexdigest(): frozenset(v) for k, v in config.keys.items()}
    if not scopes:
        raise ValueError('no API keys configured: add a [keys] table, e.g. "tml-dev-key" = ["training", "sampling"]')
    app = FastAPI(title="flywheel tinker", docs_url=None, redoc_url=None)
    counters: dict[str, int] = {}  # sampling session -> clients that joined it

    def caller(request: Request, scope: Scope | None) -> str:
        key = request.headers.get("x-api-key")
        if not key:
            raise ApiError(401, "missing API key: send `X-API-Key: tml-...` (TINKER_API_KEY)")
        owner = owner_of(key.strip())
        if owner not in scopes:
            raise ApiError(401, "unknown API key")
        if scope is not None and scope not in scopes[owner]:
            raise ApiError(403, f"this key lacks the {scope!r} scope (it has {sorted(scopes[owner])})")
        return owner

    async def body(request: Request, model: Any) -> Any:
        raw = await read_body(request, config.max_body_bytes)
        try:
            return model.model_validate(json.loads(raw or b"{}"))
        except (ValueError, ValidationError) as exc:
            raise ApiError(400, f"invalid {model.__name__}: {str(exc)[:2000]}") from exc

    async def owned_model(model_id: str, owner: str) -> None:
        # Off the event loop: after a restart the first request naming a model reads its record
        # and may load its base (seconds), while other clients' requests go on being answered.
        await asyncio.to_thread(service.model, model_id, owner)

    def future(request_id: str, **extra: Any) -> dict[str, Any]:
        return {"request_id": request_id, **extra}

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        # The Tinker shape of an error (the SDK's RequestFailedResponse), under its HTTP status.
        return JSONResponse({"error": exc.message, "category": "user" if exc.status < 500 else "server"},
                            status_code=exc.status)

    for error, status in ((NotFound, 404), (UserError, 400), (LossInputError, 400), (WireError, 400)):
        app.add_exception_handler(error, _status_handler(status))

    @app.get("/api/v1/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities(request: Request) -> dict[str, Any]:
        caller(request, None)
        return {"supported_models": [{"model_name": n, "trainable": True, "sampleable": True}
                                     for n in service.base_names()]}

    @app.post("/api/v1/client/config")
    async def client_config(request: Request) -> dict[str, Any]:
        caller(request, None)
        return {"pjwt_auth_enabled": False, "parallel_fwdbwd_chunks": False, "proto_compress_fwdbwd": False,
                "use_pyqwest_transport": False, "sample_use_retrieve_futures": False,
                "custom_loss_server_side": False, "sample_join_sampling_session": False}

    @app.post("/api/v1/client/dynamic_config")
    async def dynamic_config(request: Request) -> dict[str, Any]:
        caller(request, None)
        return {"sample_cancel_enabled": False}

    @app.post("/api/v1/telemetry")
    async def telemetry(request: Request) -> dict[str, str]:
        caller(request, None)
        await read_body(request, config.max_body_bytes)
        return {"status": "accepted"}  # accepted and dropped: flywheel keeps its own logs

    @app.post("/api/v1/create_session")
    async def create_session(request: Request) -> dict[str, Any]:
        owner = caller(request, None)
        await body(request, types.CreateSessionRequest)
        return {"type": "create_session", "session_id": service.create_session(owner)}

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat(request: Request) -> dict[str, Any]:
        owner = caller(request, None)
        service.check_session((await body(request, types.SessionHeartbeatRequest)).session_id, owner)
        return {"type": "session_heartbeat"}

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish(session_id: str, request: Request) -> dict[str, Any]:
        service.check_session(session_id, caller(request, None))
        return {}

    @app.post("/api/v1/create_model")
    async def create_model(request: Request) -> dict[str, Any]:
        owner = caller(request, "training")
        req = await body(request, types.CreateModelRequest)
        service.check_session(req.session_id, owner)
        if req.lora_config is None:
            raise ApiError(400, "full fine-tuning is not supported: flywheel trains LoRA adapters "
                                 "(create_lora_training_client)")
        if getattr(req.optimizer_config, "type", "adamw") != "adamw":
            raise ApiError(400, f"optimizer {req.optimizer_config.type!r} is not supported; flywheel has AdamW")
        lora = req.lora_config
        return future(service.submit(owner, lambda: service.create_model(
            owner, req.session_id, req.model_seq_id, req.base_model, lora.rank, lora.seed, lora.train_attn,
            lora.train_mlp)))

    @app.post("/api/v1/get_info")
    async def get_info(request: Request) -> dict[str, Any]:
        owner = caller(request, "training")
        return await asyncio.to_thread(service.info, (await body(request, types.GetInfoRequest)).model_id, owner)

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request) -> dict[str, Any]:
        owner = caller(request, "training")
        if PROTO not in request.headers.get("content-type", "") or request.headers.get("content-encoding"):
            raise ApiError(400, f"forward_backward takes an uncompressed {PROTO} body (tinker 0.38's wire)")
        req = decode_forward_backward(await read_body(request, config.max_body_bytes))
        await owned_model(req.model_id, owner)
        check_loss(req.loss_fn, req.loss_fn_config)
        return future(service.submit(owner, lambda: service.forward_backward(owner, req)), model_id=req.model_id)

    @app.post("/api/v1/optim_step")
    async def optim_step(request: Request) -> dict[str, Any]:
        owner = caller(request, "training")
        req = await body(request, types.OptimStepRequest)
        await owned_model(req.model_id, owner)
        if not isinstance(req.optim_params, types.AdamParams):
            raise ApiError(400, "only AdamParams are supported (flywheel's optimizer is AdamW)")
        params = req.optim_params.model_dump()
        return future(service.submit(owner, lambda: service.optim_step(owner, req.model_id, req.seq_id, params)),
                      model_id=req.model_id)

    @app.post("/api/v1/save_weights")
    async def save_weights(request: Request) -> dict[str, Any]:
        owner = caller(request, "training")
        req = await body(request, types.SaveWeightsRequest)
        await owned_model(req.model_id, owner)
        name = req.path or f"state-{req.seq_id}"
        return future(service.submit(owner, lambda: service.save_state(owner, req.model_id, name, req.overwrite)))

    @app.post("/api/v1/load_weights")
    async def load_weights(request: Request) -> dict[str, Any]:
        owner = caller(request, "training")
        req = await body(request, types.LoadWeightsRequest)
        if req.session_id is not None:
            service.check_session(req.session_id, owner)
            seq = req.model_seq_id or 0
            return future(service.submit(owner, lambda: service.create_from_state(
                owner, req.session_id, seq, req.path, req.optimizer)))
        if req.model_id is None:
            raise ApiError(400, "give model_id, or session_id and model_seq_id")
        await owned_model(req.model_id, owner)
        return future(service.submit(owner, lambda: service.load_state(owner, req.model_id, req.path, req.optimizer)))

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_for_sampler(request: Request) -> dict[str, Any]:
        owner = caller(request, "training")
        req = await body(request, types.SaveWeightsForSamplerRequest)
        await owned_model(req.model_id, owner)
        if req.kind != "snapshot":
            raise ApiError(400, f"sampling client kind {req.kind!r} is not supported; use 'snapshot'")
        session = req.model_id.split(":train:")[0]
        return future(service.submit(owner, lambda: service.save_for_sampler(
            owner, req.model_id, req.path, session, req.sampling_session_seq_id)))

    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request) -> dict[str, Any]:
        owner = caller(request, "sampling")
        req = await body(request, types.CreateSamplingSessionRequest)
        service.check_session(req.session_id, owner)
        sampler_id = await asyncio.to_thread(service.create_sampler, owner, req.session_id,
                                             req.sampling_session_seq_id, req.base_model, req.model_path)
        return {"type": "create_sampling_session", "sampling_session_id": sampler_id}

    @app.post("/api/v1/join_sampling_session")
    async def join(request: Request) -> dict[str, Any]:
        owner = caller(request, "sampling")
        sampler_id = (await body(request, types.JoinSamplingSessionRequest)).sampling_session_id
        await asyncio.to_thread(service.sampler, sampler_id, owner)  # may rebuild it after a restart
        counters[sampler_id] = counters.get(sampler_id, 0) + 1
        return {"type": "join_sampling_session", "client_counter": counters[sampler_id]}

    @app.get("/api/v1/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str, request: Request) -> dict[str, Any]:
        entry = await asyncio.to_thread(service.sampler, sampler_id, caller(request, "sampling"))
        return {"sampler_id": sampler_id, "base_model": entry.base_name, "model_path": entry.model_path}

    @app.post("/api/v1/asample")
    async def asample(request: Request) -> dict[str, Any]:
        owner = caller(request, "sampling")
        req = await body(request, types.SampleRequest)
        if req.sampling_session_id is None:
            raise ApiError(400, "give sampling_session_id (create_sampling_session first)")
        entry = await asyncio.to_thread(service.sampler, req.sampling_session_id, owner)
        prompt = _prompt_tokens(req.prompt)
        _, tokenizer = await asyncio.to_thread(service.base, entry.base_version)  # loads it the first time
        params = _sampling_params(req, tokenizer, config)
        n = req.num_samples
        if not 1 <= n <= 64:
            raise ApiError(400, f"num_samples must be between 1 and 64, got {n}")
        request_id = service.submit(owner, lambda: service.sample(
            owner, req.sampling_session_id, prompt, n, params, bool(req.prompt_logprobs)), on_worker=False)
        return future(request_id, sample_sequence_ids=[f"{request_id}:{i}" for i in range(n)])

    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request) -> Response:
        owner = caller(request, None)
        req = await body(request, types.FutureRetrieveRequest)
        pending = service.result(req.request_id, owner)
        try:
            outcome: Outcome = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(pending)),
                                                      config.long_poll_s)
        except TimeoutError:
            return JSONResponse({"type": "try_again", "request_id": req.request_id, "queue_state": "active"})
        if outcome.error is not None:
            return JSONResponse({"error": outcome.error, "category": outcome.category})
        if isinstance(outcome.body, bytes):
            return Response(outcome.body, media_type=PROTO)
        return JSONResponse(outcome.body)

    @app.post("/api/v1/cancel_future")
    async def cancel_future(request: Request) -> dict[str, Any]:
        caller(request, None)
        return {}

    @app.api_route("/api/v1/{rest:path}", methods=["GET", "POST", "PUT", "DELETE"])
    async def unsupported(rest: str, request: Request) -> None:
        caller(request, None)
        raise ApiError(400, f"/api/v1/{rest[:100]} is not supported by flywheel's Tinker server (docs/tinker.md)")

    return app


def _status_handler(status: int):
    async def handler(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse({"error": str(exc), "category": "user"}, status_code=status)
    return handler


def _prompt_tokens(prompt: Any) -> list[int]:
    tokens: list[int] = []
    for chunk in prompt.chunks:
        if getattr(chunk, "type", None) != "encoded_text":
            raise ApiError(400, f"{getattr(chunk, 'type', type(chunk).__name__)} chunks are not supported; "
                                 "flywheel samples from text tokens")
        tokens.extend(chunk.tokens)
    if not tokens:
        raise ApiError(400, "the prompt is empty")
    return tokens


def _sampling_params(req: Any, tokenizer: Any, config: TinkerConfig) -> SamplingParams:
    refused = {"topk_prompt_logprobs": req.topk_prompt_logprobs, "topk_sample_logprobs": req.topk_sample_logprobs,
               "target_prompt_logprobs": req.target_prompt_logprobs, "prompt_alt_tokens_k": req.prompt_alt_tokens_k,
               "prompt_logprobs_last_n": req.prompt_logprobs_last_n,
               "record_stability_info": req.record_stability_info}
    asked = sorted(name for name, value in refused.items() if value)
    if asked:
        raise ApiError(400, f"{asked} are not supported by flywheel's sampler (docs/tinker.md)")
    p = req.sampling_params
    if p.top_k not in (-1, 0):
        raise ApiError(400, "top_k is not supported by flywheel's sampler; use top_p")
    max_tokens = p.max_tokens or config.default_max_tokens
    if not 1 <= max_tokens <= config.max_tokens_limit:
        raise ApiError(400, f"max_tokens must be between 1 and {config.max_tokens_limit}, got {max_tokens}")
    return SamplingParams(temperature=float(p.temperature), top_p=float(p.top_p), max_tokens=max_tokens,
                          stop_token_ids=_stop_ids(p.stop, tokenizer), seed=p.seed)


def _stop_ids(stop: Any, tokenizer: Any) -> tuple[int, ...]:
    """Tinker's `stop`: None = the end-of-sequence token; [] = none; token ids; or strings, each of
    which must be one token of this tokenizer (the engine stops on tokens)."""
    if stop is None:
        return (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()
    items = [stop] if isinstance(stop, str) else list(stop)
    ids = []
    for item in items:
        if isinstance(item, int):
            ids.append(item)
            continue
        encoded = tokenizer.encode(item, add_special_tokens=False)
        if len(encoded) != 1:
            raise ApiError(400, f"stop string {item[:40]!r} is {len(encoded)} tokens here; flywheel stops on "
                                 "single tokens: give token ids, or a string that is one token")
        ids.append(encoded[0])
    return tuple(ids)


def serve(config: TinkerConfig) -> None:
    """Run the server until interrupted (the CLI's `flywheel tinker serve`)."""
    import torch  # noqa: PLC0415
    import uvicorn  # noqa: PLC0415

    torch.set_num_threads(config.threads)
    registry = Registry(config.registry, url=config.registry_url)
    service = TinkerService(registry, config.root, config.models, config.micro_batch_tokens, config.max_engines,
                            config.engine)
    print(f"tinker API on http://{config.host}:{config.port} (TINKER_BASE_URL), base models "
          f"{service.base_names()}", flush=True)
    try:
        uvicorn.run(create_app(service, config), host=config.host, port=config.port, log_level="warning")
    finally:
        service.close()
        registry.close()
