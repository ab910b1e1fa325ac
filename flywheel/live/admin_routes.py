"""The admin audience of the live server: what it serves, and each organization's own deployment.

    GET|POST /v1/admin/deployment       read or change production / candidate / candidate_fraction
    POST /v1/admin/deployment/sync      re-read the Registry's aliases (after `flywheel registry promote`)
    GET  /v1/admin/loop                 the live loop's settings this server serves with (store URLs'
                                        passwords masked): `flywheel live` checks its own against them
    GET  /v1/admin/orgs                 the shared deployment, and each organization's own (adapters)
    GET|PUT /v1/admin/orgs/{org}/deployment   read or change one organization's deployment of its
                                        adapters ({"deployment": null}: back to the shared one); stored
                                        in the live store's org_deployments, which every replica follows

Needs a key with the `admin` scope. Each route does what a LiveServer method does
(`set_deployment`, `sync_from_registry`, `set_org_deployment`), which the real-time cycle calls
over HTTP (flywheel/live/cycle.py's HttpControl) or in-process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, ConfigDict, ValidationError

from flywheel.api.errors import ApiError, describe_errors
from flywheel.api.http import json_body, json_reply, read_body
from flywheel.live.deploy import Deployment

if TYPE_CHECKING:
    from flywheel.live.server import LiveServer

MAX_VERSION = 10**9 - 1  # a version name has at most 9 digits (SQLite's integers end at 2**63 - 1)



class DeploymentResponse(BaseModel):
    deployment: Deployment
    served_versions: list[int]
    previous: Deployment | None = None


class LoopResponse(BaseModel):
    loop: dict[str, Any]  # LoopConfig.shareable() (flywheel/live/settings.py)


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


def admin_router(server: LiveServer) -> APIRouter:
    """The routes of the `admin` scope, served by `server`."""
    router = APIRouter()
    limit = server.config.max_body_bytes

    @router.get("/v1/admin/deployment", response_model=None, responses=json_reply(DeploymentResponse, 401, 403))
    async def get_deployment(request: Request) -> dict[str, Any]:
        server.authorize(request, "admin")
        return {"deployment": server.deployment.model_dump(), "served_versions": server.router.served_versions()}

    @router.post("/v1/admin/deployment", response_model=None, openapi_extra=json_body(Deployment),
                 responses=json_reply(DeploymentResponse, 400, 401, 403, 404, 413))
    async def post_deployment(request: Request) -> dict[str, Any]:
        server.authorize(request, "admin")
        body = await read_body(request, limit)
        try:
            deployment = Deployment.model_validate_json(body)
        except ValidationError as exc:
            raise ApiError(400, f"invalid deployment: {describe_errors(exc)}") from None
        if max(deployment.versions) > MAX_VERSION:  # SQLite's integers end at 2**63 - 1
            raise ApiError(404, f"no version above {MAX_VERSION} exists; name a registered version",
                           code="version_not_found")
        try:
            previous = await run_in_threadpool(server.set_deployment, deployment, "admin endpoint")
        except KeyError as exc:  # CheckpointNotFound: a version the registry does not hold
            raise ApiError(404, str(exc), code="version_not_found") from None
        return {"deployment": deployment.model_dump(), "previous": previous.model_dump(),
                "served_versions": server.router.served_versions()}

    @router.post("/v1/admin/deployment/sync", response_model=None,
                 responses=json_reply(DeploymentResponse, 401, 403, 409, 503))
    async def sync_deployment(request: Request) -> dict[str, Any]:
        server.authorize(request, "admin")
        try:
            deployment = await run_in_threadpool(server.sync_from_registry)
        except (KeyError, ValueError) as exc:
            raise ApiError(409, str(exc), code="registry_unusable") from None
        return {"deployment": deployment.model_dump(), "served_versions": server.router.served_versions()}

    @router.get("/v1/admin/loop", response_model=None, responses=json_reply(LoopResponse, 401, 403))
    async def get_loop(request: Request) -> dict[str, Any]:
        server.authorize(request, "admin")
        return {"loop": server.config.loop.shareable()}

    # ---- each organization's own deployment of adapters (flywheel/live/orgs.py), admin like the above

    def org_reply(org_id: str, previous: Deployment | None = None) -> dict[str, Any]:
        own = server.org_router(org_id)
        adapters = [c.version for c in server.registry.list() if c.org_id == org_id and c.base is not None] \
            if server.registry is not None else []
        deployment = server.org_deployment(org_id)
        return {"org_id": org_id, "deployment": deployment.model_dump() if deployment else None,
                "served_versions": own.served_versions() if own else [], "adapters": adapters,
                "previous": previous.model_dump() if previous else None}

    def org_param(org_id: str) -> str:
        from flywheel.live.orgs import check_org_id  # noqa: PLC0415  (peft loads only when used)

        try:
            return check_org_id(org_id)
        except ValueError as exc:
            raise ApiError(400, str(exc)[:300], code="invalid_org", param="org_id") from None

    @router.get("/v1/admin/orgs", response_model=None, responses=json_reply(OrgList, 401, 403))
    async def list_orgs(request: Request) -> dict[str, Any]:
        server.authorize(request, "admin")
        orgs = set(server.config.orgs.values()) | set(server.served_orgs())
        if server.registry is not None:
            orgs |= {c.org_id for c in await run_in_threadpool(server.registry.list) if c.base is not None}
        replies = [await run_in_threadpool(org_reply, org) for org in sorted(orgs)]
        return {"shared": server.deployment.model_dump(), "orgs": replies}

    @router.get("/v1/admin/orgs/{org_id}/deployment", response_model=None,
                responses=json_reply(OrgDeploymentResponse, 400, 401, 403))
    async def get_org_deployment(org_id: str, request: Request) -> dict[str, Any]:
        server.authorize(request, "admin")
        return await run_in_threadpool(org_reply, org_param(org_id))

    @router.put("/v1/admin/orgs/{org_id}/deployment", response_model=None,
                openapi_extra=json_body(OrgDeploymentRequest),
                responses=json_reply(OrgDeploymentResponse, 400, 401, 403, 404, 409, 413))
    async def put_org_deployment(org_id: str, request: Request) -> dict[str, Any]:
        server.authorize(request, "admin")
        org = org_param(org_id)
        try:
            wanted = OrgDeploymentRequest.model_validate_json(await read_body(request, limit)).deployment
        except ValidationError as exc:
            raise ApiError(400, f"invalid organization deployment: {describe_errors(exc)}") from None
        if wanted is not None and max(wanted.versions) > MAX_VERSION:
            raise ApiError(404, f"no version above {MAX_VERSION} exists; name a registered adapter",
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

    return router
