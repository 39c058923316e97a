"""The batcher's event metrics: batches, time held, queue depth and expiries, per lane and tenant.

Recorded as the loop decides (handlers.py) on the service's MeterProvider (weir/metrics.py);
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
from weir.metrics import COUNT_BUCKETS, FRACTION_BUCKETS, TTFT_BUCKETS, ServiceMetrics

Request = GenerateRequest | EmbedRequest

MAX_TENANTS = 50  # tenants named in labels; the rest are "other"
MAX_COUNTED = 10_000  # tenants whose requests are counted; one seen after that is "other" for good
OTHER = "other"


class TenantLabels:
    """The tenant label of a request: its tenant while among the `max_named` with most requests
    admitted so far, else "other" (bounds the series a forged stream of tenant names can make)."""

    def __init__(self, max_named: int = MAX_TENANTS, max_counted: int = MAX_COUNTED) -> None:
        if max_named < 1 or max_counted < max_named:
            raise ValueError(f"need 1 <= max_named <= max_counted, got {max_named}, {max_counted}")
        self.max_named = max_named
        self.max_counted = max_counted
        self._counts: dict[str, int] = {}
        self._named: set[str] = set()

    def count(self, tenant: str) -> None:
        """One more request of `tenant`; it takes the place of the least busy named tenant once it has more."""
        if tenant not in self._counts and len(self._counts) >= self.max_counted:
            return
        self._counts[tenant] = n = self._counts.get(tenant, 0) + 1
        if tenant in self._named:
            return
        if len(self._named) < self.max_named:
            self._named.add(tenant)
            return
        least = min(self._named, key=lambda t: (self._counts[t], t))
        if n > self._counts[least]:
            self._named.discard(least)
            self._named.add(tenant)

    def of(self, tenant: str) -> str:
        return tenant if tenant in self._named else OTHER


class BatcherMetrics:
    """Instruments the batcher's loop records into; see the module docstring."""

    def __init__(self, service: ServiceMetrics, tenants: TenantLabels | None = None) -> None:
        self.service = service
        self.tenants = tenants or TenantLabels()
        self.batch_size = service.histogram("weir_batcher_batch_size", "Requests per batch.", COUNT_BUCKETS)
        self.batch_fill = service.histogram(
            "weir_batcher_batch_fill", "A batch's tokens over the token room of the worker it was routed to.",
            FRACTION_BUCKETS,
        )  # fmt: skip
        self.queue_wait = service.histogram(
            "weir_batcher_queue_wait_seconds", "Time a request was held before it left in a batch.", TTFT_BUCKETS,
        )  # fmt: skip
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
