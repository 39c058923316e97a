"""Token accounting end to end on the real broker (docs/design.md, "Observability"): audit events
on the audit topic -> the auditor's ledger -> UsageTotals and RateCards on the token usage topic ->
the gateway's view -> GET /v1/usage, and `weir usage`.

The admin token sees both tenants; a tenant's key sees only its own, and naming another tenant is
403 in OpenAI's format; a redelivered event counts once and a mirror copy is not billed; records
on the usage topic that are malformed or forged under another key are skipped by the view; a
total published after the gateway started is followed.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from uuid import uuid4

import httpx
import orjson
import pytest
from pydantic import SecretStr

from schemas.codec import encode
from schemas.telemetry import UsageTotals
from schemas.topics import Topics
from services.auditor.app import create_app as create_auditor
from services.auditor.config import AuditorSettings
from services.gateway.app import create_app
from services.gateway.config import GatewaySettings
from services.gateway.guard.auth import new_api_key
from tests.auditor.factories import make_event
from tests.auditor.test_auditor_kafka import produce
from tests.waiting import until
from weir import usage as usage_cli
from weir.kafka.admin import delete_prefixed_topics, ensure_topics

from .fakes import GatewayServer

pytestmark = pytest.mark.kafka

REPO_TOML = Path(__file__).resolve().parents[2] / "models.toml"
TOKEN = "usage-admin-token-0123456"
ADMIN = {"authorization": f"Bearer {TOKEN}"}


@pytest.fixture
async def topics(gateway_bootstrap: str) -> AsyncIterator[Topics]:
    topics = Topics(prefix=f"t{uuid4().hex[:8]}")
    await ensure_topics(gateway_bootstrap, topics.core_specs())
    yield topics
    await delete_prefixed_topics(gateway_bootstrap, topics.prefix)


def _event(i: int, now_ms: int, **fields: Any):
    return make_event(i, finished_ms=now_ms - 1000 + i, **fields)


async def test_audit_events_to_v1_usage_per_tenant(
    gateway_bootstrap: str, topics: Topics, tmp_path: Path, capsys
) -> None:
    bootstrap = gateway_bootstrap
    now_ms = int(datetime.now(UTC).timestamp() * 1000)
    if now_ms % 86_400_000 < 5000:  # the events would straddle midnight
        await asyncio.sleep(5)  # a clock guard, in the first 5 s of a UTC day only
        now_ms += 5000
    today = datetime.fromtimestamp(now_ms / 1000, UTC).strftime("%Y-%m-%d")
    # Before anyone reads the usage topic: a record that is no JSON, one that is no UsageTotals,
    # and a forged total for acme under a key of its own choosing.
    forged = UsageTotals(day=today, tenant="acme", principal="ann", model_version="weir-tiny@1", requests=999)
    await produce(
        bootstrap,
        topics.token_usage,
        [(b"junk", b"not json"), (b"x", b'{"kind": "usage", "day": 1}'), (b"usage\x1fforged", encode(forged))],
    )
    events = [
        _event(
            1, now_ms, principal="ann", tenant="acme", prompt_tokens=10, completion_tokens=5, cached_prompt_tokens=4
        ),
        _event(2, now_ms, principal="ann", tenant="acme", prompt_tokens=20, completion_tokens=15),
        _event(3, now_ms, principal="ann", tenant="acme", shadow_of="req-2", prompt_tokens=500),
        _event(4, now_ms, principal="bob", tenant="globex", prompt_tokens=7, completion_tokens=1),
    ]
    await produce(bootstrap, topics.audit, [(e.request_id.encode(), encode(e)) for e in [*events, events[1]]])

    repo = tmp_path / "models.toml"
    repo.write_text(REPO_TOML.read_text() + "\n[prices.weir-tiny]\ninput_per_1m = 2.0\noutput_per_1m = 6.0\n")
    auditor = AuditorSettings(
        kafka_bootstrap=bootstrap,
        topic_prefix=topics.prefix,
        audit_db=tmp_path / "a.sqlite",
        model_repo=str(repo),
        usage_every_s=0.2,
        usage_rate_every_s=0.5,
        hardware_cost_per_hour=3.0,
        canary_guard=False,
    )
    settings = GatewaySettings(
        kafka_bootstrap=bootstrap,
        topic_prefix=topics.prefix,
        model_repo=str(REPO_TOML),
        gateway_admin_token=SecretStr(TOKEN),
    )
    app = create_app(settings)
    server = GatewayServer(app)
    ann_key, ann = new_api_key("ann", "acme")
    bob_key, bob = new_api_key("bob", "globex")
    async with create_auditor(auditor, embed=None):
        await server.start()
        try:
            for record in (ann, bob):
                app.state.guard.auth.keys.observe(record)
            async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:

                async def get(auth: dict[str, str] | None, **params: str) -> httpx.Response:
                    return await client.get("/v1/usage", params=params, headers=auth or {})

                async def both_tenants() -> bool:
                    response = await get(ADMIN)
                    data = response.json().get("data", []) if response.status_code == 200 else []
                    return {row["tenant"] for row in data} == {"acme", "globex"} and bool(response.json()["rate_cards"])

                await until(both_tenants, timeout_s=60, what="both tenants' totals at the gateway")
                body = (await get(ADMIN, start=today, end=today)).json()
                rows = {(row["tenant"], row["principal"]): row for row in body["data"]}
                assert set(rows) == {("acme", "ann"), ("globex", "bob")}  # the forged record is not among them
                ann_row = rows[("acme", "ann")]
                assert (
                    ann_row["requests"],
                    ann_row["prompt_tokens"],
                    ann_row["completion_tokens"],
                    ann_row["cached_prompt_tokens"],
                    ann_row["total_tokens"],
                ) == (2, 30, 20, 4, 50)
                assert ann_row["day"] == today and ann_row["model"] == "weir-tiny@1"
                assert ann_row["cost_usd"] == pytest.approx((30 * 2.0 + 20 * 6.0) / 1e6)
                card = next(c for c in body["rate_cards"] if c["model_version"] == "weir-tiny@1")
                assert card["hardware_cost_per_hour_usd"] == 3.0 and card["cost_per_1m_tokens_usd"] > 0
                assert app.state.usage.book.num_skipped == 3

                # A tenant's key: its own tenant only; another tenant's name is 403, not data.
                own = (await get({"authorization": f"Bearer {ann_key}"})).json()
                assert {row["tenant"] for row in own["data"]} == {"acme"} and own["tenant"] == "acme"
                assert own["rate_cards"] == []  # measured over every tenant's traffic: the admin's only
                refused = await get({"authorization": f"Bearer {ann_key}"}, tenant="globex")
                assert refused.status_code == 403
                assert refused.json()["error"]["code"] == "tenant_not_allowed" and "data" not in refused.json()
                assert (await get({"authorization": f"Bearer {bob_key}"}, tenant="globex")).json()["data"][0][
                    "requests"
                ] == 1
                only = (await get(ADMIN, tenant="globex", group_by="tenant")).json()["data"]
                assert only == [
                    {
                        "tenant": "globex",
                        "requests": 1,
                        "prompt_tokens": 7,
                        "completion_tokens": 1,
                        "cached_prompt_tokens": 0,
                        "cost_usd": pytest.approx(20 / 1e6),
                        "total_tokens": 8,
                    }
                ]
                assert (await get(None)).status_code == 401
                for bad in (
                    {"start": "yesterday"},
                    {"start": "2026-13-45"},
                    {"group_by": "colour"},
                    {"page": "2"},
                    {"start": today, "end": "2000-01-01"},
                ):
                    response = await get(ADMIN, **bad)
                    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"

                # A total published after the gateway started is followed.
                await produce(
                    bootstrap,
                    topics.audit,
                    [
                        (
                            b"req-5",
                            encode(
                                _event(
                                    5, now_ms, principal="bob", tenant="globex", prompt_tokens=1, completion_tokens=1
                                )
                            ),
                        )
                    ],
                )

                async def bob_has_two() -> bool:
                    data = (await get(ADMIN, tenant="globex")).json()["data"]
                    return data[0]["requests"] == 2

                await until(bob_has_two, timeout_s=60, what="the new total at the gateway")
        finally:
            await server.stop()

    code = await asyncio.to_thread(
        usage_cli.main, ["--bootstrap", bootstrap, "--topic-prefix", topics.prefix, "--tenant", "acme", "--json"]
    )
    out = capsys.readouterr().out
    printed = orjson.loads(out.strip().splitlines()[-1])
    assert code == 0 and [row["requests"] for row in printed["data"]] == [2] and printed["skipped"] == 3
