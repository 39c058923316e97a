"""The worker's vllm:* and gen_ai.server.* metrics against the real broker: batches in, the /metrics
totals equal to what the replies say (services/worker/kafka/serving_metrics.py), and the heartbeats'
prefix-cache counts and drain rate."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter

import httpx
import pytest

from schemas.codec import decode, decode_reply, encode
from schemas.messages import AuditEvent, Batch, ReplyEnd, WorkerHeartbeat
from schemas.topics import Topics
from services.worker.app import WorkerService
from services.worker.config import WorkerSettings
from services.worker.kafka.finish_rate import FinishRate
from tests.kafka_helpers import produce, read_until
from weir.kafka.admin import ensure_topics
from weir.metrics import value

from .factories import make_request

pytestmark = pytest.mark.kafka
from tests.conftest import BOOTSTRAP  # noqa: E402 - WEIR_KAFKA_BOOTSTRAP, else 127.0.0.1:9092

SHARED = "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n"
V = {"model_name": "tiny@1"}


def ends_of(records) -> dict[str, ReplyEnd]:
    return {e.request_id: e for e in (decode_reply(r.value) for r in records) if isinstance(e, ReplyEnd)}


async def serve(topics: Topics, batch_id: str, requests: list, replies: str) -> dict[str, ReplyEnd]:
    batch = Batch(batch_id=batch_id, model="tiny@1", requests=requests, batcher_id="test")
    await produce(BOOTSTRAP, topics.batches("tiny@1"), [(batch_id, encode(batch))])
    want = {r.request_id for r in requests}
    return ends_of(await read_until(BOOTSTRAP, [replies], lambda rs: want <= set(ends_of(rs)), 90))


async def test_metrics_count_what_the_replies_say_and_a_shared_prompt_hits_the_prefix_cache(tmp_path, llama_dir):
    topics = Topics(f"t{uuid.uuid4().hex[:8]}")
    repo = tmp_path / "models.toml"
    repo.write_text(f'[models.tiny]\npath = "{llama_dir}"\nmax_model_len = 128\nwarmup = ["def "]\n')
    settings = WorkerSettings(
        kafka_bootstrap=BOOTSTRAP,
        topic_prefix=topics.prefix,
        model_repo=str(repo),
        heartbeat_interval_ms=200,
        audit_fingerprint_model="",
    )
    replies = topics.replies("test")
    await ensure_topics(BOOTSTRAP, [*topics.core_specs(), topics.reply_spec("test")])
    service = WorkerService(settings)
    service.finish_rate = FinishRate(min_busy_s=0.0)  # a rate from its first busy heartbeat on
    task = asyncio.create_task(service.serve())
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=service.http_app()), base_url="http://worker")
    try:
        await read_until(
            BOOTSTRAP, [topics.workers], lambda rs: any(decode(WorkerHeartbeat, r.value).is_ready for r in rs), 120
        )
        first = make_request(SHARED + "a", model="tiny", reply_to=replies, max_tokens=5)
        others = [make_request("def add(a, b):", model="tiny", reply_to=replies, max_tokens=n) for n in (1, 6)]
        ends = await serve(topics, "b1", [first, *others], replies)
        again = make_request(SHARED + "b", model="tiny", reply_to=replies, max_tokens=4)
        ends |= await serve(topics, "b2", [again], replies)  # after `first` ended: its prompt's blocks are cached
        n = len(ends)
        assert n == 4 and all(e.error is None for e in ends.values())

        text = (await http.get("/metrics")).text
        for reason, count in Counter(e.finish_reason for e in ends.values()).items():
            assert value(text, "vllm:request_success_total", finished_reason=reason, **V) == count
        assert value(text, "vllm:prompt_tokens_total", **V) == sum(e.usage.prompt_tokens for e in ends.values())
        assert value(text, "vllm:generation_tokens_total", **V) == sum(e.usage.completion_tokens for e in ends.values())
        for name in (
            "time_to_first_token_seconds",
            "e2e_request_latency_seconds",
            "request_queue_time_seconds",
            "request_prefill_time_seconds",
            "request_decode_time_seconds",
            "request_prompt_tokens",
            "request_generation_tokens",
        ):
            assert value(text, f"vllm:{name}_count", **V) == n, name
        tokens_after_first = sum(max(0, e.usage.completion_tokens - 1) for e in ends.values())
        assert value(text, "vllm:inter_token_latency_seconds_count", **V) == tokens_after_first
        genai = {
            "gen_ai_operation_name": "text_completion",
            "gen_ai_provider_name": "weir",
            "gen_ai_request_model": "tiny",
            "gen_ai_response_model": "tiny@1",
        }
        assert value(text, "gen_ai_server_request_duration_seconds_count", **genai) == n
        assert value(text, "gen_ai_server_time_to_first_token_seconds_count", **genai) == n
        assert value(text, "vllm:num_requests_running", **V) is not None
        assert value(text, "vllm:num_requests_waiting", **V) is not None
        assert 0 <= value(text, "vllm:kv_cache_usage_perc", **V) <= 1

        # The second request with the shared prompt found its full blocks cached: its usage says
        # how many tokens, and the worker's prefix-cache hits are exactly those.
        assert ends[first.request_id].usage.cached_prompt_tokens == 0
        cached = ends[again.request_id].usage.cached_prompt_tokens
        assert 0 < cached < ends[again.request_id].usage.prompt_tokens
        assert value(text, "vllm:prefix_cache_hits_total", **V) == sum(
            e.usage.cached_prompt_tokens for e in ends.values()
        )
        assert value(text, "vllm:prefix_cache_queries_total", **V) >= sum(e.usage.prompt_tokens for e in ends.values())
        audit = await read_until(BOOTSTRAP, [topics.audit], lambda rs: len(rs) >= n, 30)
        by_id = {e.request_id: e for e in (decode(AuditEvent, r.value) for r in audit)}
        assert (
            by_id[again.request_id].cached_prompt_tokens == cached and by_id[first.request_id].cached_prompt_tokens == 0
        )

        mean_e2e_s = value(text, "vllm:e2e_request_latency_seconds_sum", **V) / n

        def counted(hb: WorkerHeartbeat) -> bool:
            # finished_per_s: the requests ended are in the heartbeats' drain rate (finish_rate.py), and
            # service_s their mean time running: within their mean time from receipt (weights differ by < 1 %)
            rate, service_s = hb.finished_per_s, hb.service_s
            # latency: the version's TTFT and inter-token counts, as its vllm: histograms have them (the dashboard's)
            latency = hb.latency.get("tiny@1")
            return (
                hb.prefix_cache_hits == cached
                and hb.kv_cache_usage_perc is not None
                and rate is not None
                and rate > 0
                and service_s is not None
                and 0 < service_s <= mean_e2e_s * 1.01
                and latency is not None
                and latency.ttft.counts[-1] == n
                and latency.itl.counts[-1] == tokens_after_first
            )

        beats = await read_until(
            BOOTSTRAP, [topics.workers], lambda rs: any(counted(decode(WorkerHeartbeat, r.value)) for r in rs)
        )
        assert any(counted(decode(WorkerHeartbeat, r.value)) for r in beats)
    finally:
        await http.aclose()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
