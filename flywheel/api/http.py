"""HTTP around the records: body limits, the OpenAPI document's pieces, a server on a thread.

    body = await read_body(request, limit)      413 past `limit` bytes, never reading further
    result = await unless_client_left(request, work, on_left)   ClientDisconnect if the client leaves first
    @router.post(..., openapi_extra=json_body(ChatRequest), responses=json_reply(ChatCompletionResponse, 400))
    with RunningServer(app) as running: running.url     uvicorn on loopback (tests, benchmarks, harnesses)

The endpoints read their bodies themselves, through `read_body`, so that a body's size is checked
while it streams in rather than after FastAPI buffered all of it; FastAPI therefore does not see
the request models, and `json_body` declares them to the OpenAPI document instead.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel
from starlette.requests import ClientDisconnect

from flywheel.api.errors import ApiError, ErrorResponse

T = TypeVar("T")


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refusing (413) past `limit` bytes without reading further."""
    length = request.headers.get("content-length")
    if length is not None:
        if not (length.isascii() and length.isdigit()):  # "²".isdigit(), yet int("²") fails
            raise ApiError(400, "Content-Length is not a number")
        if len(length.lstrip("0")) > 18 or int(length) > limit:  # int() refuses 4,300 digits and more
            raise ApiError(413, f"body of {length[:40]} bytes exceeds the limit of {limit}; send less per request",
                           code="body_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError(413, f"body exceeds the limit of {limit} bytes; send less per request",
                           code="body_too_large")
    return bytes(body)


async def unless_client_left(request: Request, work: Awaitable[T], on_left: Callable[[], None]) -> T:
    """`work`'s result, unless the client closes its connection first: then `on_left()` (stop what was
    started for it: engine requests, a sandbox command), `work` is cancelled, and ClientDisconnect is
    raised, which the error handlers answer with nothing and /metrics counts as 499
    (flywheel/api/errors.py). Call it once the body is read: the next message is the disconnect."""
    task = asyncio.ensure_future(work)
    left = asyncio.ensure_future(_client_left(request))
    try:
        await asyncio.wait({task, left}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        left.cancel()
    if task.done():
        return task.result()
    task.cancel()
    task.add_done_callback(_retrieved)  # what it ends with is nobody's to read now: not "never retrieved"
    on_left()
    raise ClientDisconnect()


def _retrieved(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


async def _client_left(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def json_reply(model: type[BaseModel], *errors: int, stream: bool = False) -> dict[int | str, dict[str, Any]]:
    """FastAPI `responses`: 200 with `model` (or SSE too), and each status in `errors` with ErrorResponse."""
    ok: dict[str, Any] = {"model": model}
    if stream:
        # Each server-sent event: `data` holds a chat.completion.chunk as JSON, or [DONE] at the end.
        ok["content"] = {"text/event-stream": {"schema": {
            "type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}}}
    return {200: ok, **{status: {"model": ErrorResponse} for status in errors}}


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """FastAPI `openapi_extra`: the request body is `model` as JSON (its schema is added to the document
    under its name)."""
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


class RunningServer:
    """An ASGI app under uvicorn on a background thread (tests, benchmarks, simulated users, harnesses)."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
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
