"""`weir models route` and the traffic part of `weir models show` against the real broker
(docs/design.md, "Traffic policies"): the policy goes through weir.registry.set_route into the
registry topic; show prints it with the auditor's counts from the traffic topic."""

from __future__ import annotations

import asyncio
import uuid

import orjson
import pytest

from schemas.codec import encode
from schemas.registry import ModelManifest, ModelVersionRecord, TrafficCounts
from tests.conftest import BOOTSTRAP
from weir import cli as weir_cli
from weir.bus import BusSettings, make_producer
from weir.kafka.admin import ensure_topics
from weir.registry import publish, read_registry, register

pytestmark = pytest.mark.kafka


@pytest.fixture
def prefix() -> str:
    return f"r{uuid.uuid4().hex[:8]}"


def _settings(prefix: str) -> BusSettings:
    return BusSettings(kafka_bootstrap=BOOTSTRAP, topic_prefix=prefix)


def weir(prefix: str, *argv: str) -> int:
    return weir_cli.main(["models", *argv, "--bootstrap", BOOTSTRAP, "--topic-prefix", prefix])


def _registered(prefix: str, *versions: str, unloaded: str | None = None) -> None:
    async def go() -> None:
        settings = _settings(prefix)
        names = {settings.topics.models, settings.topics.workers, settings.topics.traffic}
        await ensure_topics(BOOTSTRAP, [s for s in settings.topics.core_specs() if s.name in names])
        state = await read_registry(settings)
        for v in versions:
            manifest = ModelManifest(name="tiny", version=v, format="echo", location="", serving={"engine": "echo"})
            records = register(state, ModelVersionRecord(manifest=manifest, desired="unloaded" if v == unloaded else "loaded"))
            for record in records:
                state.apply(record.key, record)
            await publish(settings, records)

    asyncio.run(go())


def _route(prefix: str) -> dict:
    return asyncio.run(read_registry(_settings(prefix))).routes["tiny"].model_dump(mode="json")


def test_route_sets_canary_and_mirror_keeps_what_is_not_given_and_clears(prefix: str, capsys) -> None:
    _registered(prefix, "1", "2", "3", "4")
    assert weir(prefix, "route", "tiny", "--canary", "2=5", "--mirror", "3=100") == 0
    assert "canary: 2 5%; mirror: 3 100%" in capsys.readouterr().out
    route = _route(prefix)
    assert (route["default_version"], route["canary"], route["mirror"]) == ("1", {"2": 5.0}, {"3": 100.0})

    assert weir(prefix, "route", "tiny", "--canary", "4=2.5") == 0  # the canaries given replace; the mirror stays
    route = _route(prefix)
    assert (route["canary"], route["mirror"]) == ({"4": 2.5}, {"3": 100.0})

    assert weir(prefix, "route", "tiny", "--default", "2", "--clear-mirror") == 0
    route = _route(prefix)
    assert (route["default_version"], route["previous_version"], route["canary"], route["mirror"]) == ("2", "1", {"4": 2.5}, {})
    assert weir(prefix, "route", "tiny", "--clear-canary") == 0
    assert _route(prefix)["canary"] == {}


@pytest.mark.parametrize("argv, message", [
    (["--canary", "2"], "give VERSION=PERCENT"),
    (["--canary", "2=five"], "is not a number"),
    (["--canary", "2=150"], "must be 0-100"),
    (["--canary", "2=60", "--canary", "4=50"], "more than 100%"),
    (["--canary", "2=5", "--canary", "2=6"], "twice"),
    (["--canary", "2=5", "--clear-canary"], "contradict"),
    (["--canary", "1=5"], "the default version '1' cannot be one"),
    (["--canary", "2=5", "--mirror", "2=5"], "both canary and mirror"),
    (["--mirror", "9=5"], "'tiny@9' is not registered"),
    (["--mirror", "3=5"], "tiny@3 is unloaded"),
    ([], "nothing to change"),
])
def test_route_refuses_a_bad_policy_and_writes_nothing(prefix: str, capsys, argv: list[str], message: str) -> None:
    _registered(prefix, "1", "2", "3", "4", unloaded="3")
    before = _route(prefix)
    capsys.readouterr()
    assert weir(prefix, "route", "tiny", *argv) == 2
    assert message in capsys.readouterr().err
    assert _route(prefix) == before


def test_route_refuses_a_version_in_the_name(prefix: str, capsys) -> None:
    assert weir(prefix, "route", "tiny@2", "--canary", "2=5") == 2
    assert "give the model name alone" in capsys.readouterr().err


def test_show_prints_the_policy_and_the_auditors_counts_skipping_forged_ones(prefix: str, capsys) -> None:
    _registered(prefix, "1", "2")
    assert weir(prefix, "route", "tiny", "--canary", "2=5") == 0
    capsys.readouterr()
    assert weir(prefix, "show", "tiny") == 0
    out = capsys.readouterr().out
    assert "canary: 2 5%; mirror: none" in out and "no counts from the auditor yet" in out

    counts = TrafficCounts(name="tiny", counts={"tiny@1": {"default": 95}, "tiny@2": {"canary": 5, "pinned": 1}},
                           errors={"tiny@2": 2})
    forged = TrafficCounts(name="other", counts={"other@1": {"default": 1}})

    async def send() -> None:
        producer = make_producer(_settings(prefix), client_id="test-route")
        await producer.start()
        try:
            topic = _settings(prefix).topics.traffic
            await producer.send_and_wait(topic, encode(counts), key=b"tiny")
            await producer.send_and_wait(topic, b"not json", key=b"tiny")
            await producer.send_and_wait(topic, encode(forged), key=b"tiny")  # another name's counts under this key
        finally:
            await producer.stop()

    asyncio.run(send())
    assert weir(prefix, "show", "tiny") == 0
    out = capsys.readouterr().out
    assert "tiny@1" in out and "default=95" in out
    assert "canary=5 pinned=1" in out and "2 (33.3%)" in out and "2 malformed traffic record(s) skipped" in out
    assert weir(prefix, "show", "tiny", "--json") == 0
    shown = orjson.loads(capsys.readouterr().out)
    assert shown["traffic"]["counts"] == counts.counts and shown["skipped_traffic_records"] == 2
    assert shown["route"]["canary"] == {"2": 5.0}
