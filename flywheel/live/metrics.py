"""The live server's Prometheus metrics, served at GET /metrics in the text exposition format.

    flywheel_requests_total{route, status}            every request the server answered; 499: its
                                                      client left first (not a server error)
    flywheel_request_seconds{route}                   histogram: from the request's start to its response
    flywheel_engine_seconds{version}                  histogram: the engine's part of a completion
    flywheel_completions_total{version, arm}          completions served, by Registry version and A/B arm
    flywheel_tokens_total{kind}                       prompt and completion tokens served
    flywheel_engine_requests_in_flight{version}       completions handed to an engine and not yet back:
                                                      its queue plus its running batch, as the server sees it
    flywheel_events_total{outcome}                    feedback events accepted, duplicate or rejected

Each server owns its own `CollectorRegistry` (no module-level state: two servers in one process,
as in the tests, count apart). Labels hold only bounded values (route templates, versions, arms,
outcomes, status codes), never ids, so the series stay few whatever the traffic.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# A completion on the embedded CPU model takes 10 ms to a few seconds; a bad request answers in < 1 ms.
_SECONDS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("flywheel_requests", "Requests answered, by route and HTTP status.",
                                ["route", "status"], registry=r)
        self.request_seconds = Histogram("flywheel_request_seconds", "Time from a request's start to its response.",
                                         ["route"], buckets=_SECONDS, registry=r)
        self.engine_seconds = Histogram("flywheel_engine_seconds", "The engine's part of one completion.",
                                        ["version"], buckets=_SECONDS, registry=r)
        self.completions = Counter("flywheel_completions", "Completions served, by Registry version and arm.",
                                   ["version", "arm"], registry=r)
        self.tokens = Counter("flywheel_tokens", "Tokens served: prompt or completion.", ["kind"], registry=r)
        self.in_flight = Gauge("flywheel_engine_requests_in_flight",
                               "Completions handed to an engine and not yet back (queued or decoding).",
                               ["version"], registry=r)
        self.events = Counter("flywheel_events", "Feedback events by outcome.", ["outcome"], registry=r)

    def request(self, route: str, status: int, seconds: float) -> None:
        self.requests.labels(route, str(status)).inc()
        self.request_seconds.labels(route).observe(seconds)

    def completion(self, version: int, arm: str, prompt_tokens: int, completion_tokens: int,
                   engine_seconds: float) -> None:
        self.completions.labels(f"v{version}", arm).inc()
        self.tokens.labels("prompt").inc(prompt_tokens)
        self.tokens.labels("completion").inc(completion_tokens)
        self.engine_seconds.labels(f"v{version}").observe(engine_seconds)

    def ingested(self, accepted: int, duplicate: int, rejected: int) -> None:
        for outcome, n in (("accepted", accepted), ("duplicate", duplicate), ("rejected", rejected)):
            if n:
                self.events.labels(outcome).inc(n)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


CLIENT_CLOSED = 499  # nginx's "client closed request": the client left before its answer was sent


class MeasuredRequests:
    """ASGI middleware: counts and times every HTTP request by route and status into `metrics`.

    The route label is the request's path when the app has a route of that exact path, else
    "other" (so a client probing random paths cannot grow the series)."""

    def __init__(self, app: Any, metrics: ServerMetrics, paths: frozenset[str]):
        self.app, self.metrics, self.paths = app, metrics, paths

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status: int | None = None

        async def send_seen(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_seen)
            # Done without a response: its client left first (flywheel/api/errors.py), nginx's 499.
            status = CLIENT_CLOSED if status is None else status
        except asyncio.CancelledError:  # the server cancelled it when its client left
            status = CLIENT_CLOSED if status is None else status
            raise
        except BaseException:
            status = 500 if status is None else status
            raise
        finally:
            path = scope.get("path", "")
            self.metrics.request(path if path in self.paths else "other", status, time.perf_counter() - started)
