"""Errors on the wire: OpenAI's shape, one set of handlers for every flywheel app.

    raise ApiError(400, "what was wrong and the fix", param="messages")
        ──> 400 {"error": {"message", "type", "code", "param"}}

An endpoint refuses a request by raising `ApiError`; `install_error_handlers` makes FastAPI answer
it, and its own errors (an unknown path, a method not allowed, a path parameter that does not
validate), in the same shape, so a client reads one kind of error whichever server it talks to.
A database that cannot be reached now (`StoreUnavailable`) is answered 503 with `Retry-After`, code
`store_unavailable`: the client retries, nothing is logged as a bug. A bug is no bad request:
`BugsAsJson` logs its traceback and answers a 500 in that shape too, keeping the connection usable
for the client's next request. A client that went away before its request was read or answered
(`ClientDisconnect`) gets nothing, since nobody is there to read it: no traceback, no 500, and
/metrics counts the request as 499 (nginx's "client closed request"; flywheel/live/metrics.py).
"""

from __future__ import annotations

import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from flywheel.store.database import StoreUnavailable

log = logging.getLogger(__name__)


class ApiError(Exception):
    """An error response: status, OpenAI error type and a message that says the fix."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, retry_after_s: float | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param
        self.retry_after_s = retry_after_s  # a Retry-After header, in whole seconds (at least 1)

    @classmethod
    def store_unavailable(cls, exc: StoreUnavailable) -> ApiError:
        return cls(503, f"the store is unavailable ({exc}); retry", "server_error", "store_unavailable",
                   retry_after_s=exc.retry_after_s)

    def response(self) -> JSONResponse:
        # A body refused unread stays on the wire: the connection cannot carry another request, and
        # saying so lets the client open a new one instead of finding it reset (draining it instead
        # would let anyone make the server read gigabytes).
        headers = {"connection": "close"} if self.code == "body_too_large" else {}
        if self.retry_after_s is not None:
            headers["retry-after"] = str(max(1, math.ceil(self.retry_after_s)))
        return JSONResponse({"error": {"message": self.message, "type": self.type, "code": self.code,
                                       "param": self.param}}, status_code=self.status, headers=headers or None)


class _ErrorBody(BaseModel):
    message: str
    type: str
    code: str | None
    param: str | None


class ErrorResponse(BaseModel):
    """Every 4xx (and the 503 of a changing deployment): OpenAI's error shape."""

    error: _ErrorBody


def first_error(exc: ValidationError) -> str:
    """`where: what` of a validation's first error."""
    return _located(exc.errors(include_url=False)[0])


def describe_errors(exc: ValidationError, limit: int = 3) -> str:
    """A validation's first `limit` errors as `where: what; ...`, and how many more there are."""
    parts = [_located(err) for err in exc.errors(include_url=False)[:limit]]
    more = exc.error_count() - limit
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")


def _located(err: Any) -> str:
    where = ".".join(str(p) for p in err["loc"])
    return f"{where}: {err['msg']}" if where else err["msg"]


def install_error_handlers(app: FastAPI) -> None:
    """Answer ApiError, FastAPI's own 4xx and a bug's 500 in OpenAI's error shape (the only handlers
    a flywheel app registers). Middleware added after this wraps it, and so sees the 500 too."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return ApiError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return ApiError(400, f"invalid request: {exc.errors()[:3]}").response()

    @app.exception_handler(StoreUnavailable)
    async def _store_unavailable(request: Request, exc: StoreUnavailable) -> JSONResponse:
        log.warning("%s %s: 503, %s", request.method, request.url.path, exc)
        return ApiError.store_unavailable(exc).response()

    app.add_middleware(BugsAsJson)


class BugsAsJson:
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
        except ClientDisconnect:  # the client left mid-request: nobody to answer (metrics: 499)
            log.info("%s %s: the client disconnected before its request was answered", scope.get("method"),
                     scope.get("path"))
        except Exception as exc:
            log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            if started:  # half a response cannot be taken back: the connection has to close
                raise
            await ApiError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error").response()(
                scope, receive, send)
