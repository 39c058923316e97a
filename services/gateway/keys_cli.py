"""`weir keys create|revoke|list`: the gateway's API keys, kept on the compacted keys topic.

    weir keys create --principal alice --tenant acme [--models echo,weir-tiny-py] [--rpm 60] [--tpm 20000]
    weir keys revoke KEY_ID
    weir keys list [--json]

`create` prints the key once: only sha256(salt || secret) is published, so it cannot be shown
again. Every gateway instance follows the topic, so a new or revoked key takes effect on all of
them within their consumer lag (well under a second on a healthy cluster). Exit codes: 0 done,
1 Kafka unreachable, 2 bad arguments or unknown key.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from datetime import UTC, datetime

import orjson
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError

from schemas.codec import DecodeError, decode, encode
from schemas.messages import ApiKeyRecord
from services.gateway.guard.auth import KeyStore, new_api_key, revoked
from weir.bus import BusSettings, make_producer, partitions_of
from weir.kafka.admin import ensure_topics, wait_for_broker


async def publish_record(settings: BusSettings, record: ApiKeyRecord) -> None:
    """Write a key record (keyed by key_id) and wait until the broker has it durably."""
    topics = settings.topics
    await wait_for_broker(settings.kafka_bootstrap, timeout_s=15)
    spec = next(spec for spec in topics.core_specs() if spec.name == topics.keys)
    await ensure_topics(settings.kafka_bootstrap, [spec])
    producer = make_producer(settings, client_id="weir-keys")
    await producer.start()
    try:
        await producer.send_and_wait(topics.keys, encode(record), key=record.key_id.encode())
    finally:
        await producer.stop()


async def read_keys(settings: BusSettings) -> dict[str, ApiKeyRecord]:
    """The latest record of every key_id: the keys topic read from its beginning to its end."""
    await wait_for_broker(settings.kafka_bootstrap, timeout_s=15)
    consumer = AIOKafkaConsumer(
        bootstrap_servers=settings.kafka_bootstrap, group_id=None, enable_auto_commit=False, **settings.kafka_options()
    )
    await consumer.start()
    store = KeyStore()
    try:
        if settings.topics.keys not in await consumer.topics():  # also refreshes the metadata
            return {}
        tps = [
            TopicPartition(settings.topics.keys, p) for p in sorted(await partitions_of(consumer, settings.topics.keys))
        ]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        while [tp for tp, end in ends.items() if await consumer.position(tp) < end]:
            for batch in (await consumer.getmany(timeout_ms=500)).values():
                for message in batch:
                    try:
                        store.observe(decode(ApiKeyRecord, message.value))
                    except DecodeError:
                        continue
    finally:
        await consumer.stop()
    return {record.key_id: record for record in store.records()}


async def create_key(
    settings: BusSettings,
    principal: str,
    tenant: str,
    models: list[str] | None = None,
    max_requests_per_min: int | None = None,
    max_tokens_per_min: int | None = None,
) -> tuple[str, ApiKeyRecord]:
    """Make a key and publish its record; returns (the key, shown once; the record)."""
    key, record = new_api_key(principal, tenant, models, max_requests_per_min, max_tokens_per_min)
    await publish_record(settings, record)
    return key, record


async def revoke_key(settings: BusSettings, key_id: str) -> ApiKeyRecord:
    """Publish the revocation of `key_id`; raises KeyError when no such key exists."""
    record = (await read_keys(settings)).get(key_id)
    if record is None:
        raise KeyError(key_id)
    record = revoked(record)
    await publish_record(settings, record)
    return record


def _models(value: str) -> list[str]:
    return [m.strip() for m in value.split(",") if m.strip()]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="weir keys", description="Create, revoke and list the gateway's API keys.")
    parser.add_argument("--kafka-bootstrap", help="Kafka bootstrap servers (WEIR_KAFKA_BOOTSTRAP)")
    parser.add_argument("--topic-prefix", help="topic prefix of the deployment (WEIR_TOPIC_PREFIX)")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    create = actions.add_parser("create", help="create a key and print it (once)")
    create.add_argument("--principal", required=True, help="who the key belongs to")
    create.add_argument("--tenant", required=True, help="tenant of the principal")
    create.add_argument("--models", type=_models, default=[], help="comma-separated models it may use (default: all)")
    create.add_argument("--rpm", type=int, help="requests per minute (default: no limit)")
    create.add_argument("--tpm", type=int, help="tokens per minute (default: no limit)")
    revoke = actions.add_parser("revoke", help="revoke a key on every gateway")
    revoke.add_argument("key_id", help="the key's id (the part after weir_, as `list` shows it)")
    listing = actions.add_parser("list", help="list the keys (never their secrets)")
    listing.add_argument("--json", action="store_true", help="one JSON record per line")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of `weir keys`; returns the exit code."""
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    overrides = {"kafka_bootstrap": args.kafka_bootstrap, "topic_prefix": args.topic_prefix}
    settings = BusSettings(**{k: v for k, v in overrides.items() if v is not None})
    for name in ("rpm", "tpm"):
        if getattr(args, name, None) is not None and getattr(args, name) < 1:
            print(f"weir keys: --{name} must be >= 1", file=sys.stderr)
            return 2
    try:
        if args.action == "create":
            key, record = asyncio.run(
                create_key(settings, args.principal, args.tenant, args.models, args.rpm, args.tpm)
            )
            print(f"key_id: {record.key_id}\nprincipal: {record.principal}  tenant: {record.tenant}")
            print(f"api key (shown once, store it now): {key}")
        elif args.action == "revoke":
            record = asyncio.run(revoke_key(settings, args.key_id))
            print(f"revoked {record.key_id} ({record.principal}, tenant {record.tenant})")
        else:
            _print_keys(list(asyncio.run(read_keys(settings)).values()), args.json)
    except KeyError as exc:
        print(f"weir keys: no key {exc.args[0]!r} under prefix {settings.topic_prefix!r}", file=sys.stderr)
        return 2
    except (KafkaError, OSError, TimeoutError) as exc:
        print(f"weir keys: Kafka at {settings.kafka_bootstrap}: {exc!r}; is Kafka up? (weir kafka up)", file=sys.stderr)
        return 1
    return 0


def _print_keys(records: list[ApiKeyRecord], as_json: bool) -> None:
    records.sort(key=lambda r: r.created_ms)
    if as_json:
        for record in records:
            print(orjson.dumps(record.model_dump(mode="json", exclude={"salt_hex", "secret_sha256"})).decode())
        return
    print(f"{'KEY_ID':<14}{'PRINCIPAL':<20}{'TENANT':<16}{'MODELS':<24}{'RPM':>7}{'TPM':>9}  {'STATUS':<8}CREATED")
    for r in records:
        created = datetime.fromtimestamp(r.created_ms / 1000, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        models = ",".join(r.models) or "*"
        rpm = r.max_requests_per_min or "-"
        tpm = r.max_tokens_per_min or "-"
        status = "revoked" if r.is_revoked else "active"
        print(f"{r.key_id:<14}{r.principal:<20}{r.tenant:<16}{models:<24}{rpm:>7}{tpm:>9}  {status:<8}{created}")


if __name__ == "__main__":
    sys.exit(main())
