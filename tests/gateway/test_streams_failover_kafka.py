"""Streams that outlive their gateway, on the real broker (docs/design.md, "Streams outlive their
gateway"): gateway A (its own process) accepts a stream with a resume grace and is killed with -9
mid-stream; the client resumes at gateway B with Last-Event-ID and gets exactly the rest, and
nothing cancels the request. Records on weir.streams that B must not trust (another owner's, a
forged reply topic) get the 404 of an unknown id."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from uuid import uuid4

import httpx
import orjson
import pytest
from fastapi import FastAPI
from websockets.asyncio.client import connect

from schemas.codec import encode
from schemas.topics import Topics
from services.gateway.app import create_app
from services.gateway.config import GatewaySettings
from services.gateway.stream_index import RemoteResumes
from tests.kafka_helpers import produce
from tests.ports import HeldPort
from tests.waiting import until
from weir.kafka.admin import delete_prefixed_topics, ensure_topics

from .conftest import REPO_TOML
from .fakes import DRIP, FakeWorker, GatewayServer
from .test_stream_index import a_record

pytestmark = pytest.mark.kafka

ROOT = Path(__file__).resolve().parents[2]
CRAWL_BODY = {"model": "echo", "prompt": "crawl", "stream": True}  # 20 deltas, 150 ms apart


@dataclass
class Pair:
    topics: Topics
    worker: FakeWorker
    a_url: str
    a_process: subprocess.Popen[bytes]
    b: GatewayServer
    b_app: FastAPI


@pytest.fixture(scope="module")
async def pair(gateway_bootstrap: str) -> AsyncIterator[Pair]:
    topics = Topics(prefix=f"t{uuid4().hex[:8]}")
    await ensure_topics(gateway_bootstrap, topics.core_specs())
    held = HeldPort()  # gateway A serves the test's socket: B's port 0 can never be the same one
    port = held.port
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "WEIR_KAFKA_BOOTSTRAP": gateway_bootstrap,
        "WEIR_TOPIC_PREFIX": topics.prefix,
        "WEIR_MODEL_REPO": str(REPO_TOML),
        "WEIR_AUTH_MODE": "open",
        "WEIR_GATEWAY_PORT": str(port),
        "WEIR_GATEWAY_ID": "gateway-a",
        "WEIR_LOG_LEVEL": "WARNING",
    }
    a_process = subprocess.Popen(
        [sys.executable, "-m", "weir.cli", "gateway"], cwd=ROOT, env=held.env(env), pass_fds=held.pass_fds
    )
    held.close()  # A holds it now
    settings = GatewaySettings(
        kafka_bootstrap=gateway_bootstrap,
        topic_prefix=topics.prefix,
        model_repo=str(REPO_TOML),
        gateway_id="gateway-b",
        auth_mode="open",
        gap_timeout_s=1.0,
        max_remote_resumes=1,
    )
    b_app = create_app(settings)
    b = GatewayServer(b_app)
    worker = FakeWorker(gateway_bootstrap, topics)
    try:
        await b.start()
        await worker.start()
        a_url = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(timeout=2) as client:

            async def both_ready() -> bool:
                assert a_process.poll() is None, "gateway A exited"
                return await is_ready(client, a_url) and await is_ready(client, b.base_url)

            await until(both_ready, timeout_s=60, what="gateways A and B ready")
        yield Pair(topics, worker, a_url, a_process, b, b_app)
    finally:
        if a_process.poll() is None:
            a_process.send_signal(signal.SIGKILL)
        a_process.wait()
        await worker.stop()
        await b.stop()
        await delete_prefixed_topics(gateway_bootstrap, topics.prefix)


async def is_ready(client: httpx.AsyncClient, url: str) -> bool:
    try:
        return (await client.get(f"{url}/readyz")).status_code == 200
    except httpx.TransportError:
        return False


async def read_events(response: httpx.Response, max_deltas: int | None = None) -> list[tuple[int, str]]:
    """(id, text) of each text event of an SSE response, stopping after max_deltas of them."""
    events: list[tuple[int, str]] = []
    last_id = -1
    async for line in response.aiter_lines():
        if line.startswith("id: "):
            last_id = int(line[4:])
        elif line.startswith("data: ") and line != "data: [DONE]":
            choices = orjson.loads(line[6:])["choices"]
            if choices and choices[0]["text"]:
                events.append((last_id, choices[0]["text"]))
                if len(events) == max_deltas:
                    break
    return events


async def resume_ws(url: str, request_id: str, offset: int) -> list[dict[str, Any]]:
    """The frames of a WebSocket resume after `offset` chunk frames, to done or an error."""
    async with connect(url) as ws:
        await ws.send(orjson.dumps({"type": "resume", "request_id": request_id, "offset": offset}).decode())
        frames: list[dict[str, Any]] = []
        while not frames or frames[-1].get("type") not in ("done", "error"):
            frames.append(orjson.loads(await ws.recv()))
    return frames


async def test_streams_whose_gateway_is_killed_resume_at_another_with_exactly_the_rest(pair: Pair) -> None:
    """An SSE stream and a WebSocket stream of A, resumed at B after A's kill -9; B reads one
    other gateway's stream at a time here (max_remote_resumes=1): the second waits its turn."""
    a_ws, b_ws = (url.replace("http", "ws") + "/v1/stream" for url in (pair.a_url, pair.b.base_url))
    async with connect(a_ws) as ws:
        await ws.send(
            orjson.dumps(
                {"type": "completions", "body": {"model": "echo", "prompt": "crawl"}, "resume_grace_s": 30}
            ).decode()
        )
        first = [orjson.loads(await ws.recv()) for _ in range(2)]
    ws_id = first[0]["id"]
    async with httpx.AsyncClient(timeout=20) as client:
        headers = {"x-weir-resume-grace-s": "30"}
        async with client.stream("POST", f"{pair.a_url}/v1/completions", json=CRAWL_BODY, headers=headers) as response:
            request_id = response.headers["x-request-id"]
            assert response.headers["x-weir-gateway"] == "gateway-a"
            before = await read_events(response, max_deltas=3)
            pair.a_process.send_signal(signal.SIGKILL)  # mid-stream: 17 deltas to go, 150 ms apart
            pair.a_process.wait()
        resume_url = f"{pair.b.base_url}/v1/streams/{request_id}"
        async with client.stream("GET", resume_url, headers={"last-event-id": str(before[-1][0])}) as again:
            assert again.status_code == 200 and again.headers["x-weir-gateway"] == "gateway-b"
            busy = await resume_ws(b_ws, ws_id, 2)
            after = await read_events(again)
    ids = [seq for seq, _ in before + after]
    assert "".join(text for _, text in before + after) == "".join(DRIP)
    assert ids == sorted(set(ids))  # no event twice
    assert busy[-1]["type"] == "error" and busy[-1]["error"]["code"] == "too_many_resumes"
    remote: RemoteResumes = pair.b_app.state.remote
    await until(
        lambda: remote.num_open == 0, timeout_s=10, what="B's reader of A's stream closed"
    )  # its reader closed at the end
    rest = await resume_ws(b_ws, ws_id, 2)
    assert rest[-1] == {"type": "done"}
    assert [t for frame in first + rest[:-1] if (t := frame["choices"][0]["text"])] == DRIP
    for rid in (request_id, ws_id):  # each ran to its end: its gateway's death cancelled nothing
        assert pair.worker.generated[rid] == len(DRIP) and pair.worker.cancels_of(rid) == []
    await until(lambda: remote.num_open == 0, timeout_s=10, what="B's reader of A's stream closed")


async def test_records_b_must_not_trust_get_the_404_of_an_unknown_id(pair: Pair, gateway_bootstrap: str) -> None:
    remote: RemoteResumes = pair.b_app.state.remote
    reply_topic = pair.topics.replies("gateway-a")
    others = a_record("cmpl-others", reply_topic=reply_topic)  # tenant acme: not the open owner asking
    forged = a_record(
        "cmpl-forged",
        reply_topic=pair.topics.keys,
        owner_tenant="default",
        owner_credential="open",
        owner_principal="anonymous",
    )
    # the open owner's, but starting past the end of the topic: it would wait for nothing until its deadline
    beyond = a_record(
        "cmpl-beyond",
        reply_topic=reply_topic,
        owner_tenant="default",
        owner_credential="open",
        owner_principal="anonymous",
        start_offset=10**15,
    )
    ignored = remote.index.num_ignored
    await produce(gateway_bootstrap, pair.topics.streams, [(r.request_id, encode(r)) for r in (others, forged, beyond)])
    await until(
        lambda: remote.index.lookup("cmpl-beyond") is not None and remote.index.num_ignored > ignored,
        timeout_s=10,
        what="B to index cmpl-beyond and ignore the records beyond it",
    )
    async with httpx.AsyncClient(base_url=pair.b.base_url, timeout=10) as client:
        answers = [
            await client.get(f"/v1/streams/{rid}")
            for rid in ("cmpl-others", "cmpl-forged", "cmpl-unknown", "cmpl-beyond")
        ]
    assert [(a.status_code, a.json()["error"]["code"]) for a in answers] == [(404, "stream_not_found")] * 4
    assert remote.num_open == 0
