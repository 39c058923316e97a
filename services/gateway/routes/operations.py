"""What operators and clients ask of the gateway itself: GET /v1/models (and /v1/models/{model}), /healthz,
/readyz, /metrics."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from schemas.messages import WorkerHeartbeat, now_ms
from services.gateway.metrics import GatewayMetrics
from services.gateway.routes.parts import GatewayParts
from weir.metrics import CONTENT_TYPE


def add_metrics_routes(router: APIRouter, gateway_metrics: GatewayMetrics) -> None:
    """Add GET /metrics, the gateway's Prometheus text, to `router` (the app's)."""

    @router.get("/metrics", include_in_schema=True, tags=["operations"], summary="Prometheus metrics")
    async def metrics() -> Response:
        return Response(gateway_metrics.render(), media_type=CONTENT_TYPE)


def add_operation_routes(router: APIRouter, parts: GatewayParts) -> None:
    """Add GET /v1/models (what is ready and the caller may use), GET /v1/models/{model} (one of
    them, as OpenAI's models.retrieve reads it), /healthz (the process is up) and /readyz (it can
    serve) to `router` (the app's)."""

    @router.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        identity = parts.guard.authenticate(dict(request.headers))
        return JSONResponse(parts.catalog.listing(parts.started_s, identity.may_use))

    @router.get("/v1/models/{model_id:path}")  # `path`: an id may hold a slash, as OpenAI's fine-tunes' do
    async def model(model_id: str, request: Request) -> JSONResponse:
        identity = parts.guard.authenticate(dict(request.headers))
        return JSONResponse(parts.catalog.model(model_id, parts.started_s, identity.may_use))

    @router.get("/healthz")
    async def healthz() -> JSONResponse:
        return JSONResponse({"status": "ok", "gateway_id": parts.bus.gateway_id})

    @router.get("/readyz")
    async def readyz() -> JSONResponse:
        is_ready, reason = parts.bus.readiness()
        body = readiness_body(is_ready, reason, parts.bus.gateway_id, parts.bus.fleet.live_by_model(now_ms()))
        return JSONResponse(body, status_code=200 if is_ready else 503)


def readiness_body(
    is_ready: bool, reason: str, gateway_id: str, live_by_model: dict[str, list[WorkerHeartbeat]]
) -> dict[str, Any]:
    """GET /readyz's body: ready or why not, and how many live workers serve each model."""
    live = {model: len(heartbeats) for model, heartbeats in live_by_model.items()}
    return {"ready": is_ready, "reason": reason, "gateway_id": gateway_id, "live_workers": live}
