"""The events audience of the live server: POST /v1/events, where users' reactions come back.

    POST /v1/events  {"events": [Event, ...]}  ──> each checked on its own ──> LiveStore.add_events
                                                   (one transaction) ──> 200 only after the commit:
                     {"accepted": [id], "duplicate": [id], "rejected": [{"index", "id", "reason"}]}

Needs a key with the `events` scope. A batch is judged event by event: a bad event is rejected with
its reason and the rest are stored. Ingestion is idempotent on the client-made ids, across replicas
too (flywheel/live/store.py), so a client retrying a batch stores it once. A key that belongs to an
organization stamps its events with it; an event naming another organization is rejected.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response
from pydantic import ValidationError

from flywheel.api.errors import ApiError, describe_errors
from flywheel.api.events import Event, EventBatch, EventsResponse, loads_events_body
from flywheel.api.http import json_body, json_reply, read_body
from flywheel.live.store import Ingest

if TYPE_CHECKING:
    from flywheel.live.server import LiveServer


def events_router(server: LiveServer) -> APIRouter:
    """The routes of the `events` scope, served by `server`."""
    router = APIRouter()

    @router.post("/v1/events", response_model=None, openapi_extra=json_body(EventBatch),
                 responses=json_reply(EventsResponse, 400, 401, 403, 413, 503))
    async def events(request: Request) -> Response:
        server.authorize(request, "events")
        body = await read_body(request, server.config.max_body_bytes)
        # Parsing, validation and the commit run off the event loop, so completions keep flowing.
        result = await run_in_threadpool(ingest, server, body, server.key_org(request))
        return Response(json.dumps(result), media_type="application/json")

    return router


def ingest(server: LiveServer, body: bytes, org_id: str | None = None) -> dict[str, Any]:
    """Parse a batch, check each event, store the good ones in one transaction, say what became of each.

    `org_id`: the sending key's organization; each event carries it (one naming another is rejected)."""
    try:
        data = loads_events_body(body)  # a too-long integer fails its event, not the batch
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:  # RecursionError: absurd nesting
        raise ApiError(400, f"body is not JSON: {exc}; send {{\"events\": [...]}}") from None
    if not isinstance(data, dict) or not isinstance(data.get("events"), list):
        raise ApiError(400, 'body must be {"events": [event, ...]}', param="events")
    items = data["events"]
    if len(items) > server.config.max_events_per_batch:
        raise ApiError(413, f"{len(items)} events in one batch; send at most {server.config.max_events_per_batch}",
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
            rejected.append({"index": i, "id": event_id, "reason": describe_errors(exc)})
    accepted, duplicate = [], []
    outcomes = server.store.add_events([e for _, e in valid]) if valid else []
    for (i, event), (outcome, reason) in zip(valid, outcomes, strict=True):
        if outcome == Ingest.ACCEPTED:
            accepted.append(event.id)
        elif outcome == Ingest.DUPLICATE:
            duplicate.append(event.id)
        else:
            rejected.append({"index": i, "id": event.id, "reason": reason})
    rejected.sort(key=lambda r: r["index"])
    server.metrics.ingested(len(accepted), len(duplicate), len(rejected))
    return {"accepted": accepted, "duplicate": duplicate, "rejected": rejected}
