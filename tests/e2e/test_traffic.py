"""Traffic policies through the whole pipeline (docs/design.md, "Traffic policies"): a canary
share and a full mirror set with `weir models route`, requests from many users through the
gateway, the mirror's answers compared by the auditor and never returned to a client.

The echo model keeps it fast: its versions are registered with `weir models push --engine echo`,
and their answers are the same text, so every comparison is an exact match.
"""

from __future__ import annotations

import time

import httpx
import orjson
import pytest

from tests.e2e.conftest import weir_models as _weir_models
from tests.waiting import wait_until

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

MODEL = "echo"


@pytest.fixture(scope="module")
def traffic_pipeline(lifecycle_pipeline):
    return lifecycle_pipeline


# docs/design.md, "Traffic policies": a route applies to new requests within a second of its record;
# the gateway shows no sign of having applied it, so this waits out that documented bound.
POLICY_APPLIES_S = 1.5


def test_canary_users_stick_mirrors_are_compared_and_never_returned(traffic_pipeline, tmp_path):
    p = traffic_pipeline
    for version in ("2", "3"):
        _weir_models(
            p,
            "push",
            "--engine",
            "echo",
            "--name",
            MODEL,
            "--version",
            version,
            "--no-goldens",
            "--out",
            str(tmp_path / f"echo@{version}.manifest.json"),
        )
    client = httpx.Client(base_url=p.base_url, timeout=60)
    wait_until(
        lambda: {f"{MODEL}@2", f"{MODEL}@3"} <= {m["id"] for m in client.get("/v1/models").json()["data"]},
        timeout_s=120,
        interval_s=0.5,
        what="echo@2 and echo@3 ready",
    )
    _weir_models(p, "route", MODEL, "--canary", "2=30", "--mirror", "3=100")
    time.sleep(POLICY_APPLIES_S)  # a policy applies to new requests within a second

    seen: dict[str, set[str]] = {}
    for i in range(40):
        user = f"user-{i % 20}"
        resp = client.post(
            "/v1/completions", json={"model": MODEL, "prompt": f"hello {i}", "max_tokens": 4, "user": user}
        )
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["model"] in (f"{MODEL}@1", f"{MODEL}@2"), body["model"]  # a mirror's answer never comes back
        assignment = resp.headers["x-weir-assignment"]
        assert assignment == ("canary" if body["model"] == f"{MODEL}@2" else "default")
        seen.setdefault(user, set()).add(body["model"])
    assert all(len(versions) == 1 for versions in seen.values()), f"a user saw two versions: {seen}"
    canary_users = sum(1 for versions in seen.values() if versions == {f"{MODEL}@2"})
    assert 1 <= canary_users <= 15, f"{canary_users} of 20 users on a 30% canary"

    def mirrored() -> list[dict]:  # every live request of the 40 was copied to echo@3
        pairs = orjson.loads(_weir_models(p, "compare", MODEL, "--json"))["pairs"]
        pairs = [pair for pair in pairs if pair["mirror"] == f"{MODEL}@3"]
        return pairs if sum(pair["samples"] for pair in pairs) >= 40 else []

    pairs = wait_until(
        mirrored, timeout_s=120, interval_s=0.5, what="the auditor's comparisons of the 40 mirror copies"
    )
    assert {pair["live"] for pair in pairs} <= {f"{MODEL}@1", f"{MODEL}@2"}
    assert all(pair["errors"] == 0 and pair["exact_match_rate"] == 1.0 for pair in pairs), pairs  # echo: same text
    shown = _weir_models(p, "show", MODEL)
    assert "canary" in shown and "mirror" in shown, shown
