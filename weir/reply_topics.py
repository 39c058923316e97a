"""Writing to topics that clients name (reply topics) without one of them holding up the others.

A request names its reply topic (`reply_to`); the services check the name where the record
enters (schemas/topics.py: Topics.reply_to_problem), but a legal name may still refuse writes:
the topic does not exist and the broker will not create it, it was deleted, the producer is not
authorised for it. aiokafka then waits out its request timeout (30 s) inside `send()` for the
topic's metadata, or retries the produce until that timeout, and the failure reads like a broker
outage (a retriable error): the worker stopped every request's writes for it and redid them.

TopicWriter sends to a topic whose metadata the producer has at once, as before. A topic it
has not seen yet is first looked up with one MetadataRequest of its own, in the background:
sends to that topic queue behind the lookup, in order, while every other topic's sends go on.
When the broker answers that the topic refuses writes, the queued sends (and any in the next
`refused_for_s`) fail with TopicRefused, which is not retriable: only the requests that named the
topic fail (docs/design.md, "Reply topics"). When no broker answers, they fail with a
KafkaConnectionError, an outage, which the services retry as before (invariant 3).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.errors import (
    InvalidTopicError,
    KafkaConnectionError,
    KafkaError,
    KafkaTimeoutError,
    LeaderNotAvailableError,
    NoError,
    TopicAuthorizationFailedError,
    UnknownTopicOrPartitionError,
    for_code,
)
from aiokafka.protocol.metadata import MetadataRequest

log = logging.getLogger(__name__)

# What a produce or a metadata lookup says about the topic itself, not about the broker.
_TOPIC_ERRORS = (UnknownTopicOrPartitionError, TopicAuthorizationFailedError, InvalidTopicError)


class TopicRefused(KafkaError):
    """A topic refused a write: it does not exist (and will not be created), it is not authorised,
    or its name is invalid. Not an outage: writes to other topics are not affected."""

    retriable = False

    def __init__(self, topic: str, why: str) -> None:
        super().__init__(f"topic {topic!r} refuses writes: {why}")
        self.topic = topic
        self.why = why


def failed_future(exc: BaseException) -> asyncio.Future:
    """A future that already failed with `exc` (the result of a send that was not made)."""
    future: asyncio.Future = asyncio.get_running_loop().create_future()
    future.set_exception(exc)
    return future


class TopicWriter:
    """Sends records through one producer; a topic that refuses writes fails only its own sends.

    `auto_create`: whether a lookup asks the broker to create a missing topic (it does so only
    where the broker allows it, `auto.create.topics.enable`); a missing topic then fails its sends
    only after `lookup_timeout_s`, the longest it may take to appear (without `auto_create`, at
    once). `refused_for_s`: how long a refused topic's sends fail at once, untried.
    """

    def __init__(
        self,
        producer: AIOKafkaProducer,
        *,
        auto_create: bool = True,
        lookup_timeout_s: float = 10.0,
        refused_for_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.producer = producer
        self.auto_create = auto_create
        self.lookup_timeout_s = lookup_timeout_s
        self.refused_for_s = refused_for_s
        self._clock = clock
        self._refused: dict[str, tuple[TopicRefused, float]] = {}  # topic -> (why, until when)
        self._queued: dict[
            str, list[tuple[bytes, bytes | None, int | None, list[tuple[str, bytes]] | None, asyncio.Future]]
        ] = {}
        self._tasks: set[asyncio.Task] = set()
        self.num_refused = 0  # sends failed with TopicRefused, since start

    def refusal(self, topic: str) -> TopicRefused | None:
        """Why `topic` refuses writes, when it was found to lately; else None."""
        found = self._refused.get(topic)
        if found is None:
            return None
        if self._clock() >= found[1]:
            del self._refused[topic]
            return None
        return found[0]

    def is_looking_up(self, topic: str) -> bool:
        """Whether sends to `topic` wait for its lookup now."""
        return topic in self._queued

    async def send(
        self,
        topic: str,
        value: bytes,
        key: bytes | None,
        partition: int | None = None,
        headers: list[tuple[str, bytes]] | None = None,
    ) -> asyncio.Future:
        """Produce one record (with `headers`: trace context); returns the future of its durable
        write. Never waits for a topic's metadata: a topic not known yet is looked up in the
        background, its sends queued."""
        refused = self.refusal(topic)
        if refused is not None:
            self.num_refused += 1
            return failed_future(refused)
        queue = self._queued.get(topic)
        if queue is None and self.producer.client.cluster.partitions_for_topic(topic):
            return self._watched(
                topic, await self.producer.send(topic, value, key=key, partition=partition, headers=headers)
            )
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        if queue is None:
            queue = self._queued[topic] = []
            self._spawn(self._look_up_then_send(topic))
        queue.append((value, key, partition, headers, future))
        return future

    # -- a topic not seen yet ---------------------------------------------------------------------

    async def _look_up_then_send(self, topic: str) -> None:
        failure: KafkaError | None = None
        try:
            failure = await self._look_up(topic)
        except Exception as exc:  # noqa: BLE001 - every queued send must end
            failure = KafkaConnectionError(f"looking up topic {topic!r} failed: {exc!r}")
        queue = self._queued[topic]
        try:
            while queue:
                value, key, partition, headers, future = queue.pop(0)
                if failure is None:
                    try:
                        inner = await self.producer.send(topic, value, key=key, partition=partition, headers=headers)
                    except KafkaError as exc:
                        _settle(future, exc)
                        continue
                    _chain(self._watched(topic, inner), future)
                else:
                    if isinstance(failure, TopicRefused):
                        self.num_refused += 1
                    _settle(future, failure)
        finally:
            del self._queued[topic]

    async def _look_up(self, topic: str, *, explaining: bool = False) -> KafkaError | None:
        """None once the producer has `topic`'s partitions; else why its sends fail: TopicRefused
        when the broker says the topic refuses writes (or, for a topic not seen yet, when it never
        became available), a connection error when no broker answers.

        `explaining` a failed write to a known topic: a broker that does not answer at once, or a
        topic that stays without a leader, is the outage the failure said it was (no TopicRefused)."""
        deadline = self._clock() + self.lookup_timeout_s
        last: BaseException | None = None
        answered = False
        while self._clock() < deadline:
            client = self.producer.client
            node_id = client.get_random_node()
            try:
                if node_id is None:
                    raise KafkaConnectionError("no broker known")
                request = MetadataRequest([topic], allow_auto_topic_creation=self.auto_create)
                # A broker that does not answer holds a request for the client's whole timeout (30 s).
                response = await asyncio.wait_for(client.send(node_id, request), max(0.1, deadline - self._clock()))
            except (TimeoutError, KafkaError) as exc:
                last = exc
                if explaining and not answered:
                    break
                await asyncio.sleep(0.2)
                continue
            answered = True
            error = _topic_error(response, topic)
            if error is NoError:
                remaining = max(0.1, deadline - self._clock())
                try:  # the producer's own metadata now (the topic exists: this returns at once)
                    await asyncio.wait_for(self.producer.partitions_for(topic), remaining)
                    return None
                except (TimeoutError, KafkaError) as exc:
                    last = exc
                    continue
            # Asked to create it, a KRaft broker answers UNKNOWN_TOPIC_OR_PARTITION until it
            # exists (and for ever where it does not create topics): wait for it, up to the timeout.
            if error in _TOPIC_ERRORS and not (self.auto_create and error is UnknownTopicOrPartitionError):
                return self._refuse(topic, _WHY[error])
            last = error()  # LeaderNotAvailable while it is created, or another passing error
            await asyncio.sleep(0.1)
        if isinstance(last, UnknownTopicOrPartitionError):  # asked to create it, the broker did not
            return self._refuse(topic, _WHY[UnknownTopicOrPartitionError])
        if answered and not explaining:
            return self._refuse(topic, f"not available after {self.lookup_timeout_s:g} s ({last!r})")
        return KafkaConnectionError(f"no broker answered a lookup of topic {topic!r} ({last!r})")

    def _refuse(self, topic: str, why: str) -> TopicRefused:
        refused = TopicRefused(topic, why)
        now = self._clock()
        for name in [t for t, (_, until) in self._refused.items() if until <= now]:
            del self._refused[name]
        self._refused[topic] = (refused, now + self.refused_for_s)
        log.warning("%s; its writes fail for the next %g s", refused, self.refused_for_s)
        return refused

    # -- a topic that refuses writes after it was known ---------------------------------------------

    def _watched(self, topic: str, inner: asyncio.Future) -> asyncio.Future:
        """The future of a send to a known topic, whose failure says whether the topic refused it
        (deleted meanwhile, not authorised) rather than the broker being away."""
        outer: asyncio.Future = asyncio.get_running_loop().create_future()

        def done(_: asyncio.Future) -> None:
            if inner.cancelled():
                outer.cancel()
            elif (exc := inner.exception()) is None:
                _settle(outer, None, inner.result())
            elif isinstance(exc, _TOPIC_ERRORS):
                self.num_refused += 1
                _settle(outer, self._refuse(topic, f"{type(exc).__name__} on write"))
            elif isinstance(exc, (KafkaTimeoutError, asyncio.TimeoutError)) or getattr(exc, "retriable", False):
                self._spawn(self._explain(topic, exc, outer))  # the topic, or the broker?
            else:
                _settle(outer, exc)

        inner.add_done_callback(done)
        return outer

    async def _explain(self, topic: str, exc: BaseException, outer: asyncio.Future) -> None:
        """A write to a known topic failed with a retriable error (it timed out): a topic that
        the broker now says refuses writes makes it a TopicRefused; else it stays an outage."""
        try:  # a broker that does not answer at once is the outage the failure said it was
            found = await self._look_up(topic, explaining=True)
        except Exception:  # noqa: BLE001 - keep the original failure
            found = None
        if isinstance(found, TopicRefused):
            self.num_refused += 1
            _settle(outer, found)
        else:
            _settle(outer, exc)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


_WHY = {
    UnknownTopicOrPartitionError: "it does not exist (and the broker does not create it)",
    TopicAuthorizationFailedError: "this producer is not authorised to write it",
    InvalidTopicError: "the broker says its name is invalid",
}


def _topic_error(response: Any, topic: str) -> type[KafkaError]:
    """The error class the MetadataResponse gives for `topic` (NoError when it has a leader for
    every partition; LeaderNotAvailableError while one has none)."""
    for topic_data in response.topics:
        error_code, name, partitions = topic_data[0], topic_data[1], topic_data[-1]
        if name != topic:
            continue
        error = for_code(error_code)
        if error is NoError and (not partitions or any(p[2] == -1 for p in partitions)):
            return LeaderNotAvailableError
        return error
    return LeaderNotAvailableError


def _settle(future: asyncio.Future, exc: BaseException | None, result: Any = None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


def _chain(inner: asyncio.Future, outer: asyncio.Future) -> None:
    def done(_: asyncio.Future) -> None:
        if inner.cancelled():
            outer.cancel()
        else:
            _settle(outer, inner.exception(), None if inner.exception() else inner.result())

    inner.add_done_callback(done)
