"""Topic administration against any Kafka cluster: wait for it, create Weir's topics, read configs."""

from __future__ import annotations

import asyncio
import logging
import time

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import KafkaError, for_code

from schemas.model_repo import ModelRepository
from schemas.topics import Topics, TopicSpec

log = logging.getLogger(__name__)

TOPIC_ALREADY_EXISTS = 36  # Kafka protocol error code


def deployment_specs(topics: Topics, repo: ModelRepository) -> list[TopicSpec]:
    """Every topic one deployment needs: the core topics plus each served model's own."""
    specs = topics.core_specs()
    for name in repo.models:
        specs += topics.model_specs(name)
    return specs


async def wait_for_broker(bootstrap: str, timeout_s: float = 30.0) -> None:
    """Return once a metadata request to `bootstrap` lists at least one broker; else TimeoutError."""
    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=5000)
        try:
            await admin.start()
            cluster = await admin.describe_cluster()
            if cluster.get("brokers"):
                return
        except (KafkaError, OSError) as exc:
            last_error = exc
        finally:
            await admin.close()
        await asyncio.sleep(0.3)
    raise TimeoutError(f"no Kafka broker answered at {bootstrap} within {timeout_s:.0f} s ({last_error!r})")


async def ensure_topics(bootstrap: str, specs: list[TopicSpec], replication_factor: int = 1) -> list[str]:
    """Create the topics of `specs` that do not exist yet; returns the names it created.

    Idempotent: existing topics are left as they are (partitions and configs unchanged), and a
    topic another process creates at the same moment counts as existing.
    """
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        missing = [spec for spec in specs if spec.name not in existing]
        if not missing:
            return []
        new_topics = [NewTopic(s.name, s.num_partitions, replication_factor, topic_configs=dict(s.configs))
                      for s in missing]
        response = await admin.create_topics(new_topics, timeout_ms=30_000)
        created = []
        for topic, code, *rest in response.topic_errors:
            if code == 0:
                created.append(topic)
            elif code != TOPIC_ALREADY_EXISTS:
                message = rest[0] if rest else ""
                raise for_code(code)(f"creating topic {topic!r} failed: {message}")
        log.info("created topics %s", created)
        return created
    finally:
        await admin.close()


async def list_topic_names(bootstrap: str) -> list[str]:
    """Every topic of the cluster."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        return list(await admin.list_topics())
    finally:
        await admin.close()


async def delete_topics(bootstrap: str, names: list[str]) -> None:
    """Delete `names` (in requests of 200 topics); topics already gone are no error."""
    if not names:
        return
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=60_000)
    await admin.start()
    try:
        for i in range(0, len(names), 200):
            await admin.delete_topics(names[i : i + 200], timeout_ms=60_000)
    finally:
        await admin.close()


async def delete_prefixed_topics(bootstrap: str, prefix: str) -> None:
    """Delete every topic of the deployment under `prefix` (benchmarks and tests clean up with it)."""
    await delete_topics(bootstrap, [t for t in await list_topic_names(bootstrap) if t.startswith(f"{prefix}.")])


async def describe_topic_configs(bootstrap: str, names: list[str]) -> dict[str, dict[str, str]]:
    """The effective configs of each topic in `names`, as {topic: {key: value}}."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        responses = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, n) for n in names])
    finally:
        await admin.close()
    configs: dict[str, dict[str, str]] = {}
    for response in responses:
        for code, message, _type, name, entries in response.resources:
            if code != 0:
                raise for_code(code)(f"describing configs of {name!r} failed: {message}")
            configs[name] = {entry[0]: entry[1] for entry in entries}
    return configs
