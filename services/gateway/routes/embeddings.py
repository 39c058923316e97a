"""POST /v1/embeddings: a body becomes one or more EmbedRequests, answered as one JSON body."""

from __future__ import annotations

import uuid

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response

from schemas.messages import EmbedRequest, Priority, ReplyEnd, Usage, now_ms
from services.gateway.guard.gate import Admitted
from services.gateway.kafka_bus import Exchange
from services.gateway.openai_format import ApiError, embedding_body, parse_embedding_body, to_embed_requests
from services.gateway.routes.parts import GatewayParts
from services.gateway.routes.reading import header_timeout_s, read_body
from services.gateway.streaming import collect_ends, served_headers


def add_embedding_routes(router: APIRouter, parts: GatewayParts) -> None:
    """Add the embeddings endpoint to `router` (the app's)."""

    @router.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        return await embed(parts, request)


async def embed(parts: GatewayParts, request: Request) -> Response:
    """Credentials → body → EmbedRequests → admitted → published and collected."""
    request_id = request.state.request_id = f"embd-{uuid.uuid4().hex}"
    raw = await read_body(request, parts.settings.max_body_bytes)
    headers = dict(request.headers)
    identity = parts.guard.authenticate(headers)
    body = parse_embedding_body(raw)
    # the version it names or is assigned (one for every part of the body); the requests go out pinned to it
    model, assignment = parts.model(body.model, identity, body.user, request_id)
    parts.guard.authorize(identity, model.served_id)
    max_timeout_s = parts.settings.max_timeout_s
    embeds = to_embed_requests(
        body,
        model,
        request_id=request_id,
        reply_to=parts.bus.reply_topic,
        now_ms=now_ms(),
        client_timeout_s=header_timeout_s(headers, max_timeout_s),
        max_timeout_s=max_timeout_s,
        principal=identity.principal,
        tenant=identity.tenant,
        assignment=assignment,
    )
    lane, admitted = await parts.guard.admit_embedding(identity, model, body.inputs, headers)
    ends = await run_embeds(parts, request, request_id, embeds, lane, admitted)
    if ends is None:
        return Response(status_code=499, headers={"x-request-id": request_id})
    result = embedding_body(model.served_id, ends, body.encoding_format)
    headers = {"x-request-id": request_id, **served_headers(parts.catalog.version_tag(result["model"]), embeds[0])}
    return Response(orjson.dumps(result), media_type="application/json", headers=headers)


async def run_embeds(
    parts: GatewayParts,
    request: Request,
    request_id: str,
    embeds: list[EmbedRequest],
    lane: Priority,
    admitted: Admitted,
) -> list[ReplyEnd] | None:
    """Publish the parts of a body in `lane` and wait for every terminal; None when the client left
    first. The reservation is corrected by the usage of all parts once every part ended."""
    exchanges: list[Exchange] = []
    status: int | str = 500
    usage: ReplyEnd | None = None
    try:
        for part in embeds:  # more than one when the input exceeds what one reply can carry
            exchanges.append(
                await parts.bus.submit(
                    part.model_copy(update={"priority": lane}), dict(request.headers), "/v1/embeddings"
                )
            )
            request.state.is_submitted = True
        ends = await collect_ends(exchanges, request.receive)
        if ends is None:
            status = "client_gone"
            return None
        usage = embedding_usage(request_id, ends)
        status = 200
        return ends
    except ApiError as error:
        status = error.status
        raise
    finally:
        for exchange in exchanges:
            exchange.close("client_disconnect", status=status)
        admitted.release(usage)


def embedding_usage(request_id: str, ends: list[ReplyEnd]) -> ReplyEnd:
    """One terminal that carries the prompt tokens of every part: what the reservation is corrected by."""
    num_tokens = sum(end.usage.prompt_tokens for end in ends)
    return ReplyEnd(request_id=request_id, seq=0, finish_reason="stop", usage=Usage(prompt_tokens=num_tokens))
