"""The model admin API, shaped like Triton's model repository extension (docs/gateway.md):

    POST /v2/repository/index                       {"ready": bool}?  every version and its state
    POST /v2/repository/models/{name}/load          {"version": V}    desired = loaded
    POST /v2/repository/models/{name}/unload        {"version": V}    desired = unloaded (workers drain it)
    POST /v2/repository/models/{name}/promote       {"version": V, "force": bool?}
                                                    the default of `name` (weir.registry.promote)
    POST /v2/repository/models/{name}/route         {"default": V?, "canary": {V: pct}?, "mirror": {V: pct}?}
                                                    the traffic policy of `name` (weir.registry.set_route)

Only the gateway's admin token (WEIR_GATEWAY_ADMIN_TOKEN, a bearer token) may call them: any
other valid credential, and every caller in open mode, gets 403; no credential, 401. The path
names the model and the body its version (Triton's load takes the name in the path); a path that
holds `@` is refused, as is any body field besides those above. Writes go through weir.registry's
operations and publish() as `weir models` does (docs/design.md, "The model registry"): a RegistryError (the
operation does not fit the registry's state) is 409 with its message; a version the registry does
not hold, 404. Like `weir models promote`, promote is refused (409 version_not_ready) unless a live
worker reports the version ready, or with `"force": true`: promoting one that failed everywhere
would unload the old default and leave the bare name with nothing to serve it. route changes only
what its body names (an omitted field stays; {} clears canary or mirror); a share is a number of
percent, 0-100 (docs/design.md, "Traffic policies").
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from schemas.messages import now_ms
from schemas.registry import ModelRoute, version_problem
from services.gateway.guard.auth import GuardError
from services.gateway.openai_format import ApiError
from services.gateway.routes.parts import GatewayParts
from services.gateway.routes.reading import read_body
from weir.registry import RegistryError, promote, set_desired, set_route

Operation = Callable[..., list[Any]]

OPERATIONS: dict[str, Operation] = {
    "load": lambda state, served_id, by: set_desired(state, served_id, "loaded", by),
    "unload": lambda state, served_id, by: set_desired(state, served_id, "unloaded", by),
    "promote": lambda state, served_id, by: promote(state, served_id, by),
}


def add_admin_routes(router: APIRouter, parts: GatewayParts) -> None:
    """Add the model admin API to `router` (the app's)."""

    @router.post("/v2/repository/index", tags=["admin"], summary="Every model version and its state")
    async def repository_index(request: Request) -> JSONResponse:
        require_admin(parts, dict(request.headers))
        body = await admin_body(parts, request, {"ready": bool}, required=())
        return JSONResponse(parts.catalog.index(ready_only=body.get("ready", False)))

    for action in OPERATIONS:
        add_operation(router, parts, action)

    @router.post("/v2/repository/models/{name}/route", tags=["admin"], summary="Set a model's traffic policy")
    async def repository_route(name: str, request: Request) -> JSONResponse:
        by = require_admin(parts, dict(request.headers))
        body = await admin_body(parts, request, {"default": str, "canary": dict, "mirror": dict}, required=())
        policy = route_policy(body)
        parts.catalog.known_name(name)
        try:
            records = set_route(parts.catalog.state, name, by, **policy)
        except RegistryError as exc:
            raise ApiError(409, str(exc), code="registry_conflict") from None
        applied = await parts.catalog.write(records)
        route = next(record for record in records if isinstance(record, ModelRoute))
        return JSONResponse(
            {
                "name": name,
                "default": route.default_version,
                "canary": route.canary,
                "mirror": route.mirror,
                "records": [record.key for record in records],
                "applied": applied,
            }
        )


def add_operation(router: APIRouter, parts: GatewayParts, action: str) -> None:
    """POST /v2/repository/models/{name}/<action> with {"version": V}."""

    async def operate(name: str, request: Request) -> JSONResponse:
        by = require_admin(parts, dict(request.headers))
        fields: dict[str, type] = {"version": str, "force": bool} if action == "promote" else {"version": str}
        body = await admin_body(parts, request, fields, required=("version",))
        served_id = parts.catalog.registered(name, body["version"])
        try:
            records = OPERATIONS[action](parts.catalog.state, served_id, by)
        except RegistryError as exc:
            raise ApiError(409, str(exc), param="version", code="registry_conflict") from None
        if action == "promote" and not body.get("force", False):
            require_ready(parts, served_id)
        applied = await parts.catalog.write(records)
        return JSONResponse(
            {
                "name": name,
                "version": body["version"],
                "action": action,
                "records": [record.key for record in records],
                "applied": applied,
            }
        )

    router.add_api_route(
        f"/v2/repository/models/{{name}}/{action}",
        operate,
        methods=["POST"],
        tags=["admin"],
        summary=f"{action.capitalize()} a model version",
        name=f"repository_{action}",
    )


def route_policy(body: dict[str, Any]) -> dict[str, Any]:
    """set_route's arguments from a route body: at least one field; each version a version string,
    each share a number of percent in 0-100. 400 naming what is wrong; whether the versions may
    take traffic is set_route's question (409)."""
    if not body:
        raise ApiError(400, "give at least one of default, canary, mirror", code="missing_required_parameter")
    if "default" in body and (problem := version_problem(body["default"])) is not None:
        raise ApiError(400, f"default: {problem}", param="default", code="invalid_value")
    for field in ("canary", "mirror"):
        for version, share in body.get(field, {}).items():
            if (problem := version_problem(version)) is not None:
                raise ApiError(400, f"{field}: {problem}", param=field, code="invalid_value")
            if type(share) not in (int, float) or not 0 <= share <= 100:
                raise ApiError(
                    400,
                    f"{field}: the share of {version[:64]!r} must be a number of percent, 0-100",
                    param=field,
                    code="invalid_value",
                )
    return {"default": body.get("default"), "canary": body.get("canary"), "mirror": body.get("mirror")}


def require_ready(parts: GatewayParts, served_id: str) -> None:
    """409 unless a live worker reports `served_id` ready (the gate of `weir models promote`); the message
    says what the live workers report, with each one's reason."""
    if served_id in parts.catalog.fleet.ready_versions(now_ms()):
        return
    statuses = parts.catalog.fleet.version_states(now_ms()).get(served_id, {})
    said = "; ".join(
        f"{status.state} on {wid}" + (f": {status.reason}" if status.reason else "")
        for wid, status in sorted(statuses.items())
    )
    seen = f"live workers report: {said}" if said else "no live worker reports it"
    raise ApiError(
        409,
        f'no live worker has {served_id} ready ({seen}); load it and wait, or promote with "force": true',
        param="version",
        code="version_not_ready",
    )


def admin_caller(parts: GatewayParts, headers: dict[str, str]) -> str | None:
    """Who writes, when the request carries the gateway's admin token; else None."""
    token = parts.settings.gateway_admin_token
    scheme, _, given = headers.get("authorization", "").partition(" ")
    if (
        token is not None
        and scheme.lower() == "bearer"
        and hmac.compare_digest(given.strip().encode(), token.get_secret_value().encode())
    ):
        return f"gateway admin API ({parts.bus.gateway_id})"
    return None


def require_admin(parts: GatewayParts, headers: dict[str, str]) -> str:
    """Who writes, when the request carries the admin token; else 401 (no valid credential) or 403."""
    if (by := admin_caller(parts, headers)) is not None:
        return by
    token = parts.settings.gateway_admin_token
    identity = parts.guard.authenticate(headers)  # 401 when missing or invalid
    parts.guard.metrics.auth_failures.add(1, {"code": "admin_required"})
    unset = "" if token is not None else ", which this gateway does not set"
    raise GuardError(
        403,
        f"{identity.principal} may not administer models: the admin API takes the gateway's "
        f"admin token (WEIR_GATEWAY_ADMIN_TOKEN{unset})",
        code="admin_required",
    )


async def admin_body(
    parts: GatewayParts, request: Request, fields: dict[str, type], required: tuple[str, ...]
) -> dict[str, Any]:
    """The JSON object of an admin call (empty body: {}): only `fields`, of their types; 400 for
    anything else, naming it."""
    raw = await read_body(request, parts.settings.max_body_bytes)
    try:
        body = orjson.loads(raw) if raw.strip() else {}
    except orjson.JSONDecodeError:
        raise ApiError(400, "the body must be a JSON object", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_json")
    for key, value in body.items():
        if key not in fields:
            raise ApiError(
                400,
                f"unknown field {key[:80]!r}; this call takes {sorted(fields)}",
                param=key[:80],
                code="unknown_parameter",
            )
        if type(value) is not fields[key]:
            raise ApiError(400, f"{key} must be a {fields[key].__name__}", param=key, code="invalid_value")
    for key in required:
        if key not in body:
            raise ApiError(400, f"{key} is required", param=key, code="missing_required_parameter")
    return body
