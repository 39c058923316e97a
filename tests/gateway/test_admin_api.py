"""The model admin API's refusals, on the app without a broker (nothing here reaches Kafka): who
may call it, what bodies it takes, and the registry errors it maps (services/gateway/routes/admin.py).
Its writes are tested against the real broker in test_registry_kafka.py."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

from schemas.messages import VersionStatus, WorkerHeartbeat
from schemas.model_repo import ModelConfig
from schemas.registry import ModelRoute, ModelVersionRecord
from services.gateway.app import create_app
from services.gateway.config import GatewaySettings
from services.gateway.guard.auth import new_api_key
from weir.models.manifest import pack

REPO_TOML = Path(__file__).resolve().parents[2] / "models.toml"
TOKEN = "admin-token-0123456789"
ADMIN = {"authorization": f"Bearer {TOKEN}"}


def make_app(**extra: Any) -> Any:
    settings = GatewaySettings(model_repo=str(REPO_TOML), kafka_bootstrap="127.0.0.1:1", **extra)
    app = create_app(settings)
    state = app.state.catalog.state  # the follower's state, as if it had read these records
    for v in ("1", "2"):
        record = ModelVersionRecord(manifest=pack(ModelConfig(name="echo", engine="echo", version=v)))
        state.apply(record.key, record)
    route = ModelRoute(name="echo", default_version="1")
    state.apply(route.key, route)
    return app


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    app = make_app(auth_mode="open", gateway_admin_token=SecretStr(TOKEN))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
        yield client


def error_of(response: httpx.Response) -> tuple[int, str | None]:
    return response.status_code, response.json()["error"]["code"]


async def test_the_index_lists_registered_and_seeded_versions_for_the_admin_token(client: httpx.AsyncClient) -> None:
    answer = await client.post("/v2/repository/index", headers=ADMIN)
    assert answer.status_code == 200
    entries = {f"{e['name']}@{e['version']}": e for e in answer.json()}
    assert {"echo@1", "echo@2", "weir-tiny-py@1", "all-MiniLM-L6-v2@1"} <= set(entries)
    assert (entries["echo@1"]["default"], entries["echo@1"]["state"]) == (True, "unavailable")  # no worker
    assert (await client.post("/v2/repository/index", headers=ADMIN, json={"ready": True})).json() == []


@pytest.mark.parametrize(
    "path",
    [
        "/v2/repository/index",
        "/v2/repository/models/echo/load",
        "/v2/repository/models/echo/unload",
        "/v2/repository/models/echo/promote",
        "/v2/repository/models/echo/route",
    ],
)
async def test_anyone_without_the_admin_token_is_refused(path: str) -> None:
    body = {"canary": {"2": 5}} if path.endswith("/route") else {"version": "2"}
    open_app = make_app(auth_mode="open", gateway_admin_token=SecretStr(TOKEN))
    key, record = new_api_key("ann", "acme")
    keyed_app = make_app(gateway_admin_token=SecretStr(TOKEN))
    keyed_app.state.guard.auth.keys.observe(record)
    unset_app = make_app(auth_mode="open")
    cases = [
        (open_app, {}, (403, "admin_required")),  # open mode: everyone is anonymous, not an admin
        (open_app, {"authorization": "Bearer not-the-token"}, (403, "admin_required")),
        (keyed_app, {}, (401, "missing_api_key")),
        (keyed_app, {"authorization": "Bearer wrong"}, (401, "invalid_api_key")),
        (keyed_app, {"authorization": f"Bearer {key}"}, (403, "admin_required")),  # a valid key, not the admin's
        (unset_app, ADMIN, (403, "admin_required")),  # no token configured: nobody administers
    ]
    for app, headers, expected in cases:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
            assert error_of(await client.post(path, headers=headers, json=body)) == expected, (headers, expected)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b"{", (400, "invalid_json")),
        (b"[1]", (400, "invalid_json")),
        (b'"2"', (400, "invalid_json")),
        (b"{}", (400, "missing_required_parameter")),
        (b'{"version": 2}', (400, "invalid_value")),
        (b'{"version": "2", "force": true}', (400, "unknown_parameter")),
        (b'{"version": ""}', (400, "invalid_value")),
        (b'{"version": "2 "}', (400, "invalid_value")),
        (b'{"version": "9"}', (404, "model_not_found")),
    ],
)
async def test_a_bad_body_or_unknown_version_is_a_4xx(
    client: httpx.AsyncClient, body: bytes, expected: tuple[int, str]
) -> None:
    answer = await client.post("/v2/repository/models/echo/load", headers=ADMIN, content=body)
    assert error_of(answer) == expected


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b'{"ready": "yes"}', (400, "invalid_value")),
        (b'{"all": true}', (400, "unknown_parameter")),
        (b"nul", (400, "invalid_json")),
    ],
)
async def test_a_bad_index_body_is_a_400(client: httpx.AsyncClient, body: bytes, expected: tuple[int, str]) -> None:
    assert error_of(await client.post("/v2/repository/index", headers=ADMIN, content=body)) == expected


@pytest.mark.parametrize(
    "path",
    [
        "/v2/repository/models/echo@2/load",
        "/v2/repository/models/%40/load",
        "/v2/repository/models/nope/load",
        "/v2/repository/models/ec%20ho/load",
    ],
)
async def test_the_path_names_a_known_model_without_a_version(client: httpx.AsyncClient, path: str) -> None:
    status, _ = error_of(await client.post(path, headers=ADMIN, json={"version": "2"}))
    assert status in (400, 404)


@pytest.mark.parametrize(
    ("action", "version", "says"),
    [
        ("unload", "1", "default version"),
        ("promote", "1", "already the default"),
    ],
)
async def test_an_operation_the_registry_refuses_is_a_409_with_its_reason(
    client: httpx.AsyncClient, action: str, version: str, says: str
) -> None:
    answer = await client.post(f"/v2/repository/models/echo/{action}", headers=ADMIN, json={"version": version})
    assert error_of(answer) == (409, "registry_conflict") and says in answer.json()["error"]["message"]


async def test_an_oversized_admin_body_is_refused_by_the_request_limits(client: httpx.AsyncClient) -> None:
    body = b'{"version": "' + b"1" * (2 << 20) + b'"}'
    answer = await client.post("/v2/repository/models/echo/load", headers=ADMIN, content=body)
    assert error_of(answer)[0] == 413


async def test_promote_is_refused_unless_a_live_worker_has_the_version_ready() -> None:
    """As `weir models promote`: promoting a version that failed everywhere would unload the old
    default and leave the bare name with nothing to serve it. (Forced and allowed promotes write
    to Kafka: test_registry_kafka.py.)"""
    app = make_app(auth_mode="open", gateway_admin_token=SecretStr(TOKEN))
    app.state.bus.fleet.observe(
        WorkerHeartbeat(
            worker_id="w1",
            models=["echo@1"],
            is_ready=True,
            num_running=0,
            num_waiting=0,
            max_num_seqs=8,
            free_kv_blocks=64,
            block_size_tokens=16,
            versions={
                "echo@1": VersionStatus(state="ready"),
                "echo@2": VersionStatus(state="failed", reason="model.bin differs"),
            },
        )
    )
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
        answer = await client.post("/v2/repository/models/echo/promote", headers=ADMIN, json={"version": "2"})
        bad_force = await client.post(
            "/v2/repository/models/echo/promote", headers=ADMIN, json={"version": "2", "force": 1}
        )
    assert error_of(answer) == (409, "version_not_ready")
    assert "failed on w1: model.bin differs" in answer.json()["error"]["message"]
    assert "force" in answer.json()["error"]["message"]
    assert error_of(bad_force) == (400, "invalid_value")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{}", None),
        (b'{"default": 2}', "default"),
        (b'{"default": "1 "}', "default"),
        (b'{"canary": []}', "canary"),
        (b'{"canary": {"2": "5"}}', "canary"),
        (b'{"canary": {"2": true}}', "canary"),
        (b'{"canary": {"2": 101}}', "canary"),
        (b'{"canary": {"2": -0.5}}', "canary"),
        (b'{"canary": {"2 ": 5}}', "canary"),
        (b'{"mirror": {"": 5}}', "mirror"),
        (b'{"mirror": {"3": null}}', "mirror"),
        (b'{"weights": {"2": 5}}', "weights"),
        (b'{"canary": {"2": 5}', None),
    ],
)
async def test_a_bad_route_body_is_a_400_naming_the_field(
    client: httpx.AsyncClient, body: bytes, param: str | None
) -> None:
    answer = await client.post("/v2/repository/models/echo/route", headers=ADMIN, content=body)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"canary": {"9": 5}}, "not registered"),
        ({"canary": {"1": 5}}, "default version"),
        ({"default": "2", "canary": {"2": 5}}, "default version"),
        ({"canary": {"2": 5}, "mirror": {"2": 5}}, "both"),
        ({"default": "7"}, "not registered"),
    ],
)
async def test_a_policy_the_registry_refuses_is_a_409_with_its_reason(
    client: httpx.AsyncClient, body: dict[str, Any], says: str
) -> None:
    answer = await client.post("/v2/repository/models/echo/route", headers=ADMIN, json=body)
    assert error_of(answer) == (409, "registry_conflict") and says in answer.json()["error"]["message"], answer.text


async def test_a_canary_of_an_unloaded_version_is_a_409() -> None:
    app = make_app(auth_mode="open", gateway_admin_token=SecretStr(TOKEN))
    record = ModelVersionRecord(manifest=pack(ModelConfig(name="echo", engine="echo", version="3")), desired="unloaded")
    app.state.catalog.state.apply(record.key, record)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
        answer = await client.post("/v2/repository/models/echo/route", headers=ADMIN, json={"canary": {"3": 5}})
    assert error_of(answer) == (409, "registry_conflict") and "load it first" in answer.json()["error"]["message"]


@pytest.mark.parametrize(("path", "status"), [("echo@2", 400), ("nope", 404), ("ec%20ho", 400)])
async def test_a_route_names_a_known_model_without_a_version(client: httpx.AsyncClient, path: str, status: int) -> None:
    answer = await client.post(f"/v2/repository/models/{path}/route", headers=ADMIN, json={"canary": {"2": 5}})
    assert answer.status_code == status, answer.text
