"""`weir up`'s banner names the versions the registry holds, pushed ones included (issue 35: it
named models.toml's only), read from the real broker; `weir up` records its deployment for the
other commands of its $WEIR_HOME (weir/deployment.py)."""

from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path

import pytest

from schemas.model_repo import ModelConfig, ModelRepository
from schemas.registry import ModelManifest, ModelVersionRecord, RegistryState
from schemas.topics import Topics
from tests.conftest import BOOTSTRAP
from weir import deployment
from weir.bus import BusSettings
from weir.kafka.admin import delete_prefixed_topics, ensure_topics
from weir.kafka.launcher import BrokerConfig
from weir.registry import promote, publish, register, seed_records
from weir.stack import registered_versions


def _echo(version: str) -> ModelVersionRecord:
    manifest = ModelManifest(
        name="echo", version=version, format="echo", location="", serving={"engine": "echo", "max_model_len": 64}
    )
    return ModelVersionRecord(manifest=manifest, registered_by="test")


@pytest.mark.kafka
def test_the_banner_names_pushed_versions_and_the_default(tmp_path: Path) -> None:
    topics = Topics(f"banner{uuid.uuid4().hex[:6]}")
    settings = BusSettings(kafka_bootstrap=BOOTSTRAP, topic_prefix=topics.prefix)
    seed = ModelRepository(models={"echo": ModelConfig(name="echo", engine="echo", version="1")})

    async def setup() -> None:
        await ensure_topics(BOOTSTRAP, [s for s in topics.core_specs() if s.name == topics.models])
        state = RegistryState(seed)
        records = seed_records(seed, state)
        for record in records:
            state.apply(record.key, record)
        records += (pushed := register(state, _echo("2")))  # `weir models push --version 2`
        for record in pushed:
            state.apply(record.key, record)
        records += promote(state, "echo@2", by="test")
        await publish(settings, records)

    try:
        asyncio.run(setup())
        broker = BrokerConfig(data_dir=tmp_path)  # plaintext
        assert registered_versions(BOOTSTRAP, topics.prefix, broker, "echo") == ["echo@1", "echo@2*"]
        assert registered_versions(BOOTSTRAP, topics.prefix, broker, "other") == []
    finally:
        asyncio.run(delete_prefixed_topics(BOOTSTRAP, topics.prefix))


def test_the_recorded_deployment_fills_in_what_nothing_says_and_only_while_its_weir_up_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert deployment.apply({}, tmp_path) == {}  # no record: nothing
    deployment.record("127.0.0.1:9292", "mine", True, ["http://127.0.0.1:8000"], tmp_path)
    env = {"WEIR_TOPIC_PREFIX": "explicit"}
    assert deployment.apply(env, tmp_path) == {
        "WEIR_KAFKA_BOOTSTRAP": "127.0.0.1:9292",
        "WEIR_KAFKA_SECURITY": "sasl",
        "WEIR_KAFKA_USER": "admin",
    }
    assert env["WEIR_TOPIC_PREFIX"] == "explicit"  # an explicit setting wins
    assert deployment.load(tmp_path)["state"] == deployment.UP  # what `weir up` writes once ready
    assert deployment.apply({"WEIR_KAFKA_BOOTSTRAP": "b:1", "WEIR_KAFKA_SECURITY": "plaintext"}, tmp_path) == {
        "WEIR_TOPIC_PREFIX": "mine"
    }
    assert (
        "WEIR_KAFKA_BOOTSTRAP=127.0.0.1:9292 WEIR_TOPIC_PREFIX=mine WEIR_KAFKA_SECURITY=sasl"
        in deployment.export_line("127.0.0.1:9292", "mine", True, tmp_path)
    )
    # A record whose `weir up` is gone (killed -9) is not a deployment: ignored, and said so.
    body = (tmp_path / deployment.FILE).read_text().replace(f'"pid": {os.getpid()}', '"pid": 999999999')
    (tmp_path / deployment.FILE).write_text(body)
    assert deployment.apply({}, tmp_path) == {}
    assert "is not running" in capsys.readouterr().err
    # A starting record whose `weir up` is gone is ignored the same way.
    deployment.record("127.0.0.1:9292", "mine", False, [], tmp_path, state=deployment.STARTING)
    body = (tmp_path / deployment.FILE).read_text().replace(f'"pid": {os.getpid()}', '"pid": 999999999')
    (tmp_path / deployment.FILE).write_text(body)
    assert deployment.load(tmp_path) is None and "is not running" in capsys.readouterr().err
    # A record written before `state` existed is one that is up; an unknown state is refused.
    deployment.record("127.0.0.1:9292", "mine", False, [], tmp_path)
    body = (tmp_path / deployment.FILE).read_text().replace('"state": "up"', '"state": "gone"')
    (tmp_path / deployment.FILE).write_text(body)
    assert deployment.load(tmp_path) is None and "unknown state 'gone'" in capsys.readouterr().err
    (tmp_path / deployment.FILE).write_text(body.replace(',\n "state": "gone"', ""))
    assert "state" not in (tmp_path / deployment.FILE).read_text()
    assert deployment.load(tmp_path)["state"] == deployment.UP
    with pytest.raises(ValueError):
        deployment.record("127.0.0.1:9292", "mine", False, [], tmp_path, state="ready")
    deployment.record("127.0.0.1:9292", "mine", False, [], tmp_path)
    deployment.forget(tmp_path)
    assert not (tmp_path / deployment.FILE).exists()


def test_weir_commands_find_the_deployment_and_an_explicit_bootstrap_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`weir topics create` after `weir up --kafka-port 9292` of this home targets 9292, not 9092;
    with --bootstrap it targets what it is told. Nothing listens on either port here: the error
    names the broker it tried."""
    from weir import cli

    for name in ("WEIR_KAFKA_BOOTSTRAP", "WEIR_TOPIC_PREFIX", "WEIR_KAFKA_SECURITY", "WEIR_KAFKA_USER"):
        monkeypatch.setenv(name, "")  # recorded as it was, so what the command fills in is undone after
        monkeypatch.delenv(name)
    monkeypatch.setenv("WEIR_HOME", str(tmp_path))
    from weir.stack import free_ports

    recorded, explicit = free_ports(2)
    deployment.record(f"127.0.0.1:{recorded}", "mine", False, [], tmp_path)
    repo = Path(__file__).resolve().parents[2] / "models.toml"
    assert cli.main(["topics", "create", "--timeout", "1", "--model-repo", str(repo)]) == 1
    err = capsys.readouterr().err
    assert f"WEIR_KAFKA_BOOTSTRAP=127.0.0.1:{recorded}" in err and f"127.0.0.1:{recorded}" in err.splitlines()[-1]
    os.environ.pop("WEIR_KAFKA_BOOTSTRAP"), os.environ.pop("WEIR_TOPIC_PREFIX")  # what the first command filled in
    assert (
        cli.main(
            ["topics", "create", "--bootstrap", f"127.0.0.1:{explicit}", "--timeout", "1", "--model-repo", str(repo)]
        )
        == 1
    )
    err = capsys.readouterr().err
    assert "deployment" not in err and f"127.0.0.1:{explicit}" in err


def test_weir_commands_find_a_deployment_that_is_still_starting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Between `weir up --kafka-port P`'s choice of broker and its readiness (67-165 s), the commands
    of its home already target P, not 127.0.0.1:9092 (another stack's broker, whose empty registry
    read "no models registered"), and say on stderr that the stack is still starting. Nothing
    listens on P here: the error names the broker tried."""
    from weir import cli
    from weir.stack import free_ports

    for name in ("WEIR_KAFKA_BOOTSTRAP", "WEIR_TOPIC_PREFIX", "WEIR_KAFKA_SECURITY", "WEIR_KAFKA_USER"):
        monkeypatch.setenv(name, "")  # recorded as it was, so what the commands fill in is undone after
        monkeypatch.delenv(name)
    monkeypatch.setenv("WEIR_HOME", str(tmp_path))
    (recorded,) = free_ports(1)
    # What `weir up` writes before its services start (weir/stack.py: main).
    deployment.record(f"127.0.0.1:{recorded}", "mine", True, [], tmp_path, state=deployment.STARTING)
    cli.find_deployment(["models", "list"])
    assert os.environ["WEIR_KAFKA_BOOTSTRAP"] == f"127.0.0.1:{recorded}" and os.environ["WEIR_TOPIC_PREFIX"] == "mine"
    assert os.environ["WEIR_KAFKA_SECURITY"] == "sasl" and os.environ["WEIR_KAFKA_USER"] == "admin"
    err = capsys.readouterr().err
    assert f"WEIR_KAFKA_BOOTSTRAP=127.0.0.1:{recorded}" in err and "is still starting" in err
    for name in ("WEIR_KAFKA_BOOTSTRAP", "WEIR_TOPIC_PREFIX", "WEIR_KAFKA_SECURITY", "WEIR_KAFKA_USER"):
        os.environ.pop(name)
    deployment.record(f"127.0.0.1:{recorded}", "mine", False, [], tmp_path, state=deployment.STARTING)
    repo = Path(__file__).resolve().parents[2] / "models.toml"
    assert cli.main(["topics", "create", "--timeout", "1", "--model-repo", str(repo)]) == 1
    err = capsys.readouterr().err
    assert "is still starting" in err and f"127.0.0.1:{recorded}" in err.splitlines()[-1]
    # Once up, the same lookup without the starting line.
    for name in ("WEIR_KAFKA_BOOTSTRAP", "WEIR_TOPIC_PREFIX"):
        os.environ.pop(name)
    deployment.record(f"127.0.0.1:{recorded}", "mine", False, [], tmp_path, state=deployment.UP)
    cli.find_deployment(["models", "list"])
    err = capsys.readouterr().err
    assert f"WEIR_KAFKA_BOOTSTRAP=127.0.0.1:{recorded}" in err and "starting" not in err


def test_weir_kafka_user_add_speaks_to_the_recorded_broker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """After `weir up --secure --kafka-port P`, `weir kafka user add NAME` is pointed at P (and the
    deployment's prefix); `--port` still wins."""
    from weir import cli
    from weir.stack import free_ports

    for name in (
        "WEIR_KAFKA_BOOTSTRAP",
        "WEIR_TOPIC_PREFIX",
        "WEIR_KAFKA_SECURITY",
        "WEIR_KAFKA_USER",
        "WEIR_KAFKA_PORT",
    ):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setenv("WEIR_HOME", str(tmp_path))
    recorded, explicit = free_ports(2)
    deployment.record(f"127.0.0.1:{recorded}", "mine", True, [], tmp_path)
    cli.find_deployment(["kafka", "user", "add", "alice"])
    assert os.environ["WEIR_KAFKA_PORT"] == str(recorded) and os.environ["WEIR_TOPIC_PREFIX"] == "mine"
    assert f"WEIR_KAFKA_PORT={recorded}" in capsys.readouterr().err
    for name in (
        "WEIR_KAFKA_BOOTSTRAP",
        "WEIR_TOPIC_PREFIX",
        "WEIR_KAFKA_SECURITY",
        "WEIR_KAFKA_USER",
        "WEIR_KAFKA_PORT",
    ):
        os.environ.pop(name, None)
    cli.find_deployment(["kafka", "user", "add", "alice", "--port", str(explicit)])
    assert "WEIR_KAFKA_PORT" not in os.environ and "WEIR_TOPIC_PREFIX" not in os.environ
