"""Requests from an outside producer's own topic are bound to it (schemas/producers.py)."""

from __future__ import annotations

import re

import pytest

from schemas.messages import EmbedRequest, GenerateRequest
from schemas.producers import PRODUCER_TENANT, ProducerBindingError, bind_to_producer
from schemas.topics import Topics

WEIR = Topics("weir")


def _generate(reply_to: str, principal: str = "alice", tenant: str = "acme") -> GenerateRequest:
    return GenerateRequest(
        request_id="r1",
        model="echo",
        prompt="hi",
        principal=principal,
        tenant=tenant,
        deadline_ms=2_000_000_000_000,
        reply_to=reply_to,
    )


def test_the_request_topics_are_the_shared_one_and_one_per_producer() -> None:
    assert WEIR.producer_requests("client") == "weir.requests.client"
    assert WEIR.producer_requests_spec("bob").name == "weir.requests.bob"
    assert WEIR.producer_requests_spec("bob").num_partitions == next(
        s.num_partitions for s in WEIR.core_specs() if s.name == WEIR.requests
    )
    pattern = re.compile(WEIR.requests_pattern)
    for topic in ("weir.requests", "weir.requests.client", "weir.requests.a_b-9"):
        assert pattern.fullmatch(topic), topic
    for topic in (
        "weir.requestsX",
        "weir.requests.",
        "weir.requests.a.b",
        "weir.requests.Bob",
        "xweir.requests",
        "weir.replies.client",
        "weir.requests.-x",
        "weirXrequests",
    ):
        assert not pattern.search(topic), topic
    assert WEIR.producer_of("weir.requests") is None
    assert WEIR.producer_of("weir.requests.bob") == "bob"
    with pytest.raises(ValueError, match="not a request topic"):
        WEIR.producer_of("weir.control")
    # The prefix is escaped: a "." in it matches only a dot.
    assert not re.search(Topics("a.b").requests_pattern, "aXb.requests")


def test_the_shared_requests_topic_keeps_what_the_request_says() -> None:
    req = _generate("weir.replies.bob.x")
    assert bind_to_producer(WEIR, WEIR.requests, req) is req


@pytest.mark.parametrize("reply_to", ["weir.replies.client.x", "weir.replies.client.a.b", "weir.replies.client.-"])
def test_a_producers_request_is_served_as_that_producer(reply_to: str) -> None:
    bound = bind_to_producer(WEIR, "weir.requests.client", _generate(reply_to))
    assert (bound.principal, bound.tenant, bound.reply_to) == ("client", PRODUCER_TENANT, reply_to)
    embed = EmbedRequest(
        request_id="e1",
        model="minilm",
        inputs=["x"],
        principal="alice",
        tenant="acme",
        deadline_ms=2_000_000_000_000,
        reply_to=reply_to,
    )
    assert (bind_to_producer(WEIR, "weir.requests.client", embed).principal, PRODUCER_TENANT) == ("client", "kafka")


@pytest.mark.parametrize(
    "reply_to",
    [
        "weir.replies.bob.x",  # another producer's stream
        "weir.replies.gateway-up-8000",  # a gateway's
        "weir.replies.job.batch_1",  # a batch job's
        "weir.replies.client",  # not under the prefix: the prefix ends with its dot
        "weir.replies.client.",  # the prefix alone
        "weir.replies.clientx.y",  # a longer name that starts the same
    ],
)
def test_a_producer_cannot_name_another_readers_reply_topic(reply_to: str) -> None:
    with pytest.raises(ProducerBindingError, match=r"must be weir\.replies\.client\.<name>"):
        bind_to_producer(WEIR, "weir.requests.client", _generate(reply_to))
    assert WEIR.request_source_problem("weir.requests.client", reply_to) is not None
    assert WEIR.request_source_problem(WEIR.requests, reply_to) is None
