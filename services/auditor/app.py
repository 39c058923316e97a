"""Wiring of the auditor: a FastStream app built from settings, run by weir/service.py.

`weir auditor` serves /healthz, /readyz, /metrics and the lookup API (api.py) on its port.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from faststream import FastStream
from faststream.kafka import KafkaBroker
from pydantic import SecretStr
from starlette.types import ASGIApp

from schemas import access
from schemas.codec import encode
from schemas.messages import AuditEvent, now_ms
from schemas.registry import ModelComparison
from services.auditor.api import create_api
from services.auditor.comparison import Comparisons, Embed, ShadowJoin, register_comparison
from services.auditor.config import AuditorSettings
from services.auditor.consumers import AnchorPublisher, AuditBatches, DeadLetters, LedgerWriter, register_handlers
from services.auditor.drift import HealthMonitor, HealthPolicy
from services.auditor.fingerprints import embedding_function
from services.auditor.health import HealthMetrics
from services.auditor.ledger import Ledger, LedgerError
from services.auditor.traffic import CanaryGuard, ErrorWindows, TrafficCounter, register_health_handler
from services.auditor.usage import UsageAccounts, UsageLedger, load_prices
from services.auditor.watermark import WatermarkDetector
from weir.bus import TopicFollower, instance_id, wait_for_cluster
from weir.kafka.admin import ensure_topics
from weir.registry import RegistryFollower
from weir.service import ConfigError, bus_overrides, ops_app, run_service, service_parser
from weir.tracing import Tracing

log = logging.getLogger(__name__)

Publish = Callable[[str, bytes, bytes], Awaitable[None]]  # (topic, key, value)


def create_app(
    settings: AuditorSettings, health: HealthMetrics | None = None, embed: Embed | Literal["default"] | None = "default"
) -> FastStream:
    """The auditor app: one consumer group on the audit topic, a ledger, dead letters and
    checkpoint anchors published through the same broker, and a timer that writes the quiet
    chains' checkpoints and publishes any anchor not yet out. New records feed `health` (the /metrics).
    With settings.health_alerts, a HealthMonitor (services/auditor/drift.py) judges each version's
    drift and freshness every health_every_s and publishes the transitions on Topics.health.
    A second group makes the shadow comparison (services/auditor/comparison.py); its similarity
    comes from `embed` ("default": settings.comparison_embedding_model, loaded on first use).

    The parts are built in order (build_parts), subscribed to the broker, and started in order
    before the broker consumes and stopped in reverse after it stopped (`running`), as the
    gateway's lifespan does. Nothing connects until the app starts (`await app.start()`, or
    `async with app:` in tests).
    """
    parts = build_parts(settings, health)
    subscribe(parts, embed)
    lifespan = contextlib.AsyncExitStack()

    async def start() -> None:
        await lifespan.enter_async_context(running(parts))

    async def start_timers() -> None:
        # After the broker started (FastStream runs on_startup before it, after_startup once it is): a
        # timer's first publish went to a broker not started yet. The rate cards publish at once, so
        # every start of a ledger with tokens in its window warned "publishing rate cards failed".
        await lifespan.enter_async_context(ticking(parts))

    async def flush_spans() -> None:
        await parts.tracing.stop()  # before the broker stops: its last spans go out through it

    async def stop() -> None:  # after the broker stopped: no handler runs any more
        await lifespan.aclose()

    return FastStream(
        parts.broker, on_startup=[start], after_startup=[start_timers], on_shutdown=[flush_spans], after_shutdown=[stop]
    )


@dataclass
class AuditorParts:
    """What one auditor app is made of, in the order it is built (build_parts); each part is handed
    what it needs when it is made, and none reaches back to the app."""

    settings: AuditorSettings
    client_id: str
    broker: KafkaBroker
    publish: Publish  # a record out through the broker (acks=all)
    writer: LedgerWriter
    anchors: AnchorPublisher
    dead_letters: DeadLetters
    counter: TrafficCounter
    registry: RegistryFollower
    guard: CanaryGuard
    monitor: HealthMonitor | None  # settings.health_alerts
    alerts: TopicFollower | None  # the health topic, followed when there is a monitor
    accounts: UsageAccounts
    join: ShadowJoin
    tracing: Tracing
    health: HealthMetrics | None  # the /metrics it feeds (None: in tests that read the ledger only)

    def observe(self, event: AuditEvent) -> None:
        """A new AuditEvent, once stored: counted per version, per key, judged, guarded."""
        self.counter.observe(event)
        self.accounts.observe(event)
        if self.monitor is not None:
            result = self.monitor.observe(event)
            if result is not None and self.health is not None:
                self.health.compared(event.model_version, result)
        if self.settings.canary_guard:
            self.guard.observe(event)

    async def publish_traffic(self) -> None:
        """Changed TrafficCounts out, due canaries stopped (docs/design.md, "Traffic policies")."""
        try:
            await self.guard.act()
            for counts in self.counter.take_changed():
                await self.publish(self.settings.topics.traffic, counts.name.encode(), encode(counts))
        except Exception:
            self.counter.changed.update(self.counter.counts)  # publish them all again at the next tick
            raise

    async def judge_health(self) -> None:
        """Each transition of a version's health out as a HealthAlert (docs/design.md, "Observability");
        held as the latest only once published, so a failed publish is tried again at the next tick."""
        assert self.monitor is not None
        for alert in self.monitor.evaluate(now_ms()):
            await self.publish(self.settings.topics.health, alert.model_version.encode(), encode(alert))
            self.monitor.hold(alert)
            if self.health is not None:
                self.health.published(alert)
            log.info("health alert %s: %s %s (%s)", alert.state, alert.model_version, alert.signal, alert.detail)

    async def checkpoint(self) -> None:
        """The quiet chains' checkpoints written and any anchor not yet out published; the
        comparison's waiting halves expired (also when no record comes)."""
        self.join.expire()
        await self.writer.checkpoint_due()
        await self.anchors.publish_new()


def build_parts(settings: AuditorSettings, health: HealthMetrics | None) -> AuditorParts:
    """The auditor's parts, each built after what it uses; nothing connects here."""
    client_id = instance_id("auditor")
    topics = settings.topics
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

    async def publish(topic: str, key: bytes, value: bytes) -> None:
        await broker.publish(value, topic=topic, key=key)

    writer = LedgerWriter(settings)
    registry = RegistryFollower(settings, client_id=f"{client_id}-registry")
    guard = CanaryGuard(
        ErrorWindows(settings.canary_min_requests, settings.canary_max_error_rate),
        lambda: registry.state,
        publish,
        topics.models,
        topics.model_health,
        by=client_id,
    )
    monitor = (
        HealthMonitor(HealthPolicy.from_settings(settings), lambda: registry.state, by=client_id)
        if settings.health_alerts
        else None
    )
    alerts = (
        None
        if monitor is None
        else TopicFollower(
            settings, topics.health, f"{client_id}-health", lambda key, value, _: monitor.on_alert(key, value)
        )
    )
    join = ShadowJoin(settings.comparison_ttl_s, settings.comparison_max_pending)
    if health is not None:
        health.monitor = monitor
        health.shadow_join = join.counts
    return AuditorParts(
        settings,
        client_id,
        broker,
        publish,
        writer,
        AnchorPublisher(topics, broker, writer),
        DeadLetters(topics, broker),
        TrafficCounter(),
        registry,
        guard,
        monitor,
        alerts,
        usage_accounts(settings, writer, publish),
        join,
        Tracing("auditor", client_id, settings, send=publish),  # spans through its own broker
        health,
    )


def subscribe(parts: AuditorParts, embed: Embed | Literal["default"] | None) -> None:
    """The app's subscribers on its broker: the audit topic (the ledger), the model health topic (the
    canary guard, when on) and the shadow comparison's two topics."""
    settings, broker = parts.settings, parts.broker
    register_handlers(
        broker,
        settings,
        AuditBatches(
            settings,
            parts.writer,
            parts.dead_letters,
            parts.health,
            parts.anchors,
            parts.observe,
            tracing=parts.tracing,
        ),
    )
    if settings.canary_guard:
        register_health_handler(broker, settings.topics, parts.guard)

    async def publish_comparison(comparison: ModelComparison) -> None:
        await parts.publish(settings.topics.comparisons, comparison.name.encode(), encode(comparison))

    if embed == "default":
        embed = (
            embedding_function(settings.model_repo, settings.comparison_embedding_model)
            if settings.comparison_embedding_model
            else None
        )
    register_comparison(
        broker,
        settings,
        Comparisons(parts.join, embed, publish_comparison, parts.writer.add_comparison, parts.dead_letters.send),
    )


@contextlib.asynccontextmanager
async def running(parts: AuditorParts) -> AsyncIterator[None]:
    """The auditor's parts started in order before its broker consumes: the ledger, tracing, the
    state kept in the ledger (traffic counts since it began, token totals not yet published), the
    registry, the health alerts (the timers start once the broker has: `ticking`); stopped in reverse
    after the broker stopped, and
    what started is stopped when a later part fails to start. Tracing is stopped before the broker
    (create_app's flush_spans), since its spans go out through it."""
    settings, topics, writer = parts.settings, parts.settings.topics, parts.writer
    async with contextlib.AsyncExitStack() as started:
        await writer.open()
        started.push_async_callback(writer.close)
        await parts.tracing.start()
        parts.counter.load(await writer.traffic_rows())  # before the first batch: since the ledger began
        await parts.accounts.restate()  # totals stored before a crash but not yet published go out
        if settings.canary_guard or settings.health_alerts:
            await parts.registry.start()  # the models topic must exist (AuditorService.start makes sure)
            started.push_async_callback(parts.registry.stop)
        if parts.monitor is not None and parts.alerts is not None:
            monitor = parts.monitor
            monitor.load(await writer.drift_rows(settings.health_baseline_outputs, settings.health_window_outputs))
            for event in await writer.comparable_events(settings.health_determinism_keys):
                monitor.compare(event)  # the recent keys again: a pair split by a restart is still compared
            await ensure_topics(
                settings.kafka_bootstrap,
                [s for s in topics.core_specs() if s.name == topics.health],
                options=settings.kafka_options(),
            )
            await parts.alerts.start()  # the latest alert per (version, signal): what a transition is judged from
            started.push_async_callback(parts.alerts.stop)
        log.info(
            "auditor %s: ledger %s, consuming %s as group %s",
            parts.client_id,
            writer.name,
            topics.audit,
            topics.auditor_group,
        )
        yield


@contextlib.asynccontextmanager
async def ticking(parts: AuditorParts) -> AsyncIterator[None]:
    """The auditor's timers, run while the broker runs (their publishes go through it): checkpoints
    and anchors, traffic counts and the canary guard, token usage, rate cards, health alerts."""
    settings = parts.settings
    timers = [
        every(min(settings.audit_checkpoint_every_s, 5.0), parts.checkpoint, "checkpoint or anchor"),
        every(settings.traffic_every_s, parts.publish_traffic, "traffic counts or canary guard"),
        every(settings.usage_every_s, parts.accounts.publish_touched, "publishing token usage"),
        every(settings.usage_rate_every_s, parts.accounts.publish_rates, "publishing rate cards", at_once=True),
    ]
    if parts.monitor is not None and parts.alerts is not None:
        timers.insert(0, every(settings.health_every_s, parts.judge_health, "health alerts"))
    async with contextlib.AsyncExitStack() as running_timers:
        for timer in timers:
            running_timers.push_async_callback(_cancel, asyncio.get_running_loop().create_task(timer))
        yield


async def every(interval_s: float, tick: Callable[[], Awaitable[object]], what: str, at_once: bool = False) -> None:
    """Run `tick` every `interval_s` (first after one interval; `at_once`: first now) until
    cancelled. A tick that fails is logged and the next one tries again: the auditor's appends go
    on whatever a timer meets (the broker away, a ledger busy)."""
    if not at_once:
        await asyncio.sleep(interval_s)
    while True:
        try:
            await tick()
        except Exception as exc:  # noqa: BLE001 - retried at the next tick
            log.warning("%s failed (%r); retrying at the next tick", what, exc)
        await asyncio.sleep(interval_s)


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def usage_accounts(settings: AuditorSettings, writer: LedgerWriter, publish: Publish) -> UsageAccounts:
    """The token accounts, priced from the model repository's [prices.*] (none when it has no
    file); a malformed price table is a ConfigError."""
    try:
        prices = load_prices(settings.model_repo) if Path(settings.model_repo).is_file() else {}
    except (ValueError, OSError) as exc:
        raise ConfigError(f"token prices: {exc}") from exc
    ledger = UsageLedger(writer.usage_of, writer.usage_keys_since, writer.tokens_served_since)
    topic = settings.topics.token_usage
    return UsageAccounts(
        ledger,
        prices,
        lambda key, value: publish(topic, key, value),
        settings.hardware_cost_per_hour,
        settings.usage_rate_window_s,
    )


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
        # The topics it uses (schemas/access.py, which its ACLs come from too), created with the
        # others; here too for a deployment made before they existed: publishing to a missing topic
        # would stall the handler that does. The mirror copies' reply topic is among them: like
        # every reply topic, its reader creates it.
        await ensure_topics(self.settings.kafka_bootstrap, access.needed_specs("auditor", self.settings.topics))
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
    parser.add_argument(
        "--db", type=Path, help="ledger SQLite file (env WEIR_AUDIT_DB; default $WEIR_HOME/audit.sqlite)"
    )
    parser.add_argument("--dsn", help="ledger PostgreSQL DSN (env WEIR_AUDIT_DSN); replaces --db")
    parser.add_argument("--port", type=int, dest="http_port", help="alias of --http-port")
    return parser


def build(args: argparse.Namespace) -> tuple[AuditorService, str, int]:
    updates = {
        **bus_overrides(args),
        "audit_db": args.db,
        "audit_dsn": SecretStr(args.dsn) if args.dsn else None,
        "audit_api_port": args.http_port,
    }
    settings = AuditorSettings(**{k: v for k, v in updates.items() if v is not None})
    return AuditorService(settings), settings.http_host, settings.audit_api_port


def main(argv: list[str]) -> int:
    """Run the auditor until SIGINT/SIGTERM; returns the process exit status (weir/service.py)."""
    return run_service("auditor", argv, build_parser(), build)
