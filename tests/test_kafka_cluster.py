"""A real 3-node KRaft cluster (weir/kafka/launcher.py: cluster_configs): Weir's topics are
replicated, and a broker killed with -9 under an acks=all producer loses no acknowledged record.

ONE cluster for the module (marker `cluster`, fixture `kafka_cluster`), on the consecutive ports
from WEIR_TEST_CLUSTER_PORT (six of them), else on a free block; its data dirs are temporary. It
costs 20-90 s to start (by the box's load) and 5-8 s to stop on a 2-core box; the tests
about 40 s more.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from schemas.topics import Topics, TopicSpec
from services.auditor.app import create_app
from services.auditor.config import AuditorSettings
from tests.waiting import until
from weir.kafka import launcher
from weir.kafka.admin import broker_ids, describe_topic_configs, ensure_topics
from weir.stack import free_ports

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

NODES = 3
TOPICS = Topics("clustertest")


def _port_block(size: int = 2 * NODES) -> int:
    """The first of `size` consecutive free ports (WEIR_TEST_CLUSTER_PORT when set)."""
    if env := os.environ.get("WEIR_TEST_CLUSTER_PORT"):
        return int(env)
    for _ in range(50):
        base = free_ports(1)[0]
        try:
            for port in range(base, base + size):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no {size} consecutive free ports found")


@pytest.fixture(scope="module")
def kafka_cluster(tmp_path_factory: pytest.TempPathFactory) -> list[launcher.BrokerConfig]:
    """Three nodes, each a controller and a broker, started together and stopped at the end."""
    cfgs = launcher.cluster_configs(_port_block(), NODES, data_dir=tmp_path_factory.mktemp("cluster"))
    try:
        launcher.start_cluster(cfgs)
        asyncio.run(launcher.wait_cluster_ready(cfgs, 180))
        yield cfgs
    finally:
        launcher.stop_cluster(cfgs)


async def _partitions(bootstrap: str, topics: list[str]) -> dict[str, list[dict]]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        return {t["topic"]: t["partitions"] for t in await admin.describe_topics(topics)}
    finally:
        await admin.close()


async def test_topics_get_three_replicas_and_their_min_insync(kafka_cluster: list[launcher.BrokerConfig]) -> None:
    bootstrap = launcher.bootstrap_of(kafka_cluster)
    specs = [*TOPICS.core_specs(), *TOPICS.model_specs("tiny@1"), TOPICS.reply_spec("gw-1")]
    assert len(await ensure_topics(bootstrap, specs)) == len(specs)
    partitions = await _partitions(bootstrap, [s.name for s in specs])
    assert {len(p["replicas"]) for ps in partitions.values() for p in ps} == {3}
    configs = await describe_topic_configs(bootstrap, [s.name for s in specs])
    insync = {name: c["min.insync.replicas"] for name, c in configs.items()}
    cheap = {TOPICS.workers, TOPICS.usage, TOPICS.traces, TOPICS.shadow_live, TOPICS.comparisons, TOPICS.traffic}
    assert {name for name, value in insync.items() if value == "1"} == cheap
    assert {value for name, value in insync.items() if name not in cheap} == {"2"}
    # A topic a plain client makes by writing to it gets the cluster's defaults.
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True)
    await producer.start()
    try:
        await producer.send_and_wait(TOPICS.replies("auto"), b"x")
    finally:
        await producer.stop()
    assert len((await _partitions(bootstrap, [TOPICS.replies("auto")]))[TOPICS.replies("auto")][0]["replicas"]) == 3
    assert (await describe_topic_configs(bootstrap, [TOPICS.replies("auto")]))[TOPICS.replies("auto")][
        "min.insync.replicas"
    ] == "2"


async def test_the_auditor_starts_on_the_whole_bootstrap_list(
    kafka_cluster: list[launcher.BrokerConfig], tmp_path: Path
) -> None:
    """FastStream (the auditor's client) takes a string as one server: given the cluster's
    "h:p,h:p,h:p" whole, the auditor could not start (found by `weir up --brokers 3`)."""
    bootstrap = launcher.bootstrap_of(kafka_cluster)
    await ensure_topics(bootstrap, TOPICS.core_specs())  # made by the first test; idempotent
    settings = AuditorSettings(kafka_bootstrap=bootstrap, topic_prefix=TOPICS.prefix, audit_db=tmp_path / "a.sqlite")
    async with create_app(settings, embed=None):
        pass


async def _read_committed(bootstrap: str, tp: TopicPartition) -> list[bytes]:
    """Every record of `tp` from its start, as a read_committed consumer sees it."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, isolation_level="read_committed")
    await consumer.start()
    try:
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        end = (await consumer.end_offsets([tp]))[tp]
        values: list[bytes] = []
        while await consumer.position(tp) < end:
            batch = await consumer.getmany(tp, timeout_ms=2000)
            values += [m.value for m in batch.get(tp, [])]
        return values
    finally:
        await consumer.stop()


async def in_sync(bootstrap: str, topic: str) -> dict | None:
    """Partition 0 of `topic` when every node is in its ISR, else None."""
    part = (await _partitions(bootstrap, [topic]))[topic][0]
    return part if len(part["isr"]) >= NODES else None


async def test_a_killed_leader_loses_no_acknowledged_record(kafka_cluster: list[launcher.BrokerConfig]) -> None:
    bootstrap = launcher.bootstrap_of(kafka_cluster)
    topic = f"{TOPICS.prefix}.kill"
    await ensure_topics(bootstrap, [TopicSpec(topic, 1)])
    tp = TopicPartition(topic, 0)
    part = await until(lambda: in_sync(bootstrap, topic), timeout_s=30, what=f"the ISR of {topic} to fill")
    victim = next(cfg for cfg in kafka_cluster if cfg.node_id == part["leader"])

    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True)
    await producer.start()
    acked, failed, stall_s = [], [], 0.0
    try:
        for i in range(300):
            if i == 150:
                os.kill(launcher.running_pid(victim), signal.SIGKILL)
            value = f"record-{i}".encode()
            began = time.monotonic()
            try:
                await producer.send_and_wait(topic, value, key=f"k{i % 7}".encode())
                acked.append(value)
            except KafkaError:
                failed.append(value)
            stall_s = max(stall_s, time.monotonic() - began)
    finally:
        await producer.stop()
    print(f"leader {victim.node_id} killed: {len(acked)} acked, {len(failed)} failed, longest send {stall_s:.1f} s")
    assert not failed  # the producer's retries carry every send over the failover (40 s request timeout)
    assert stall_s < 8  # the controller fences the dead broker after 3 s (launcher: broker.session.timeout.ms)

    survivors = [cfg for cfg in kafka_cluster if cfg is not victim]
    read = await _read_committed(launcher.bootstrap_of(survivors), tp)
    assert sorted(v for v in read if v in set(acked)) == sorted(acked)  # every acknowledged record, once
    assert len(read) == len(set(read))  # and nothing twice (idempotence across the retries)
    assert set(read) <= set(acked) | set(failed)
    assert victim.node_id not in await broker_ids(launcher.bootstrap_of(survivors))

    # The killed node restarts on its data dir (no reformat), rejoins and catches up.
    await asyncio.to_thread(launcher.start, victim)
    await launcher.wait_cluster_ready(kafka_cluster, 120)
    await until(lambda: in_sync(bootstrap, topic), timeout_s=60, what="the restarted node to rejoin the ISR")
    assert await _read_committed(victim.bootstrap, tp) == read
    assert (victim.home / "logs" / "meta.properties").is_file()
    assert Path(victim.cluster_id_file).read_text() == Path(kafka_cluster[0].cluster_id_file).read_text()
