"""GET /v1/usage: token usage and cost, from the auditor's totals (docs/design.md, "Observability").

    GET /v1/usage?start=YYYY-MM-DD&end=YYYY-MM-DD&group_by=day,tenant,principal,model&tenant=T

Answers {"object": "list", "data": rows, "rate_cards": [...], ...}: per distinct value of the
`group_by` fields (default all four: one row per day, tenant, principal and model version),
requests, prompt_tokens, cached_prompt_tokens, completion_tokens, total_tokens and cost_usd
(null when a summed row has no price); `start` and `end` are UTC days, inclusive, each optional.
The gateway's admin token (WEIR_GATEWAY_ADMIN_TOKEN) sees every tenant, or one with `tenant=`;
any other credential sees only its own tenant, and `tenant=` naming another is 403, never other
data. Every parameter is honoured or refused (400). The view is the gateway's follower of the
token usage topic (services/gateway/usage.py): 503 until it has read the topic once.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.datastructures import QueryParams

from services.gateway.openai_format import ApiError
from services.gateway.routes.admin import admin_caller
from services.gateway.routes.parts import GatewayParts
from services.gateway.usage import UsageView
from weir.usage import GROUPS, check_day

PARAMS = ("start", "end", "group_by", "tenant")


def add_usage_routes(router: APIRouter, parts: GatewayParts, view: UsageView) -> None:
    """Add GET /v1/usage to `router` (the app's)."""

    @router.get("/v1/usage", tags=["usage"], summary="Token usage and cost per day, tenant, principal and model")
    async def usage(request: Request) -> JSONResponse:
        tenant = visible_tenant(parts, dict(request.headers), request.query_params.get("tenant"))
        query = usage_query(request.query_params)
        if not view.is_ready:
            raise ApiError(503, "the usage view is still reading its topic; try again shortly", code="usage_not_ready")
        rows = view.book.rows(tenant=tenant, start=query["start"], end=query["end"], group_by=query["group_by"])
        # Rate cards measure every tenant's traffic on a version: the deployment's operators' business.
        cards = view.book.rate_cards() if admin_caller(parts, dict(request.headers)) is not None else []
        return JSONResponse(
            {
                "object": "list",
                "data": rows,
                "rate_cards": cards,
                "tenant": tenant,
                "start": query["start"],
                "end": query["end"],
                "group_by": query["group_by"],
            }
        )


def usage_query(params: QueryParams) -> dict[str, Any]:
    """The query's start, end, group_by (a list) and tenant; 400 naming an unknown, repeated or bad one."""
    for name in params:
        if name not in PARAMS:
            raise ApiError(
                400,
                f"unknown parameter {name[:80]!r}; this call takes {', '.join(PARAMS)}",
                param=name[:80],
                code="unknown_parameter",
            )
        if len(params.getlist(name)) > 1:
            raise ApiError(400, f"{name} is given more than once", param=name, code="invalid_value")
    try:
        start, end = check_day(params.get("start"), "start"), check_day(params.get("end"), "end")
    except ValueError as exc:
        raise ApiError(400, str(exc), param=str(exc).split()[0], code="invalid_value") from None
    if start is not None and end is not None and end < start:
        raise ApiError(400, "end is before start", param="end", code="invalid_value")
    group_by = [g.strip() for g in params.get("group_by", ",".join(GROUPS)).split(",") if g.strip()]
    bad = [g for g in group_by if g not in GROUPS]
    if bad or not group_by:
        raise ApiError(
            400, f"group_by takes a comma-separated list of {', '.join(GROUPS)}", param="group_by", code="invalid_value"
        )
    return {
        "start": start,
        "end": end,
        "group_by": [g for g in GROUPS if g in group_by],
        "tenant": params.get("tenant"),
    }


def visible_tenant(parts: GatewayParts, headers: dict[str, str], asked: str | None) -> str | None:
    """The tenant whose rows the caller gets (None: all, for the admin token); 401 without a valid
    credential, 403 when a tenant's credential asks for another tenant."""
    if admin_caller(parts, headers) is not None:
        return asked
    identity = parts.guard.authenticate(headers)
    if asked is not None and asked != identity.tenant:
        parts.guard.metrics.auth_failures.add(1, {"code": "tenant_not_allowed"})
        raise ApiError(
            403,
            f"{identity.principal} may read the usage of its own tenant only",
            param="tenant",
            code="tenant_not_allowed",
        )
    return identity.tenant
