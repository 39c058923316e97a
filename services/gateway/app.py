"""Wiring of the gateway: the FastAPI app (built by `create_app`, never at import) and `main`.

Endpoints, one routes/ module per concern: POST /v1/chat/completions, POST /v1/completions (JSON
or SSE; completions.py), POST /v1/embeddings (embeddings.py), WS /v1/stream and GET
/v1/streams/{id} (streams.py), OpenAI's Files and Batch APIs (batches.py), GET /v1/models,
/healthz, /readyz, /metrics (operations.py), the model admin API under /v2/repository (admin.py),
GET /v1/usage (usage.py), the live dashboard at /dashboard (dashboard.py). Every error leaves through one handler
(routes/errors.py), in OpenAI's format. Kafka starts in the lifespan, before the server accepts a
connection; create_app owns the lifespan of everything that starts and stops with the app.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from schemas.messages import now_ms
from schemas.model_repo import ModelRepoError, ModelRepository, load_model_repo
from services.gateway.batch_store import BatchStore
from services.gateway.catalog import Catalog
from services.gateway.config import GatewaySettings
from services.gateway.dashboard_data import DashboardData
from services.gateway.guard.gate import Guard
from services.gateway.guard.output_guard import OutputGuard
from services.gateway.kafka_bus import GatewayBus
from services.gateway.metrics import ResponseCounter
from services.gateway.openapi_doc import install_openapi
from services.gateway.request_limits import RequestLimits, head_limited_protocol
from services.gateway.resume import ResumableStreams
from services.gateway.routes.admin import add_admin_routes
from services.gateway.routes.batches import add_batch_routes, add_file_routes
from services.gateway.routes.completions import add_completion_routes
from services.gateway.routes.dashboard import add_dashboard_routes
from services.gateway.routes.embeddings import add_embedding_routes
from services.gateway.routes.errors import HANDLED, on_error
from services.gateway.routes.operations import add_metrics_routes, add_operation_routes
from services.gateway.routes.parts import GatewayParts
from services.gateway.routes.streams import add_stream_routes
from services.gateway.routes.tokenize import add_tokenize_routes
from services.gateway.routes.usage import add_usage_routes
from services.gateway.stream_index import RemoteResumes, StreamIndex
from services.gateway.usage import UsageView
from weir.lag import LagMonitor
from weir.service import ConfigError, bus_overrides, run_service, service_parser

log = logging.getLogger(__name__)


def create_app(settings: GatewaySettings, repo: ModelRepository | None = None) -> FastAPI:
    """The gateway app for `settings`; loads the model repository now (a bad one fails here): it
    seeds the registry the app follows while it runs (catalog.py)."""
    parts = build_parts(settings, repo)
    batches = BatchStore(settings)
    dashboard = DashboardData(
        settings, f"{parts.bus.gateway_id}-dashboard", parts.catalog, parts.guard.metrics.render, now_ms
    )
    usage = UsageView(settings, f"{parts.bus.gateway_id}-usage")
    app = FastAPI(
        title="Weir gateway",
        lifespan=lambda _: running(parts, batches, dashboard, usage),
        docs_url=None,
        redoc_url=None,
    )
    app.state.settings, app.state.catalog, app.state.bus, app.state.guard = (
        settings,
        parts.catalog,
        parts.bus,
        parts.guard,
    )
    app.state.batches, app.state.dashboard, app.state.usage = batches, dashboard, usage
    app.state.streams, app.state.remote = parts.streams, parts.remote
    app.add_middleware(
        RequestLimits,
        max_headers=settings.max_headers,
        max_header_bytes=settings.max_header_bytes,
        max_body_bytes=settings.max_body_bytes,
        max_json_depth=settings.max_json_depth,
        upload_paths=frozenset({"/v1/files"}),  # multipart, up to batch_format.MAX_FILE_BYTES
    )
    app.add_middleware(ResponseCounter, metrics=parts.guard.metrics)  # outermost: counts the limits' refusals too
    # Routes go on the app's own router, not include_router: in FastAPI 0.165 an included router
    # is one lazy entry of app.routes, and tests/gateway/test_openapi.py walks app.routes.
    add_metrics_routes(app.router, parts.guard.metrics)
    add_file_routes(app.router, batches, parts)
    add_batch_routes(app.router, batches, parts)
    for add_routes in (
        add_completion_routes,
        add_embedding_routes,
        add_stream_routes,
        add_operation_routes,
        add_admin_routes,
        add_tokenize_routes,
    ):
        add_routes(app.router, parts)
    add_usage_routes(app.router, parts, usage)
    for exc_class in HANDLED:
        app.add_exception_handler(exc_class, on_error)
    add_dashboard_routes(app.router, parts, dashboard)
    install_openapi(app)
    return app


def build_parts(settings: GatewaySettings, repo: ModelRepository | None) -> GatewayParts:
    """The bus, catalog, guards and stream registry one app's routes share (Kafka clients start later)."""
    repo = repo if repo is not None else load_model_repo(settings.model_repo)
    bus = GatewayBus(settings)
    catalog = Catalog.following(settings, f"{bus.gateway_id}-registry", repo, bus.fleet)
    guard = Guard(settings, bus, catalog.desired, wanted_since=catalog.wanted_since)
    output_guard = OutputGuard(
        settings.output_guard == "redact",
        settings.output_holdback_chars,
        on_redacted=lambda n: guard.metrics.redactions.add(n),
    )
    streams = ResumableStreams(settings.resume_keep_s, settings.max_resumable_streams, journal=bus.publish_stream)
    remote = RemoteResumes(settings, bus, StreamIndex(settings, f"{bus.gateway_id}-streams"), streams)
    lag = LagMonitor(settings, settings.lag_interval_s)
    guard.metrics.follow_lag(lag)
    return GatewayParts(
        settings, catalog, bus, guard, output_guard, streams, started_s=int(time.time()), lag=lag, remote=remote
    )


@asynccontextmanager
async def running(parts: GatewayParts, batches: BatchStore, *more: DashboardData | UsageView) -> AsyncIterator[None]:
    """The app's lifespan: the bus, then the registry (read to its end before a request is served),
    the guard's peer sync, the index of other gateways' streams, the batch store, then `more` (the dashboard's followers, the usage view),
    then the consumer-lag poller; they stop in reverse order, however the app ends."""
    async with contextlib.AsyncExitStack() as started:
        for part in (parts.bus, parts.catalog, parts.guard, parts.remote, batches, *more, parts.lag):
            await part.start()
            started.push_async_callback(part.stop)
        yield


class GatewayService:
    """The gateway process for weir/service.py: Kafka first (a broker that is not there is exit 3,
    not a traceback), then the app on its port, whose lifespan (`running`) finds the bus started."""

    name = "gateway"

    def __init__(self, settings: GatewaySettings) -> None:
        self.app = create_app(settings)
        self.bus: GatewayBus = self.app.state.bus
        # Streams outlive a short graceful shutdown; a WebSocket frame may carry a whole body; a
        # request head is refused (431) once past what the header limits allow with room for the
        # request line (request_limits.py).
        self.http_options = {
            "timeout_graceful_shutdown": 10,
            "ws_max_size": settings.max_body_bytes + 1024,
            "http": head_limited_protocol(max_head_bytes(settings)),
        }

    async def start(self) -> None:
        await self.bus.start()

    async def run(self, stop: asyncio.Event) -> None:
        await stop.wait()  # uvicorn serves the app; the runner stops it after this returns

    async def close(self) -> None:
        await self.bus.stop()  # idempotent: the lifespan stopped it already when the app started

    def http_app(self) -> FastAPI:
        return self.app


def max_head_bytes(settings: GatewaySettings) -> int:
    """The most bytes of a request head the server buffers: the headers the middleware allows,
    each with its ": " and CRLF, and 16 KiB for the request line."""
    return settings.max_header_bytes + 4 * settings.max_headers + (16 << 10)


def build_parser() -> argparse.ArgumentParser:
    """`weir gateway`'s flags: the common service flags (weir/service.py) and its own."""
    parser = service_parser("gateway", "Weir's OpenAI-compatible gateway.", 8000, "WEIR_GATEWAY_PORT")
    parser.add_argument("--host", dest="http_host", help="alias of --http-host (env WEIR_GATEWAY_HOST)")
    parser.add_argument("--port", dest="http_port", type=int, help="alias of --http-port")
    parser.add_argument("--model-repo", help="model repository TOML (env WEIR_MODEL_REPO)")
    parser.add_argument("--kafka-bootstrap", dest="bootstrap", help="alias of --bootstrap")
    return parser


def build(args: argparse.Namespace) -> tuple[GatewayService, str, int]:
    """The service from flags over WEIR_* settings; a bad model repository is a ConfigError."""
    given = bus_overrides(args)
    overrides = {
        "kafka_bootstrap": given.get("kafka_bootstrap"),
        "topic_prefix": given.get("topic_prefix"),
        "gateway_host": given.get("http_host"),
        "gateway_port": args.http_port,
        "model_repo": args.model_repo,
        "log_level": args.log_level.lower(),
    }
    settings = GatewaySettings(**{k: v for k, v in overrides.items() if v is not None})
    try:
        return GatewayService(settings), settings.gateway_host, settings.gateway_port
    except ModelRepoError as exc:
        raise ConfigError(str(exc)) from exc


def main(argv: list[str]) -> int:
    """`weir gateway`: serve until SIGINT/SIGTERM; exit codes as every service's (weir/service.py)."""
    return run_service("gateway", argv, build_parser(), build)
