"""Every route of the gateway, walked with other owners' credentials: no 2xx reaches a resource of
another owner (docs/design.md, "Ownership").

Owner A (an API key of alice in tenant acme) makes one of everything the gateway keeps: a
resumable stream, a batch input file, a batch, and (the batcher's job runner runs the batch
against the fake worker) the batch's output file. Then each intruder calls every route of the
OpenAPI document, and the WebSocket route, with A's ids:
- a route that names one of A's resources (in its path or its body) must answer 404, exactly as
  it answers an id that does not exist (nothing tells that A's exists); A itself gets a 2xx there,
  so the 404 is not the answer of a broken setup;
- a route that names nothing of A's (create, list, public) may answer 2xx, but never with any of
  A's ids or of the text of A's files in it; the model admin API (/v2/repository) answers none of
  them (intruders and A hold no admin token) with 2xx.
The routes come from the document and the app, and the walk fails on a route it has no probe for:
a new route cannot be forgotten. Runs against the real broker (the stores are Kafka topics).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import jwt
import orjson
import pytest
from starlette.routing import WebSocketRoute
from websockets.asyncio.client import connect

from schemas.model_repo import load_model_repo
from schemas.registry import RegistryState
from schemas.topics import Topics
from services.batcher.jobs import JobRunner
from services.gateway.app import create_app
from services.gateway.config import GatewaySettings
from services.gateway.guard.auth import new_api_key
from services.gateway.keys_cli import publish_record
from tests.waiting import until
from weir.kafka.admin import delete_prefixed_topics, ensure_topics

from .fakes import FakeWorker, GatewayServer

REPO_TOML = Path(__file__).resolve().parents[2] / "models.toml"
SECRET = b"tenancy-walk-secret-0123456789abcdef"
JWKS = {"keys": [{"kty": "oct", "k": jwt.utils.base64url_encode(SECRET).decode(), "kid": "w", "alg": "HS256"}]}
CHAT = {"model": "echo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
SUCCESS = range(200, 300)


def bearer_jwt(sub: str, tenant: str) -> dict[str, str]:
    claims = {"sub": sub, "tenant": tenant, "exp": int(time.time()) + 3600}
    token = jwt.encode(claims, SECRET, algorithm="HS256", headers={"kid": "w"})
    return {"authorization": f"Bearer {token}"}


@dataclass
class Resources:
    """What owner A made: ids and the text only A's files hold."""

    stream_id: str = ""
    file_id: str = ""
    batch_id: str = ""
    output_file_id: str = ""
    secret: str = field(default_factory=lambda: f"alice-private-{uuid.uuid4().hex}")

    def ids(self) -> list[str]:
        return [self.stream_id, self.file_id, self.batch_id, self.output_file_id]

    def leaked_in(self, text: str) -> list[str]:
        """Which of A's ids or text appear in `text`."""
        return [value for value in [*self.ids(), self.secret] if value and value in text]


@dataclass
class Walk:
    """A gateway with auth required, a fake worker, a job runner, and the credentials."""

    base_url: str
    app: Any
    owner: dict[str, str]
    intruders: dict[str, dict[str, str]]
    made: Resources


Call = Callable[[httpx.AsyncClient, dict[str, str], Resources], Awaitable[list[httpx.Response | dict[str, Any]]]]


@dataclass(frozen=True)
class Probe:
    refers: bool  # the call names one of A's resources: 404 for anyone else, 2xx for A
    call: Call


def jsonl(made: Resources) -> bytes:
    line = {
        "custom_id": made.secret,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {**CHAT, "messages": [{"role": "user", "content": made.secret}]},
    }
    return orjson.dumps(line) + b"\n"


async def upload(client: httpx.AsyncClient, auth: dict[str, str], content: bytes) -> httpx.Response:
    files = {"file": ("input.jsonl", content, "application/jsonl")}
    return await client.post("/v1/files", headers=auth, files=files, data={"purpose": "batch"})


async def new_batch(client: httpx.AsyncClient, auth: dict[str, str], file_id: str) -> httpx.Response:
    body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    return await client.post("/v1/batches", headers=auth, json=body)


async def ws_resume(base_url: str, auth: dict[str, str], request_id: str) -> dict[str, Any]:
    """The first frame the WebSocket answers a resume of `request_id` with (a chunk or an error)."""
    async with connect(base_url.replace("http", "ws", 1) + "/v1/stream", additional_headers=auth) as ws:
        await ws.send(orjson.dumps({"type": "resume", "request_id": request_id, "offset": 0}).decode())
        return orjson.loads(await asyncio.wait_for(ws.recv(), 10))


def probes(base_url: str) -> dict[tuple[str, str], Probe]:
    """One probe per route: what the route is called with. A new route needs one here."""

    def one(call: Callable[[httpx.AsyncClient, dict[str, str], Resources], Awaitable[Any]]) -> Call:
        async def calls(client: httpx.AsyncClient, auth: dict[str, str], made: Resources) -> list[Any]:
            return [await call(client, auth, made)]

        return calls

    async def file_reads(suffix: str, client: httpx.AsyncClient, auth: dict[str, str], made: Resources) -> list[Any]:
        return [
            await client.get(f"/v1/files/{file_id}{suffix}", headers=auth)
            for file_id in (made.file_id, made.output_file_id)
        ]

    async def batch_lists(client: httpx.AsyncClient, auth: dict[str, str], made: Resources) -> list[Any]:
        return [
            await client.get("/v1/batches", headers=auth, params=params)
            for params in ({}, {"after": made.batch_id}, {"limit": 100})
        ]

    async def file_lists(client: httpx.AsyncClient, auth: dict[str, str], made: Resources) -> list[Any]:
        return [
            await client.get("/v1/files", headers=auth, params=params)
            for params in (
                {},
                {"after": made.file_id},
                {"purpose": "batch"},
                {"purpose": "batch_output"},
                {"order": "asc", "limit": 10_000},
            )
        ]

    async def usages(client: httpx.AsyncClient, auth: dict[str, str], made: Resources) -> list[Any]:
        return [await client.get("/v1/usage", headers=auth, params=params) for params in ({}, {"tenant": "acme"})]

    def files(suffix: str) -> Call:
        return lambda client, auth, made: file_reads(suffix, client, auth, made)

    completion = {"model": "echo", "prompt": "hi", "max_tokens": 8}
    embedding = {"model": "all-MiniLM-L6-v2", "input": "hi"}
    return {
        ("POST", "/v1/chat/completions"): Probe(
            False, one(lambda c, a, m: c.post("/v1/chat/completions", headers=a, json=CHAT))
        ),
        ("POST", "/v1/completions"): Probe(
            False, one(lambda c, a, m: c.post("/v1/completions", headers=a, json=completion))
        ),
        ("POST", "/v1/embeddings"): Probe(
            False, one(lambda c, a, m: c.post("/v1/embeddings", headers=a, json=embedding))
        ),
        ("GET", "/v1/streams/{request_id}"): Probe(
            True, one(lambda c, a, m: c.get(f"/v1/streams/{m.stream_id}", headers=a))
        ),
        ("WS", "/v1/stream"): Probe(True, one(lambda c, a, m: ws_resume(base_url, a, m.stream_id))),
        ("POST", "/v1/files"): Probe(False, one(lambda c, a, m: upload(c, a, b'{"custom_id": "mine"}\n'))),
        ("GET", "/v1/files"): Probe(False, file_lists),
        ("GET", "/v1/files/{file_id}"): Probe(True, files("")),
        ("GET", "/v1/files/{file_id}/content"): Probe(True, files("/content")),
        ("POST", "/v1/batches"): Probe(True, one(lambda c, a, m: new_batch(c, a, m.file_id))),
        ("GET", "/v1/batches"): Probe(False, batch_lists),
        ("GET", "/v1/batches/{batch_id}"): Probe(
            True, one(lambda c, a, m: c.get(f"/v1/batches/{m.batch_id}", headers=a))
        ),
        ("POST", "/v1/batches/{batch_id}/cancel"): Probe(
            True, one(lambda c, a, m: c.post(f"/v1/batches/{m.batch_id}/cancel", headers=a))
        ),
        ("GET", "/v1/models"): Probe(False, one(lambda c, a, m: c.get("/v1/models", headers=a))),
        ("GET", "/v1/models/{model_id}"): Probe(False, one(lambda c, a, m: c.get("/v1/models/echo", headers=a))),
        ("POST", "/tokenize"): Probe(
            False, one(lambda c, a, m: c.post("/tokenize", headers=a, json={"model": "weir-tiny-py", "prompt": "hi"}))
        ),
        ("POST", "/detokenize"): Probe(
            False, one(lambda c, a, m: c.post("/detokenize", headers=a, json={"model": "weir-tiny-py", "tokens": [1]}))
        ),
        ("GET", "/healthz"): Probe(False, one(lambda c, a, m: c.get("/healthz", headers=a))),
        ("GET", "/readyz"): Probe(False, one(lambda c, a, m: c.get("/readyz", headers=a))),
        ("GET", "/metrics"): Probe(False, one(lambda c, a, m: c.get("/metrics", headers=a))),
        ("POST", "/v2/repository/index"): Probe(
            False, one(lambda c, a, m: c.post("/v2/repository/index", headers=a, json={}))
        ),
        **{
            ("POST", f"/v2/repository/models/{{name}}/{action}"): Probe(
                False,
                one(
                    lambda c, a, m, action=action: c.post(
                        f"/v2/repository/models/echo/{action}", headers=a, json={"version": "1"}
                    )
                ),
            )
            for action in ("load", "unload", "promote")
        },
        ("POST", "/v2/repository/models/{name}/route"): Probe(
            False, one(lambda c, a, m: c.post("/v2/repository/models/echo/route", headers=a, json={"canary": {"1": 5}}))
        ),
        ("GET", "/v1/usage"): Probe(False, usages),  # a tenant's own rows; A's tenant named by another: 403
        ("GET", "/dashboard"): Probe(False, one(lambda c, a, m: c.get("/dashboard", headers=a))),  # no data in it
        ("GET", "/dashboard/static/{name}"): Probe(
            False, one(lambda c, a, m: c.get("/dashboard/static/dashboard.js", headers=a))
        ),
        ("GET", "/dashboard/data"): Probe(False, one(lambda c, a, m: c.get("/dashboard/data", headers=a))),
    }


def unknown_ids(made: Resources) -> Resources:
    """Ids of A's shapes that nothing has: what every intruder's answer must look like."""
    fresh = uuid.uuid4().hex
    return Resources(f"chatcmpl-{fresh}", f"file-{fresh}", f"batch_{fresh}", f"file-{fresh[::-1]}", made.secret)


def status_and_code(answer: httpx.Response | dict[str, Any]) -> tuple[int, str | None]:
    """(HTTP status, error code) of an answer; a WebSocket frame: 200 for a chunk, its error's status."""
    if isinstance(answer, dict):
        if answer.get("type") != "error":
            return 200, None
        code = answer["error"]["code"]
        return (404 if code == "stream_not_found" else 400), code
    body = answer.json() if answer.headers.get("content-type", "").startswith("application/json") else {}
    return answer.status_code, (body.get("error") or {}).get("code") if isinstance(body, dict) else None


def text_of(answer: httpx.Response | dict[str, Any]) -> str:
    return orjson.dumps(answer).decode() if isinstance(answer, dict) else answer.text


@pytest.fixture(scope="module")
async def walk(gateway_bootstrap: str) -> AsyncIterator[Walk]:
    topics = Topics(prefix=f"t{uuid.uuid4().hex[:8]}")
    await ensure_topics(gateway_bootstrap, topics.core_specs())
    settings = GatewaySettings(
        kafka_bootstrap=gateway_bootstrap,
        topic_prefix=topics.prefix,
        model_repo=str(REPO_TOML),
        jwt_keys=orjson.dumps(JWKS).decode(),
        reply_grace_s=0.5,
        gap_timeout_s=1.0,
        resume_keep_s=600,
    )
    app = create_app(settings)
    assert routes_of(app) == set(probes("http://gw"))  # the walk below covers every route
    server = GatewayServer(app)
    worker = FakeWorker(gateway_bootstrap, topics)
    runner = JobRunner(settings, RegistryState(load_model_repo(str(REPO_TOML))), "walk-runner")
    stop = asyncio.Event()
    running = None
    keys = {
        name: new_api_key(principal, tenant)
        for name, principal, tenant in (
            ("alice", "alice", "acme"),
            ("bob", "bob", "globex"),
            ("carol", "carol", "acme"),
        )
    }
    auth = {name: {"authorization": f"Bearer {key}"} for name, (key, _) in keys.items()}
    try:
        await server.start()
        await worker.start()
        running = asyncio.create_task(runner.run(stop))
        for _, record in keys.values():
            await publish_record(settings, record)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
            for headers in auth.values():  # the gateway has read every key record
                await until(
                    lambda h=headers: app.state.guard.auth.keys.get(h["authorization"].split("_")[1]) is not None,
                    timeout_s=30,
                    what="the gateway to know the key",
                )
            await until(lambda: app.state.bus.readiness()[0], timeout_s=30, what="the gateway ready")
            made = await make_resources(client, auth["alice"])
        intruders = {
            "another tenant's API key": auth["bob"],
            "a JWT of A's principal in another tenant": bearer_jwt("alice", "globex"),
            "another principal of A's tenant": auth["carol"],
            "a JWT of A's principal in A's tenant (another kind of credential)": bearer_jwt("alice", "acme"),
        }
        yield Walk(server.base_url, app, auth["alice"], intruders, made)
    finally:
        stop.set()
        if running is not None:
            await asyncio.gather(running, return_exceptions=True)
        await worker.stop()
        await server.stop()
        await delete_prefixed_topics(gateway_bootstrap, topics.prefix)


async def make_resources(client: httpx.AsyncClient, auth: dict[str, str]) -> Resources:
    """A's stream, input file, batch (run to its end) and output file."""
    made = Resources()
    headers = {**auth, "x-weir-resume-grace-s": "60"}
    streamed = await client.post("/v1/chat/completions", headers=headers, json={**CHAT, "stream": True})
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]"), streamed.text
    made.stream_id = streamed.headers["x-request-id"]
    uploaded = await upload(client, auth, jsonl(made))
    assert uploaded.status_code == 200, uploaded.text
    made.file_id = uploaded.json()["id"]
    created = await new_batch(client, auth, made.file_id)
    assert created.status_code == 200, created.text
    made.batch_id = created.json()["id"]

    async def finished() -> dict[str, Any] | None:
        batch = (await client.get(f"/v1/batches/{made.batch_id}", headers=auth)).json()
        return batch if batch["status"] in ("completed", "failed", "expired", "cancelled") else None

    batch = await until(finished, timeout_s=60, what="the batch to end")
    assert batch["status"] == "completed" and batch["output_file_id"], batch
    made.output_file_id = batch["output_file_id"]
    output = await client.get(f"/v1/files/{made.output_file_id}/content", headers=auth)
    assert output.status_code == 200 and made.secret in output.text  # the output names A's custom_id
    return made


def routes_of(app: Any) -> set[tuple[str, str]]:
    """Every route a client can call: the OpenAPI document's, and the app's WebSocket routes
    (OpenAPI cannot describe those)."""
    document = app.openapi()
    documented = {(method.upper(), path) for path, item in document["paths"].items() for method in item}
    sockets = {("WS", route.path) for route in app.routes if isinstance(route, WebSocketRoute)}
    return documented | sockets


def test_every_route_has_a_probe() -> None:
    # No broker needed: a route added to the gateway without a probe here fails in every run.
    app = create_app(
        GatewaySettings(model_repo=str(REPO_TOML), kafka_bootstrap="127.0.0.1:1", jwt_keys=orjson.dumps(JWKS).decode())
    )
    routes = routes_of(app)
    walked = set(probes("http://gw"))
    assert routes - walked == set(), f"routes without a cross-tenant probe here: {sorted(routes - walked)}"
    assert walked - routes == set(), f"probes of routes that are gone: {sorted(walked - routes)}"
    assert len(routes) >= 16


@pytest.mark.kafka
async def test_no_route_answers_another_owner_with_2xx(walk: Walk) -> None:
    made = walk.made
    refused: list[str] = []
    async with httpx.AsyncClient(base_url=walk.base_url, timeout=30) as client:
        for (method, path), probe in sorted(probes(walk.base_url).items()):
            route = f"{method} {path}"
            for who, auth in walk.intruders.items():
                answers = await probe.call(client, auth, made)
                for answer in answers:
                    status, _code = status_and_code(answer)
                    leaked = made.leaked_in(text_of(answer)) if status in SUCCESS else []
                    if leaked:
                        refused.append(f"{route} as {who}: {status} shows A's {leaked}")
                    if probe.refers and status in SUCCESS:
                        refused.append(f"{route} as {who}: {status} on A's resource")
                    if (path.startswith("/v2/repository") or path == "/dashboard/data") and status != 403:
                        refused.append(f"{route} as {who}: {status}, not 403 (no admin token)")
                if probe.refers:  # the same answer as for an id nobody has: 404
                    unknown = [status_and_code(a) for a in await probe.call(client, auth, unknown_ids(made))]
                    got = [status_and_code(a) for a in answers]
                    if got != unknown or any(status != 404 for status, _ in got):
                        refused.append(f"{route} as {who}: {got} for A's ids, {unknown} for unknown ones")
        for (method, path), probe in sorted(probes(walk.base_url).items(), key=lambda kv: "cancel" in kv[0][1]):
            if probe.refers:  # the owner itself is served (the cancel last: it changes the batch)
                for answer in await probe.call(client, walk.owner, made):
                    if status_and_code(answer)[0] not in SUCCESS:
                        refused.append(f"{method} {path} as A itself: {status_and_code(answer)}")
    assert not refused, "\n".join(refused)
