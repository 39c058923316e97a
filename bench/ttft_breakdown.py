"""Where the Kafka path's time to first token goes, hop by hop, from what the run left in Kafka.

Every record carries its producer's CreateTime (epoch ms, taken at send()), and each ReplyEnd
says when the engine took the request (received_ms). Joined by request_id with the client's own
wall-clock times, they split one request's TTFT into the gateway, each Kafka hop with the service
that consumes it, and the engine. Resolution is 1 ms per timestamp, so the figures are means over
many requests (a rounding error of up to 1 ms per hop averages out; a single request's do not).
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass

import orjson
from aiokafka import AIOKafkaConsumer, TopicPartition

from bench.stats import percentile
from weir.bus import partitions_of

HOPS = (
    "client -> request accepted (gateway: HTTP, parsing, auth)",
    "accepted -> request produced (gateway: limits, guards, admission)",
    "request -> batch produced (Kafka hop, batcher)",
    "batch -> engine has it (Kafka hop, worker, pipe to the engine process)",
    "engine has it -> first delta produced (prefill step, pipe back, worker)",
    "first delta -> client has it (Kafka hop, gateway, SSE)",
)


@dataclass
class ClientMark:
    """One streamed request as the client saw it, in wall-clock epoch ms."""

    request_id: str
    sent_ms: float
    first_text_ms: float


async def read_stamps(bootstrap: str, topic_names: list[str]) -> dict[str, dict[str, float]]:
    """{request_id: {"accepted", "request", "batch", "delta", "received"}: ms} from the topics' records
    ("accepted": the GenerateRequest's created_ms, which the gateway sets once the body is parsed)."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    stamps: dict[str, dict[str, float]] = {}
    try:
        tps = [TopicPartition(t, p) for t in topic_names for p in sorted(await partitions_of(consumer, t))]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        while [tp for tp in tps if await consumer.position(tp) < ends[tp]]:
            for records in (await consumer.getmany(timeout_ms=1000)).values():
                for record in records:
                    _take(orjson.loads(record.value), record.timestamp, stamps)
    finally:
        await consumer.stop()
    return stamps


def _take(value: dict, timestamp_ms: int, stamps: dict[str, dict[str, float]]) -> None:
    if "requests" in value and "batch_id" in value:  # a Batch
        for request in value["requests"]:
            stamps.setdefault(request["request_id"], {}).setdefault("batch", timestamp_ms)
        return
    request_id = value.get("request_id")
    if not isinstance(request_id, str):
        return
    mine = stamps.setdefault(request_id, {})
    if "reply_to" in value and "max_tokens" in value:  # a GenerateRequest
        mine.setdefault("request", timestamp_ms)
        if isinstance(value.get("created_ms"), int):
            mine.setdefault("accepted", value["created_ms"])
    elif "finish_reason" in value:  # the ReplyEnd
        if value.get("received_ms"):
            mine["received"] = value["received_ms"]
    elif value.get("text"):  # the first delta with text: what the client shows first
        mine.setdefault("delta", timestamp_ms)


def hop_rows(marks: list[ClientMark], stamps: dict[str, dict[str, float]]) -> tuple[list[list[str]], int]:
    """Table rows (hop, mean ms, p50 ms) and how many requests had every timestamp."""
    spans: list[list[float]] = [[] for _ in HOPS]
    for mark in marks:
        s = stamps.get(mark.request_id, {})
        if not all(k in s for k in ("accepted", "request", "batch", "received", "delta")):
            continue
        points = [mark.sent_ms, s["accepted"], s["request"], s["batch"], s["received"], s["delta"], mark.first_text_ms]
        for i, (start, end) in enumerate(itertools.pairwise(points)):
            spans[i].append(end - start)
    rows = [
        [hop, f"{statistics.mean(v):.1f}", f"{percentile(v, 50):.1f}"] for hop, v in zip(HOPS, spans, strict=True) if v
    ]
    num = len(spans[0])
    if num:
        total = [sum(hop[i] for hop in spans) for i in range(num)]
        rows.append(["total (client TTFT)", f"{statistics.mean(total):.1f}", f"{percentile(total, 50):.1f}"])
    return rows, num
