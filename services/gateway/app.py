"""Wiring of the gateway: the FastAPI app (built by `create_app`, never at import) and `main`.

Endpoints, one routes/ module per concern: POST /v1/chat/completions, POST /v1/completions (JSON
or SSE; completions.py), POST /v1/embeddings (embeddings.py), WS /v1/stream and GET
/v1/streams/{id} (streams.py), OpenAI's Files and Batch APIs (batches.py), GET /v1/models,
/healthz, /readyz, /metrics (operations.py). Every error leaves through one handler
(routes/errors.py), in OpenAI's format. Kafka starts in the lifespan, before the server accepts a
connection; create_app owns the lifespan of everything that starts and stops with the app.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import uvicorn
from aiokafka.errors import KafkaError
from fastapi import FastAPI

from schemas.model_repo import ModelRepository, load_model_repo
from services.gateway.batch_store import BatchStore
from services.gateway.config import GatewaySettings
from services.gateway.guard.gate import Guard
from services.gateway.guard.output_guard import OutputGuard
from services.gateway.handlers import GatewayBus
from services.gateway.metrics import ResponseCounter
from services.gateway.openapi_doc import install_openapi
from services.gateway.resume import ResumableStreams
from services.gateway.routes.batches import add_batch_routes, add_file_routes
from services.gateway.routes.completions import add_completion_routes
from services.gateway.routes.embeddings import add_embedding_routes
from services.gateway.routes.errors import HANDLED, on_error
from services.gateway.routes.operations import add_metrics_routes, add_operation_routes
from services.gateway.routes.parts import GatewayParts
from services.gateway.routes.streams import add_stream_routes

log = logging.getLogger("weir.gateway")


def create_app(settings: GatewaySettings, repo: ModelRepository | None = None) -> FastAPI:
    """The gateway app for `settings`; loads the model repository now (a bad one fails here)."""
    parts = build_parts(settings, repo)
    batches = BatchStore(settings)
    app = FastAPI(
        title="Weir gateway", lifespan=lambda _: running(parts, batches), docs_url=None, redoc_url=None
    )  # fmt: skip
    app.state.settings, app.state.repo, app.state.bus, app.state.guard = settings, parts.repo, parts.bus, parts.guard
    app.state.batches = batches
    app.add_middleware(ResponseCounter, metrics=parts.guard.metrics)
    # Routes go on the app's own router, not include_router: in FastAPI 0.165 an included router
    # is one lazy entry of app.routes, and tests/gateway/test_openapi.py walks app.routes.
    add_metrics_routes(app.router, parts.guard.metrics)
    add_file_routes(app.router, batches, parts.guard)
    add_batch_routes(app.router, batches, parts.guard)
    for add_routes in (add_completion_routes, add_embedding_routes, add_stream_routes, add_operation_routes):
        add_routes(app.router, parts)
    for exc_class in HANDLED:
        app.add_exception_handler(exc_class, on_error)
    install_openapi(app)
    return app


def build_parts(settings: GatewaySettings, repo: ModelRepository | None) -> GatewayParts:
    """The bus, guards and stream registry one app's routes share (Kafka clients start later)."""
    repo = repo if repo is not None else load_model_repo(settings.model_repo)
    bus = GatewayBus(settings)
    guard = Guard(settings, bus)
    output_guard = OutputGuard(
        settings.output_guard == "redact", settings.output_holdback_chars,
        on_redacted=lambda n: guard.metrics.redactions.add(n),
    )  # fmt: skip
    streams = ResumableStreams(settings.resume_keep_s, settings.max_resumable_streams)
    return GatewayParts(settings, repo, bus, guard, output_guard, streams, started_s=int(time.time()))


@asynccontextmanager
async def running(parts: GatewayParts, batches: BatchStore) -> AsyncIterator[None]:
    """The app's lifespan: the bus, then the guard's peer sync, then the batch store start; they
    stop in reverse order, however the app ends."""
    await parts.bus.start()
    try:
        await parts.guard.start()
        await batches.start()
        try:
            yield
        finally:
            await batches.stop()
    finally:
        await parts.guard.stop()
        await parts.bus.stop()


def main(argv: list[str]) -> int:
    """`weir gateway [--host H] [--port P] [--model-repo PATH]`: serve until interrupted.

    Returns 0 after a clean shutdown (SIGINT/SIGTERM), 3 when startup failed (Kafka unreachable,
    bad model repository, port taken).
    """
    parser = argparse.ArgumentParser(prog="weir gateway", description="Weir's OpenAI-compatible gateway")
    parser.add_argument("--host", help="bind address (WEIR_GATEWAY_HOST, default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="TCP port (WEIR_GATEWAY_PORT, default 8000)")
    parser.add_argument("--model-repo", help="model repository TOML (WEIR_MODEL_REPO)")
    parser.add_argument("--kafka-bootstrap", help="Kafka bootstrap servers (WEIR_KAFKA_BOOTSTRAP)")
    args = parser.parse_args(argv)
    overrides = {
        key: value
        for key, value in {
            "gateway_host": args.host,
            "gateway_port": args.port,
            "model_repo": args.model_repo,
            "kafka_bootstrap": args.kafka_bootstrap,
        }.items()
        if value is not None
    }
    settings = GatewaySettings(**overrides)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        app = create_app(settings)
    except ValueError as exc:  # ModelRepoError names the entry and the fix
        log.error("gateway cannot start: %s", exc)
        return 3
    config = uvicorn.Config(
        app, host=settings.gateway_host, port=settings.gateway_port, log_level=settings.log_level.lower(),
        access_log=False, timeout_graceful_shutdown=10, ws_max_size=settings.max_body_bytes + 1024,
    )
    return asyncio.run(_serve(app.state.bus, uvicorn.Server(config)))


async def _serve(bus: GatewayBus, server: uvicorn.Server) -> int:
    # Kafka first, outside uvicorn's lifespan: a broker that is not there is one clear log line
    # and exit code 3, not a traceback; the lifespan's own start() then finds it started.
    try:
        await bus.start()
    except (KafkaError, OSError, TimeoutError) as exc:
        log.error("gateway cannot start: Kafka at %s: %s; is Kafka up? (weir kafka up)",
                  bus.settings.kafka_bootstrap, exc)
        await bus.stop()
        return 3
    # SIGTERM/SIGINT end the server gracefully and main returns 0 (uvicorn's own handling would
    # re-raise the signal after shutdown, so a supervisor would see death by signal).
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, server.handle_exit, sig, None)
    try:
        await server.serve()
    except SystemExit as exc:  # uvicorn exits this way when binding or the lifespan fails
        log.error("gateway did not start (exit %s)", exc.code)
        await bus.stop()
        return 3
    return 0
