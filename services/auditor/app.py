"""Wiring of the auditor: a FastStream app built from settings, run by weir/service.py.

`weir auditor` serves /healthz, /readyz, /metrics and the lookup API (api.py) on its port.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sqlite3
from pathlib import Path
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from faststream import FastStream
from faststream.kafka import KafkaBroker
from pydantic import SecretStr
from starlette.types import ASGIApp

from schemas.codec import encode
from schemas.registry import ModelComparison
from services.auditor.api import create_api
from services.auditor.comparison import Comparisons, Embed, ShadowJoin, register_comparison
from services.auditor.config import AuditorSettings
from services.auditor.drift import HealthMonitor, HealthPolicy
from services.auditor.fingerprints import embedding_function
from services.auditor.consumers import AnchorPublisher, AuditBatches, DeadLetters, LedgerWriter, register_handlers
from services.auditor.health import HealthMetrics
from services.auditor.ledger import Ledger, LedgerError
from services.auditor.traffic import CanaryGuard, ErrorWindows, TrafficCounter, register_health_handler
from services.auditor.usage import UsageAccounts, UsageLedger, load_prices
from services.auditor.watermark import WatermarkDetector
from schemas.codec import encode
from schemas.messages import AuditEvent, now_ms
from weir.bus import TopicFollower, instance_id, wait_for_cluster
from weir.kafka.admin import ensure_topics
from weir.registry import RegistryFollower
from weir.service import ConfigError, bus_overrides, ops_app, run_service, service_parser
from weir.tracing import Tracing

log = logging.getLogger(__name__)


def create_app(settings: AuditorSettings, health: HealthMetrics | None = None,
               embed: Embed | None | Literal["default"] = "default") -> FastStream:
    """The auditor app: one consumer group on the audit topic, a ledger, dead letters and
    checkpoint anchors published through the same broker, and a timer that writes the quiet
    chains' checkpoints and publishes any anchor not yet out. New records feed `health` (the /metrics).
    With settings.health_alerts, a HealthMonitor (services/auditor/drift.py) judges each version's
    drift and freshness every health_every_s and publishes the transitions on Topics.health.
    A second group makes the shadow comparison (services/auditor/comparison.py); its similarity
    comes from `embed` ("default": settings.comparison_embedding_model, loaded on first use).

    Nothing connects until the app starts (`await app.start()`, or `async with app:` in tests).
    """
    client_id = instance_id("auditor")
    broker = KafkaBroker(
        # A list: FastStream wraps a string whole into one, and aiokafka splits only a string at its
        # commas, so a cluster's "h:p,h:p,h:p" would reach it as one unknown host.
        settings.kafka_bootstrap.split(","),
        client_id=client_id,
        acks="all",  # dead letters are durable before their record's offset is committed
        enable_idempotence=True,
        request_timeout_ms=settings.producer_request_timeout_ms,
        allow_auto_create_topics=False,  # topics are created by `weir kafka up` / `weir topics create`
        security=settings.faststream_security(),  # its own principal on a secure deployment
        log_level=logging.DEBUG,  # per-batch "Received"/"Processed" lines
    )
    writer = LedgerWriter(settings)
    anchors = AnchorPublisher(settings.topics, broker, writer)
    topics = settings.topics
    dead_letters = DeadLetters(topics, broker)
    counter = TrafficCounter()
    registry = RegistryFollower(settings, client_id=f"{client_id}-registry")

    async def publish(topic: str, key: bytes, value: bytes) -> None:
        await broker.publish(value, topic=topic, key=key)

    guard = CanaryGuard(ErrorWindows(settings.canary_min_requests, settings.canary_max_error_rate),
                        lambda: registry.state, publish, topics.models, topics.model_health, by=client_id)  # fmt: skip

    monitor = HealthMonitor(HealthPolicy.from_settings(settings), lambda: registry.state, by=client_id) \
        if settings.health_alerts else None
    alerts = None if monitor is None else \
        TopicFollower(settings, topics.health, f"{client_id}-health", lambda key, value, _: monitor.on_alert(key, value))
    if health is not None:
        health.monitor = monitor
    accounts = usage_accounts(settings, writer, publish)

    def on_new_event(event: AuditEvent) -> None:
        counter.observe(event)
        accounts.observe(event)
        if monitor is not None:
            result = monitor.observe(event)
            if result is not None and health is not None:
                health.compared(event.model_version, result)
        if settings.canary_guard:
            guard.observe(event)

    tracing = Tracing("auditor", client_id, settings, send=publish)  # spans through its own broker
    register_handlers(broker, settings, AuditBatches(settings, writer, dead_letters, health, anchors, on_new_event,
                                                     tracing=tracing))  # fmt: skip
    if settings.canary_guard:
        register_health_handler(broker, topics, guard)
    join = ShadowJoin(settings.comparison_ttl_s, settings.comparison_max_pending)
    if health is not None:
        health.shadow_join = join.counts

    async def publish_comparison(comparison: ModelComparison) -> None:
        await broker.publish(encode(comparison), topic=topics.comparisons, key=comparison.name.encode())

    if embed == "default":
        embed = embedding_function(settings.model_repo, settings.comparison_embedding_model) \
            if settings.comparison_embedding_model else None
    register_comparison(broker, settings, Comparisons(join, embed, publish_comparison,
                                                      writer.add_comparison, dead_letters.send))
    timers: list[asyncio.Task[None]] = []

    async def publish_traffic() -> None:
        """Changed TrafficCounts out, due canaries stopped (docs/design.md, "Traffic policies")."""
        while True:
            await asyncio.sleep(settings.traffic_every_s)
            try:
                await guard.act()
                for counts in counter.take_changed():
                    await publish(topics.traffic, counts.name.encode(), encode(counts))
            except Exception as exc:  # noqa: BLE001 - retried at the next tick
                counter.changed.update(counter.counts)  # publish them all again then
                log.warning("traffic counts or canary guard failed (%r); retrying at the next tick", exc)

    async def judge_health(monitor: HealthMonitor) -> None:
        """Each transition of a version's health out as a HealthAlert (docs/design.md, "Observability");
        held as the latest only once published, so a failed publish is tried again at the next tick."""
        while True:
            await asyncio.sleep(settings.health_every_s)
            try:
                for alert in monitor.evaluate(now_ms()):
                    await publish(topics.health, alert.model_version.encode(), encode(alert))
                    monitor.hold(alert)
                    if health is not None:
                        health.published(alert)
                    log.info("health alert %s: %s %s (%s)", alert.state, alert.model_version, alert.signal, alert.detail)
            except Exception as exc:  # noqa: BLE001 - judged again at the next tick
                log.warning("health alerts failed (%r); retrying at the next tick", exc)

    async def publish_usage() -> None:
        """The touched keys' totals out, recomputed from the ledger (services/auditor/usage.py)."""
        while True:
            await asyncio.sleep(settings.usage_every_s)
            try:
                await accounts.publish_touched()
            except Exception as exc:  # noqa: BLE001 - the keys stay touched: retried at the next tick
                log.warning("publishing token usage failed (%r); retrying at the next tick", exc)

    async def publish_rates() -> None:
        while True:
            try:
                await accounts.publish_rates()
            except Exception as exc:  # noqa: BLE001 - measured again at the next tick
                log.warning("publishing rate cards failed (%r); retrying at the next tick", exc)
            await asyncio.sleep(settings.usage_rate_every_s)

    async def checkpoint_quiet_chains() -> None:
        while True:
            await asyncio.sleep(min(settings.audit_checkpoint_every_s, 5.0))
            join.expire()  # the comparison's waiting halves, also when no record comes
            try:
                await writer.checkpoint_due()
                await anchors.publish_new()
            except Exception as exc:  # noqa: BLE001 - retried at the next tick; appends go on
                log.warning("checkpoint or anchor failed (%r); retrying at the next tick", exc)

    async def open_ledger() -> None:
        await writer.open()
        await tracing.start()
        counter.load(await writer.traffic_rows())  # before the first batch: since the ledger began
        await accounts.restate()  # totals stored before a crash but not yet published go out
        if settings.canary_guard or settings.health_alerts:
            await registry.start()  # the models topic must exist (AuditorService.start makes sure)
        if monitor is not None and alerts is not None:
            monitor.load(await writer.drift_rows(settings.health_baseline_outputs, settings.health_window_outputs))
            for event in await writer.comparable_events(settings.health_determinism_keys):
                monitor.compare(event)  # the recent keys again: a pair split by a restart is still compared
            await ensure_topics(settings.kafka_bootstrap, [s for s in topics.core_specs() if s.name == topics.health],
                                options=settings.kafka_options())
            await alerts.start()  # the latest alert per (version, signal): what a transition is judged from
            timers.append(asyncio.get_running_loop().create_task(judge_health(monitor)))
        timers.append(asyncio.get_running_loop().create_task(checkpoint_quiet_chains()))
        timers.append(asyncio.get_running_loop().create_task(publish_traffic()))
        timers.append(asyncio.get_running_loop().create_task(publish_usage()))
        timers.append(asyncio.get_running_loop().create_task(publish_rates()))
        log.info("auditor %s: ledger %s, consuming %s as group %s", client_id, writer.name,
                 settings.topics.audit, settings.topics.auditor_group)

    async def close_ledger() -> None:
        # After the broker stopped: no handler is running any more.
        for timer in timers:
            timer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await timer
        timers.clear()
        if alerts is not None:
            await alerts.stop()
        await registry.stop()
        await writer.close()

    async def flush_spans() -> None:
        await tracing.stop()  # before the broker stops: its last spans go out through it

    return FastStream(broker, on_startup=[open_ledger], on_shutdown=[flush_spans], after_shutdown=[close_ledger])


def usage_accounts(settings: AuditorSettings, writer: LedgerWriter,
                   publish: Callable[[str, bytes, bytes], Awaitable[None]]) -> UsageAccounts:  # fmt: skip
    """The token accounts, priced from the model repository's [prices.*] (none when it has no
    file); a malformed price table is a ConfigError."""
    try:
        prices = load_prices(settings.model_repo) if Path(settings.model_repo).is_file() else {}
    except (ValueError, OSError) as exc:
        raise ConfigError(f"token prices: {exc}") from exc
    ledger = UsageLedger(writer.usage_of, writer.usage_keys_since, writer.tokens_served_since)
    topic = settings.topics.token_usage
    return UsageAccounts(ledger, prices, lambda key, value: publish(topic, key, value),
                         settings.hardware_cost_per_hour, settings.usage_rate_window_s)


class AuditorService:
    """The auditor process: the FastStream app (its lifespan: ledger, broker) and the HTTP API."""

    name = "auditor"

    def __init__(self, settings: AuditorSettings) -> None:
        from schemas.watermark import parse_tenants
        from services.auditor.fingerprints import simhash_function

        self.settings = settings
        self.health = HealthMetrics()
        self.app = create_app(settings, self.health)
        self.is_started = False
        target = settings.ledger_target()
        detector = WatermarkDetector(settings.model_repo, parse_tenants(settings.watermark_tenants))
        self.api = create_api(settings, lambda: Ledger(target, readonly=True), detector, simhash_function())

    async def start(self) -> None:
        await wait_for_cluster(self.settings)
        # Its anchor and comparison topics (created with the others; here too for a deployment made
        # before they existed): publishing to a missing topic would stall the handler that does.
        topics = self.settings.topics
        # It writes the traffic counts, the canary guard's routes and health events too (its alerts'
        # topic: create_app makes sure of it, as it does in tests that build the app alone).
        wanted = {topics.audit_anchors, topics.shadow_live, topics.comparisons, topics.traffic, topics.model_health,
                  topics.models, topics.token_usage, topics.traces}
        specs = [spec for spec in topics.core_specs() if spec.name in wanted]
        # The mirror copies' reply topic: like every reply topic, its reader creates it.
        await ensure_topics(self.settings.kafka_bootstrap, [*specs, topics.reply_spec("shadow")])
        try:
            await self.app.start()
        except (LedgerError, sqlite3.Error) as exc:
            raise ConfigError(f"cannot use its ledger {self.settings.audit_db}: {exc}") from exc
        self.is_started = True

    async def run(self, stop: asyncio.Event) -> None:
        await stop.wait()  # FastStream's subscriber does the work

    async def close(self) -> None:
        if self.is_started:
            self.is_started = False
            await self.app.stop()

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        return self.is_started, {"reason": None if self.is_started else "starting or stopping"}

    def http_app(self) -> ASGIApp:
        return ops_app(self.readiness, self.health.render, mount=self.api)


def build_parser() -> argparse.ArgumentParser:
    """Arguments of `weir auditor`: the common service flags (weir/service.py) and its own."""
    parser = service_parser("auditor", "Run the auditor service.", 8100, "WEIR_AUDIT_API_PORT")
    parser.add_argument("--db", type=Path, help="ledger SQLite file (env WEIR_AUDIT_DB; default $WEIR_HOME/audit.sqlite)")
    parser.add_argument("--dsn", help="ledger PostgreSQL DSN (env WEIR_AUDIT_DSN); replaces --db")
    parser.add_argument("--port", type=int, dest="http_port", help="alias of --http-port")
    return parser


def build(args: argparse.Namespace) -> tuple[AuditorService, str, int]:
    updates = {**bus_overrides(args), "audit_db": args.db, "audit_dsn": SecretStr(args.dsn) if args.dsn else None,
               "audit_api_port": args.http_port}
    settings = AuditorSettings(**{k: v for k, v in updates.items() if v is not None})
    return AuditorService(settings), settings.http_host, settings.audit_api_port


def main(argv: list[str]) -> int:
    """Run the auditor until SIGINT/SIGTERM; returns the process exit status (weir/service.py)."""
    return run_service("auditor", argv, build_parser(), build)
