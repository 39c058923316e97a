"""Kafka helpers of the batcher tests: produce, read a topic to a condition, read group offsets."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from schemas.codec import encode
from schemas.messages import GenerateRequest
from tests.waiting import until


async def produce(bootstrap: str, topic: str, items: Sequence[GenerateRequest | tuple[str, bytes]]) -> None:
    """Produce requests keyed by request_id, or raw (key, value) pairs, and wait for the acks."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True)
    await producer.start()
    try:
        futures = []
        for item in items:
            key, value = (item.request_id, encode(item)) if isinstance(item, GenerateRequest) else item
            futures.append(await producer.send(topic, value, key=key.encode()))
        await asyncio.gather(*futures)
    finally:
        await producer.stop()


async def read_until(
    bootstrap: str, topics: list[str], is_done: Callable[[list[ConsumerRecord]], bool], timeout_s: float = 30
) -> list[ConsumerRecord]:
    """Read `topics` from the start until is_done(records so far) or the timeout; returns the records."""
    consumer = AIOKafkaConsumer(
        *topics, bootstrap_servers=bootstrap, group_id=None, auto_offset_reset="earliest", fetch_max_wait_ms=50
    )
    await consumer.start()
    records: list[ConsumerRecord] = []
    deadline = time.monotonic() + timeout_s
    try:
        while not is_done(records) and time.monotonic() < deadline:
            for batch in (await consumer.getmany(timeout_ms=200)).values():
                records.extend(batch)
    finally:
        await consumer.stop()
    return records


async def group_lag(bootstrap: str, group: str, topic: str) -> dict[int, tuple[int, int]]:
    """{partition: (committed offset or -1, end offset)} for the partitions of `topic` that hold records."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None)
    await admin.start()
    await consumer.start()
    try:
        committed: dict[Any, Any] = await admin.list_consumer_group_offsets(group)
        [described] = await admin.describe_topics([topic])
        tps = [TopicPartition(topic, p["partition"]) for p in described["partitions"]]
        ends = await consumer.end_offsets(tps)
    finally:
        await consumer.stop()
        await admin.close()
    return {tp.partition: (committed[tp].offset if tp in committed else -1, end) for tp, end in ends.items() if end > 0}


async def wait_committed(bootstrap: str, group: str, topic: str, timeout_s: float = 20) -> dict[int, tuple[int, int]]:
    """Until the group's committed offsets reach the end offsets (tests/waiting.py: until); returns
    that reading, {partition: (committed, end)}."""

    read: list[dict[int, tuple[int, int]]] = [{}]

    async def caught_up() -> bool:  # (an empty reading, no partition holding records, is caught up too)
        read[0] = await group_lag(bootstrap, group, topic)
        return all(committed == end for committed, end in read[0].values())

    await until(
        caught_up, timeout_s=timeout_s, interval_s=0.3, what=f"group {group}'s commits to reach the end of {topic}"
    )
    return read[0]
