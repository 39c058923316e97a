"""Files and batches against the real broker, with keys of two tenants (and two principals of
one tenant) made with `weir keys` and carried on the keys topic: every file and batch route
answers 404 to anyone but the owner, lists show only the caller's own, uploads are checked line
by line and refused over the size limit while streaming, the batch quota holds, and a batch's
output file is served through the output guard."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from uuid import uuid4

import httpx
import openai
import orjson
import pytest

from schemas.messages import now_ms
from schemas.topics import Topics
from services.gateway.app import create_app
from services.gateway.config import GatewaySettings
from services.gateway.keys_cli import create_key
from tests.waiting import until
from weir.bus import make_producer
from weir.files import FileHeader, chunk_file, write_file
from weir.kafka.admin import delete_prefixed_topics, ensure_topics

from .conftest import REPO_TOML
from .fakes import GatewayServer

pytestmark = pytest.mark.kafka

MAX_FILE_BYTES = 256 << 10
MAX_QUEUED_REQUESTS = 5


@dataclass
class Tenants:
    settings: GatewaySettings
    server: GatewayServer
    ann: str  # acme/ann, every model
    ann_echo: str  # acme/ann again, a key limited to echo
    bob: str  # acme/bob: the same tenant, another principal
    eve: str  # evil/eve: another tenant
    quinn: str  # acme/quinn, for the quota

    def http(self, key: str) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.server.base_url, headers={"authorization": f"Bearer {key}"}, timeout=30)

    def openai(self, key: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.server.base_url}/v1", api_key=key, max_retries=0, timeout=30)


@pytest.fixture(scope="module")
async def tenants(gateway_bootstrap: str) -> AsyncIterator[Tenants]:
    topics = Topics(prefix=f"t{uuid4().hex[:8]}")
    await ensure_topics(gateway_bootstrap, topics.core_specs())
    settings = GatewaySettings(
        kafka_bootstrap=gateway_bootstrap,
        topic_prefix=topics.prefix,
        model_repo=str(REPO_TOML),
        auth_mode="required",
        batch_max_file_bytes=MAX_FILE_BYTES,
        batch_max_queued_requests=MAX_QUEUED_REQUESTS,
    )
    server = GatewayServer(create_app(settings))
    await server.start()
    try:
        keys = {}
        for name, principal, tenant, models in [
            ("ann", "ann", "acme", None),
            ("ann_echo", "ann", "acme", ["echo"]),
            ("bob", "bob", "acme", None),
            ("eve", "eve", "evil", None),
            ("quinn", "quinn", "acme", None),
        ]:
            key, record = await create_key(settings, principal, tenant, models)
            await until(
                lambda r=record: server.server.config.app.state.guard.keys.get(r.key_id),
                timeout_s=10,
                what="the gateway to know the new key",
            )
            keys[name] = key
        yield Tenants(settings, server, **keys)
    finally:
        await server.stop()
        await delete_prefixed_topics(gateway_bootstrap, topics.prefix)


def line(custom_id: str, content: str = "hi", model: str = "echo", **body: object) -> bytes:
    return orjson.dumps(
        {
            "custom_id": custom_id,
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": content}], **body},
        }
    )


def jsonl(*lines: bytes) -> bytes:
    return b"".join(x + b"\n" for x in lines)


async def upload(t: Tenants, key: str, content: bytes, purpose: str = "batch") -> httpx.Response:
    async with t.http(key) as http:
        return await http.post("/v1/files", files={"file": ("in.jsonl", content)}, data={"purpose": purpose})


async def test_files_and_batches_are_their_owners_alone(tenants: Tenants) -> None:
    t = tenants
    ann = t.openai(t.ann)
    content = jsonl(line("a"), line("b"))
    uploaded = await ann.files.create(file=("in.jsonl", content), purpose="batch")
    assert re.fullmatch(r"file-[0-9a-f]{32}", uploaded.id) and uploaded.bytes == len(content)
    assert (await ann.files.content(uploaded.id)).content == content
    batch = await ann.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert re.fullmatch(r"batch_[0-9a-f]{32}", batch.id) and batch.request_counts.total == 2
    assert (await ann.batches.retrieve(batch.id)).id == batch.id
    assert uploaded.id in [f.id for f in (await ann.files.list()).data]
    assert batch.id in [b.id for b in (await ann.batches.list()).data]
    assert uploaded.id in [f.id for f in (await t.openai(t.ann_echo).files.list()).data]  # the same principal

    routes = [
        ("GET", f"/v1/files/{uploaded.id}", None),
        ("GET", f"/v1/files/{uploaded.id}/content", None),
        ("GET", f"/v1/batches/{batch.id}", None),
        ("POST", f"/v1/batches/{batch.id}/cancel", None),
        (
            "POST",
            "/v1/batches",
            {"input_file_id": uploaded.id, "endpoint": "/v1/chat/completions", "completion_window": "24h"},
        ),
    ]
    for other in (t.eve, t.bob):  # another tenant, and another principal of the same tenant
        async with t.http(other) as http:
            for method, path, body in routes:
                response = await http.request(method, path, json=body)
                assert response.status_code == 404, (method, path, response.text)
                assert response.json()["error"]["code"] == "not_found"
            assert (await http.get("/v1/files")).json()["data"] == []
            assert (await http.get("/v1/batches")).json()["data"] == []
            assert (await http.get("/v1/batches", params={"after": batch.id})).json()["data"] == []
    assert (await ann.batches.retrieve(batch.id)).status == "validating"  # the others' cancel did nothing
    async with t.http(t.ann) as http:  # no one deletes a file yet, its owner included (docs/batch.md)
        assert (await http.delete(f"/v1/files/{uploaded.id}")).status_code == 405
    assert (await ann.files.content(uploaded.id)).content == content


async def test_an_output_file_is_its_batchs_owners_and_passes_the_output_guard(tenants: Tenants) -> None:
    t = tenants
    file_id = f"file-{uuid4().hex}"
    body = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "write to ann@example.com"}}]}
    row = {
        "id": "batch_req_1",
        "custom_id": "a",
        "response": {"status_code": 200, "request_id": "r", "body": body},
        "error": None,
    }
    header = FileHeader(file_id, "b_output.jsonl", "batch_output", "acme", "key", "ann", now_ms())
    producer = make_producer(t.settings, client_id="test-runner")
    await producer.start()
    try:  # written as the batcher's job runner writes a result file
        await write_file(producer, t.settings.topics.files, chunk_file(header, orjson.dumps(row) + b"\n"))
    finally:
        await producer.stop()
    files = t.server.server.config.app.state.batches.files
    await until(
        lambda: files.get(file_id), timeout_s=10, what="the gateway to follow the file record"
    )  # the gateway follows the files topic
    async with t.http(t.ann) as http:
        response = await http.get(f"/v1/files/{file_id}/content")
        assert response.status_code == 200, response.text
        served = orjson.loads(response.content)
        assert served["response"]["body"]["choices"][0]["message"]["content"] == "write to [REDACTED]"
        assert served["custom_id"] == "a"
        # an output file is no batch input
        refused = await http.post(
            "/v1/batches",
            json={"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"},
        )
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "input_file_id"
    async with t.http(t.eve) as http:
        assert (await http.get(f"/v1/files/{file_id}/content")).status_code == 404


async def test_every_line_of_an_upload_is_checked_and_the_first_bad_one_named(tenants: Tenants) -> None:
    t = tenants
    tiny = line("b", model="weir-tiny-py")
    cases = [
        (t.ann_echo, jsonl(line("a"), tiny), "line 2: ann may not use the model 'weir-tiny-py@1'", "model_not_allowed"),
        (t.ann_echo, jsonl(line("a") + "\u2028".encode() + tiny), "line 1: the line is not JSON", "invalid_json"),
        (
            t.ann,
            jsonl(line("a"), line("b"), line("c", temperature=7)),
            "line 3: invalid value for 'temperature'",
            "invalid_value",
        ),
        (t.ann, jsonl(line("a"), line("a")), "line 2: custom_id 'a' repeats an earlier line", "duplicate_custom_id"),
        (t.ann, b"\n\n", "the file has no requests", "empty_file"),
    ]
    for key, content, message, code in cases:
        response = await upload(t, key, content)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["message"].startswith(message) and error["code"] == code, error
    # one line whose text holds U+2028 and a whole other line is one request, and is accepted
    assert (await upload(t, t.ann_echo, jsonl(line("a", "x\u2028" + tiny.decode())))).status_code == 200
    wrong = await upload(t, t.ann, jsonl(line("a")), purpose="fine-tune")
    assert (wrong.status_code, wrong.json()["error"]["param"]) == (400, "purpose")


async def test_a_batch_is_checked_again_with_its_creators_key_and_endpoint(tenants: Tenants) -> None:
    t = tenants
    file_id = (await upload(t, t.ann, jsonl(line("a"), line("b", model="weir-tiny-py")))).json()["id"]
    async with t.http(t.ann_echo) as http:  # the same principal, a key limited to echo
        response = await http.post(
            "/v1/batches",
            json={"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"},
        )
    assert response.status_code == 400 and response.json()["error"]["message"].startswith("line 2: ann may not use")
    async with t.http(t.ann) as http:
        response = await http.post(
            "/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"}
        )
    assert response.status_code == 400 and response.json()["error"]["code"] == "mismatched_url"


async def test_an_upload_over_the_limit_is_a_413_while_it_streams(tenants: Tenants) -> None:
    """A chunked upload (no Content-Length to refuse it by) is answered 413 while the client is
    still sending: the gateway stops reading at the limit instead of taking the whole body."""
    t = tenants
    host, port = t.server.base_url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    boundary = "b0undary"
    writer.write(
        f"POST /v1/files HTTP/1.1\r\nhost: {host}\r\nauthorization: Bearer {t.ann}\r\n"
        f"content-type: multipart/form-data; boundary={boundary}\r\ntransfer-encoding: chunked\r\n\r\n".encode()
    )
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--{boundary}\r\n'
        'Content-Disposition: form-data; name="file"; filename="big.jsonl"\r\n\r\n'
    ).encode()
    block = jsonl(line("x")) * 200
    status = asyncio.create_task(reader.readline())
    sent, cap = 0, 400 * MAX_FILE_BYTES
    try:
        for data in [head, *([block] * (cap // len(block)))]:
            if status.done():
                break
            writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            await writer.drain()
            sent += len(data)
        status_line = await asyncio.wait_for(status, 30)
    except ConnectionError:  # the gateway answered and closed while we were still sending
        status_line = await asyncio.wait_for(status, 30)
    finally:
        writer.close()
    assert status_line.startswith(b"HTTP/1.1 413"), status_line
    assert sent < 100 * MAX_FILE_BYTES, sent  # answered long before the 100 MB the client had to send


async def test_the_batch_quota_counts_live_batches_of_the_principal(tenants: Tenants) -> None:
    t = tenants
    quinn = t.openai(t.quinn)
    three = await quinn.files.create(file=("in.jsonl", jsonl(line("a"), line("b"), line("c"))), purpose="batch")
    await quinn.batches.create(input_file_id=three.id, endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.RateLimitError) as caught:  # 3 live + 3 > 5
        await quinn.batches.create(input_file_id=three.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert caught.value.code == "batch_quota_exceeded"
    bob = t.openai(t.bob)  # another principal has a quota of its own
    bobs = await bob.files.create(file=("in.jsonl", jsonl(line("a"), line("b"), line("c"))), purpose="batch")
    await bob.batches.create(input_file_id=bobs.id, endpoint="/v1/chat/completions", completion_window="24h")
