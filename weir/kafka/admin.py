"""Administration against any Kafka cluster: wait for it, create Weir's topics, read configs; on a
secure cluster, add SCRAM users and ACLs (weir/kafka/security.py).

Every function connects with `options` (aiokafka's security keyword arguments) when given, else
with those of the environment (WEIR_KAFKA_SECURITY, WEIR_KAFKA_USER, WEIR_KAFKA_PASSWORD_FILE), so
each service and CLI that calls them honours the deployment's credentials.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import KafkaError, for_code
from aiokafka.protocol.admin import CreateAclsRequest
from aiokafka.protocol.api import Request, RequestStruct, Response
from aiokafka.protocol.metadata import MetadataRequest
from aiokafka.protocol.types import CompactArray, CompactBytes, CompactString, Int8, Int16, Int32, Schema, TaggedFields

from schemas.model_repo import ModelRepository
from schemas.topics import Topics, TopicSpec, replication_for
from weir.kafka.security import (
    DEFAULT_CLIENT,
    Grant,
    acl_creations,
    client_grants,
    client_options_from_env,
    new_salt,
    salted_password,
    service_grants,
)

log = logging.getLogger(__name__)

TOPIC_ALREADY_EXISTS = 36  # Kafka protocol error code
SCRAM_SHA_512 = 2  # ScramMechanism's code in AlterUserScramCredentials


def _admin(bootstrap: str, options: dict[str, Any] | None, **kwargs: Any) -> AIOKafkaAdminClient:
    """An admin client of `bootstrap` with `options`, else the environment's credentials."""
    security = client_options_from_env() if options is None else options
    return AIOKafkaAdminClient(bootstrap_servers=bootstrap, **kwargs, **security)


def deployment_specs(topics: Topics, repo: ModelRepository) -> list[TopicSpec]:
    """Every topic one deployment needs: the core topics plus the batch topic of each version the
    model repository seeds (versions pushed later get theirs from the batcher and the worker)."""
    specs = topics.core_specs()
    for config in repo.models.values():
        specs += topics.model_specs(config.served_id)
    return specs


async def wait_for_broker(bootstrap: str, timeout_s: float = 30.0, options: dict[str, Any] | None = None) -> None:
    """Return once a metadata request to `bootstrap` lists at least one broker; else TimeoutError."""
    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        admin = _admin(bootstrap, options, request_timeout_ms=5000)
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


async def broker_ids(bootstrap: str, options: dict[str, Any] | None = None) -> list[int]:
    """The node ids of the brokers the cluster's metadata lists now (a dead one drops out)."""
    admin = _admin(bootstrap, options, request_timeout_ms=5000)
    await admin.start()
    try:
        cluster = await admin.describe_cluster()
    finally:
        await admin.close()
    return sorted(broker["node_id"] for broker in cluster.get("brokers", []))


async def cluster_replication(admin: AIOKafkaAdminClient, bootstrap: str, wait_s: float = 60.0) -> int:
    """replication_for(the cluster's size): the brokers its metadata lists, or the servers
    `bootstrap` names when those are more. A starting cluster lists its brokers as they register,
    and a topic made then would keep fewer replicas for good, so this waits up to `wait_s` for
    that many to be listed; TimeoutError after it."""
    named = len({server.strip() for server in bootstrap.split(",") if server.strip()})
    deadline = time.monotonic() + wait_s
    while True:
        listed = len((await admin.describe_cluster()).get("brokers", []))
        wanted = replication_for(max(listed, named, 1))
        if listed >= wanted:
            return wanted
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{bootstrap} names {named} brokers, and topics get {wanted} replicas, but only "
                f"{listed} registered within {wait_s:.0f} s; start the others (weir kafka up --brokers)"
            )
        await asyncio.sleep(0.5)


async def ensure_topics(
    bootstrap: str,
    specs: list[TopicSpec],
    replication_factor: int | None = None,
    options: dict[str, Any] | None = None,
) -> list[str]:
    """Create the topics of `specs` that do not exist yet; returns the names it created.

    Each gets `replication_factor` replicas, by default cluster_replication's, and its spec's
    configs for that (min.insync.replicas; docs/design.md, "Scale-out and failover"). Idempotent:
    existing topics are left as they are (partitions and configs unchanged), and a topic another
    process creates at the same moment counts as existing.
    """
    admin = _admin(bootstrap, options)
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        missing = [spec for spec in specs if spec.name not in existing]
        if not missing:
            return []
        if replication_factor is None:
            replication_factor = await cluster_replication(admin, bootstrap)
        new_topics = [
            NewTopic(s.name, s.num_partitions, replication_factor, topic_configs=s.configs_for(replication_factor))
            for s in missing
        ]
        response = await admin.create_topics(new_topics, timeout_ms=30_000)
        created = []
        for topic, code, *rest in response.topic_errors:
            if code == 0:
                created.append(topic)
            elif code != TOPIC_ALREADY_EXISTS:
                message = rest[0] if rest else ""
                raise for_code(code)(f"creating topic {topic!r} failed: {message}")
        log.info("created topics %s", created)
        await wait_topics_visible(admin, {s.name: s.num_partitions for s in missing if s.name in created})
        return created
    finally:
        await admin.close()


async def wait_topics_visible(admin: AIOKafkaAdminClient, partitions: dict[str, int], timeout_s: float = 30.0) -> None:
    """Return once every broker's metadata shows each topic of `partitions` with that many
    partitions, each with a leader; TimeoutError after `timeout_s`, naming what is missing.

    A KRaft controller answers CreateTopics when the topic is committed to its log; each broker
    learns it when it replays that log, a little later (under load, seconds). A client that asks
    a broker in between is told the topic does not exist, and a consumer-group member then holds
    no partition of it until its next metadata refresh (docs/design.md, "Scale-out and failover").
    So topics are only handed over once every broker knows them, as Kafka's own tests wait."""
    if not partitions:
        return
    deadline = time.monotonic() + timeout_s
    while True:
        cluster = await admin.describe_cluster()
        lacking: list[str] = []
        for broker in cluster.get("brokers", []):
            node = broker["node_id"]
            try:
                response = await admin._send_request_to_node(
                    node, MetadataRequest(list(partitions), allow_auto_topic_creation=False)
                )
            except (TimeoutError, KafkaError, OSError) as exc:
                lacking.append(f"node {node} ({exc!r})")
                continue
            for topic in response.to_object()["topics"]:
                ready = [p for p in topic["partitions"] if p["leader"] >= 0]
                if topic["error_code"] != 0 or len(ready) < partitions.get(topic["topic"], 1):
                    lacking.append(f"{topic['topic']} on node {node}")
        if not lacking:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"topics made but not visible with a leader for every partition within "
                f"{timeout_s:.0f} s: {', '.join(lacking[:10])}"
            )
        await asyncio.sleep(0.1)


async def list_topic_names(bootstrap: str, options: dict[str, Any] | None = None) -> list[str]:
    """Every topic of the cluster."""
    admin = _admin(bootstrap, options)
    await admin.start()
    try:
        return list(await admin.list_topics())
    finally:
        await admin.close()


async def delete_topics(bootstrap: str, names: list[str], options: dict[str, Any] | None = None) -> None:
    """Delete `names` (in requests of 200 topics); topics already gone are no error."""
    if not names:
        return
    admin = _admin(bootstrap, options, request_timeout_ms=60_000)
    await admin.start()
    try:
        for i in range(0, len(names), 200):
            await admin.delete_topics(names[i : i + 200], timeout_ms=60_000)
    finally:
        await admin.close()


async def delete_prefixed_topics(bootstrap: str, prefix: str) -> None:
    """Delete every topic of the deployment under `prefix` (benchmarks and tests clean up with it)."""
    await delete_topics(bootstrap, [t for t in await list_topic_names(bootstrap) if t.startswith(f"{prefix}.")])


async def describe_topic_configs(
    bootstrap: str, names: list[str], options: dict[str, Any] | None = None
) -> dict[str, dict[str, str]]:
    """The effective configs of each topic in `names`, as {topic: {key: value}}."""
    admin = _admin(bootstrap, options)
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


async def create_acls(bootstrap: str, grants: list[Grant], options: dict[str, Any] | None = None) -> int:
    """Create the ALLOW ACLs of `grants` (an ACL that exists already is no error: idempotent);
    returns how many bindings were sent. Needs a super user's `options` on a secure cluster."""
    creations = acl_creations(grants)
    admin = _admin(bootstrap, options)
    await admin.start()
    try:
        for creation in creations:
            response = await admin._send_request(CreateAclsRequest(*creation))  # aiokafka has no create_acls
            for code, message in response.creation_responses:
                if code != 0:
                    raise for_code(code)(f"creating the ACL {creation} failed: {message}")
    finally:
        await admin.close()
    return len(creations)


class _AlterUserScramCredentialsResponse_v0(Response):
    API_KEY = 51
    API_VERSION = 0
    SCHEMA = Schema(
        ("throttle_time_ms", Int32),
        (
            "results",
            CompactArray(
                ("user", CompactString("utf-8")),
                ("error_code", Int16),
                ("error_message", CompactString("utf-8")),
                ("tags", TaggedFields),
            ),
        ),
        ("tags", TaggedFields),
    )


class _AlterUserScramCredentialsRequest_v0(RequestStruct):
    FLEXIBLE_VERSION = True
    API_KEY = 51
    API_VERSION = 0
    RESPONSE_TYPE = _AlterUserScramCredentialsResponse_v0
    SCHEMA = Schema(
        ("deletions", CompactArray(("name", CompactString("utf-8")), ("mechanism", Int8), ("tags", TaggedFields))),
        (
            "upsertions",
            CompactArray(
                ("name", CompactString("utf-8")),
                ("mechanism", Int8),
                ("iterations", Int32),
                ("salt", CompactBytes),
                ("salted_password", CompactBytes),
                ("tags", TaggedFields),
            ),
        ),
        ("tags", TaggedFields),
    )


class AlterUserScramCredentialsRequest(Request[_AlterUserScramCredentialsRequest_v0]):
    """KIP-554's AlterUserScramCredentials (API key 51), which aiokafka does not wrap: upsert one
    user's SCRAM-SHA-512 credential. The client salts and hashes; the password never travels."""

    API_KEY = 51

    def __init__(self, user: str, password: str, iterations: int) -> None:
        salt = new_salt()
        self._upsertion: tuple[Any, ...] = (
            user,
            SCRAM_SHA_512,
            iterations,
            salt,
            salted_password(password, salt, iterations),
            {},
        )

    def build(
        self, request_struct_class: type[_AlterUserScramCredentialsRequest_v0]
    ) -> _AlterUserScramCredentialsRequest_v0:
        return request_struct_class([], [self._upsertion], {})


async def upsert_scram_user(
    bootstrap: str, user: str, password: str, options: dict[str, Any] | None = None, iterations: int = 8192
) -> None:
    """Create `user` with `password` (SCRAM-SHA-512), or change its password; needs a super user."""
    admin = _admin(bootstrap, options)
    await admin.start()
    try:
        response = await admin._send_to_controller(AlterUserScramCredentialsRequest(user, password, iterations))
        for name, code, message, _tags in response.results:
            if code != 0:
                raise for_code(code)(f"setting the SCRAM credential of {name!r} failed: {message}")
    finally:
        await admin.close()


async def grant_deployment_acls(bootstrap: str, topics: Topics, options: dict[str, Any]) -> int:
    """Give the services and the default outside producer (`client`) their ACLs for `topics` on a
    secure cluster, and make `client`'s own request topic (idempotent; `options`: a super user's);
    returns how many bindings that is."""
    await ensure_topics(bootstrap, [topics.producer_requests_spec(DEFAULT_CLIENT)], options=options)
    return await create_acls(bootstrap, service_grants(topics) + client_grants(topics, DEFAULT_CLIENT), options)


async def add_client_user(bootstrap: str, topics: Topics, user: str, password: str, options: dict[str, Any]) -> None:
    """`weir kafka user add`: `user`'s SCRAM credential, its own request topic
    (<prefix>.requests.<user>) and an outside producer's ACLs for `topics`."""
    grants = client_grants(topics, user)  # checks the name first
    await upsert_scram_user(bootstrap, user, password, options)
    await ensure_topics(bootstrap, [topics.producer_requests_spec(user)], options=options)
    await create_acls(bootstrap, grants, options)
