"""Requests from outside producers are bound to the producer that wrote them.

In a secure deployment each outside producer (a Kafka user: `client`, or one `weir kafka user add`
made) may write only its own request topic, `<prefix>.requests.<user>` (Topics.producer_requests),
and the broker has authenticated whoever wrote there. What such a record says about who asked is
therefore not taken on trust (docs/design.md, "The Kafka trust boundary"):

- its principal is the producer's user name and its tenant PRODUCER_TENANT, whatever it claims;
- its `reply_to` must be one of the producer's own reply topics (`<prefix>.replies.<user>.<name>`),
  else the request is dead-lettered with the reason and no reply is written anywhere.

Requests on `<prefix>.requests` itself (the gateway's and the batch jobs', trusted principals only
in secure mode) are kept as they are.
"""

from __future__ import annotations

from typing import overload

from schemas.messages import EmbedRequest, GenerateRequest
from schemas.topics import Topics

PRODUCER_TENANT = "kafka"  # the tenant of every request an outside producer writes to its own topic


class ProducerBindingError(ValueError):
    """A request an outside producer may not make: its reply_to names another reader's topic."""


@overload
def bind_to_producer(topics: Topics, topic: str, req: GenerateRequest) -> GenerateRequest: ...
@overload
def bind_to_producer(topics: Topics, topic: str, req: EmbedRequest) -> EmbedRequest: ...
@overload
def bind_to_producer(
    topics: Topics, topic: str, req: GenerateRequest | EmbedRequest
) -> GenerateRequest | EmbedRequest: ...
def bind_to_producer(topics: Topics, topic: str, req: GenerateRequest | EmbedRequest) -> GenerateRequest | EmbedRequest:
    """`req`, read from `topic`, as the deployment serves it: unchanged from the requests topic;
    from an outside producer's topic, with that producer as principal and PRODUCER_TENANT as tenant.
    ProducerBindingError (the reason) when its reply_to is not one of that producer's reply topics."""
    producer = topics.producer_of(topic)
    if producer is None:
        return req
    if (problem := topics.request_source_problem(topic, req.reply_to)) is not None:
        raise ProducerBindingError(problem)
    if req.principal == producer and req.tenant == PRODUCER_TENANT:
        return req
    return req.model_copy(update={"principal": producer, "tenant": PRODUCER_TENANT})
