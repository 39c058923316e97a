"""The batcher's event metrics: batches, time held, queue depth and expiries, per lane and tenant.

Recorded as the loop decides (consumers.py) on the service's MeterProvider (weir/metrics.py);
app.py adds the gauges read from state at scrape time beside them.

- `weir_batcher_batch_size{model_name}`: requests per batch (COUNT_BUCKETS).
- `weir_batcher_batch_fill{model_name}`: the batch's tokens over the room of the worker it was
  routed to (FRACTION_BUCKETS); a batch sent unrouted (no heartbeat names its version) has no
  token budget and is not observed.
- `weir_batcher_queue_wait_seconds{lane,tenant}`: held -> batched (TTFT_BUCKETS: batching waits
  are milliseconds, vLLM's latency buckets start at 0.3 s).
- `weir_batcher_queue_depth{lane,tenant}`: requests held now (a gauge read at scrape time).
- `weir_batcher_requests_expired{lane,tenant}`: requests timed out before batching, on arrival
  or while held.

Tenant names come from request records, so their number is bounded (`TenantLabels`): the 50
tenants with most requests keep their name, the others are tenant="other".
"""

from __future__ import annotations

from schemas.messages import EmbedRequest, GenerateRequest
from services.batcher.planner import PlannedBatch, Planner
from weir.metrics import COUNT_BUCKETS, FRACTION_BUCKETS, TTFT_BUCKETS, ServiceMetrics, TenantLabels

Request = GenerateRequest | EmbedRequest


class BatcherMetrics:
    """Instruments the batcher's loop records into; see the module docstring."""

    def __init__(self, service: ServiceMetrics, tenants: TenantLabels | None = None) -> None:
        self.service = service
        self.tenants = tenants or TenantLabels()
        self.batch_size = service.histogram("weir_batcher_batch_size", "Requests per batch.", COUNT_BUCKETS)
        self.batch_fill = service.histogram(
            "weir_batcher_batch_fill",
            "A batch's tokens over the token room of the worker it was routed to.",
            FRACTION_BUCKETS,
        )
        self.queue_wait = service.histogram(
            "weir_batcher_queue_wait_seconds",
            "Time a request was held before it left in a batch.",
            TTFT_BUCKETS,
        )
        self.expired = service.counter(
            "weir_batcher_requests_expired", "Requests timed out before batching (on arrival or while held)."
        )

    def labels(self, req: Request) -> dict[str, str]:
        return {"lane": req.priority, "tenant": self.tenants.of(req.tenant)}

    def on_admitted(self, req: Request) -> None:
        """A request record was admitted (held or timed out on arrival): counts toward its tenant's rank."""
        self.tenants.count(req.tenant)

    def on_batch(self, batch: PlannedBatch, now_ms: int) -> None:
        """A batch left: its size, its fill of the worker's room, and how long each request waited."""
        model = {"model_name": batch.model}
        self.batch_size.record(len(batch.requests), model)
        room = batch.slot.room_tokens
        if room:
            self.batch_fill.record(batch.num_tokens / room, model)
        for req, arrived_ms in zip(batch.requests, batch.arrived_ms, strict=True):
            self.queue_wait.record(max(now_ms - arrived_ms, 0) / 1000, self.labels(req))

    def on_expired(self, req: Request) -> None:
        self.expired.add(1, self.labels(req))

    def observe_depth(self, planner: Planner | None) -> list[tuple[float, dict[str, str]]]:
        """The queue-depth gauge: requests held per lane and tenant label (none before the planner exists)."""
        if planner is None:
            return []
        depth: dict[tuple[str, str], int] = {}
        for (lane, tenant), n in planner.waiting().items():
            key = (lane, self.tenants.of(tenant))
            depth[key] = depth.get(key, 0) + n
        return [(n, {"lane": lane, "tenant": tenant}) for (lane, tenant), n in sorted(depth.items())]
