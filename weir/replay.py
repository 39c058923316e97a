"""`weir replay`: run recorded requests again on another model (or version) and diff the outputs.

    weir replay --since 2026-11-30T12:00:00Z --until 2026-11-30T13:00:00Z --model OTHER [--out diff.jsonl]
    weir replay --job batch_<id> --model OTHER [--out diff.jsonl]

The recorded requests are the GenerateRequests on `<prefix>.requests` whose record timestamps fall
in [since, until) (found with offsets_for_times), or, with --job, those of one batch job (request
ids `<job_id>.<hash>`). Each runs again under a new request id, with the same prompt, sampling
parameters and effective seed, in the bulk lane, answered on a private reply topic. The original
outputs are read from the original reply topics while they are retained. Writes one JSONL line per
request (request_id, prompt_sha256, original and new text and finish reason, is_equal) and a
final summary line. Exit status 0, or 2 when Kafka is unusable.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import sys
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
from aiokafka import AIOKafkaConsumer, TopicPartition

from schemas.codec import DecodeError, decode_reply, decode_request, encode
from schemas.messages import GenerateRequest, ReplyEnd, now_ms
from schemas.reply_stream import ReplyCursor
from weir.bus import BusSettings, make_consumer, make_producer, partitions_of
from weir.kafka.admin import ensure_topics


@dataclass
class Outcome:
    """What a reply topic said about one request: its text and terminal event (first wins)."""

    text: list[str] = field(default_factory=list)
    cursor: ReplyCursor = field(default_factory=ReplyCursor)  # the positions kept (a repeat's are dropped)
    end: ReplyEnd | None = None

    def add(self, event: Any) -> None:
        part = self.cursor.take(event)
        if isinstance(part, ReplyEnd):
            self.end = part
        elif part is not None:
            self.text.append(part.text)


def parse_time_ms(text: str) -> int:
    """Epoch ms of an ISO 8601 time (naive means UTC), or of an integer epoch-ms string."""
    if text.isdigit():
        return int(text)
    moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return int(moment.timestamp() * 1000)


def prompt_text(request: GenerateRequest) -> str:
    """The prompt (token ids as their numbers), or the chat turns as role: content lines."""
    if request.prompt is not None:
        return request.prompt
    if request.prompt_token_ids is not None:
        return " ".join(map(str, request.prompt_token_ids))
    return "\n".join(f"{m.role}: {m.content}" for m in request.messages or [])


async def _window(
    consumer: AIOKafkaConsumer, topic: str, since_ms: int, until_ms: int
) -> dict[TopicPartition, tuple[int, int]]:
    """Per partition of `topic`: [first offset at or after since, first offset at or after until)."""
    tps = [TopicPartition(topic, p) for p in sorted(await partitions_of(consumer, topic))]
    starts = await consumer.offsets_for_times(dict.fromkeys(tps, since_ms))
    stops = await consumer.offsets_for_times(dict.fromkeys(tps, until_ms))
    ends = await consumer.end_offsets(tps)
    spans = {}
    for tp in tps:
        start = starts.get(tp)
        if start is None:
            continue
        stop = stops.get(tp)
        spans[tp] = (start.offset, stop.offset if stop is not None else ends[tp])
    return {tp: span for tp, span in spans.items() if span[0] < span[1]}


async def _read_spans(consumer: AIOKafkaConsumer, spans: dict[TopicPartition, tuple[int, int]]) -> list[Any]:
    """Every record of the given offset spans."""
    if not spans:
        return []
    consumer.assign(list(spans))
    for tp, (start, _stop) in spans.items():
        consumer.seek(tp, start)
    records: list[Any] = []
    remaining = dict(spans)
    while remaining:
        fetched = await consumer.getmany(*remaining, timeout_ms=500, max_records=5000)
        for tp, batch in fetched.items():
            records.extend(r for r in batch if r.offset < spans[tp][1])
        for tp in list(remaining):
            if await consumer.position(tp) >= spans[tp][1]:
                del remaining[tp]
    return records


async def recorded_requests(
    settings: BusSettings, since_ms: int, until_ms: int, job_id: str | None
) -> list[GenerateRequest]:
    """The GenerateRequests recorded in the window (of one job, with job_id), first copy of each id."""
    consumer = make_consumer(settings, client_id=f"replay-{uuid.uuid4().hex[:8]}", group_id=None)
    await consumer.start()
    try:
        spans = await _window(consumer, settings.topics.requests, since_ms, until_ms)
        seen: dict[str, GenerateRequest] = {}
        for record in await _read_spans(consumer, spans):
            try:
                request = decode_request(record.value)
            except DecodeError:
                continue
            if not isinstance(request, GenerateRequest) or request.request_id in seen:
                continue
            if job_id is not None and not request.request_id.startswith(f"{job_id}."):
                continue
            seen[request.request_id] = request
        return sorted(seen.values(), key=lambda r: (r.created_ms, r.request_id))
    finally:
        await consumer.stop()


async def original_outcomes(
    settings: BusSettings, requests: list[GenerateRequest], since_ms: int
) -> dict[str, Outcome]:
    """What the original reply topics still hold about `requests`."""
    wanted = {r.request_id for r in requests}
    outcomes: dict[str, Outcome] = {}
    consumer = make_consumer(settings, client_id=f"replay-{uuid.uuid4().hex[:8]}", group_id=None)
    await consumer.start()
    try:
        for topic in sorted({r.reply_to for r in requests}):
            try:
                spans = await _window(consumer, topic, since_ms, now_ms() + 60_000)
            except RuntimeError:  # the topic is gone
                continue
            for record in await _read_spans(consumer, spans):
                try:
                    event = decode_reply(record.value)
                except DecodeError:
                    continue
                if event.request_id in wanted:
                    outcomes.setdefault(event.request_id, Outcome()).add(event)
    finally:
        await consumer.stop()
    return outcomes


async def rerun(
    settings: BusSettings, requests: list[GenerateRequest], model: str, timeout_s: float
) -> dict[str, Outcome]:
    """Run each request again on `model`; returns outcomes by the *original* request id."""
    run = uuid.uuid4().hex[:10]
    topics = settings.topics
    reply_to = topics.replies(f"replay-{run}")
    await ensure_topics(settings.kafka_bootstrap, [topics.reply_spec(f"replay-{run}")])
    by_new: dict[str, str] = {}
    producer = make_producer(settings, client_id=f"replay-{run}", linger_ms=5)
    consumer = make_consumer(settings, client_id=f"replay-{run}", group_id=None)
    await producer.start()
    await consumer.start()
    outcomes: dict[str, Outcome] = {}
    try:
        tp = TopicPartition(reply_to, 0)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        deadline_ms = now_ms() + int(timeout_s * 1000)
        sends = []
        for request in requests:
            new_id = f"rp-{run}-{hashlib.sha256(request.request_id.encode()).hexdigest()[:24]}"
            by_new[new_id] = request.request_id
            again = request.model_copy(
                update={
                    "request_id": new_id,
                    "model": model,
                    "reply_to": reply_to,
                    "seed": request.effective_seed,
                    "deadline_ms": deadline_ms,
                    "created_ms": now_ms(),
                    "priority": "bulk",
                }
            )
            sends.append(await producer.send(topics.requests, encode(again), key=new_id.encode()))
        await asyncio.gather(*sends)
        stop_at = time.monotonic() + timeout_s + 5
        while time.monotonic() < stop_at and sum(o.end is not None for o in outcomes.values()) < len(requests):
            for records in (await consumer.getmany(timeout_ms=200, max_records=5000)).values():
                for record in records:
                    try:
                        event = decode_reply(record.value)
                    except DecodeError:
                        continue
                    if event.request_id in by_new:
                        outcomes.setdefault(by_new[event.request_id], Outcome()).add(event)
    finally:
        await consumer.stop()
        await producer.stop()
    return outcomes


def diff_rows(
    requests: list[GenerateRequest],
    before: dict[str, Outcome],
    after: dict[str, Outcome],
    model: str,
    with_prompts: bool,
) -> list[dict[str, Any]]:
    """One row per request, then the summary row."""
    rows: list[dict[str, Any]] = []
    for request in requests:
        old, new = before.get(request.request_id), after.get(request.request_id)
        old_text = "".join(old.text) if old and old.end else None
        new_text = "".join(new.text) if new and new.end else None
        prompt = prompt_text(request)
        row: dict[str, Any] = {
            "request_id": request.request_id,
            "prompt_sha256": hashlib.sha256(prompt.encode()).hexdigest(),
            "original_model": request.model,
            "new_model": model,
            "original_text": old_text,
            "original_finish_reason": old.end.finish_reason if old and old.end else None,
            "new_text": new_text,
            "new_finish_reason": new.end.finish_reason if new and new.end else None,
            "is_equal": old_text is not None and old_text == new_text,
        }
        if with_prompts:
            row["prompt"] = prompt
        rows.append(row)
    rows.append(
        {
            "summary": True,
            "new_model": model,
            "num_requests": len(rows),
            "num_equal": sum(r["is_equal"] for r in rows),
            "num_different": sum(
                r["original_text"] is not None and r["new_text"] is not None and not r["is_equal"] for r in rows
            ),
            "num_missing_original": sum(r["original_text"] is None for r in rows),
            "num_missing_new": sum(r["new_text"] is None for r in rows),
        }
    )
    return rows


async def replay(
    settings: BusSettings,
    since_ms: int,
    until_ms: int,
    job_id: str | None,
    model: str,
    timeout_s: float,
    with_prompts: bool,
) -> list[dict[str, Any]]:
    """Find, rerun and diff; returns the rows `weir replay` writes."""
    requests = await recorded_requests(settings, since_ms, until_ms, job_id)
    before = await original_outcomes(settings, requests, since_ms)
    after = await rerun(settings, requests, model, timeout_s) if requests else {}
    return diff_rows(requests, before, after, model, with_prompts)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="weir replay", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--since", help="window start, ISO 8601 (UTC when naive) or epoch ms; default: the beginning")
    parser.add_argument("--until", help="window end (exclusive); default: now")
    parser.add_argument("--job", help="only the requests of this batch job")
    parser.add_argument("--model", required=True, help="model to run the requests on")
    parser.add_argument("--out", help="diff JSONL (default: stdout)")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="how long the rerun may take")
    parser.add_argument("--with-prompts", action="store_true", help="write the prompt text, not only its hash")
    parser.add_argument("--bootstrap", default=None, help="Kafka bootstrap servers (WEIR_KAFKA_BOOTSTRAP)")
    parser.add_argument("--topic-prefix", default=None, help="topic prefix (WEIR_TOPIC_PREFIX)")
    return parser


def main(argv: list[str]) -> int:
    """Entry point of `weir replay`; returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.since is None and args.job is None:
        print("weir replay: give --since (and --until), or --job", file=sys.stderr)
        return 2
    overrides = {k: v for k, v in (("kafka_bootstrap", args.bootstrap), ("topic_prefix", args.topic_prefix)) if v}
    settings = BusSettings(**overrides)
    since_ms = parse_time_ms(args.since) if args.since else 0
    until_ms = parse_time_ms(args.until) if args.until else now_ms()
    from aiokafka.errors import KafkaError

    try:
        rows = asyncio.run(
            replay(settings, since_ms, until_ms, args.job, args.model, args.timeout_s, args.with_prompts)
        )
    except (KafkaError, OSError, RuntimeError) as exc:
        print(f"weir replay: {exc}", file=sys.stderr)
        return 2
    data = b"".join(orjson.dumps(row) + b"\n" for row in rows)
    if args.out:
        Path(args.out).write_bytes(data)
    else:
        sys.stdout.buffer.write(data)
    summary = rows[-1]
    print(
        f"replayed {summary['num_requests']} requests on {args.model}: {summary['num_equal']} equal, "
        f"{summary['num_different']} different, {summary['num_missing_original']} without original, "
        f"{summary['num_missing_new']} without new output",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
