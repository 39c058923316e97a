"""The live dashboard: GET /dashboard (a static page), its files, and GET /dashboard/data (JSON).

The page holds no data: it asks for the gateway's admin token (or reads it from the URL fragment
`#token=...`, which a browser never sends to a server), keeps it in sessionStorage and polls
/dashboard/data every 2 s with it as a bearer token. /dashboard/data takes only the admin token
(routes/admin.py: require_admin; 401 without a credential, 403 with any other). Everything the
page loads comes from this gateway (the chart library, uPlot, is vendored in static/ with its
license), and the Content-Security-Policy allows nothing else. The data is dashboard_data.py's.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from services.gateway.dashboard_data import DashboardData
from services.gateway.openai_format import ApiError
from services.gateway.routes.admin import require_admin
from services.gateway.routes.parts import GatewayParts

STATIC = Path(__file__).resolve().parents[1] / "static"
# The files the page may load, by name (no path from the request reaches the file system).
FILES = {
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
    "uPlot.iife.min.js": "text/javascript; charset=utf-8",
    "uPlot.min.css": "text/css; charset=utf-8",
    "uPlot.LICENSE": "text/plain; charset=utf-8",
}
SECURITY_HEADERS = {
    "content-security-policy": "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "connect-src 'self'; img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "referrer-policy": "no-referrer",
    "x-content-type-options": "nosniff",
}


def add_dashboard_routes(router: APIRouter, parts: GatewayParts, data: DashboardData) -> None:
    """Add GET /dashboard, /dashboard/static/{name} and /dashboard/data to `router` (the app's)."""

    @router.get("/dashboard", tags=["operations"], summary="The live dashboard (HTML; data from /dashboard/data)")
    async def dashboard() -> Response:
        return static_file("dashboard.html", "text/html; charset=utf-8")

    @router.get("/dashboard/static/{name}", tags=["operations"], summary="A file of the dashboard page")
    async def dashboard_static(name: str) -> Response:
        if name not in FILES:
            raise ApiError(404, f"the dashboard has no file {name[:80]!r}", code="not_found")
        return static_file(name, FILES[name])

    @router.get("/dashboard/data", tags=["operations"], summary="The dashboard's data (admin token only)")
    async def dashboard_data(request: Request) -> JSONResponse:
        require_admin(parts, dict(request.headers))
        return JSONResponse(data.report(), headers={"cache-control": "no-store"})


def static_file(name: str, media_type: str) -> Response:
    return Response((STATIC / name).read_bytes(), media_type=media_type, headers=SECURITY_HEADERS)
