"""Wiring of the auditor: a FastStream app built from settings (`weir auditor` runs main)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sqlite3
from pathlib import Path

from aiokafka.errors import KafkaError
from faststream import FastStream
from faststream.kafka import KafkaBroker

from services.auditor.config import AuditorSettings
from services.auditor.handlers import DeadLetters, LedgerWriter, register_handlers
from services.auditor.ledger import LedgerError
from weir.bus import instance_id, make_producer

log = logging.getLogger(__name__)


def create_app(settings: AuditorSettings) -> FastStream:
    """The auditor app: one consumer of the audit topic, a ledger, a dead-letter producer.

    Nothing connects until the app starts (`await app.run()`, or `async with app:` in tests).
    """
    client_id = instance_id("auditor")
    dead_letters = DeadLetters(settings.topics)
    broker = KafkaBroker(
        settings.kafka_bootstrap,
        client_id=client_id,
        middlewares=[dead_letters],
        # The auditor produces only dead letters, through weir.bus's idempotent acks=all producer;
        # topics are created by `weir kafka up` / `weir topics create` with their specs.
        consumer_only=True,
        allow_auto_create_topics=False,
        log_level=logging.DEBUG,  # per-message "Received"/"Processed" lines
    )
    writer = LedgerWriter(settings.audit_db)
    register_handlers(broker, settings, writer)

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
        log.info("auditor %s: ledger %s, consuming %s as group %s", client_id, settings.audit_db,
                 settings.topics.audit, settings.topics.auditor_group)

    async def close_ledger_and_producer() -> None:
        # After the broker stopped: no handler is running any more.
        if dead_letters.producer is not None:
            await dead_letters.producer.stop()
            dead_letters.producer = None
        await writer.close()

    return FastStream(broker, on_startup=[open_ledger_and_producer], after_shutdown=[close_ledger_and_producer])


def build_parser() -> argparse.ArgumentParser:
    """Arguments of `weir auditor`; everything else comes from the environment (config.py)."""
    parser = argparse.ArgumentParser(prog="weir auditor", description="Run the auditor service.")
    parser.add_argument("--db", type=Path, help="ledger SQLite file (env WEIR_AUDIT_DB; default var/audit.sqlite)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log each message")
    return parser


def main(argv: list[str]) -> int:
    """Run the auditor until SIGINT/SIGTERM; returns the process exit status."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = AuditorSettings()
    if args.db is not None:
        settings = settings.model_copy(update={"audit_db": args.db})
    try:
        asyncio.run(create_app(settings).run(log_level=logging.INFO))
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
