"""The dashboard audience of the live server: the live dashboard and the Prometheus metrics.

    GET /dashboard        HTML: flywheel.report's views, live; polls GET /dashboard/data
    GET /dashboard/data   {"html": the page's sections, "data": build_report_data's dict}
    GET /metrics          Prometheus text format (flywheel/live/metrics.py): requests, latency histograms,
                          tokens, per-arm counts, engine in-flight, events

Each takes a key with the `dashboard` (read only) or `admin` scope, also as `?key=KEY`, because a
browser opening a URL cannot send a header. The dashboard shows behaviour metrics, not completions'
text. Its monitors read the store as the real-time cycle does (flywheel/live/sessions.py's `watch`),
with the live loop's one set of reward and monitor settings (`LoopConfig`, flywheel/live/settings.py),
so the page and the cycle's report score the same completions the same way.
"""

from __future__ import annotations

import json
import threading
import time
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, Response
from pydantic import BaseModel, ConfigDict

from flywheel.api.errors import ErrorResponse
from flywheel.api.http import json_reply
from flywheel.live.monitors import Monitor
from flywheel.live.rewards import RewardDistiller
from flywheel.live.sessions import SessionMonitor, watch
from flywheel.report import build_report_data, dashboard_page, render_body

if TYPE_CHECKING:
    from flywheel.live.server import LiveServer

KEY_PARAMETER = {"name": "key", "in": "query", "required": False, "schema": {"type": "string"},
                 "description": "an API key with the dashboard or admin scope (a browser cannot send a header)"}


class DashboardData(BaseModel):
    model_config = ConfigDict(extra="allow")  # `data`: build_report_data's dict, unless html_only=1
    generated_at: float
    html: str


class DashboardView:
    """What /dashboard shows (`flywheel.report.build_report_data`): the configured run folders, and
    the monitors over the server's completions of the last `horizon_s`. Recomputed at most every
    `refresh_s`, however many pages are open."""

    def __init__(self, server: LiveServer):
        self.server = server
        self._lock = threading.Lock()
        self._cached: tuple[float, dict[str, Any]] | None = None  # (monotonic time computed, data)

    def data(self) -> dict[str, Any]:
        server, config, loop = self.server, self.server.config.dashboard, self.server.config.loop
        with self._lock:
            if self._cached is not None and time.monotonic() - self._cached[0] < config.refresh_s:
                return self._cached[1]
            now = time.time()
            d = server.deployment
            # The cycle's own window and monitors, per answer and per session (flywheel/live/sessions.py).
            watched = watch(server.store, RewardDistiller(loop.rewards), Monitor(loop.monitor),
                            SessionMonitor(loop.session_monitor), now, config.horizon_s, d.production)
            monitors = watched.report
            live = {"production": f"v{d.production}",
                    "candidate": "none" if d.candidate is None else f"v{d.candidate} ({d.candidate_fraction:.0%} of "
                                                                    "sessions)",
                    "completions": server.store.count_completions(), "events": server.store.count_events()}
            data = build_report_data(config.report_dirs, live=live, title="flywheel dashboard", monitors={
                "source": f"this server's last {config.horizon_s / 3600:g} h ({watched.completions} completions, "
                          f"{watched.sessions} background sessions, "
                          f"{loop.monitor.window_s:g} s windows)",
                "series": monitors.series, "alarms": monitors.alarms})
            self._cached = (time.monotonic(), data)
            return data


def dashboard_router(server: LiveServer, view: DashboardView) -> APIRouter:
    """The routes of the `dashboard` scope (and `admin`'s), served by `server`."""
    router = APIRouter()

    @router.get("/dashboard", response_model=None, openapi_extra={"parameters": [KEY_PARAMETER]},
                responses={200: {"content": {"text/html": {"schema": {"type": "string"}}}},
                           401: {"model": ErrorResponse}, 403: {"model": ErrorResponse}})
    async def dashboard(request: Request) -> Response:
        server.authorize_dashboard(request)
        data = await run_in_threadpool(view.data)
        page = await run_in_threadpool(dashboard_page, data, "dashboard/data", server.config.dashboard.refresh_s)
        return HTMLResponse(page, headers={"cache-control": "no-store"})

    @router.get("/dashboard/data", response_model=None, responses=json_reply(DashboardData, 401, 403),
                openapi_extra={"parameters": [KEY_PARAMETER, {"name": "html_only", "in": "query", "required": False,
                                                              "schema": {"type": "string", "enum": ["0", "1"]}}]})
    async def dashboard_data(request: Request) -> Response:
        server.authorize_dashboard(request)
        data = await run_in_threadpool(view.data)
        reply = {"generated_at": data["generated_at"], "html": await run_in_threadpool(render_body, data)}
        if request.query_params.get("html_only") != "1":  # the page's polls need only the sections
            reply["data"] = data
        return Response(json.dumps(reply, allow_nan=False), media_type="application/json",
                        headers={"cache-control": "no-store"})

    @router.get("/metrics", response_model=None, openapi_extra={"parameters": [KEY_PARAMETER]},
                responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}},
                           401: {"model": ErrorResponse}, 403: {"model": ErrorResponse}})
    async def metrics(request: Request) -> Response:
        # Prometheus scrapes with a bearer token (`authorization.credentials`), a key with the
        # dashboard or admin scope: the counts say how much traffic each version gets.
        server.authorize_dashboard(request)
        return Response(server.metrics.exposition(), media_type=server.metrics.content_type)

    return router
