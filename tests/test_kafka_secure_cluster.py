"""docker-compose.secure.yml's cluster without Docker: scripts/secure-kafka.sh run three times as
local processes, as kafka-1..3 run it (node id, voters, CLUSTER_ID and addresses from the
environment), with one secrets folder made as `weir kafka secrets` makes it. The nodes form a
quorum over SASL, an anonymous client is refused, and topic-init's work as `admin` (the topics, with
three replicas and min.insync.replicas 2, and every principal's ACLs) holds each principal to its
grants. Marked `cluster` too: three JVMs cost 20-60 s to start on a 2-core box.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import uuid
from pathlib import Path

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import KafkaConnectionError, TopicAuthorizationFailedError

from schemas.model_repo import load_model_repo
from schemas.topics import Topics
from tests.waiting import WaitTimeout, until
from weir.kafka import launcher, security
from weir.kafka.admin import broker_ids, deployment_specs, describe_topic_configs, ensure_topics, grant_deployment_acls
from weir.stack import free_ports

pytestmark = [pytest.mark.kafka, pytest.mark.cluster]

REPO = Path(__file__).resolve().parents[1]
TOPICS = Topics(f"seccl{uuid.uuid4().hex[:6]}")
NODES = 3
STEP_S = 20.0


def _node_env(i: int, ports: list[int], home: Path, cluster_id: str) -> dict[str, str]:
    """Node i's environment: what docker-compose.yml and the overlay give kafka-<i>, on loopback."""
    internal, external, controller = ports[3 * (i - 1) : 3 * i]
    voters = ",".join(f"{n}@127.0.0.1:{ports[3 * (n - 1) + 2]}" for n in range(1, NODES + 1))
    return {
        **os.environ,
        "CLUSTER_ID": cluster_id,
        "KAFKA_NODE_ID": str(i),
        "KAFKA_CONTROLLER_QUORUM_VOTERS": voters,
        "WEIR_KAFKA_SECRETS": str(home / "secrets"),
        "KAFKA_LIBS": str(launcher.lib_dir()),
        "KAFKA_DATA_DIR": str(home / f"node-{i}" / "data"),
        "KAFKA_CONF_DIR": str(home / f"node-{i}" / "conf"),
        "KAFKA_INTERNAL_LISTENER": f"127.0.0.1:{internal}",
        "KAFKA_INTERNAL_ADVERTISED": f"127.0.0.1:{internal}",
        "KAFKA_EXTERNAL_LISTENER": f"127.0.0.1:{external}",
        "KAFKA_EXTERNAL_ADVERTISED": f"127.0.0.1:{external}",
        "KAFKA_CONTROLLER_LISTENER": f"127.0.0.1:{controller}",
        "KAFKA_HEAP_OPTS": " ".join([*launcher.CLUSTER_HEAP_OPTS, "-XX:TieredStopAtLevel=1"]),
    }


@pytest.fixture(scope="module")
def secure_cluster(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[int]]:
    """The three nodes, started together and killed at the end; (their home, their 9 ports)."""
    if not launcher.jars_resolved() or shutil.which("java") is None:
        pytest.skip("Kafka's jars are not resolved here (weir kafka up resolves them) or java is missing")
    home = tmp_path_factory.mktemp("secure-cluster")
    for user in (security.ADMIN, security.CONTROLLER, *security.SERVICES, security.DEFAULT_CLIENT):
        security.ensure_password(user, home / "secrets")  # as `weir kafka secrets`
    ports, cluster_id = free_ports(3 * NODES), launcher.new_cluster_id()
    procs = []
    try:
        for i in range(1, NODES + 1):
            with (home / f"node-{i}.log").open("w") as log:
                procs.append(
                    subprocess.Popen(
                        ["bash", str(REPO / "scripts" / "secure-kafka.sh")],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=_node_env(i, ports, home, cluster_id),
                        start_new_session=True,
                    )
                )
        yield home, ports
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # scratch data: no clean shutdown needed
            proc.wait()


def _login(home: Path, user: str) -> dict[str, str]:
    password = security.read_password(security.password_path(user, home / "secrets"))
    return security.Credentials(user, password).client_options()


async def _produce(bootstrap: str, options: dict[str, str], topic: str) -> None:
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap, acks="all", enable_idempotence=True, request_timeout_ms=10_000, **options
    )
    try:
        await asyncio.wait_for(producer.start(), STEP_S)
        await asyncio.wait_for(producer.send_and_wait(topic, b"record", key=b"k"), STEP_S)
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(producer.stop(), STEP_S)


async def _registered(bootstrap: str, options: dict[str, str]) -> bool:
    """Whether every node is a registered broker (False while the cluster cannot answer yet)."""
    try:
        return await broker_ids(bootstrap, options) == list(range(1, NODES + 1))
    except Exception:  # noqa: BLE001 - not up yet: refused, timed out, no controller
        return False


async def _replication(bootstrap: str, options: dict[str, str], topic: str) -> tuple[set[int], list[dict[str, str]]]:
    """The replica counts of `topic`'s partitions, and each node's replication defaults (what the
    script writes for Kafka's own topics and auto-created ones)."""
    keys = (
        "default.replication.factor",
        "min.insync.replicas",
        "offsets.topic.replication.factor",
        "transaction.state.log.min.isr",
        "broker.session.timeout.ms",
        "group.min.session.timeout.ms",
    )
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, **options)
    await admin.start()
    try:
        counts = {len(p["replicas"]) for t in await admin.describe_topics([topic]) for p in t["partitions"]}
        nodes = []
        for node in range(1, NODES + 1):
            [response] = await admin.describe_configs([ConfigResource(ConfigResourceType.BROKER, str(node))])
            entries = {entry[0]: entry[1] for resource in response.resources for entry in resource[4]}
            nodes.append({key: entries[key] for key in keys})
        return counts, nodes
    finally:
        await admin.close()


@pytest.mark.timeout(180)
async def test_three_secure_nodes_form_a_cluster_that_holds_each_principal_to_its_acls(
    secure_cluster: tuple[Path, list[int]],
) -> None:
    home, ports = secure_cluster
    bootstrap = ",".join(f"127.0.0.1:{ports[3 * n]}" for n in range(NODES))
    admin = _login(home, security.ADMIN)
    try:  # the quorum forms over SASL/PLAIN, the brokers register over SCRAM
        await until(lambda: _registered(bootstrap, admin), timeout_s=120, interval_s=1, what="three registered nodes")
    except WaitTimeout:
        logs = "\n".join(f"node-{i}: {(home / f'node-{i}.log').read_text()[-1500:]}" for i in range(1, NODES + 1))
        pytest.fail(f"the three secure nodes did not all register within 120 s:\n{logs}")
    # topic-init's work, as `admin` (weir topics create --acls)
    await ensure_topics(bootstrap, deployment_specs(TOPICS, load_model_repo(REPO / "models.toml")), options=admin)
    await grant_deployment_acls(bootstrap, TOPICS, admin)
    counts, nodes = await _replication(bootstrap, admin, TOPICS.requests)
    assert counts == {3}
    assert nodes == NODES * [
        {
            "default.replication.factor": "3",
            "min.insync.replicas": "2",
            "offsets.topic.replication.factor": "3",
            "transaction.state.log.min.isr": "2",
            "broker.session.timeout.ms": "3000",
            "group.min.session.timeout.ms": "1000",
        }
    ]
    configs = await describe_topic_configs(bootstrap, [TOPICS.requests], admin)
    assert configs[TOPICS.requests]["min.insync.replicas"] == "2"

    with pytest.raises(KafkaConnectionError):
        await _produce(bootstrap, {}, TOPICS.requests)  # no anonymous client on any listener
    await _produce(bootstrap, _login(home, "gateway"), TOPICS.requests)
    with pytest.raises(TopicAuthorizationFailedError):
        await _produce(bootstrap, _login(home, "gateway"), TOPICS.workers)  # the workers' heartbeats
    # the host's EXTERNAL listener of node 2, as the outside producer `client`: its own request topic only
    external = f"127.0.0.1:{ports[4]}"
    await _produce(external, _login(home, security.DEFAULT_CLIENT), TOPICS.producer_requests(security.DEFAULT_CLIENT))
    with pytest.raises(TopicAuthorizationFailedError):
        await _produce(external, _login(home, security.DEFAULT_CLIENT), TOPICS.requests)
