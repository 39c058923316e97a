"""The gateway's catalog on an in-memory registry state and fleet: what a request's `model`
resolves to, the x-weir-model-version tag, GET /v1/models, the admin index, key allowlists that
name versions, and the read-back of admin writes (services/gateway/catalog.py)."""

from __future__ import annotations

import pytest

from schemas.messages import ReplyEnd, VersionStatus, WorkerHeartbeat, now_ms
from schemas.model_repo import ModelConfig, ModelRepository
from schemas.registry import ModelRoute, ModelVersionRecord, RegistryState
from services.gateway import catalog as catalog_module
from services.gateway.catalog import Catalog, Record, ref_problem
from services.gateway.fleet import Fleet
from services.gateway.guard.auth import Identity
from services.gateway.openai_format import ApiError, served_version
from weir.models.manifest import pack
from weir.registry import promote, register

SEED = ModelRepository(
    models={
        "echo": ModelConfig(name="echo", engine="echo", version="1", max_model_len=2048),
        "other": ModelConfig(name="other", engine="echo", version="7"),
    }
)


def version(name: str, v: str, desired: str = "loaded", **serving: object) -> ModelVersionRecord:
    config = ModelConfig(name=name, engine="echo", version=v, **serving)
    return ModelVersionRecord(manifest=pack(config), desired=desired)


def apply(state: RegistryState, records: list[Record]) -> None:
    for record in records:
        state.apply(record.key, record)


def beat(worker_id: str, versions: dict[str, VersionStatus]) -> WorkerHeartbeat:
    ready = [served_id for served_id, status in versions.items() if status.state == "ready"]
    return WorkerHeartbeat(
        worker_id=worker_id,
        models=ready,
        is_ready=True,
        num_running=0,
        num_waiting=0,
        max_num_seqs=8,
        free_kv_blocks=10,
        block_size_tokens=16,
        versions=versions,
        sent_ms=now_ms(),
    )


@pytest.fixture
def state() -> RegistryState:
    """echo@1 (seeded) and echo@2 (registered, bigger context) with echo@1 the default; echo@0 retired."""
    state = RegistryState(SEED)
    apply(state, [version("echo", "1", max_model_len=2048), ModelRoute(name="echo", default_version="1")])
    apply(state, [version("echo", "2", max_model_len=4096), version("echo", "0", desired="retired")])
    return state


def test_a_bare_name_resolves_to_its_default_version_and_a_pinned_one_to_that_version(state: RegistryState) -> None:
    catalog = Catalog(state, Fleet())
    assert catalog.resolve("echo").served_id == "echo@1"
    pinned = catalog.resolve("echo@2")
    assert (pinned.served_id, pinned.max_model_len) == ("echo@2", 4096)  # the version's own bounds
    assert catalog.resolve("other").served_id == "other@7"  # a seed entry nobody registered


def test_a_route_record_moves_a_bare_name_at_once(state: RegistryState) -> None:
    catalog = Catalog(state, Fleet())
    apply(state, promote(state, "echo@2", by="test"))
    assert catalog.resolve("echo").served_id == "echo@2"


@pytest.mark.parametrize(
    ("ref", "says"),
    [
        ("nope", "does not exist"),
        ("echo@9", "not registered"),
        ("echo@0", "retired"),
        ("other@1", "not registered"),
    ],
)
def test_an_unknown_unregistered_or_retired_model_is_a_404_model_not_found(
    state: RegistryState, ref: str, says: str
) -> None:
    with pytest.raises(ApiError) as caught:
        Catalog(state, Fleet()).resolve(ref)
    error = caught.value
    assert (error.status, error.code, error.param) == (404, "model_not_found", "model")
    assert ref in error.message and says in error.message


@pytest.mark.parametrize(
    "ref", ["echo@", "@1", "ec ho", "echo@ 1", "echo@1 ", "a@b@1", "echo@-1", "echo@" + "9" * 65, 7, None]
)
def test_a_malformed_model_reference_is_a_400(state: RegistryState, ref: object) -> None:
    with pytest.raises(ApiError) as caught:
        Catalog(state, Fleet()).resolve(ref)
    assert (caught.value.status, caught.value.code, caught.value.param) == (400, "invalid_value", "model")


def test_ref_problem_accepts_names_and_pinned_versions() -> None:
    assert ref_problem("echo") is None and ref_problem("echo@1.2-rc_3") is None
    assert ref_problem("echo@") is not None and ref_problem("@1") is not None


def test_the_version_tag_is_the_manifest_digest_prefix_or_what_a_worker_reports(state: RegistryState) -> None:
    fleet = Fleet()
    catalog = Catalog(state, fleet)
    digest = state.versions["echo@2"].manifest.digest()
    assert catalog.version_tag("echo@2") == f"echo@2:{digest[:12]}"
    # other@7 is only in models.toml: no record, no worker reports it yet
    assert catalog.version_tag("other@7") == "other@7:unregistered"
    fleet.observe(beat("w1", {"other@7": VersionStatus(state="ready", digest="ab" * 32)}))
    assert catalog.version_tag("other@7") == "other@7:" + "ab" * 6


def test_models_lists_names_whose_default_is_ready_and_every_ready_version(state: RegistryState) -> None:
    fleet = Fleet()
    catalog = Catalog(state, fleet)
    assert catalog.listing(100, lambda _: True)["data"] == []  # nothing is ready: nothing is listed
    fleet.observe(
        beat(
            "w1",
            {
                "echo@2": VersionStatus(state="ready"),
                "echo@1": VersionStatus(state="loading"),
                "echo@0": VersionStatus(state="ready"),
                "other@7": VersionStatus(state="failed"),
            },
        )
    )
    listed = catalog.listing(100, lambda _: True)
    ids = [m["id"] for m in listed["data"]]
    assert ids == ["echo@2"]  # echo's default (1) is loading; the retired echo@0 is not listed
    entry = listed["data"][0]
    assert entry == {
        "id": "echo@2",
        "object": "model",
        "owned_by": "weir",
        "weir_version": "2",
        "weir_state": "ready",
        "weir_quantization": "none",
        "created": state.versions["echo@2"].manifest.created_ms // 1000,
    }
    fleet.observe(beat("w2", {"echo@1": VersionStatus(state="ready"), "other@7": VersionStatus(state="ready")}))
    ids = [m["id"] for m in catalog.listing(100, lambda _: True)["data"]]
    assert ids == ["echo", "other", "echo@1", "echo@2", "other@7"]
    other = catalog.listing(100, lambda _: True)["data"][1]
    assert (other["weir_version"], other["created"]) == ("7", 100)  # a seed-only version: the gateway's start


def test_a_key_sees_and_uses_only_the_versions_its_allowlist_names(state: RegistryState) -> None:
    fleet = Fleet()
    fleet.observe(
        beat(
            "w1",
            {
                "echo@1": VersionStatus(state="ready"),
                "echo@2": VersionStatus(state="ready"),
                "other@7": VersionStatus(state="ready"),
            },
        )
    )
    catalog = Catalog(state, fleet)
    whole = Identity("ann", "acme", "key:a", models=frozenset({"echo"}))
    pinned = Identity("bob", "acme", "key:b", models=frozenset({"echo@2"}))
    assert [m["id"] for m in catalog.listing(0, whole.may_use)["data"]] == ["echo", "echo@1", "echo@2"]
    assert [m["id"] for m in catalog.listing(0, pinned.may_use)["data"]] == ["echo@2"]  # echo -> echo@1: not bob's
    assert whole.may_use("echo@1") and whole.may_use("echo@2") and not whole.may_use("other@7")
    assert pinned.may_use("echo@2") and not pinned.may_use("echo@1") and not pinned.may_use("echo")
    apply(state, promote(state, "echo@2", by="test"))  # now the bare name is served by echo@2
    assert [m["id"] for m in catalog.listing(0, pinned.may_use)["data"]] == ["echo", "echo@2"]


def test_a_model_is_retrieved_as_listed_and_what_the_caller_cannot_see_is_a_404(state: RegistryState) -> None:
    fleet = Fleet()
    fleet.observe(
        beat(
            "w1",
            {
                "echo@1": VersionStatus(state="ready"),
                "echo@2": VersionStatus(state="ready"),
                "other@7": VersionStatus(state="ready"),
            },
        )
    )
    catalog = Catalog(state, fleet)
    pinned = Identity("bob", "acme", "key:b", models=frozenset({"echo@2"}))
    for model in catalog.listing(0, lambda _: True)["data"]:
        assert catalog.model(model["id"], 0, lambda _: True) == model  # the list's own object
    assert catalog.model("echo@2", 0, pinned.may_use)["id"] == "echo@2"
    # not bob's (echo is served by echo@1; other), unknown, retired, not ready: all the same 404
    fleet.observe(
        beat(
            "w1",
            {
                "echo@1": VersionStatus(state="ready"),
                "echo@2": VersionStatus(state="ready"),
                "other@7": VersionStatus(state="loading"),
            },
        )
    )
    for ref, may_use in [
        ("echo", pinned.may_use),
        ("echo@1", pinned.may_use),
        ("other", lambda _: True),
        ("nope", lambda _: True),
        ("echo@0", lambda _: True),
        ("echo@9", lambda _: True),
        ("org/model", lambda _: True),
    ]:
        with pytest.raises(ApiError) as missing:
            catalog.model(ref, 0, may_use)
        assert (missing.value.status, missing.value.code, missing.value.param) == (404, "model_not_found", "model")
        assert missing.value.message == f"The model '{ref}' does not exist or you do not have access to it."


def test_the_index_shows_every_version_with_the_best_state_a_live_worker_reports(state: RegistryState) -> None:
    fleet = Fleet()
    fleet.observe(beat("w1", {"echo@2": VersionStatus(state="failed", reason="sha256 of model.safetensors")}))
    fleet.observe(beat("w2", {"echo@2": VersionStatus(state="loading"), "echo@1": VersionStatus(state="ready")}))
    index = {f"{e['name']}@{e['version']}": e for e in Catalog(state, fleet).index()}
    assert set(index) == {"echo@0", "echo@1", "echo@2", "other@7"}
    assert index["echo@2"] == {
        "name": "echo",
        "version": "2",
        "state": "loading",
        "reason": "",
        "desired": "loaded",
        "registered": True,
        "default": False,
        "workers": {"w1": "failed", "w2": "loading"},
    }
    assert (index["echo@1"]["state"], index["echo@1"]["default"]) == ("ready", True)
    assert (index["echo@0"]["desired"], index["echo@0"]["state"]) == ("retired", "unavailable")
    assert (index["other@7"]["registered"], index["other@7"]["reason"]) == (False, "no live worker reports it")
    assert [e["version"] for e in Catalog(state, fleet).index(ready_only=True)] == ["1"]


@pytest.mark.parametrize(
    ("name", "v", "status"),
    [
        ("echo", "2", None),
        ("echo", "9", 404),
        ("other", "7", 404),
        ("echo", "", 400),
        ("echo", " 2", 400),
        ("echo@2", "2", 400),
        ("", "2", 400),
        ("echo", 2, 400),
    ],
)
def test_an_admin_call_names_a_registered_version(
    state: RegistryState, name: str, v: object, status: int | None
) -> None:
    catalog = Catalog(state, Fleet())
    if status is None:
        assert catalog.registered(name, v) == "echo@2"
        return
    with pytest.raises(ApiError) as caught:
        catalog.registered(name, v)
    assert caught.value.status == status


async def test_a_write_returns_once_the_registry_holds_it(state: RegistryState) -> None:
    published: list[Record] = []

    async def publisher(records: list[Record]) -> None:
        published.extend(records)
        apply(state, records)  # what the follower does once it reads them back

    catalog = Catalog(state, Fleet(), publisher)
    records = register(state, version("echo", "3"))
    assert await catalog.write(records) is True
    assert published == records and catalog.resolve("echo@3").served_id == "echo@3"


async def test_a_write_the_registry_does_not_read_back_says_so(state: RegistryState, monkeypatch) -> None:
    async def lost(records: list[Record]) -> None:
        pass

    monkeypatch.setattr(catalog_module, "APPLY_WAIT_S", 0.1)
    assert await Catalog(state, Fleet(), lost).write(register(state, version("echo", "3"))) is False
    with pytest.raises(ApiError) as caught:
        await Catalog(state, Fleet()).write([])
    assert caught.value.status == 503


def test_a_response_names_the_version_the_worker_reports_else_the_pinned_one() -> None:
    def end(model_version: str | None) -> ReplyEnd:
        return ReplyEnd(request_id="r", seq=0, finish_reason="stop", model_version=model_version)

    assert served_version(end("echo@2"), "echo@2") == "echo@2"
    assert served_version(end(None), "echo@2") == "echo@2"  # e.g. the gateway's own timeout terminal
    assert served_version(end("echo"), "echo@2") == "echo@2"  # a bare name is no version
