"""The gateway's metrics: OpenTelemetry SDK instruments, scraped as Prometheus text at GET /metrics.

The instruments live on this app's own MeterProvider (weir/metrics.py, shared by every service);
a scrape collects it and renders the exposition format (text/plain; version=0.0.4).
Counters of this gateway: requests by route, status and error code, cancellations by reason,
rate-limit and admission rejections, authentication failures, output redactions, input-guard
detections, resumed streams; in flight per model and lane. Observed from the
latest worker heartbeats at scrape time: live workers per model, open breakers, and per worker
its free KV blocks, running/waiting sequences and each device's name, memory and utilisation.
Consumer lag of the deployment's groups (weir/lag.py, polled in the background) as
`kafka_consumergroup_lag`; the estimated wait of a new request per version (queue_wait.py, the
estimate admission refuses by) as `weir_gateway_queue_wait_seconds{model_name}`.

Generations as the gateway sees them (`GenerationTimer`, label `model_name`: the served
`name@version`, as vLLM's names are labelled: docs/design.md, "Observability"): `weir_gateway_time_to_first_token_seconds` (request accepted -> first content
written to a streamed response, or first token received for a JSON one) and
`weir_gateway_inter_token_latency_seconds` (between those: a chunk may hold several tokens), for
every generation as vLLM records them, with label `stream` ("true" for a streamed response, SSE
or WebSocket; "false" for a JSON body, whose client sees only the end: its first token is the
pipeline's, read by this gateway); for every generation that
reached its terminal, `weir_gateway_e2e_request_latency_seconds`, `weir_gateway_generation_tokens`
(completion tokens billed), and the OpenTelemetry GenAI client metrics `gen_ai.client.token.usage`
and `gen_ai.client.operation.duration` (with `error.type`, the OpenAI error code, when the
terminal was an error: how a stream that answered 200 and then failed is counted).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from opentelemetry.metrics import CallbackOptions, Observation
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from schemas.messages import ReplyEnd, WorkerHeartbeat
from schemas.registry import split_ref
from weir.lag import LAG_METRIC, LagMonitor
from weir.metrics import ITL_BUCKETS, LATENCY_BUCKETS, TTFT_BUCKETS, ServiceMetrics

if TYPE_CHECKING:
    from services.gateway.queue_wait import BatchBacklog

# The GenAI semantic conventions' bucket advice for the client metrics (gen-ai-metrics.md).
GEN_AI_TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864)
GEN_AI_DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
GEN_AI_PROVIDER = "weir"  # gen_ai.provider.name: this deployment serves the models itself
# gen_ai.operation.name of each kind of request the gateway times.
GEN_AI_OPERATION = {"chat.completions": "chat", "completions": "text_completion"}
# Where a refusal leaves its OpenAI error code for ResponseCounter (the request's scope state).
ERROR_CODE_STATE = "weir_error_code"


def note_error_code(scope: Scope, code: str | None) -> None:
    """Record the error code of the response being sent, for the request counter's `code` label."""
    scope.setdefault("state", {})[ERROR_CODE_STATE] = code or "unknown"


class GatewayMetrics:
    """Instruments of one gateway app; `render` returns the Prometheus text."""

    def __init__(
        self, live_workers: Callable[[], list[WorkerHeartbeat]], open_breakers: Callable[[], set[str]]
    ) -> None:
        self._live_workers = live_workers
        self._open_breakers = open_breakers
        self.service = ServiceMetrics("gateway")
        meter = self.service.meter
        self.requests = meter.create_counter(
            "weir_gateway_requests",
            description="HTTP responses by route, status and code (the OpenAI error code of an error body, else '').",
        )
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
            "weir_gateway_input_guard",
            description="Prompts the input guard rated medium or high risk, by level and action.",
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
        self._add_generation_instruments()
        gauges: list[tuple[str, str, Callable[[CallbackOptions], Iterable[Observation]]]] = [
            ("weir_workers_live", "Workers with a live heartbeat, per model.", self._observe_live),
            (
                "weir_gateway_breaker_open",
                "1 while a model's breaker is open (no live worker).",
                self._observe_breakers,
            ),
            (
                "weir_worker_free_kv_blocks",
                "Free KV-cache blocks per live worker.",
                self._worker_field("free_kv_blocks"),
            ),
            ("weir_worker_num_running", "Sequences in a live worker's decode loop.", self._worker_field("num_running")),
            ("weir_worker_num_waiting", "Sequences queued in a live worker.", self._worker_field("num_waiting")),
            (
                "weir_worker_device_memory_total_bytes",
                "Device memory of a live worker.",
                self._device_field("memory_total_bytes"),
            ),
            (
                "weir_worker_device_memory_free_bytes",
                "Free device memory of a live worker.",
                self._device_field("memory_free_bytes"),
            ),
            (
                "weir_worker_device_utilization_pct",
                "Device utilisation of a live worker, percent.",
                self._device_field("utilization_pct"),
            ),
        ]
        for name, description, callback in gauges:
            meter.create_observable_gauge(name, callbacks=[callback], description=description)

    def follow_lag(self, lag: LagMonitor) -> None:
        """Export `lag`'s last values as kafka_consumergroup_lag (read at scrape time, no I/O)."""
        self.service.gauge(
            LAG_METRIC, "Consumer lag per group and topic of this deployment (weir/lag.py).", lag.observe
        )

    def follow_queue(self, backlog: BatchBacklog) -> None:
        """Export the queue's estimated wait per version (read at scrape time, no I/O)."""
        self.service.gauge(
            "weir_gateway_queue_wait_seconds",
            "Estimated wait of a new request per model version: "
            "the queue ahead over the live workers' drain rate (absent: unknown).",
            backlog.observe,
        )

    def _add_generation_instruments(self) -> None:
        """The instruments GenerationTimer records into (see the module docstring)."""
        service = self.service
        self.time_to_first_token = service.histogram(
            "weir_gateway_time_to_first_token_seconds",
            "Request accepted to its first content: written to the "
            "client (stream=true) or received from the worker (stream=false, a JSON body).",
            TTFT_BUCKETS,
        )
        self.inter_token_latency = service.histogram(
            "weir_gateway_inter_token_latency_seconds",
            "Time between two contents of a generation, written (stream=true) or received (stream=false).",
            ITL_BUCKETS,
        )
        self.e2e_latency = service.histogram(
            "weir_gateway_e2e_request_latency_seconds",
            "Request accepted to its terminal, generations that reached one.",
            LATENCY_BUCKETS,
        )
        self.generation_tokens = service.counter(
            "weir_gateway_generation_tokens", "Completion tokens of the generations that finished, as billed."
        )
        self.gen_ai_token_usage = service.histogram(
            "gen_ai.client.token.usage", "Number of input and output tokens used.", GEN_AI_TOKEN_BUCKETS, unit="{token}"
        )
        self.gen_ai_duration = service.histogram(
            "gen_ai.client.operation.duration", "GenAI operation duration.", GEN_AI_DURATION_BUCKETS, unit="s"
        )

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
                        labels = {
                            "worker": hb.worker_id,
                            "device": str(index),
                            "kind": device.kind,
                            "name": device.name,
                        }
                        out.append(Observation(value, labels))
            return out

        return observe


class ResponseCounter:
    """ASGI middleware: counts every HTTP response by route template, status and code.

    Pure ASGI (not BaseHTTPMiddleware) so streaming responses and disconnect detection pass
    through untouched. A request that matched no route counts as route "unmatched". `code` is
    the OpenAI error code whoever refused the request left with `note_error_code` (the error
    handler, the request limits), "" for a response without an error body (a success, a 499),
    "internal_error" when no response started.
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
            code = scope.get("state", {}).get(ERROR_CODE_STATE, "" if status else "internal_error")
            self.metrics.requests.add(1, {"route": path, "status": str(status[0] if status else 500), "code": code})


class GenerationTimer:
    """Times one generation from the moment its request was accepted, as its client sees it.

    `on_content` after each content write of a streamed response, or as each delta with tokens of
    a JSON one (`is_streamed` False) arrives (the first gives the TTFT, the next ones the
    inter-token latency); `on_end` once, when the terminal is reached. `clock` (time.monotonic)
    is injectable so tests give known timings.
    """

    def __init__(
        self,
        metrics: GatewayMetrics,
        model_name: str,
        kind: str,
        started_s: float,
        clock: Callable[[], float] = time.monotonic,
        is_streamed: bool = True,
    ) -> None:
        self.metrics = metrics
        self.model_name = model_name
        self.operation = GEN_AI_OPERATION[kind]
        self._clock = clock
        self.started_s = started_s  # clock() when the request was accepted
        self._labels = {"model_name": model_name, "stream": "true" if is_streamed else "false"}
        self._last_write_s: float | None = None
        self.is_ended = False

    def on_content(self) -> None:
        now = self._clock()
        labels = self._labels
        if self._last_write_s is None:
            self.metrics.time_to_first_token.record(now - self.started_s, labels)
        else:
            self.metrics.inter_token_latency.record(now - self._last_write_s, labels)
        self._last_write_s = now

    def on_end(self, end: ReplyEnd, error_code: str | None) -> None:
        """The generation reached its terminal `end` (`error_code`: its error's, None when it finished)."""
        if self.is_ended:
            return
        self.is_ended = True
        elapsed_s = self._clock() - self.started_s
        m = self.metrics
        m.e2e_latency.record(elapsed_s, {"model_name": self.model_name})
        m.generation_tokens.add(end.usage.completion_tokens, {"model_name": self.model_name})
        common = {
            "gen_ai.operation.name": self.operation,
            "gen_ai.provider.name": GEN_AI_PROVIDER,
            "gen_ai.request.model": split_ref(self.model_name)[0],
            "gen_ai.response.model": self.model_name,
        }
        for token_type, n in (("input", end.usage.prompt_tokens), ("output", end.usage.completion_tokens)):
            m.gen_ai_token_usage.record(n, {**common, "gen_ai.token.type": token_type})
        m.gen_ai_duration.record(elapsed_s, common if error_code is None else {**common, "error.type": error_code})
