"""The worker's serving metrics per model version: vLLM's `vllm:*` with vLLM's names, meanings
and buckets (vllm/v1/metrics/loggers.py; label `model_name` = the served name@version), and the
OpenTelemetry GenAI server metrics beside them (docs/design.md, "Observability").

Structured outputs (docs/design.md, "Structured output, tools and logprobs": the output SLA) are
counted per version as `weir_structured_outputs_total{model_name, result}`, once per request: when
its run's writes are durable (Publisher.settle), so a run redone after a failed write counts once.

The times are the engine's (services/worker/engine: received, first scheduled, first token, each
later token, finished; ms of the engine's clock), carried on its outputs and recorded on the event
loop as the publisher takes each output (Recorder). What an engine counts itself (requests running
and waiting, KV-cache usage, prefix-cache lookups, preemptions) is read from its stats at scrape
time: the engine may run in a child process, where no instrument of the worker's can be reached.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable
from typing import Literal

from opentelemetry.metrics import CallbackOptions, Observation

from schemas.messages import EmbedRequest, GenerateRequest, LatencyHistogram, VersionLatency
from schemas.model_repo import ModelConfig
from services.worker.engine import EngineOutput
from weir.metrics import ITL_BUCKETS, LATENCY_BUCKETS, TOKEN_BUCKETS, TTFT_BUCKETS, ServiceMetrics, vllm

# The advisory buckets of gen_ai.server.request.duration (OpenTelemetry GenAI semantic conventions);
# its TTFT and time-per-output-token advisories are within TTFT_BUCKETS and ITL_BUCKETS.
GENAI_DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)

# vLLM's finished_reason for a request its client ended; the reasons vLLM lacks keep Weir's name
# (timeout, rejected, error), so no ending is folded into another.
_VLLM_REASONS = {"cancelled": "abort"}
_SUCCESSFUL = ("stop", "length")  # GenAI's TTFT and time per output token are of successful responses

StructuredResult = Literal["valid", "invalid", "truncated"]

EngineStats = Callable[[], Iterable[tuple[str, list[dict[str, float]]]]]  # (name@version, its engines' stats)


def kv_cache_usage(stats: Iterable[dict[str, float]]) -> float | None:
    """Share of KV-cache blocks in use over engines that have a KV cache (None: none has one)."""
    used = total = 0.0
    for s in stats:
        if "kv_cache_usage_perc" in s:
            used += s["kv_cache_usage_perc"] * s["num_kv_blocks"]
            total += s["num_kv_blocks"]
    return min(1.0, used / total) if total else None  # the rounding of the weighted sum stays within 0..1


def operation(request: GenerateRequest | EmbedRequest) -> str:
    """gen_ai.operation.name of a request."""
    if isinstance(request, EmbedRequest):
        return "embeddings"
    return "chat" if request.messages is not None else "text_completion"


def is_constrained(request: GenerateRequest | EmbedRequest) -> bool:
    """The request's output is constrained by a token mask: a structured spec, or tool_choice
    required or a named function (docs/design.md, "Structured output, tools and logprobs")."""
    if isinstance(request, EmbedRequest):
        return False
    return request.structured is not None or (request.calls_tools and request.tool_choice not in (None, "auto"))


def structured_result(request: GenerateRequest | EmbedRequest, out: EngineOutput) -> StructuredResult | None:
    """How a constrained request's final output counts: `truncated` when it ran out of max_tokens
    (never claimed valid), else on `stop` the worker's check (structured_valid). None: not counted
    (unconstrained, another ending, or a stop the engine did not check)."""
    if not is_constrained(request):
        return None
    if out.finish_reason == "length":
        return "truncated"
    if out.finish_reason == "stop" and out.structured_valid is not None:
        return "valid" if out.structured_valid else "invalid"
    return None


class ServingMetrics:
    """The instruments, made once per worker on its ServiceMetrics; `engine_stats` lists each served
    version's engines' last stats (read at scrape time)."""

    def __init__(
        self, metrics: ServiceMetrics, engine_stats: EngineStats, on_ran: Callable[[float], None] | None = None
    ) -> None:
        """`on_ran`: called with the seconds each request that ran took, first scheduled (or, on an
        engine that runs every request at once, received) to its end: the heartbeat's service
        time (finish_rate.py)."""
        self.on_ran = on_ran
        h = metrics.histogram
        self.ttft = h(
            vllm("time_to_first_token_seconds"),
            "Time from the worker's receipt of a request to its first token.",
            TTFT_BUCKETS,
        )
        self.itl = h(vllm("inter_token_latency_seconds"), "Time between consecutive output tokens.", ITL_BUCKETS)
        self.e2e = h(vllm("e2e_request_latency_seconds"), "Time from receipt to the end of a request.", LATENCY_BUCKETS)
        self.queue = h(
            vllm("request_queue_time_seconds"),
            "Time a request waited before the scheduler first ran it.",
            LATENCY_BUCKETS,
        )
        self.prefill = h(
            vllm("request_prefill_time_seconds"), "Time from first scheduled to the first token.", LATENCY_BUCKETS
        )
        self.decode = h(vllm("request_decode_time_seconds"), "Time from the first token to the end.", LATENCY_BUCKETS)
        self.prompt_hist = h(vllm("request_prompt_tokens"), "Prompt tokens of each finished request.", TOKEN_BUCKETS)
        self.generation_hist = h(
            vllm("request_generation_tokens"), "Generated tokens of each finished request.", TOKEN_BUCKETS
        )
        self.prompt_tokens = metrics.counter(vllm("prompt_tokens"), "Prompt tokens of finished requests.")
        self.generation_tokens = metrics.counter(vllm("generation_tokens"), "Generated tokens of finished requests.")
        self.success = metrics.counter(vllm("request_success"), "Finished requests, by finished_reason.")
        self.genai_ttft = h(
            "gen_ai.server.time_to_first_token",
            "Time to generate first token for successful responses.",
            TTFT_BUCKETS,
            unit="s",
        )
        self.genai_tpot = h(
            "gen_ai.server.time_per_output_token",
            "Time per output token generated after the first token for successful responses.",
            ITL_BUCKETS,
            unit="s",
        )
        self.genai_duration = h(
            "gen_ai.server.request.duration",
            "Generative AI server request duration, to the last output token.",
            GENAI_DURATION_BUCKETS,
            unit="s",
        )
        self.structured = metrics.counter(
            "weir_structured_outputs",
            "Constrained outputs by result: valid or invalid "
            "(ended stop, checked against the constraint), truncated (ended length).",
        )
        self._engine_stats = engine_stats
        for name, stat, text in (
            ("num_requests_running", "num_running", "Requests in the engines' running batch."),
            ("num_requests_waiting", "num_waiting", "Requests waiting to be scheduled."),
        ):
            metrics.gauge(vllm(name), text, self._summed(stat))
        metrics.gauge(vllm("kv_cache_usage_perc"), "KV-cache usage: 1 means fully used.", self._kv_usage)
        for name, stat, text in (
            ("prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
            ("prefix_cache_hits", "prefix_cache_hits", "Of those, tokens found in the prefix cache."),
            ("num_preemptions", "num_preemptions", "Preemptions of requests by the scheduler."),
        ):
            metrics.meter.create_observable_counter(vllm(name), callbacks=[self._observed(stat)], description=text)

    def recorder(self, config: ModelConfig) -> Recorder:
        return Recorder(self, config)

    def _summed(self, stat: str) -> Callable[[], list[tuple[float, dict[str, str]]]]:
        def observe() -> list[tuple[float, dict[str, str]]]:
            return [
                (sum(s.get(stat, 0) for s in stats), {"model_name": served_id})
                for served_id, stats in self._engine_stats()
            ]

        return observe

    def _observed(self, stat: str) -> Callable[[CallbackOptions], list[Observation]]:
        def callback(_: CallbackOptions) -> list[Observation]:
            return [Observation(value, labels) for value, labels in self._summed(stat)()]

        return callback

    def _kv_usage(self) -> list[tuple[float, dict[str, str]]]:
        usage = ((kv_cache_usage(stats), served_id) for served_id, stats in self._engine_stats())
        return [
            (u, {"model_name": served_id}) for u, served_id in usage if u is not None
        ]  # echo, embeddings: no KV cache


class Counts:
    """A histogram's counts kept beside the instrument, for the heartbeat (the instrument's own
    are read only by a scrape): the same bounds, one count per bucket and +Inf."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self._counts = [0] * (len(bounds) + 1)

    def add(self, seconds: float) -> None:
        self._counts[bisect_left(self.bounds, seconds)] += 1  # le: a value on a bound is in that bucket

    def histogram(self) -> LatencyHistogram:
        total, cumulative = 0, []
        for count in self._counts:
            total += count
            cumulative.append(total)
        return LatencyHistogram(bounds=list(self.bounds), counts=cumulative)


class Recorder:
    """Records the outputs of one version's requests as the publisher takes them."""

    def __init__(self, metrics: ServingMetrics, config: ModelConfig) -> None:
        self.m = metrics
        self.labels = {"model_name": config.served_id}  # one dict for every record: no allocation per token
        self.genai = {
            "gen_ai.provider.name": "weir",
            "gen_ai.request.model": config.name,
            "gen_ai.response.model": config.served_id,
        }
        self.ttft_counts, self.itl_counts = Counts(TTFT_BUCKETS), Counts(ITL_BUCKETS)

    def latency(self) -> VersionLatency:
        """This version's TTFT and inter-token histograms since it was loaded (the heartbeat's)."""
        return VersionLatency(ttft=self.ttft_counts.histogram(), itl=self.itl_counts.histogram())

    def on_output(self, request: GenerateRequest | EmbedRequest, out: EngineOutput) -> None:
        """An output of a run being written: its inter-token gaps, and on the final one the request."""
        if out.itl_ms:
            record, labels, count = self.m.itl.record, self.labels, self.itl_counts.add
            for gap_ms in out.itl_ms:
                record(gap_ms / 1000, labels)
                count(gap_ms / 1000)
        if out.finish_reason is not None:
            self.finished(request, out)

    def settled(self, request: GenerateRequest | EmbedRequest, out: EngineOutput) -> None:
        """A request's end is durable (Publisher.settle): count a constrained one's result once."""
        result = structured_result(request, out)
        if result is not None:
            self.m.structured.add(1, {**self.labels, "result": result})

    def finished(self, request: GenerateRequest | EmbedRequest, out: EngineOutput) -> None:
        """A request's end: vLLM's per-request histograms and counters, and the GenAI ones. A request
        refused before it ran counts in request_success only (vLLM never sees such a request)."""
        m, labels, reason = self.m, self.labels, out.finish_reason or ""
        m.success.add(1, {**labels, "finished_reason": _VLLM_REASONS.get(reason, reason)})
        if reason == "rejected":
            return
        m.prompt_tokens.add(out.prompt_tokens, labels)
        m.generation_tokens.add(out.completion_tokens, labels)
        m.prompt_hist.record(out.prompt_tokens, labels)
        m.generation_hist.record(out.completion_tokens, labels)
        received, scheduled, first, end = out.received_ms, out.scheduled_ms, out.first_token_ms, out.finished_ms
        genai = {**self.genai, "gen_ai.operation.name": operation(request)}
        if out.error is not None and reason not in _SUCCESSFUL:
            genai["error.type"] = out.error.code
        if received is not None and end is not None:
            m.e2e.record((end - received) / 1000, labels)
            m.genai_duration.record((end - received) / 1000, genai)
            if m.on_ran is not None and request.shadow_of is None:  # a mirror copy yields to live work: not its pace
                m.on_ran((end - (received if scheduled is None else scheduled)) / 1000)
        if scheduled is not None and received is not None:
            m.queue.record((scheduled - received) / 1000, labels)
            if first is not None:
                m.prefill.record((first - scheduled) / 1000, labels)
        if first is None or received is None:
            return
        m.ttft.record((first - received) / 1000, labels)
        self.ttft_counts.add((first - received) / 1000)
        if end is not None:
            m.decode.record((end - first) / 1000, labels)
        if reason in _SUCCESSFUL:
            m.genai_ttft.record((first - received) / 1000, genai)
            if end is not None and out.completion_tokens > 1:
                m.genai_tpot.record((end - first) / 1000 / (out.completion_tokens - 1), genai)
