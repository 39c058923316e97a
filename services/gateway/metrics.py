"""The gateway's metrics: OpenTelemetry SDK instruments, scraped as Prometheus text at GET /metrics.

The instruments live on this app's own MeterProvider (weir/metrics.py, shared by every service);
a scrape collects it and renders the exposition format (text/plain; version=0.0.4).
Counters of this gateway: requests by route and status, cancellations by reason, rate-limit and
admission rejections, authentication failures, output redactions, input-guard detections,
resumed streams; in flight per model and lane. Observed from the
latest worker heartbeats at scrape time: live workers per model, open breakers, and per worker
its free KV blocks, running/waiting sequences and each device's name, memory and utilisation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from opentelemetry.metrics import CallbackOptions, Observation
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from schemas.messages import WorkerHeartbeat
from weir.metrics import ServiceMetrics


class GatewayMetrics:
    """Instruments of one gateway app; `render` returns the Prometheus text."""

    def __init__(self, live_workers: Callable[[], list[WorkerHeartbeat]], open_breakers: Callable[[], set[str]]) -> None:
        self._live_workers = live_workers
        self._open_breakers = open_breakers
        self.service = ServiceMetrics("gateway")
        meter = self.service.meter
        self.requests = meter.create_counter("weir_gateway_requests", description="HTTP responses by route and status.")
        self.in_flight = meter.create_up_down_counter(
            "weir_gateway_in_flight", description="Requests published and not yet ended, per model and lane."
        )
        self.cancellations = meter.create_counter(
            "weir_gateway_cancellations", description="Cancellations this gateway published, by reason."
        )
        self.redactions = meter.create_counter(
            "weir_gateway_redactions", description="Spans of personal data the output guard replaced."
        )
        self.input_guard = meter.create_counter(
            "weir_gateway_input_guard", description="Prompts the input guard rated medium or high risk, by level and action."
        )
        self.streams_resumed = meter.create_counter(
            "weir_gateway_streams_resumed", description="Readers that reconnected to a resumable stream."
        )
        self.rate_limited = meter.create_counter(
            "weir_gateway_rate_limited", description="Requests refused by a rate limit, by scope kind and limit."
        )
        self.admission_rejected = meter.create_counter(
            "weir_gateway_admission_rejected", description="Requests refused by admission control, by model and code."
        )
        self.auth_failures = meter.create_counter(
            "weir_gateway_auth_failures", description="Requests refused with 401/403, by code."
        )
        gauges: list[tuple[str, str, Callable[[CallbackOptions], Iterable[Observation]]]] = [
            ("weir_workers_live", "Workers with a live heartbeat, per model.", self._observe_live),
            ("weir_gateway_breaker_open", "1 while a model's breaker is open (no live worker).", self._observe_breakers),
            ("weir_worker_free_kv_blocks", "Free KV-cache blocks per live worker.", self._worker_field("free_kv_blocks")),
            ("weir_worker_num_running", "Sequences in a live worker's decode loop.", self._worker_field("num_running")),
            ("weir_worker_num_waiting", "Sequences queued in a live worker.", self._worker_field("num_waiting")),
            ("weir_worker_device_memory_total_bytes", "Device memory of a live worker.",
             self._device_field("memory_total_bytes")),
            ("weir_worker_device_memory_free_bytes", "Free device memory of a live worker.",
             self._device_field("memory_free_bytes")),
            ("weir_worker_device_utilization_pct", "Device utilisation of a live worker, percent.",
             self._device_field("utilization_pct")),
        ]  # fmt: skip
        for name, description, callback in gauges:
            meter.create_observable_gauge(name, callbacks=[callback], description=description)

    def render(self) -> str:
        """Collect every instrument and render the Prometheus text exposition format."""
        return self.service.render()

    def shutdown(self) -> None:
        self.service.shutdown()

    def _observe_live(self, _: CallbackOptions) -> Iterable[Observation]:
        counts: dict[str, int] = {}
        for hb in self._live_workers():
            for model in hb.models:
                counts[model] = counts.get(model, 0) + 1
        return [Observation(n, {"model": model}) for model, n in sorted(counts.items())]

    def _observe_breakers(self, _: CallbackOptions) -> Iterable[Observation]:
        return [Observation(1, {"model": model}) for model in sorted(self._open_breakers())]

    def _worker_field(self, field: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(_: CallbackOptions) -> Iterable[Observation]:
            return [Observation(getattr(hb, field), {"worker": hb.worker_id}) for hb in self._live_workers()]

        return observe

    def _device_field(self, field: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(_: CallbackOptions) -> Iterable[Observation]:
            out = []
            for hb in self._live_workers():
                for index, device in enumerate(hb.devices):
                    value = getattr(device, field)
                    if value is not None:
                        labels = {"worker": hb.worker_id, "device": str(index), "kind": device.kind, "name": device.name}
                        out.append(Observation(value, labels))
            return out

        return observe


class ResponseCounter:
    """ASGI middleware: counts every HTTP response by route template and status.

    Pure ASGI (not BaseHTTPMiddleware) so streaming responses and disconnect detection pass
    through untouched. A request that matched no route counts as route "unmatched".
    """

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status: list[int] = []

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"
            self.metrics.requests.add(1, {"route": path, "status": str(status[0] if status else 500)})
