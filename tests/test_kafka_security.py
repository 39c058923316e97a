"""Kafka's secure mode (weir/kafka/security.py): SASL/SCRAM principals and ACLs.

The Kafka-marked tests share ONE secure broker this module starts on its own free ports, with its
own data dir and secrets folder (not the session's broker, which is plaintext): a forged record
from a client without credentials, from the outside producer `client`, or from a service that has
no business on a topic, is refused on each protected topic; the principals that own a topic use it.
"""

from __future__ import annotations

import asyncio
import contextlib
import stat
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaConnectionError, KafkaError, TopicAuthorizationFailedError
from aiokafka.structs import OffsetAndMetadata

from schemas.codec import decode, decode_reply, encode
from schemas.messages import AuditEvent, Batch, ReplyEnd
from schemas.model_repo import load_model_repo
from schemas.topics import Topics
from tests.waiting import until
from weir.bus import BusSettings, partitions_of
from weir.kafka import launcher, security
from weir.kafka.admin import add_client_user, deployment_specs, ensure_topics, grant_deployment_acls
from weir.lag import LagMonitor
from weir.stack import free_ports

REPO = Path(__file__).resolve().parents[1]
TOPICS = Topics(f"sec{uuid.uuid4().hex[:6]}")
STEP_S = 20.0  # the bound of every single Kafka step below


# --- without a broker ---------------------------------------------------------------------------


def _properties(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#"))


def test_secure_properties_need_sasl_everywhere_and_deny_by_default(tmp_path: Path) -> None:
    cfg = launcher.BrokerConfig(port=19592, data_dir=tmp_path, secure=True, secrets_dir=tmp_path / "s")
    with pytest.raises(ValueError, match="admin and controller passwords"):
        launcher.render_server_properties(cfg)
    props = _properties(launcher.render_server_properties(cfg, {"admin": "a1", "controller": "c1"}))
    assert props["listeners"] == "SASL_PLAINTEXT://127.0.0.1:19592,CONTROLLER://127.0.0.1:19593"
    assert props["listener.security.protocol.map"] == "CONTROLLER:SASL_PLAINTEXT,SASL_PLAINTEXT:SASL_PLAINTEXT"
    assert "PLAINTEXT://" not in props["listeners"].replace("SASL_PLAINTEXT://", "")
    assert props["sasl.enabled.mechanisms"] == "SCRAM-SHA-512"
    assert props["authorizer.class.name"] == "org.apache.kafka.metadata.authorizer.StandardAuthorizer"
    assert props["allow.everyone.if.no.acl.found"] == "false"
    assert props["super.users"] == "User:admin;User:controller"
    assert 'password="a1"' in props["listener.name.sasl_plaintext.scram-sha-512.sasl.jaas.config"]
    plain = launcher.BrokerConfig(port=19592, data_dir=tmp_path)
    assert "authorizer.class.name" not in _properties(launcher.render_server_properties(plain))


def test_a_data_dir_keeps_the_mode_it_was_formatted_with(tmp_path: Path) -> None:
    cfg = launcher.BrokerConfig(data_dir=tmp_path, secure=False)
    cfg.log_dir.mkdir(parents=True)
    (cfg.log_dir / "meta.properties").write_text("formatted\n")
    cfg.security_file.write_text("sasl\n")
    with pytest.raises(launcher.BrokerError, match="formatted as a sasl broker"):
        launcher.format_storage(cfg, tmp_path)  # returns before any java runs
    cfg.security_file.unlink()  # formatted before secure mode existed: plaintext
    with pytest.raises(launcher.BrokerError, match="formatted as a plaintext broker"):
        launcher.format_storage(launcher.BrokerConfig(data_dir=tmp_path, secure=True), tmp_path)
    launcher.format_storage(cfg, tmp_path)  # same mode: kept as it is


def test_passwords_are_made_once_private_and_checked(tmp_path: Path) -> None:
    folder = tmp_path / "secrets" / "kafka"
    first = security.ensure_password("gateway", folder)
    assert len(first) == 64 and security.ensure_password("gateway", folder) == first
    path = security.password_path("gateway", folder)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(folder.stat().st_mode) == 0o700
    path.chmod(0o644)
    with pytest.raises(security.KafkaSecurityError, match="chmod 600"):
        security.read_password(path)


def test_client_settings_are_honoured_or_refused(tmp_path: Path) -> None:
    folder = tmp_path / "secrets" / "kafka"
    password = security.ensure_password("worker", folder)
    path = security.password_path("worker", folder)
    assert security.client_options_from_env({}) == {}
    assert BusSettings(kafka_security="sasl", kafka_user="worker", kafka_password_file=path).kafka_options() == {
        "security_protocol": "SASL_PLAINTEXT",
        "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_plain_username": "worker",
        "sasl_plain_password": password,
    }
    with pytest.raises(security.KafkaSecurityError, match="is not `sasl`"):
        security.client_options_from_env({"WEIR_KAFKA_USER": "worker"})  # a user alone is not ignored
    with pytest.raises(security.KafkaSecurityError, match="needs WEIR_KAFKA_USER"):
        security.client_options_from_env({"WEIR_KAFKA_SECURITY": "sasl"})
    with pytest.raises(security.KafkaSecurityError, match="use one of"):
        security.client_options_from_env({"WEIR_KAFKA_SECURITY": "ssl"})
    with pytest.raises(security.KafkaSecurityError, match="cannot read"):
        security.client_credentials("sasl", "nobody", None, home=tmp_path)


@pytest.mark.parametrize("name", ["gateway", "admin", "job", "Alice", "a.b", "", "x" * 64, "-x"])
def test_outside_producers_cannot_take_a_reserved_or_ambiguous_name(name: str) -> None:
    with pytest.raises(security.KafkaSecurityError):
        security.check_user_name(name)


def _writers(grants: list[security.Grant], topic: str) -> set[str]:
    """Users that some grant lets write `topic`."""
    return {
        g.user
        for g in grants
        if "write" in g.operations
        and g.resource == "topic"
        and (g.name == topic if g.pattern == "literal" else topic.startswith(g.name))
    }


def _readers(grants: list[security.Grant], topic: str) -> set[str]:
    """Users that some grant lets read `topic`."""
    return {
        g.user
        for g in grants
        if "read" in g.operations
        and g.resource == "topic"
        and (g.name == topic if g.pattern == "literal" else topic.startswith(g.name))
    }


def test_the_acl_plan_keeps_each_topic_to_its_writers() -> None:
    t = TOPICS
    grants = security.service_grants(t) + security.client_grants(t, "client") + security.client_grants(t, "alice")
    assert _writers(grants, t.keys) == _writers(grants, t.usage) == {"gateway"}
    assert _writers(grants, t.requests) == {"gateway", "batcher"}  # outside producers write their own
    assert _writers(grants, t.producer_requests("client")) == {"client"}
    assert _writers(grants, t.producer_requests("alice")) == {"alice"}
    assert _writers(grants, t.producer_requests("bob")) == set()
    request_readers = {
        g.user
        for g in grants
        if "read" in g.operations and g.resource == "topic" and t.producer_requests("alice").startswith(g.name)
    }
    assert request_readers == {"batcher"}
    assert _writers(grants, t.control) == {"gateway", "batcher"}
    assert _writers(grants, t.audit) == {"gateway", "worker"}
    assert _writers(grants, t.dead_letter) == {"gateway", "batcher", "worker", "auditor"}
    assert _writers(grants, t.workers) == {"worker"}
    assert _writers(grants, t.audit_anchors) == {"auditor"}  # the anchor of the audit chain
    assert _writers(grants, t.traces) == {"gateway", "batcher", "worker", "auditor"}  # each its own spans
    assert _readers(grants, t.traces) == set()  # reading spans is for operators (the admin)
    assert _writers(grants, t.batches("echo")) == {"batcher"}
    assert _readers(grants, t.batches("echo")) == {"worker", "gateway"}  # the gateway counts what is unread
    # workers write replies; the batcher the terminal reply of a request it ends itself
    assert _writers(grants, t.replies("client.r1")) == _writers(grants, t.replies("gateway-1")) == {"worker", "batcher"}
    readers = {
        g.user
        for g in grants
        if "read" in g.operations and t.replies("alice.r1").startswith(g.name) and g.resource == "topic"
    }
    assert readers == {"alice"}  # the worker writes replies and reads none
    # the model registry: written by the gateway's admin API (and `weir models` as gateway) and by
    # a worker's rollback; health events by workers (docs/design.md, "The model registry"); the
    # auditor's canary guard writes a failing canary's route and its canary_stopped event, and the
    # traffic counts are the auditor's alone ("Traffic policies")
    assert _writers(grants, t.models) == {"gateway", "worker", "auditor"}
    assert _writers(grants, t.model_health) == {"worker", "auditor"}
    assert _readers(grants, t.models) == {"gateway", "batcher", "worker", "auditor"}
    assert _readers(grants, t.model_health) == {"auditor"}  # its canary guard; nobody else's code reads it
    assert _writers(grants, t.traffic) == {"auditor"}
    # token usage: the auditor is the only bookkeeper; gateways read it for /v1/usage ("Observability")
    assert _writers(grants, t.token_usage) == {"auditor"} and _readers(grants, t.token_usage) == {"gateway"}
    assert "gateway" in _readers(grants, t.workers)  # `weir models list` reads the heartbeats


# --- against a secure broker --------------------------------------------------------------------


@pytest.fixture(scope="module")
def secure_broker(tmp_path_factory: pytest.TempPathFactory) -> launcher.BrokerConfig:
    """One secure broker for this module, on free ports, with the deployment TOPICS and its ACLs."""
    home = tmp_path_factory.mktemp("secure-kafka")
    port, controller_port = free_ports(2)
    cfg = launcher.BrokerConfig(
        port=port, controller_port=controller_port, data_dir=home / "broker", secure=True, secrets_dir=home / "secrets"
    )

    async def setup() -> None:
        await launcher.up(cfg, timeout_s=120)
        options = cfg.admin_options()
        await ensure_topics(
            cfg.bootstrap, deployment_specs(TOPICS, load_model_repo(REPO / "models.toml")), options=options
        )
        await grant_deployment_acls(cfg.bootstrap, TOPICS, options)

    try:
        asyncio.run(setup())
        yield cfg
    finally:
        launcher.stop(cfg)


def _login(cfg: launcher.BrokerConfig, user: str) -> dict[str, str]:
    return security.Credentials(
        user, security.read_password(security.password_path(user, cfg.secrets))
    ).client_options()


async def _produce(cfg: launcher.BrokerConfig, options: dict[str, str], topic: str, value: bytes = b"forged") -> None:
    """One idempotent, acks=all record, as every Weir producer writes; raises what Kafka says."""
    producer = AIOKafkaProducer(
        bootstrap_servers=cfg.bootstrap, acks="all", enable_idempotence=True, request_timeout_ms=10_000, **options
    )
    try:
        await asyncio.wait_for(producer.start(), STEP_S)
        await asyncio.wait_for(producer.send_and_wait(topic, value, key=b"k"), STEP_S)
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(producer.stop(), STEP_S)


async def _read_all(cfg: launcher.BrokerConfig, options: dict[str, str], topic: str) -> list[bytes]:
    """Every record of every partition of `topic`, each read from its beginning to its end offset."""
    # earliest: an assign() resets to it; with "latest" that reset raced the seek below.
    consumer = AIOKafkaConsumer(bootstrap_servers=cfg.bootstrap, group_id=None, auto_offset_reset="earliest", **options)
    await asyncio.wait_for(consumer.start(), STEP_S)
    try:
        consumer.assign([TopicPartition(topic, 0)])
        try:
            await asyncio.wait_for(consumer.end_offsets([TopicPartition(topic, 0)]), 8)
        except TimeoutError:
            # aiokafka's consumer logs Kafka's refusal of the topic's metadata and retries it
            # forever: this raises the refusal instead.
            if topic in consumer._client.cluster.unauthorized_topics:
                raise TopicAuthorizationFailedError(topic) from None
            raise
        tps = [TopicPartition(topic, p) for p in sorted(await partitions_of(consumer, topic))]
        consumer.assign(tps)
        ends = await asyncio.wait_for(consumer.end_offsets(tps), STEP_S)
        await consumer.seek_to_beginning(*tps)
        values: list[bytes] = []
        async with asyncio.timeout(STEP_S):
            while [tp for tp in tps if await consumer.position(tp) < ends[tp]]:
                for batch in (await consumer.getmany(*tps, timeout_ms=500)).values():
                    values += [m.value for m in batch]
        return values
    finally:
        await consumer.stop()


async def _read_until(
    cfg: launcher.BrokerConfig,
    user: str,
    topic: str,
    task: asyncio.Task[None],
    is_done: Callable[[list[bytes]], bool],
    timeout_s: float = 120,
) -> list[bytes]:
    """Read `topic` as `user` again and again until is_done(its records), while `task` runs."""
    read: list[list[bytes]] = [[]]

    async def done() -> bool:
        read[0] = await _read_all(cfg, _login(cfg, user), topic)
        return is_done(read[0])

    await until(
        done, timeout_s=timeout_s, interval_s=0.5, what=f"the records awaited on {topic} (read as {user})", watch=[task]
    )
    return read[0]


PROTECTED = {  # topic -> why no outside producer may write it
    "requests": TOPICS.requests,  # requests there are taken as they say (principal, tenant, reply_to)
    "another_producers_requests": TOPICS.producer_requests("bob"),  # be served as bob
    "control": TOPICS.control,  # cancel anyone's request
    "keys": TOPICS.keys,  # forge an API key
    "usage": TOPICS.usage,  # lock a key out with one usage record
    "audit": TOPICS.audit,  # forge audit events
    "audit_anchors": TOPICS.audit_anchors,  # forge an anchor of the audit chain
    "dead_letter": TOPICS.dead_letter,
    "workers": TOPICS.workers,  # fake a worker
    "models": TOPICS.models,  # register, promote or retire a model version
    "model_health": TOPICS.model_health,  # report a version unhealthy
    "batches": TOPICS.batches("echo"),  # bypass the batcher
    "jobs": TOPICS.jobs,
    "another_client_replies": TOPICS.replies("alice.r1"),  # inject deltas into another's stream
    "gateway_replies": TOPICS.replies("gateway-up-8000"),
    "job_replies": TOPICS.job_replies("batch_1"),
    "own_replies": TOPICS.replies("client.r1"),  # only services write replies, even to one's own
}


@pytest.mark.kafka
@pytest.mark.timeout(120)
async def test_a_client_without_credentials_cannot_even_connect(secure_broker: launcher.BrokerConfig) -> None:
    for topic in (TOPICS.requests, TOPICS.control, TOPICS.keys):
        with pytest.raises(KafkaConnectionError):
            await _produce(secure_broker, {}, topic)
    wrong = {**_login(secure_broker, "client"), "sasl_plain_password": "0" * 64}
    with pytest.raises(KafkaError):
        await _produce(secure_broker, wrong, TOPICS.requests)


@pytest.mark.kafka
@pytest.mark.timeout(120)
async def test_the_client_principal_writes_requests_only(secure_broker: launcher.BrokerConfig) -> None:
    client = _login(secure_broker, "client")
    await _produce(secure_broker, client, TOPICS.producer_requests("client"), b"a request")
    refused = []
    for name, topic in PROTECTED.items():
        try:
            await _produce(secure_broker, client, topic)
        except TopicAuthorizationFailedError:
            refused.append(name)
    assert refused == list(PROTECTED)


@pytest.mark.kafka
@pytest.mark.timeout(120)
async def test_services_cannot_write_what_is_not_theirs(secure_broker: launcher.BrokerConfig) -> None:
    for user, topics in {
        "worker": [TOPICS.keys, TOPICS.usage, TOPICS.control, TOPICS.requests, TOPICS.audit_anchors],
        "batcher": [TOPICS.keys, TOPICS.usage, TOPICS.audit, TOPICS.workers, TOPICS.audit_anchors],
        "auditor": [TOPICS.keys, TOPICS.usage, TOPICS.audit, TOPICS.control],
    }.items():
        for topic in topics:
            with pytest.raises(TopicAuthorizationFailedError):
                await _produce(secure_broker, _login(secure_broker, user), topic)


@pytest.mark.kafka
@pytest.mark.timeout(120)
async def test_the_model_registry_is_written_by_the_gateway_workers_and_the_auditor_only(
    secure_broker: launcher.BrokerConfig,
) -> None:
    # The auditor writes a failing canary's route and its canary_stopped event (the canary guard).
    marker = f"registry-{uuid.uuid4().hex}".encode()
    for writer in ("gateway", "worker", "auditor"):
        await _produce(secure_broker, _login(secure_broker, writer), TOPICS.models, marker)
    for reader in ("gateway", "batcher", "worker", "auditor"):
        assert marker in await _read_all(secure_broker, _login(secure_broker, reader), TOPICS.models)
    for writer in ("worker", "auditor"):
        await _produce(secure_broker, _login(secure_broker, writer), TOPICS.model_health, marker)
    assert marker in await _read_all(secure_broker, _login(secure_broker, "auditor"), TOPICS.model_health)
    for reader in ("gateway", "batcher"):  # no code of theirs reads it (schemas/access.py)
        with pytest.raises(TopicAuthorizationFailedError):
            await _read_all(secure_broker, _login(secure_broker, reader), TOPICS.model_health)
    for user, topic in (
        ("batcher", TOPICS.models),
        ("gateway", TOPICS.model_health),
        ("batcher", TOPICS.model_health),
        ("gateway", TOPICS.traffic),
    ):
        with pytest.raises(TopicAuthorizationFailedError):
            await _produce(secure_broker, _login(secure_broker, user), topic)


@pytest.mark.kafka
@pytest.mark.timeout(180)
def test_weir_models_runs_as_the_gateway_and_not_as_the_batcher(
    secure_broker: launcher.BrokerConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    from weir import cli

    def as_user(user: str) -> None:
        monkeypatch.setenv("WEIR_KAFKA_SECURITY", "sasl")
        monkeypatch.setenv("WEIR_KAFKA_USER", user)
        monkeypatch.setenv("WEIR_KAFKA_PASSWORD_FILE", str(security.password_path(user, secure_broker.secrets)))

    where = tmp_path / "m"
    where.mkdir()
    (where / "weights.bin").write_bytes(b"w" * 64)
    kafka = ["--bootstrap", secure_broker.bootstrap, "--topic-prefix", TOPICS.prefix, "--timeout", "20"]
    as_user("gateway")
    assert cli.main(["models", "push", str(where), "--name", "sec", "--version", "1", "--no-goldens", *kafka]) == 0
    capsys.readouterr()
    assert cli.main(["models", "list", *kafka]) == 0
    assert "sec   1*" in capsys.readouterr().out
    as_user("batcher")  # reads the registry, may not change it
    assert cli.main(["models", "push", str(where), "--name", "sec", "--version", "2", "--no-goldens", *kafka]) == 2
    err = capsys.readouterr().err
    assert err.startswith("weir models push: error: ") and "TopicAuthorizationFailed" in err, err


@pytest.mark.kafka
@pytest.mark.timeout(120)
async def test_the_gateway_owns_the_keys_and_usage_topics(secure_broker: launcher.BrokerConfig) -> None:
    gateway = _login(secure_broker, "gateway")
    marker = f"key-record-{uuid.uuid4().hex}".encode()
    await _produce(secure_broker, gateway, TOPICS.keys, marker)
    await _produce(secure_broker, gateway, TOPICS.usage, marker)
    assert marker in await _read_all(secure_broker, gateway, TOPICS.keys)
    assert marker in await _read_all(secure_broker, gateway, TOPICS.usage)
    with pytest.raises(TopicAuthorizationFailedError):  # and nobody else reads the keys
        await _read_all(secure_broker, _login(secure_broker, "client"), TOPICS.keys)


@pytest.mark.kafka
@pytest.mark.timeout(120)
async def test_the_gateway_and_the_batcher_read_the_consumer_lag_of_the_deployments_groups(
    secure_broker: launcher.BrokerConfig,
) -> None:
    cfg = secure_broker
    tp = TopicPartition(TOPICS.requests, 0)
    await _produce(cfg, _login(cfg, "gateway"), TOPICS.requests, b"not a request: only its offset counts")
    consumer = AIOKafkaConsumer(
        bootstrap_servers=cfg.bootstrap,
        group_id=TOPICS.batcher_group,
        enable_auto_commit=False,
        **_login(cfg, "batcher"),
    )
    await asyncio.wait_for(consumer.start(), STEP_S)
    try:
        consumer.assign([tp])
        end = (await asyncio.wait_for(consumer.end_offsets([tp]), STEP_S))[tp]
        await asyncio.wait_for(consumer.commit({tp: OffsetAndMetadata(0, "")}), STEP_S)
    finally:
        await consumer.stop()
    for user in ("gateway", "batcher"):
        settings = BusSettings(
            kafka_bootstrap=cfg.bootstrap,
            topic_prefix=TOPICS.prefix,
            kafka_security="sasl",
            kafka_user=user,
            kafka_password_file=security.password_path(user, cfg.secrets),
        )
        monitor = LagMonitor(settings)
        try:
            assert await monitor.refresh(), user
        finally:
            await monitor.stop()
        assert monitor.lags[(TOPICS.batcher_group, TOPICS.requests)] >= end >= 1, (user, monitor.lags)


@pytest.mark.kafka
@pytest.mark.timeout(120)
async def test_an_added_user_reads_its_own_replies_and_nobody_elses(secure_broker: launcher.BrokerConfig) -> None:
    cfg = secure_broker
    password = security.ensure_password("alice", cfg.secrets)
    await add_client_user(cfg.bootstrap, TOPICS, "alice", password, cfg.admin_options())
    # A reply topic is made by its reader (the worker may write replies, not create topics).
    await ensure_topics(
        cfg.bootstrap, [TOPICS.reply_spec("alice.r1"), TOPICS.reply_spec("client.r1")], options=cfg.admin_options()
    )
    alice, client, worker = _login(cfg, "alice"), _login(cfg, "client"), _login(cfg, "worker")
    await _produce(cfg, alice, TOPICS.producer_requests("alice"), b"alice's request")  # made by `user add`
    await _produce(cfg, worker, TOPICS.replies("alice.r1"), b"alice's reply")
    await _produce(cfg, worker, TOPICS.replies("client.r1"), b"client's reply")
    assert await _read_all(cfg, alice, TOPICS.replies("alice.r1")) == [b"alice's reply"]
    assert await _read_all(cfg, client, TOPICS.replies("client.r1")) == [b"client's reply"]
    for options, topic in ((alice, TOPICS.replies("client.r1")), (client, TOPICS.replies("alice.r1"))):
        with pytest.raises(TopicAuthorizationFailedError):
            await _read_all(cfg, options, topic)
    for topic in (TOPICS.control, TOPICS.keys, TOPICS.usage):
        with pytest.raises(TopicAuthorizationFailedError):
            await _produce(cfg, alice, topic)


@pytest.mark.kafka
@pytest.mark.timeout(240)
async def test_a_real_worker_serves_with_its_own_principal(
    secure_broker: launcher.BrokerConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker logs in as `worker` (its clients and its admin calls alike), reads a batch the
    batcher's principal wrote, and replies to the client's reply topic; a request whose reply_to
    names the keys topic gets nothing written there (the worker's principal may not)."""
    from services.worker.app import WorkerService
    from services.worker.config import WorkerSettings
    from tests.worker.factories import make_request

    cfg = secure_broker
    monkeypatch.setenv("WEIR_HOME", str(tmp_path))  # the worker's audit key
    for name, value in {
        "WEIR_KAFKA_SECURITY": "sasl",
        "WEIR_KAFKA_USER": "worker",
        "WEIR_KAFKA_PASSWORD_FILE": str(security.password_path("worker", cfg.secrets)),
    }.items():
        monkeypatch.setenv(name, value)
    repo = tmp_path / "models.toml"
    repo.write_text('[models.echo]\nengine = "echo"\nmax_model_len = 4096\n')
    settings = WorkerSettings(
        kafka_bootstrap=cfg.bootstrap,
        topic_prefix=TOPICS.prefix,
        model_repo=str(repo),
        audit_fingerprint_model="",
        heartbeat_interval_ms=200,
    )
    assert settings.kafka_user == "worker"
    await ensure_topics(cfg.bootstrap, [TOPICS.reply_spec("client.w1")], options=cfg.admin_options())
    service = WorkerService(settings)
    task = asyncio.create_task(service.serve())
    try:
        good = make_request("one two three", model="echo", reply_to=TOPICS.replies("client.w1"), max_tokens=50)
        forged = make_request("four five", model="echo", reply_to=TOPICS.keys, max_tokens=50)
        batch = Batch(batch_id="b1", model="echo@1", requests=[forged, good], batcher_id="test")
        await _produce(cfg, _login(cfg, "batcher"), TOPICS.batches("echo@1"), encode(batch))
        replies = await _read_until(
            cfg,
            "client",
            TOPICS.replies("client.w1"),
            task,
            lambda vs: any(isinstance(decode_reply(v), ReplyEnd) for v in vs),
        )
        assert "".join(e.text for e in map(decode_reply, replies) if e.type == "delta") == "one two three"
        audit = await _read_until(
            cfg,
            "auditor",
            TOPICS.audit,
            task,
            lambda vs: good.request_id in {decode(AuditEvent, v).request_id for v in vs},
        )
        assert good.request_id in {decode(AuditEvent, v).request_id for v in audit}
        keys = await _read_all(cfg, _login(cfg, "gateway"), TOPICS.keys)
        assert not [v for v in keys if forged.request_id.encode() in v]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@pytest.mark.kafka
@pytest.mark.timeout(240)
async def test_a_producers_requests_are_served_as_that_producer_and_reply_only_to_it(
    secure_broker: launcher.BrokerConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real batcher (principal `batcher`) and worker (`worker`): `client` names principal alice
    and tenant acme on its own request topic and is served as client/kafka (the reply in its own
    topic, the audit event's owner); a request of its naming bob's reply topic is dead-lettered
    and nothing is written to bob's topic (docs/design.md, "The Kafka trust boundary")."""
    from schemas.messages import DeadLetter
    from schemas.producers import PRODUCER_TENANT
    from services.batcher.app import BatcherApp
    from services.batcher.config import BatcherSettings
    from services.worker.app import WorkerService
    from services.worker.config import WorkerSettings
    from tests.worker.factories import make_request

    cfg = secure_broker
    monkeypatch.setenv("WEIR_HOME", str(tmp_path))  # the worker's audit key
    for name, value in {
        "WEIR_KAFKA_SECURITY": "sasl",
        "WEIR_KAFKA_USER": "worker",
        "WEIR_KAFKA_PASSWORD_FILE": str(security.password_path("worker", cfg.secrets)),
    }.items():
        monkeypatch.setenv(name, value)  # the worker's admin calls read the environment
    repo = tmp_path / "models.toml"
    repo.write_text('[models.echo]\nengine = "echo"\nmax_model_len = 4096\n')
    password = security.ensure_password("bob", cfg.secrets)
    await add_client_user(cfg.bootstrap, TOPICS, "bob", password, cfg.admin_options())
    await ensure_topics(
        cfg.bootstrap, [TOPICS.reply_spec("client.p1"), TOPICS.reply_spec("bob.x")], options=cfg.admin_options()
    )
    worker = WorkerService(
        WorkerSettings(
            kafka_bootstrap=cfg.bootstrap,
            topic_prefix=TOPICS.prefix,
            model_repo=str(repo),
            audit_fingerprint_model="",
            heartbeat_interval_ms=200,
        )
    )
    batcher = BatcherApp(
        BatcherSettings(
            kafka_bootstrap=cfg.bootstrap,
            topic_prefix=TOPICS.prefix,
            model_repo=repo,
            kafka_security="sasl",
            kafka_user="batcher",
            kafka_password_file=security.password_path("batcher", cfg.secrets),
        ),
        load_model_repo(repo),
    )
    stop = asyncio.Event()

    async def serve_both() -> None:
        await asyncio.gather(worker.serve(), batcher.serve(stop))

    task = asyncio.create_task(serve_both())
    client = _login(cfg, "client")
    try:
        forged = make_request("one two", model="echo", reply_to=TOPICS.replies("bob.x"), max_tokens=20)
        claimed = make_request(
            "three four",
            model="echo",
            reply_to=TOPICS.replies("client.p1"),
            max_tokens=20,
            principal="alice",
            tenant="acme",
        )
        await _produce(cfg, client, TOPICS.producer_requests("client"), encode(forged))
        await _produce(cfg, client, TOPICS.producer_requests("client"), encode(claimed))
        replies = await _read_until(
            cfg,
            "client",
            TOPICS.replies("client.p1"),
            task,
            lambda vs: any(isinstance(decode_reply(v), ReplyEnd) for v in vs),
        )
        assert "".join(e.text for e in map(decode_reply, replies) if e.type == "delta") == "three four"
        audit = await _read_until(
            cfg,
            "auditor",
            TOPICS.audit,
            task,
            lambda vs: claimed.request_id in {decode(AuditEvent, v).request_id for v in vs},
        )
        event = next(e for e in (decode(AuditEvent, v) for v in audit) if e.request_id == claimed.request_id)
        assert (event.principal, event.tenant) == ("client", PRODUCER_TENANT)
        admin = cfg.admin_options()

        async def dead_letters_of_forged() -> list[DeadLetter]:
            letters = [decode(DeadLetter, v) for v in await _read_all(cfg, admin, TOPICS.dead_letter)]
            return [d for d in letters if forged.request_id in d.value]

        dead = await until(
            dead_letters_of_forged, timeout_s=60, interval_s=0.5, watch=[task], what="the forged request dead-lettered"
        )
        assert dead[0].source_topic == TOPICS.producer_requests("client")
        assert "is not a reply topic of 'client'" in dead[0].reason and "no reply was written" in dead[0].reason
        assert await _read_all(cfg, admin, TOPICS.replies("bob.x")) == []
    finally:
        stop.set()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_weir_up_secure_gives_each_service_its_own_principal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from weir import stack as up

    monkeypatch.delenv("WEIR_KAFKA_SECURITY", raising=False)
    assert up.build_parser().parse_args([]).secure is False  # `weir up` stays simple by default
    assert up.build_parser().parse_args(["--secure"]).secure is True
    monkeypatch.setenv("WEIR_KAFKA_SECURITY", "sasl")
    assert up.build_parser().parse_args([]).secure is True
    broker = launcher.BrokerConfig(data_dir=tmp_path, secure=True, secrets_dir=tmp_path / "secrets")
    envs = up.service_principals(broker)
    assert set(envs) == set(up.SERVICES)
    for name, env in envs.items():
        assert env == {
            "WEIR_KAFKA_SECURITY": "sasl",
            "WEIR_KAFKA_USER": name,
            "WEIR_KAFKA_PASSWORD_FILE": str(tmp_path / "secrets" / f"{name}.password"),
        }
    # Each start of a service, a restart included, gets its own login on top of the shared settings.
    started: list[dict[str, str]] = []

    class Recorded:
        def __init__(self, argv: list[str], env: dict[str, str], **_: object) -> None:
            started.append(env)

    monkeypatch.setattr(up.subprocess, "Popen", Recorded)
    stack = up.Stack({"WEIR_TOPIC_PREFIX": "shared"}, tmp_path / "logs", own_env=envs)
    for name in ("worker", "gateway", "worker"):
        stack.start(name)
    assert [env["WEIR_KAFKA_USER"] for env in started] == ["worker", "gateway", "worker"]
    assert all(env["WEIR_TOPIC_PREFIX"] == "shared" and env["WEIR_KAFKA_SECURITY"] == "sasl" for env in started)


def test_weir_kafka_secrets_makes_every_principals_password_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from weir import cli

    monkeypatch.setenv("WEIR_HOME", str(tmp_path))
    assert cli.main(["kafka", "secrets"]) == 0
    folder = tmp_path / "secrets" / "kafka"
    users = ["admin", "controller", "gateway", "batcher", "worker", "auditor", "client"]
    before = {user: security.password_path(user, folder).read_text() for user in users}
    assert all(stat.S_IMODE(security.password_path(u, folder).stat().st_mode) == 0o600 for u in users)
    assert len(set(before.values())) == len(users)  # one random password each
    assert cli.main(["kafka", "secrets"]) == 0  # kept, not remade
    assert {user: security.password_path(user, folder).read_text() for user in users} == before
    assert str(folder) in capsys.readouterr().out
