"""Wiring of the auditor: a FastStream app built from settings (`weir auditor` runs main)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import socket
import sqlite3
from pathlib import Path

from aiokafka.errors import KafkaError
from faststream import FastStream
from pydantic import SecretStr
from faststream.kafka import KafkaBroker

from services.auditor.config import AuditorSettings
from services.auditor.handlers import AuditBatches, DeadLetters, LedgerWriter, register_handlers
from services.auditor.api import create_api
from services.auditor.health import HealthMetrics
from services.auditor.ledger import Ledger, LedgerError
from services.auditor.watermark import WatermarkDetector
from weir.bus import instance_id, make_producer

log = logging.getLogger(__name__)


def create_app(settings: AuditorSettings, health: HealthMetrics | None = None) -> FastStream:
    """The auditor app: one consumer of the audit topic, a ledger, a dead-letter producer, and a
    timer that writes the quiet chains' checkpoints. New records feed `health` (the /metrics).

    Nothing connects until the app starts (`await app.run()`, or `async with app:` in tests).
    """
    client_id = instance_id("auditor")
    dead_letters = DeadLetters(settings.topics)
    broker = KafkaBroker(
        settings.kafka_bootstrap,
        client_id=client_id,
        # The auditor produces only dead letters, through weir.bus's idempotent acks=all producer;
        # topics are created by `weir kafka up` / `weir topics create` with their specs.
        consumer_only=True,
        allow_auto_create_topics=False,
        log_level=logging.DEBUG,  # per-batch "Received"/"Processed" lines
    )
    writer = LedgerWriter(settings)
    register_handlers(broker, settings, AuditBatches(settings, writer, dead_letters, health))
    timers: list[asyncio.Task[None]] = []

    async def checkpoint_quiet_chains() -> None:
        while True:
            await asyncio.sleep(min(settings.audit_checkpoint_every_s, 5.0))
            try:
                await writer.checkpoint_due()
            except Exception as exc:  # noqa: BLE001 - retried at the next tick; appends go on
                log.warning("checkpoint failed (%r); retrying at the next tick", exc)

    async def open_ledger_and_producer() -> None:
        producer = make_producer(settings, client_id=f"{client_id}-dlq")
        try:
            await producer.start()
            await writer.open()
        except BaseException:
            await producer.stop()
            await writer.close()
            raise
        dead_letters.producer = producer
        timers.append(asyncio.get_running_loop().create_task(checkpoint_quiet_chains()))
        log.info("auditor %s: ledger %s, consuming %s as group %s", client_id, writer.name,
                 settings.topics.audit, settings.topics.auditor_group)

    async def close_ledger_and_producer() -> None:
        # After the broker stopped: no handler is running any more.
        for timer in timers:
            timer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await timer
        timers.clear()
        if dead_letters.producer is not None:
            await dead_letters.producer.stop()
            dead_letters.producer = None
        await writer.close()

    return FastStream(broker, on_startup=[open_ledger_and_producer], after_shutdown=[close_ledger_and_producer])


async def serve(settings: AuditorSettings) -> None:
    """The Kafka app and, unless its port is 0, the HTTP API (lookup, watermark, /metrics)."""
    import uvicorn

    from services.auditor.fingerprints import simhash_function
    from schemas.watermark import parse_tenants

    health = HealthMetrics()
    app = create_app(settings, health)
    if settings.audit_api_port == 0:
        await app.run(log_level=logging.INFO)
        return
    target = settings.ledger_target()
    detector = WatermarkDetector(settings.model_repo, parse_tenants(settings.watermark_tenants))
    api = create_api(settings, lambda: Ledger(target, readonly=True), health, detector, simhash_function())
    where = f"{settings.audit_api_host}:{settings.audit_api_port}"
    try:  # bound here, so a taken port is one log line, not the end of ingestion
        sock = socket.create_server((settings.audit_api_host, settings.audit_api_port))
    except OSError as exc:
        log.error("auditor API cannot listen on %s (%s); ingesting without it. Set WEIR_AUDIT_API_PORT "
                  "(0 turns the API off)", where, exc)
        await app.run(log_level=logging.INFO)
        return
    server = uvicorn.Server(uvicorn.Config(api, log_level="warning", lifespan="off"))
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]  # FastStream handles SIGINT/SIGTERM
    api_task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    log.info("auditor API on http://%s (POST /v1/audit/lookup, /v1/audit/watermark; GET /metrics)", where)
    try:
        await app.run(log_level=logging.INFO)
    finally:
        server.should_exit = True
        await api_task


def build_parser() -> argparse.ArgumentParser:
    """Arguments of `weir auditor`; everything else comes from the environment (config.py)."""
    parser = argparse.ArgumentParser(prog="weir auditor", description="Run the auditor service.")
    parser.add_argument("--db", type=Path, help="ledger SQLite file (env WEIR_AUDIT_DB; default var/audit.sqlite)")
    parser.add_argument("--dsn", help="ledger PostgreSQL DSN (env WEIR_AUDIT_DSN); replaces --db")
    parser.add_argument("--port", type=int, help="HTTP API port (env WEIR_AUDIT_API_PORT; default 8100; 0: off)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log each message")
    return parser


def main(argv: list[str]) -> int:
    """Run the auditor until SIGINT/SIGTERM; returns the process exit status."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = AuditorSettings()
    updates = {"audit_db": args.db, "audit_dsn": SecretStr(args.dsn) if args.dsn else None, "audit_api_port": args.port}
    settings = settings.model_copy(update={k: v for k, v in updates.items() if v is not None})
    try:
        asyncio.run(serve(settings))
    except (LedgerError, sqlite3.Error) as exc:
        log.error("auditor cannot use its ledger %s: %s", settings.audit_db, exc)
        return 2
    except KafkaError as exc:
        log.error("auditor cannot reach Kafka at %s: %r; is it up (`weir kafka up`)?", settings.kafka_bootstrap, exc)
        return 1
    except OSError as exc:
        log.error("auditor failed: %s", exc)
        return 1
    return 0
