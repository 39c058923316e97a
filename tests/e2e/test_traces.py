"""Traces across every Kafka hop, read back with `weir trace` (docs/design.md, "Observability").

A request sent with a client's traceparent is one trace through the gateway, the batcher, the
worker and the auditor, whose spans form one tree under the client's span; a request produced
straight to Kafka with a forged traceparent is served normally and starts a new trace.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from typing import Any

import httpx
import orjson
import pytest
from aiokafka import AIOKafkaProducer

from schemas.codec import decode_reply, encode
from schemas.messages import GenerateRequest, now_ms
from tests.e2e.conftest import REPO_ROOT, Pipeline
from tests.kafka_helpers import read_until
from tests.waiting import wait_until

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
MODEL = "echo"
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
PROMPT = "a prompt that must never reach a span"


@pytest.fixture(scope="module")
def traced(pipeline):
    """The shared stack (tests/e2e/conftest.py): spans are keyed by request, so other modules' traffic
    does not mix with the traces read here; sampling is 1 by default (WEIR_TRACE_SAMPLE)."""
    return pipeline


def weir_trace(p: Pipeline, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), **p.stack.env}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "weir.cli",
            "trace",
            *args,
            "--bootstrap",
            p.bootstrap,
            "--topic-prefix",
            p.topics.prefix,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def wait_for_spans(p: Pipeline, request_id: str, services: set[str], timeout_s: float = 60) -> list[dict[str, Any]]:
    """`weir trace --json` until spans of every one of `services` are there (spans go out about once a second)."""

    def all_there() -> list[dict[str, Any]] | None:
        done = weir_trace(p, request_id, "--json")
        spans = orjson.loads(done.stdout) if done.returncode == 0 else []
        return spans if services <= {s["service"] for s in spans} else None

    return wait_until(all_there, timeout_s=timeout_s, interval_s=1.0, what=f"spans of {sorted(services)}")


def test_a_clients_trace_goes_through_every_service_as_one_tree(traced):
    response = httpx.post(
        f"{traced.base_url}/v1/chat/completions",
        timeout=60,
        json={"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8},
        headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"},
    )
    assert response.status_code == 200, response.text
    request_id = response.headers["x-request-id"]
    spans = wait_for_spans(traced, request_id, {"gateway", "batcher", "worker", "auditor"})
    own = [s for s in spans if not s["linked"]]
    assert {s["service"] for s in own} == {"gateway", "batcher", "worker", "auditor"}
    assert {s["trace_id"] for s in own} == {CLIENT_TRACE}  # the client's trace, continued
    ids = {s["span_id"] for s in own}
    (root,) = [s for s in own if s["parent_span_id"] not in ids]
    assert (root["service"], root["kind"], root["parent_span_id"]) == ("gateway", "server", CLIENT_SPAN)
    assert all(s["parent_span_id"] in ids for s in own if s is not root)  # one tree
    by_name = {(s["service"], s["name"]): s for s in own}
    publish = by_name[("gateway", f"{traced.topics.requests} publish")]
    assert publish["attributes"]["messaging.system"] == "kafka"
    assert publish["attributes"]["messaging.destination.name"] == traced.topics.requests
    assert isinstance(publish["attributes"]["messaging.kafka.offset"], int)
    process = by_name[("batcher", f"{traced.topics.requests} process")]
    assert process["parent_span_id"] == publish["span_id"]
    assert process["attributes"]["messaging.consumer.group.name"] == traced.topics.batcher_group
    (run,) = [s for s in own if s["service"] == "worker" and s["kind"] == "consumer"]
    assert run["parent_span_id"] == process["span_id"]
    assert run["attributes"]["gen_ai.usage.output_tokens"] >= 1 and "first_token" in [e["name"] for e in run["events"]]
    assert {s["name"] for s in own if s["parent_span_id"] == run["span_id"] and s["service"] == "worker"} >= {
        "queue wait",
        "prefill",
    }
    (append,) = [s for s in own if s["service"] == "auditor"]
    assert (
        append["parent_span_id"] == run["span_id"]
        and append["attributes"]["messaging.destination.name"] == traced.topics.audit
    )
    assert (
        root["attributes"]["gen_ai.request.model"] == f"{MODEL}@1"
        and root["attributes"]["gen_ai.usage.output_tokens"] >= 1
    )
    assert "first_byte" in [e["name"] for e in root["events"]]
    (batch,) = [s for s in spans if s["linked"]]  # the batch's publish span: linked, in a trace of its own
    assert batch["service"] == "batcher" and f"{CLIENT_TRACE}/{process['span_id']}" in batch["links"]
    assert PROMPT not in orjson.dumps(spans).decode()  # invariant 7
    text = weir_trace(traced, request_id)
    assert text.returncode == 0 and all(name in text.stdout for name in ("gateway", "batcher", "worker", "auditor"))
    assert text.stdout.splitlines()[1].startswith("gateway") and " ms" in text.stdout


async def test_a_forged_traceparent_on_a_raw_request_is_served_in_a_new_trace(traced):
    topics = traced.topics
    reply_to = topics.replies(f"raw-{uuid.uuid4().hex[:6]}")
    request = GenerateRequest(
        request_id=f"forged-{uuid.uuid4().hex}",
        model=MODEL,
        prompt="hello there",
        max_tokens=4,
        deadline_ms=now_ms() + 60_000,
        reply_to=reply_to,
    )
    producer = AIOKafkaProducer(bootstrap_servers=traced.bootstrap, acks="all")
    await producer.start()
    try:
        forged = [
            ("traceparent", b"00-" + b"f" * 40 + b"-zz"),
            ("tracestate", b"\xff\xfe"),
            ("weir-traceparents", b"{"),
        ]
        await (await producer.send(topics.requests, encode(request), key=request.request_id.encode(), headers=forged))
    finally:
        await producer.stop()
    records = await read_until(
        traced.bootstrap, [reply_to], lambda rs: any(decode_reply(r.value).type == "end" for r in rs), 60
    )
    (end,) = [e for e in (decode_reply(r.value) for r in records) if e.type == "end"]
    assert end.finish_reason in ("length", "stop")  # served normally
    spans = await asyncio.to_thread(wait_for_spans, traced, request.request_id, {"batcher", "worker"})
    process = next(s for s in spans if s["service"] == "batcher" and not s["linked"])
    assert process["parent_span_id"] is None  # a new trace, rooted here
    run = next(s for s in spans if s["service"] == "worker" and s["kind"] == "consumer")
    assert run["trace_id"] == process["trace_id"] and run["parent_span_id"] == process["span_id"]
    reply_headers = {key: value for r in records for key, value in r.headers}
    assert reply_headers["traceparent"].decode().split("-")[1] == process["trace_id"]  # replies carry the trace


def test_weir_trace_says_when_a_request_has_no_spans(traced):
    done = weir_trace(traced, "no-such-request")
    assert done.returncode == 1 and "no spans of request" in done.stderr
