"""Metrics of one service: OpenTelemetry SDK instruments, exported by OpenTelemetry's Prometheus
exporter at /metrics (no hand-written exposition text).

Each service holds one `ServiceMetrics`: its own MeterProvider (not the global one, so tests can
build several apps in one process) with a PrometheusMetricReader on its own CollectorRegistry; a
scrape renders that registry (prometheus_client's text format, CONTENT_TYPE).

Names tools already read (docs/design.md, "Observability"): vLLM's `vllm:*` names are not valid
OpenTelemetry instrument names (no ':'), so an instrument is created as `vllm.<rest>` and a View
renames it to `vllm:<rest>` (VLLM_NAMES lists them). Counters get Prometheus' `_total` suffix, as
vLLM's do. The OpenTelemetry GenAI names (`gen_ai.server.time_to_first_token`, ...) are used as
they are; the exporter writes them with '_' and a unit suffix (`gen_ai_server_time_to_first_token_seconds`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import CallbackOptions, Counter, Histogram, Meter, Observation, UpDownCounter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.view import View
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

CONTENT_TYPE = CONTENT_TYPE_LATEST  # what /metrics answers with (text/plain; version=0.0.4 or 1.0.0)

Observe = Callable[[CallbackOptions], Iterable[Observation]]
Labels = dict[str, str]

# vLLM's metric names (vllm/v1/metrics/loggers.py), same meanings, label `model_name`.
VLLM_NAMES = (
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "request_prefill_time_seconds",
    "request_decode_time_seconds",
    "request_prompt_tokens",
    "request_generation_tokens",
    "num_requests_running",
    "num_requests_waiting",
    "kv_cache_usage_perc",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "num_preemptions",
    "prompt_tokens",
    "generation_tokens",
    "request_success",
)

# vLLM's histogram buckets, so a Grafana board made for vLLM reads ours the same.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
COUNT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # batch sizes
FRACTION_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


def vllm(name: str) -> str:
    """The instrument name for vLLM's `vllm:<name>` (see the module docstring)."""
    if name not in VLLM_NAMES:
        raise ValueError(f"vllm:{name} is not one of vLLM's names this project exports (weir/metrics.py VLLM_NAMES)")
    return f"vllm.{name}"


class ServiceMetrics:
    """A MeterProvider of one service and its Prometheus exposition."""

    def __init__(self, service: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.reader = PrometheusMetricReader(disable_target_info=True, scope_info_enabled=False, registry=self.registry)
        views = [View(instrument_name=f"vllm.{name}", name=f"vllm:{name}") for name in VLLM_NAMES]
        self.provider = MeterProvider(metric_readers=[self.reader], views=views)
        self.meter: Meter = self.provider.get_meter(f"weir.{service}")

    def gauge(self, name: str, description: str, observe: Callable[[], Iterable[tuple[float, Labels]]]) -> None:
        """An observable gauge read at scrape time from `observe()`: (value, labels) pairs."""

        def callback(_: CallbackOptions) -> Iterable[Observation]:
            return [Observation(value, labels) for value, labels in observe()]

        self.meter.create_observable_gauge(name, callbacks=[callback], description=description)

    def counter(self, name: str, description: str, unit: str = "") -> Counter:
        return self.meter.create_counter(name, unit=unit, description=description)

    def up_down(self, name: str, description: str, unit: str = "") -> UpDownCounter:
        return self.meter.create_up_down_counter(name, unit=unit, description=description)

    def histogram(self, name: str, description: str, buckets: Sequence[float], unit: str = "") -> Histogram:
        """A histogram with explicit bucket bounds (the SDK's default bounds suit milliseconds, not seconds)."""
        return self.meter.create_histogram(
            name, unit=unit, description=description, explicit_bucket_boundaries_advisory=list(buckets)
        )

    def render(self) -> str:
        """Collect every instrument and render the Prometheus text exposition format."""
        return generate_latest(self.registry).decode()

    def shutdown(self) -> None:
        self.provider.shutdown()


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Parse exposition text into {(sample name, labels): value}: for tests, the dashboard and the bench."""
    out: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = float(sample.value)
    return out


def value(text: str, name: str, **labels: str) -> float | None:
    """One sample's value from exposition text (None: absent); labels must match exactly."""
    return samples(text).get((name, frozenset(labels.items())))


MAX_TENANTS = 50  # tenants named in labels; the rest are "other"
MAX_COUNTED = 10_000  # tenants whose requests are counted; one seen after that is "other" for good
OTHER = "other"


class TenantLabels:
    """A bounded tenant label: the tenant while among the `max_named` with most requests seen so
    far, else "other". Tenant names come from requests anyone may produce (in plaintext mode), so
    every metric labelled by tenant goes through one of these: a forged stream of names costs a
    few series, not one each (the batcher's queues, the auditor's counts)."""

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
