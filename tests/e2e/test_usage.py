"""Token accounting through the whole pipeline (docs/design.md, "Observability"): what GET
/v1/usage reports for a tenant is what its clients were billed in each response's `usage`,
JSON and streamed, as the worker's audit events carried it to the auditor's ledger."""

from __future__ import annotations

import time

import httpx
import orjson
import pytest

from tests.e2e.conftest import start_pipeline

MODEL = "echo"
# This suite's own HTTP ports (the session's range), not the defaults another deployment may hold.
PORTS = {"WEIR_GATEWAY_PORT": "28670", "WEIR_AUDIT_API_PORT": "28671", "WEIR_BATCHER_HTTP_PORT": "28672",
         "WEIR_WORKER_HTTP_PORT": "28673"}  # fmt: skip


@pytest.fixture(scope="module")
def usage_pipeline(tmp_path_factory):
    """Its own stack: the shared ones' other modules bill the same open-mode tenant, so their
    totals would mix with the ones compared here. Echo only, no fingerprints: quick to start."""
    p = start_pipeline(tmp_path_factory.mktemp("usage"), WEIR_MODELS=MODEL, WEIR_USAGE_EVERY_S="0.5",
                       WEIR_AUDIT_FINGERPRINT_MODEL="", **PORTS)  # fmt: skip
    yield p
    p.stack.stop_all()


def _streamed_usage(client: httpx.Client, body: dict) -> dict:
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True,
                                                             "stream_options": {"include_usage": True}}) as resp:
        assert resp.status_code == 200
        chunks = [orjson.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    return chunks[-1]["usage"]


def test_v1_usage_is_what_the_clients_were_billed(usage_pipeline):
    client = httpx.Client(base_url=usage_pipeline.base_url, timeout=60)
    billed = []
    for i in range(4):
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"count the words of prompt {i} " * (i + 1)}],
                "max_tokens": 8 + i}  # fmt: skip
        resp = client.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200, resp.text
        billed.append(resp.json()["usage"])
    billed.append(_streamed_usage(client, {"model": MODEL, "messages": [{"role": "user", "content": "stream me"}]}))
    assert all("cached_tokens" in u["prompt_tokens_details"] for u in billed)

    expected = {"requests": len(billed), "prompt_tokens": sum(u["prompt_tokens"] for u in billed),
                "completion_tokens": sum(u["completion_tokens"] for u in billed),
                "cached_prompt_tokens": sum(u["prompt_tokens_details"]["cached_tokens"] for u in billed)}  # fmt: skip
    deadline = time.monotonic() + 120
    while True:
        resp = client.get("/v1/usage", params={"group_by": "tenant"})  # open mode: the default tenant's
        rows = resp.json().get("data", []) if resp.status_code == 200 else []
        got = {k: rows[0][k] for k in expected} if rows else None
        if got == expected:
            break
        assert time.monotonic() < deadline, f"/v1/usage says {got} ({resp.status_code}), clients were billed {expected}"
        time.sleep(0.5)
    assert rows[0]["tenant"] == "default" and rows[0]["total_tokens"] == sum(u["total_tokens"] for u in billed)
