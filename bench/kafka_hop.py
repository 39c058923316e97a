"""`weir bench hop`: the floor under the Kafka path, one hop measured the way the services make it.

The gateway -> batcher -> worker -> gateway path makes three Kafka hops before a client sees its
first token, so three times one hop is the least the path can add to time-to-first-token, before
any service does any work. Measured side by side in one run, between two processes on this
machine, one message at a time with a gap between them (as at concurrency 1):

- a loopback TCP message between two asyncio processes: what waking a peer costs here;
- one Kafka hop: an aiokafka producer and consumer built by weir.bus (acks=all, idempotent,
  read_committed, the services' fetch settings) through the local broker, split at the sockets
  into the producer client (send() -> the request written), the broker and loopback (-> the fetch
  response readable in the consumer) and the consumer client (-> the record returned).

The split stamps socket writes and reads of CPython's selector event loop in both processes;
clocks are CLOCK_MONOTONIC, shared by the processes of one machine.
"""

from __future__ import annotations

import argparse
import asyncio
import asyncio.selector_events
import contextlib
import multiprocessing
import time
import uuid
from collections.abc import Iterator
from typing import Any

from bench.stats import percentile, print_table

_stamps: dict[str, list[float]] = {"write": [], "read": []}


@contextlib.contextmanager
def stamped_socket_io() -> Iterator[None]:
    """Record the time of every socket write and every readable socket in this process, until
    the block ends (then the event loop's transport is as it was, and the stamps are gone)."""
    transport: Any = getattr(asyncio.selector_events, "_SelectorSocketTransport")  # noqa: B009 - CPython internal, not in the stubs
    write, read_ready = transport.write, transport._read_ready

    def stamped_write(self, data) -> None:
        _stamps["write"].append(time.perf_counter())
        write(self, data)

    def stamped_read_ready(self) -> None:
        _stamps["read"].append(time.perf_counter())
        read_ready(self)

    transport.write, transport._read_ready = stamped_write, stamped_read_ready
    try:
        yield
    finally:
        transport.write, transport._read_ready = write, read_ready
        for stamps in _stamps.values():
            stamps.clear()


# -- loopback TCP ---------------------------------------------------------------------------------


def _tcp_echo(port: int, ready) -> None:
    async def serve() -> None:
        async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while data := await reader.read(64):
                writer.write(data)

        server = await asyncio.start_server(echo, "127.0.0.1", port)
        ready.set()
        async with server:
            await server.serve_forever()

    asyncio.run(serve())


async def _tcp_one_way_ms(count: int, gap_s: float) -> list[float]:
    from weir.stack import free_ports

    (port,) = free_ports(1)
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    child = context.Process(target=_tcp_echo, args=(port, ready), daemon=True)
    child.start()
    try:
        await asyncio.to_thread(ready.wait, 30)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        out = []
        for _ in range(count):
            start = time.perf_counter()
            writer.write(b"12345678")
            await reader.readexactly(8)
            out.append((time.perf_counter() - start) * 1000 / 2)
            await asyncio.sleep(gap_s)
        writer.close()
        return out
    finally:
        child.kill()
        child.join(5)


# -- one Kafka hop --------------------------------------------------------------------------------


def _kafka_sink(bootstrap: str, topic: str, ready, results) -> None:
    """The consumer process: for each record, (its index, socket readable at, returned at)."""

    async def consume() -> None:
        from weir.bus import BusSettings, make_consumer

        consumer = make_consumer(
            BusSettings(kafka_bootstrap=bootstrap),
            topic,
            client_id="bench-hop-sink",
            group_id=None,
            auto_offset_reset="latest",
        )
        await consumer.start()
        await consumer.seek_to_end()
        ready.set()
        out = []
        try:
            while True:
                record = await consumer.getone()
                returned = time.perf_counter()
                if record.value == b"stop":
                    break
                index, sent = record.value.split()
                readable = [t for t in _stamps["read"] if float(sent) < t <= returned]
                out.append((int(index), readable[0] if readable else float("nan"), returned))
                _stamps["read"].clear()
        finally:
            await consumer.stop()
        results.put(out)

    with stamped_socket_io():
        asyncio.run(consume())


async def _kafka_hops(bootstrap: str, count: int, gap_s: float, num_warmup: int) -> dict[str, list[float]]:
    from schemas.topics import TopicSpec
    from weir.bus import BusSettings, make_producer
    from weir.kafka.admin import delete_prefixed_topics, ensure_topics

    prefix = f"benchhop{uuid.uuid4().hex[:6]}"
    topic = f"{prefix}.hop"
    await ensure_topics(bootstrap, [TopicSpec(topic, 1)])
    context = multiprocessing.get_context("spawn")
    ready, results = context.Event(), context.Queue()
    child = context.Process(target=_kafka_sink, args=(bootstrap, topic, ready, results), daemon=True)
    child.start()
    producer = make_producer(BusSettings(kafka_bootstrap=bootstrap), client_id="bench-hop")
    await producer.start()
    try:
        await asyncio.to_thread(ready.wait, 60)
        await asyncio.sleep(0.5)
        for _ in range(num_warmup):  # back to back, not measured: a broker just started runs cold (JIT)
            await (await producer.send(topic, f"-1 {time.perf_counter()!r}".encode()))
        sent_at, written_at, acked_at = [], [], []
        with stamped_socket_io():
            for i in range(count):
                _stamps["write"].clear()
                start = time.perf_counter()
                future = await producer.send(topic, f"{i} {start!r}".encode())
                await future
                acked_at.append(time.perf_counter())
                sent_at.append(start)
                written_at.append(next((t for t in _stamps["write"] if t >= start), float("nan")))
                _stamps["read"].clear()  # the acks' reads: not used here
                await asyncio.sleep(gap_s)
        await producer.send_and_wait(topic, b"stop")
        received = await asyncio.to_thread(results.get, True, 60)
    finally:
        await producer.stop()
        child.join(10)
        if child.is_alive():
            child.kill()
        await delete_prefixed_topics(bootstrap, prefix)
    by_index = {i: (readable, returned) for i, readable, returned in received if i >= 0}
    hops: dict[str, list[float]] = {"hop": [], "producer": [], "broker": [], "consumer": [], "ack": []}
    for i, (sent, written, acked) in enumerate(zip(sent_at, written_at, acked_at, strict=True)):
        if i not in by_index:
            continue
        readable, returned = by_index[i]
        hops["hop"].append((returned - sent) * 1000)
        hops["producer"].append((written - sent) * 1000)
        hops["broker"].append((readable - written) * 1000)
        hops["consumer"].append((returned - readable) * 1000)
        hops["ack"].append((acked - sent) * 1000)
    return hops


async def measure_kafka_hop(bootstrap: str, count: int, gap_s: float, num_warmup: int) -> dict[str, list[float]]:
    """One Kafka hop, `count` messages `gap_s` apart after `num_warmup` unmeasured ones, the first
    10% of the measured dropped (a new producer and consumer settling): ms per message, by part
    ("hop", "producer", "broker", "consumer", "ack"). `weir bench hop` and `weir bench pipeline`
    both measure the hop with this."""
    skip = count // 10
    return {k: v[skip:] for k, v in (await _kafka_hops(bootstrap, count, gap_s, num_warmup)).items()}


def three_hop_floor_ms(hop_ms: list[float]) -> float:
    """The least the gateway -> batcher -> worker -> gateway path adds to TTFT: three hops at one
    hop's p50 (not a measured chain of three; a sum of three medians, a little under the median
    of a sum of three when, as here, a hop's tail is long on the slow side)."""
    return 3 * percentile(hop_ms, 50)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="weir bench hop", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--bootstrap", default="127.0.0.1:9092")
    parser.add_argument("--count", type=int, default=300, help="messages per path (the first 10%% are dropped)")
    parser.add_argument("--gap-ms", type=float, default=15.0, help="idle time between two messages")
    parser.add_argument("--warmup", type=int, default=2000, help="Kafka messages sent back to back first, not measured")
    args = parser.parse_args(argv)
    from weir.kafka import launcher

    broker = launcher.BrokerConfig.from_env()
    if args.bootstrap == broker.bootstrap:
        asyncio.run(launcher.up(broker, 120))
    gap_s, skip = args.gap_ms / 1000, args.count // 10
    tcp = asyncio.run(_tcp_one_way_ms(args.count, gap_s))[skip:]
    hops = asyncio.run(measure_kafka_hop(args.bootstrap, args.count, gap_s, args.warmup))
    labels = [
        ("loopback TCP message, asyncio, two processes", tcp),
        ("one Kafka hop, aiokafka with weir.bus settings", hops["hop"]),
        ("  producer client: send() -> request written", hops["producer"]),
        ("  broker + loopback: -> fetch response readable", hops["broker"]),
        ("  consumer client: readable -> record returned", hops["consumer"]),
        ("producer ack: send() -> durable (acks=all)", hops["ack"]),
    ]
    rows = [[label, f"{percentile(v, 50):.2f}", f"{percentile(v, 90):.2f}", str(len(v))] for label, v in labels]
    print(f"one message at a time, {args.gap_ms:.0f} ms apart, between two processes on this machine\n")
    print_table(rows, ["path (one way)", "p50 ms", "p90 ms", "n"])
    floor = three_hop_floor_ms(hops["hop"])
    print(
        f"\nthree hops, the least the gateway -> batcher -> worker -> gateway path adds to TTFT before any "
        f"service works: {floor:.1f} ms (3 x p50)"
    )
    return 0
