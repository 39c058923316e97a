"""Metrics of one service: OpenTelemetry SDK instruments, scraped as Prometheus text at /metrics.

Each service holds one `ServiceMetrics`: its own MeterProvider (not the global one, so tests can
build several apps in one process) with an in-memory pull reader; a scrape collects it and
renders the text exposition format (CONTENT_TYPE).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

from opentelemetry.metrics import CallbackOptions, Meter, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import Gauge, InMemoryMetricReader, Sum

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # what /metrics answers with

Observe = Callable[[CallbackOptions], Iterable[Observation]]


class ServiceMetrics:
    """A MeterProvider of one service and its Prometheus rendering."""

    def __init__(self, service: str) -> None:
        self.reader = InMemoryMetricReader()
        self.provider = MeterProvider(metric_readers=[self.reader])
        self.meter: Meter = self.provider.get_meter(f"weir.{service}")

    def gauge(self, name: str, description: str, observe: Callable[[], Iterable[tuple[float, dict[str, str]]]]) -> None:
        """An observable gauge read at scrape time from `observe()`: (value, labels) pairs."""

        def callback(_: CallbackOptions) -> Iterable[Observation]:
            return [Observation(value, labels) for value, labels in observe()]

        self.meter.create_observable_gauge(name, callbacks=[callback], description=description)

    def render(self) -> str:
        """Collect every instrument and render the Prometheus text exposition format."""
        lines: list[str] = []
        data = self.reader.get_metrics_data()
        for resource_metrics in data.resource_metrics if data else []:
            for scope_metrics in resource_metrics.scope_metrics:
                for metric in scope_metrics.metrics:
                    lines.extend(render_metric(metric.name, metric.description or "", metric.data))
        return "\n".join(lines) + "\n"

    def shutdown(self) -> None:
        self.provider.shutdown()


def render_metric(name: str, description: str, data: Any) -> list[str]:
    """The exposition lines of one collected metric (counters, up-down counters and gauges)."""
    if isinstance(data, Sum):
        kind = "counter" if data.is_monotonic else "gauge"
        sample = f"{name}_total" if data.is_monotonic else name
    elif isinstance(data, Gauge):
        kind, sample = "gauge", name
    else:  # histograms are not used yet
        return []
    lines = [f"# HELP {sample} {_escape_help(description)}", f"# TYPE {sample} {kind}"]
    for point in data.data_points:
        lines.append(f"{sample}{_labels(point.attributes or {})} {_number(point.value)}")
    return lines


def _labels(attributes: Any) -> str:
    if not attributes:
        return ""
    parts = [f'{key}="{_escape_label(str(value))}"' for key, value in sorted(attributes.items())]
    return "{" + ",".join(parts) + "}"


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n")


def _number(value: float) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        if math.isinf(value):
            return "+Inf" if value > 0 else "-Inf"
        return repr(value)
    return str(value)
