"""What GET /dashboard/data answers: one JSON view of the deployment, built inside the gateway.

The gateway calls no other service (docs/design.md, invariant 1); everything here comes from what
it already holds or follows on Kafka:

- its own exposition text (GatewayMetrics.render()): latency percentiles and token throughput over
  the last window, from the difference of two snapshots' buckets and counters (as Prometheus'
  `histogram_quantile(q, rate(..._bucket[w]))` and `rate(..._total[w])` would), and the consumer
  lag gauge `kafka_consumergroup_lag` as it is now;
- the worker heartbeats it follows (fleet.py): queue, KV-cache usage and prefix-cache hit rate per
  live worker, and each version's TTFT and inter-token histograms as the workers measure them
  (vLLM's: every request, a Batch API job's too, which no gateway sees), windowed like its own;
- the registry it follows (catalog.py): every version and the states the live workers report;
- `<prefix>.health` (HealthAlert): the last alerts and the ones still open per (version, signal),
  and per version the output SLA of its latest `structured` and `determinism` alerts (the valid
  rate with its counts, the same/differs counts: weir/models/health.py, outcome_view);
- `<prefix>.usage.tokens` (UsageTotals, compacted): today's top tenants by tokens and cost.

A metric that is absent, or a window with nothing in it, is `null` (the page says "no data yet"),
never a made-up zero. Records that do not decode are skipped and counted, not dead-lettered: every
gateway replica reads these topics from the beginning at each start, so each would letter the same
record again (as the heartbeat reader does, kafka_bus.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import orjson
from aiokafka import ConsumerRecord

from schemas.codec import DecodeError, decode
from schemas.messages import WorkerHeartbeat
from schemas.telemetry import HealthAlert, RateCard, UsageTotals
from services.gateway.catalog import Catalog
from weir.bus import BusSettings, TopicFollower
from weir.metrics import samples
from weir.models.health import OUTCOME_SIGNALS, outcome_view

log = logging.getLogger(__name__)

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]

# The gateway's histograms (label model_name) and counters the dashboard reads, by panel key.
LATENCIES = {
    "ttft": "weir_gateway_time_to_first_token_seconds",
    "itl": "weir_gateway_inter_token_latency_seconds",
    "e2e": "weir_gateway_e2e_request_latency_seconds",
    # The live workers' heartbeats (WorkerHeartbeat.latency), as samples under these names (heartbeat_samples).
    "worker_ttft": "worker_time_to_first_token_seconds",
    "worker_itl": "worker_inter_token_latency_seconds",
}
TOKENS = "weir_gateway_generation_tokens_total"
LAG = "kafka_consumergroup_lag"
QUANTILES = (0.5, 0.95, 0.99)
WINDOW_S = 60.0  # percentiles and throughput cover at most the last minute
SAMPLE_EVERY_S = 2.0  # the page polls every 2 s; a snapshot as often keeps the window's start fresh
MIN_SPAN_S = 0.5  # a window shorter than this says nothing about a rate
MAX_ALERTS = 50
TOP_TENANTS = 10
_KEPT = tuple(f"{name}_bucket" for name in LATENCIES.values()) + (TOKENS, LAG)


@dataclass(frozen=True)
class Snapshot:
    at_s: float  # monotonic seconds
    samples: Samples


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The q-quantile of cumulative (upper bound, count) buckets, as Prometheus' histogram_quantile
    computes it: linear within the bucket the rank falls in; in the +Inf bucket, the highest finite
    bound. None when the buckets hold no observation."""
    buckets = sorted(buckets)
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if math.isinf(upper):
                return lower
            if count == below:
                return upper
            return lower + (upper - lower) * (rank - below) / (count - below)
        lower, below = upper, count
    return lower


def _by_series(snap: Samples, name: str) -> dict[frozenset[tuple[str, str]], float]:
    return {labels: value for (sample, labels), value in snap.items() if sample == name}


def _delta(new: dict[Any, float], old: dict[Any, float]) -> dict[Any, float]:
    """new - old per series; when a series went down (its process restarted), that process's series
    count from zero: the process is the `worker` label's (the workers' histograms), else this gateway."""
    by_process: dict[str, dict[Any, float]] = {}
    for key, value in new.items():
        by_process.setdefault(dict(key).get("worker", ""), {})[key] = value
    out: dict[Any, float] = {}
    for series in by_process.values():
        if any(value < old.get(key, 0.0) for key, value in series.items()):
            out.update(series)
        else:
            out.update({key: value - old.get(key, 0.0) for key, value in series.items()})
    return out


def _model_of(labels: frozenset[tuple[str, str]]) -> str:
    return dict(labels).get("model_name", "")


class MetricWindow:
    """Snapshots of the gateway's own exposition over the last WINDOW_S, and what changed since."""

    def __init__(
        self,
        render: Callable[[], str],
        window_s: float = WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
        extra: Callable[[], Samples] = dict,
    ) -> None:
        """`extra`: samples from elsewhere than the exposition (the workers' histograms: heartbeat_samples)."""
        self._render = render
        self.window_s = window_s
        self._clock = clock
        self._extra = extra
        self._snapshots: deque[Snapshot] = deque()

    def snapshot(self) -> Snapshot:
        """The exposition now, only the samples the dashboard reads (a NaN gauge is no data: JSON has no NaN)."""
        kept = {
            key: value for key, value in samples(self._render()).items() if key[0] in _KEPT and math.isfinite(value)
        }
        return Snapshot(self._clock(), {**kept, **self._extra()})

    def sample(self) -> None:
        """Keep a snapshot; forget those older than the window, keeping one at or before its start."""
        self._snapshots.append(self.snapshot())
        start = self._snapshots[-1].at_s - self.window_s
        while len(self._snapshots) > 1 and self._snapshots[1].at_s <= start:
            self._snapshots.popleft()

    def report(self) -> dict[str, Any]:
        """Percentiles, throughput and lag now, over the window since the oldest kept snapshot."""
        now = self.snapshot()
        base = self._snapshots[0] if self._snapshots else None
        span_s = now.at_s - base.at_s if base is not None else 0.0
        usable = base is not None and span_s >= MIN_SPAN_S
        return {
            "window_s": round(span_s, 3) if usable else None,
            "latency": {
                key: self._latency(now, base, name) if base and usable else None for key, name in LATENCIES.items()
            },
            "throughput": self._throughput(now, base, span_s) if base and usable else None,
            "lag": self._lag(now),
        }

    @staticmethod
    def _lag(now: Snapshot) -> list[dict[str, Any]] | None:
        """kafka_consumergroup_lag per (consumergroup, topic) as it is now; None if absent."""
        rows = [
            {
                "consumergroup": dict(labels).get("consumergroup", ""),
                "topic": dict(labels).get("topic", ""),
                "lag": value,
            }
            for labels, value in _by_series(now.samples, LAG).items()
        ]
        return sorted(rows, key=lambda row: (row["consumergroup"], row["topic"])) or None

    @staticmethod
    def _latency(now: Snapshot, base: Snapshot, name: str) -> dict[str, Any] | None:
        """p50/p95/p99 and the count of observations in the window, over all models and per
        model_name; None if the histogram is absent."""
        bucket = f"{name}_bucket"
        new = _by_series(now.samples, bucket)
        if not new:
            return None
        grown = _delta(new, _by_series(base.samples, bucket))
        per_model: dict[str, dict[float, float]] = {}
        every: dict[float, float] = {}  # the models' histograms summed: the same bounds, bucket by bucket
        for labels, count in grown.items():
            le = float(dict(labels).get("le", "+Inf"))
            buckets = per_model.setdefault(_model_of(labels), {})
            buckets[le] = buckets.get(le, 0.0) + count  # summed over any other label (lane, ...)
            every[le] = every.get(le, 0.0) + count
        by_model = {model: _percentiles(model_buckets) for model, model_buckets in sorted(per_model.items())}
        return {"all": _percentiles(every), "by_model": by_model}

    @staticmethod
    def _throughput(now: Snapshot, base: Snapshot, span_s: float) -> dict[str, Any] | None:
        """Generated tokens per second over the window, in all and per model_name; None if absent."""
        new = _by_series(now.samples, TOKENS)
        if not new:
            return None
        grown = _delta(new, _by_series(base.samples, TOKENS))
        by_model: dict[str, float] = {}
        for labels, tokens in grown.items():
            by_model[_model_of(labels)] = by_model.get(_model_of(labels), 0.0) + tokens / span_s
        return {"tokens_per_s": sum(by_model.values()), "by_model": dict(sorted(by_model.items()))}


def _percentiles(buckets: dict[float, float]) -> dict[str, Any]:
    pairs = sorted(buckets.items())
    out: dict[str, Any] = {f"p{round(q * 100)}": histogram_quantile(q, pairs) for q in QUANTILES}
    out["count"] = pairs[-1][1] if pairs else 0.0
    return out


def heartbeat_samples(live: list[WorkerHeartbeat]) -> Samples:
    """The live workers' latency histograms as exposition samples (`<name>_bucket` with model_name,
    worker and le), so MetricWindow windows them like the gateway's own: a worker that restarted
    counts from zero again (_delta), one that is gone drops out."""
    out: Samples = {}
    for hb in live:
        for served_id, latency in hb.latency.items():
            for key, histogram in (("worker_ttft", latency.ttft), ("worker_itl", latency.itl)):
                name = f"{LATENCIES[key]}_bucket"
                for bound, count in zip([*histogram.bounds, math.inf], histogram.counts, strict=True):
                    le = "+Inf" if math.isinf(bound) else repr(float(bound))
                    out[(name, frozenset({("model_name", served_id), ("worker", hb.worker_id), ("le", le)}))] = float(
                        count
                    )
    return out


class AlertsView:
    """HealthAlerts of `<prefix>.health`: the last MAX_ALERTS, and the latest of each (version,
    signal) whose state is `raised` (open). A repeated alert_id (a retried publish) counts once."""

    def __init__(self, keep: int = MAX_ALERTS) -> None:
        self.recent: deque[HealthAlert] = deque(maxlen=keep)
        self.latest: dict[tuple[str, str], HealthAlert] = {}
        self._seen: deque[str] = deque(maxlen=keep * 4)
        self.skipped = 0

    def on_record(self, key: bytes | None, value: bytes | None, record: ConsumerRecord) -> None:
        try:
            alert = decode(HealthAlert, value)
        except DecodeError as exc:
            self.skipped += 1
            log.warning("dashboard: skipping %s[%d]@%d: %s", record.topic, record.partition, record.offset, exc)
            return
        if alert.alert_id in self._seen:
            return
        self._seen.append(alert.alert_id)
        self.recent.append(alert)
        known = self.latest.get((alert.model_version, alert.signal))
        if known is None or alert.created_ms >= known.created_ms:
            self.latest[(alert.model_version, alert.signal)] = alert

    def report(self) -> dict[str, Any]:
        opened = [alert for alert in self.latest.values() if alert.state == "raised"]
        return {
            "recent": [_alert(alert) for alert in sorted(self.recent, key=lambda a: -a.created_ms)],
            "open": [_alert(alert) for alert in sorted(opened, key=lambda a: (a.model_version, a.signal))],
            "sla": self.sla(),
            "skipped": self.skipped,
        }

    def sla(self) -> dict[str, dict[str, Any]]:
        """Per version with an output-SLA alert: each outcome signal's view (None: no alert yet)."""
        versions = sorted({served_id for served_id, signal in self.latest if signal in OUTCOME_SIGNALS})
        return {
            served_id: {signal: outcome_view(self.latest.get((served_id, signal))) for signal in OUTCOME_SIGNALS}
            for served_id in versions
        }


def _alert(alert: HealthAlert) -> dict[str, Any]:
    return alert.model_dump(mode="json", exclude={"schema_version"})


class UsageView:
    """The latest UsageTotals per key of the compacted `<prefix>.usage.tokens` (a tombstone removes
    its key; RateCards, the topic's other kind, are not tenants' and are left out). A record whose
    key is not its own is skipped: it would stand in for another tenant's totals."""

    def __init__(self) -> None:
        self.totals: dict[str, UsageTotals] = {}
        self.skipped = 0

    def on_record(self, key: bytes | None, value: bytes | None, record: ConsumerRecord) -> None:
        name = key.decode("utf-8", "replace") if key is not None else None
        if value is None:
            if name is not None:
                self.totals.pop(name, None)
            return
        problem = self._problem(name, value)
        if problem is not None:
            self.skipped += 1
            log.warning("dashboard: skipping %s[%d]@%d: %s", record.topic, record.partition, record.offset, problem)

    def _problem(self, name: str | None, value: bytes) -> str | None:
        """Fold one record; why it was skipped, or None."""
        try:
            kind = orjson.loads(value).get("kind")
        except (orjson.JSONDecodeError, AttributeError):
            return "not a JSON object"
        if kind not in ("usage", "rate"):
            return f"unknown kind {str(kind)[:40]!r}"
        try:
            totals: UsageTotals | RateCard = decode(UsageTotals, value) if kind == "usage" else decode(RateCard, value)
        except DecodeError as exc:
            return str(exc)
        if totals.key() != name:
            return f"key {str(name)[:80]!r} is not the record's own ({totals.key()[:80]!r})"
        if isinstance(totals, UsageTotals):
            self.totals[totals.key()] = totals
        return None

    def top_tenants(self, day: str, n: int = TOP_TENANTS) -> list[dict[str, Any]]:
        """The n tenants with the most tokens on `day`, summed over principals and versions; cost is
        the sum of the priced records (`unpriced` says some had no price)."""
        tenants: dict[str, dict[str, Any]] = {}
        for totals in self.totals.values():
            if totals.day != day:
                continue
            row = tenants.setdefault(
                totals.tenant,
                {
                    "tenant": totals.tenant,
                    "requests": 0,
                    "prompt_tokens": 0,
                    "completion_tokens": 0,
                    "cost_usd": None,
                    "unpriced": False,
                },
            )
            row["requests"] += totals.requests
            row["prompt_tokens"] += totals.prompt_tokens
            row["completion_tokens"] += totals.completion_tokens
            if totals.cost_usd is None:
                row["unpriced"] = True
            else:
                row["cost_usd"] = (row["cost_usd"] or 0.0) + totals.cost_usd
        for row in tenants.values():
            row["tokens"] = row["prompt_tokens"] + row["completion_tokens"]
        return sorted(tenants.values(), key=lambda row: (-row["tokens"], row["tenant"]))[:n]


class DashboardData:
    """The dashboard's sources in one gateway: started and stopped with the app (app.py)."""

    def __init__(
        self,
        settings: BusSettings,
        client_id: str,
        catalog: Catalog,
        render: Callable[[], str],
        clock_ms: Callable[[], int],
    ) -> None:
        self.catalog = catalog
        self.metrics = MetricWindow(render, extra=lambda: heartbeat_samples(catalog.fleet.live(clock_ms())))
        self.alerts = AlertsView()
        self.usage = UsageView()
        self._now_ms = clock_ms
        topics = settings.topics
        self._followers = [
            TopicFollower(settings, topics.health, f"{client_id}-health", self.alerts.on_record),
            TopicFollower(settings, topics.token_usage, f"{client_id}-usage", self.usage.on_record),
        ]
        self._sampler: asyncio.Task[None] | None = None

    async def start(self) -> None:
        for follower in self._followers:
            await follower.start()
        self.metrics.sample()
        self._sampler = asyncio.create_task(self._sample(), name="dashboard-metrics")

    async def stop(self) -> None:
        if self._sampler is not None:
            self._sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sampler
        for follower in self._followers:
            await follower.stop()

    async def _sample(self) -> None:
        while True:
            await asyncio.sleep(SAMPLE_EVERY_S)
            try:
                self.metrics.sample()
            except Exception:  # a failed scrape must not end the sampling
                log.exception("dashboard: sampling the gateway's metrics failed")

    def report(self) -> dict[str, Any]:
        """The JSON of GET /dashboard/data."""
        now = self._now_ms()
        day = datetime.fromtimestamp(now / 1000, UTC).strftime("%Y-%m-%d")
        return {
            "now_ms": now,
            **self.metrics.report(),
            "workers": workers(self.catalog, now),
            "versions": self.catalog.index(),
            "alerts": self.alerts.report(),
            "tenants": {"day": day, "top": self.usage.top_tenants(day), "skipped": self.usage.skipped},
        }


def workers(catalog: Catalog, now_ms: int) -> list[dict[str, Any]]:
    """Per live worker: its queue, KV-cache usage and prefix-cache hit rate (None: not reported,
    or no prompt token looked up yet), and its versions' states."""
    rows = []
    for hb in sorted(catalog.fleet.live(now_ms), key=lambda hb: hb.worker_id):
        queries = hb.prefix_cache_queries
        rows.append(
            {
                "worker_id": hb.worker_id,
                "num_running": hb.num_running,
                "num_waiting": hb.num_waiting,
                "max_num_seqs": hb.max_num_seqs,
                "kv_cache_usage_perc": hb.kv_cache_usage_perc,
                "prefix_cache_hit_rate": hb.prefix_cache_hits / queries if queries else None,
                "prefix_cache_queries": queries,
                "versions": {served_id: status.state for served_id, status in hb.versions.items()},
                "age_ms": now_ms - hb.sent_ms,
            }
        )
    return rows
