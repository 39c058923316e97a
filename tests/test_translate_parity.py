"""One body, two paths, one answer (schemas/openai_translate.py).

Hypothesis makes chat, completions and embeddings bodies and feeds each to the gateway's online
path (parse_body -> to_generate_request -> siblings; the charge the rate limits reserve; the
whole body `collect` answers from reply events) and to the batch path (the upload check's line
charge, the batcher's job runner's JobLines, and the output file's response body from the same
reply events). The requests must be the same apart from where they go and for whom (id, reply
topic, deadline, lane, principal); a body refused online is refused in a batch with the same
code and parameter; the charge (requests and tokens) is the same; and the response bodies are the
same apart from the id, which names the batch line.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas.batch_lines import LineError, parse_envelope
from schemas.messages import (
    BatchJob,
    GenerateRequest,
    PromptLogprob,
    ReplyDelta,
    ReplyEnd,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from schemas.model_repo import load_model_repo
from schemas.openai_translate import siblings_of
from schemas.registry import RegistryState
from services.batcher.job_core import JobResults, parse_input
from services.gateway.batch_format import LineRules, check_line
from services.gateway.catalog import Catalog
from services.gateway.config import GatewaySettings
from services.gateway.fleet import Fleet
from services.gateway.guard.auth import Identity
from services.gateway.guard.validation import TokenCounter, check_request
from services.gateway.kafka_bus import Exchange, GatewayBus
from services.gateway.openai_format import (
    ApiError,
    ChunkWriter,
    parse_body,
    parse_embedding_body,
    refuse_embedding_model,
    to_embed_requests,
    to_generate_request,
)
from services.gateway.siblings import SiblingGroup
from services.gateway.streaming import collect

REGISTRY = RegistryState(load_model_repo(Path(__file__).resolve().parents[1] / "models.toml"))
CATALOG = Catalog(REGISTRY, Fleet())
ANN = Identity(principal="ann", tenant="acme", scope="key:ann")
COUNTER = TokenCounter()
MAX_INPUT_TOKENS, MAX_STOPS, MAX_TIMEOUT_S = None, 16, 600.0
T0 = 1_767_225_600_000
URLS = {"chat.completions": "/v1/chat/completions", "completions": "/v1/completions", "embeddings": "/v1/embeddings"}
# where a request goes and for whom: set by each path, not by the body
ROUTING_FIELDS = {
    "request_id",
    "reply_to",
    "created_ms",
    "deadline_ms",
    "principal",
    "tenant",
    "priority",
    "stream",
    "assignment",
}

words = st.text(alphabet="abcdefgh é\n", min_size=1, max_size=24).filter(str.strip)
common = {
    "max_tokens": st.integers(1, 2100),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.05, 1),
    "top_k": st.integers(0, 50),
    "presence_penalty": st.floats(-2, 2),
    "seed": st.integers(-(2**40), 2**40),
    "stop": st.one_of(words, st.lists(words, min_size=1, max_size=3)),
    "n": st.integers(1, 3),
    "user": st.text(max_size=8),
    "ignore_eos": st.booleans(),
    "logit_bias": st.dictionaries(st.integers(0, 200).map(str), st.integers(-100, 100), max_size=2),
}
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant"]), "content": words}
)
chat_only = {
    "max_completion_tokens": st.integers(1, 2100),
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 3),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
}
completion_only = {
    "best_of": st.integers(1, 4),
    "logprobs": st.integers(0, 3),
    "echo": st.booleans(),
    "suffix": st.just(""),
    "max_tokens": st.integers(0, 40),
}
token_ids = st.lists(st.integers(0, 500), min_size=1, max_size=6)
prompts = st.one_of(
    words, st.lists(words, min_size=1, max_size=3), token_ids, st.lists(token_ids, min_size=1, max_size=3)
)
generation_models = st.sampled_from(["echo", "weir-tiny-py", "weir-tiny-py@1", "all-MiniLM-L6-v2"])


def optional(fields: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({}, optional=fields)


@st.composite
def bodies(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    kind = draw(st.sampled_from(["chat.completions", "completions", "embeddings"]))
    if kind == "embeddings":
        body = {
            "model": draw(st.sampled_from(["all-MiniLM-L6-v2", "echo"])),
            "input": draw(st.one_of(words, st.lists(words, min_size=1, max_size=3))),
            **draw(
                optional(
                    {
                        "encoding_format": st.sampled_from(["float", "base64"]),
                        "user": st.text(max_size=8),
                        "dimensions": st.sampled_from([384, 12]),
                    }
                )
            ),
        }
        return kind, body
    body = {"model": draw(generation_models), **draw(optional(common))}
    if kind == "chat.completions":
        body["messages"] = draw(st.lists(message, min_size=1, max_size=3))
        body.update(draw(optional(chat_only)))
    else:
        body["prompt"] = draw(prompts)
        body.update(draw(optional(completion_only)))
    return kind, body


def online(kind: str, body: dict[str, Any]) -> tuple[list[Any], int] | tuple[str, str | None]:
    """The gateway's path: (requests, charged tokens), or the refusal's (code, param)."""
    raw = orjson.dumps(body)
    try:
        if kind == "embeddings":
            parsed_embedding = parse_embedding_body(raw)
            model = CATALOG.resolve(parsed_embedding.model)
            embeds = to_embed_requests(
                parsed_embedding,
                model,
                request_id="r",
                reply_to="weir.replies.g",
                now_ms=T0,
                client_timeout_s=None,
                max_timeout_s=MAX_TIMEOUT_S,
            )
            return embeds, sum(COUNTER.count(model, text) for text in parsed_embedding.inputs)
        parsed = parse_body(kind, raw)
        model = CATALOG.resolve(parsed.model)
        refuse_embedding_model(model)
        request = to_generate_request(
            kind,
            parsed,
            model,
            request_id="r",
            reply_to="weir.replies.g",
            now_ms=T0,
            client_timeout_s=None,
            max_timeout_s=MAX_TIMEOUT_S,
        )
        charge = check_request(
            parsed,
            request,
            model,
            COUNTER.count_prompts(model, parsed),
            max_input_tokens=MAX_INPUT_TOKENS,
            max_stop_sequences=MAX_STOPS,
        )
        siblings = siblings_of(parsed, request)
        return siblings, charge * len(siblings)  # each sibling reserves the charge (routes/completions.py)
    except ApiError as exc:
        return exc.code or "", exc.param


def batch_line(kind: str, body: dict[str, Any]) -> bytes:
    return orjson.dumps({"custom_id": "line-1", "method": "POST", "url": URLS[kind], "body": body})


def batch_check(kind: str, body: dict[str, Any]) -> tuple[int, int] | tuple[str, str | None]:
    """The gateway's batch upload check of the line: (requests, tokens) or the refusal."""
    rules = LineRules(CATALOG.resolve, ANN, COUNTER, MAX_INPUT_TOKENS, MAX_STOPS, MAX_TIMEOUT_S, "weir.replies.job.c")
    try:
        return check_line(parse_envelope(1, batch_line(kind, body), set()), rules)
    except LineError as exc:
        return exc.code, exc.param


def job(kind: str) -> BatchJob:
    return BatchJob(
        job_id="batch_1",
        status="in_progress",
        endpoint=URLS[kind],
        input_file_id="file-1",
        created_ms=T0,
        expires_ms=T0 + 86_400_000,
        updated_ms=T0,
        principal="ann",
        tenant="acme",
    )


def without_routing(request: Any, ignored: set[str]) -> dict[str, Any]:
    return {k: v for k, v in request.model_dump().items() if k not in ROUTING_FIELDS | ignored}


def logprob(token: str) -> TokenLogprob:
    top = [TopLogprob(token_id=1, token=token, bytes=list(token.encode()), logprob=-0.5)]
    return TokenLogprob(token_id=1, token=token, bytes=list(token.encode()), logprob=-0.5, top_logprobs=top)


def replies(requests: list[Any]) -> list[ReplyDelta | ReplyEnd]:
    """What workers could answer: two tokens and a stop each (or an embedding)."""
    events: list[ReplyDelta | ReplyEnd] = []
    for i, request in enumerate(requests):
        if not isinstance(request, GenerateRequest):
            usage = Usage(prompt_tokens=3, total_tokens=3)
            vectors = [[0.5, float(i)] for _ in request.inputs]
            events.append(
                ReplyEnd(
                    request_id=request.request_id,
                    seq=0,
                    finish_reason="stop",
                    usage=usage,
                    embeddings=vectors,
                    model_version=request.model,
                )
            )
            continue
        events.append(
            ReplyDelta(
                request_id=request.request_id,
                seq=0,
                count=2,
                text=f"x{i}y",
                texts=[f"x{i}", "y"],
                token_ids=[5, 6],
                logprobs=[logprob(f"x{i}"), logprob("y")],
            )
        )
        usage = Usage(prompt_tokens=7 + i, completion_tokens=2, total_tokens=9 + i, cached_prompt_tokens=3)
        prompt = None
        if request.prompt_logprobs is not None:  # the prompt's tokens: "p<i>" and "é" ("é" of token ids)
            prompt = [
                PromptLogprob(token_id=1, token=f"p{i}", bytes=list(f"p{i}".encode()), logprob=None),
                PromptLogprob(
                    token_id=2,
                    token="é",
                    bytes=list("é".encode()),
                    logprob=-0.25,
                    top_logprobs=[TopLogprob(token_id=2, token="é", bytes=[195, 169], logprob=-0.25)],
                ),
            ]
        events.append(
            ReplyEnd(
                request_id=request.request_id,
                seq=2,
                finish_reason="stop",
                usage=usage,
                cumulative_logprob=-1.0 - i,
                model_version=request.model,
                prompt_logprobs=prompt,
            )
        )
    return events


async def _never_gone() -> dict[str, Any]:
    await asyncio.Event().wait()
    return {}


def online_body(kind: str, body: dict[str, Any], requests: list[GenerateRequest]) -> dict[str, Any]:
    """The gateway's whole (stream=false) answer: the siblings' events through collect."""
    parsed = parse_body(kind, orjson.dumps(body))
    parent = requests[0] if len(requests) == 1 else requests[0].model_copy(update={"request_id": "r"})

    async def run() -> dict[str, Any]:
        bus = GatewayBus(GatewaySettings(kafka_bootstrap="127.0.0.1:1"))
        exchanges = [Exchange(bus, r, bus.router.register(r.request_id)) for r in requests]
        group = SiblingGroup(parent, exchanges, parsed.num_results) if len(requests) > 1 else exchanges[0]
        for event in replies(requests):
            bus.router.on_event(event)
        writer = ChunkWriter.of(kind, parsed, parent)
        result = await collect(group, kind, writer.created_s, _never_gone, lambda text: text, None, writer)
        assert result is not None
        return result

    return asyncio.run(run())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bodies())
def test_a_body_gives_the_same_requests_charge_and_answer_online_and_in_a_batch(
    case: tuple[str, dict[str, Any]],
) -> None:
    kind, body = case
    served = online(kind, body)
    checked = batch_check(kind, body)
    parsed = parse_input(batch_line(kind, body) + b"\n", job(kind), REGISTRY, "weir.replies.job.batch_1")
    assert parsed.errors == []
    lines = parsed.lines
    if isinstance(served[0], str):  # refused online: refused in the batch, by the same code and parameter
        assert checked == served
        assert len(lines) == 1
        if lines[0].error is None:
            # the runner counts no prompt tokens: only a prompt (+ max_tokens) past the context,
            # which the upload check refused (above), is left to the worker
            assert served[0] == "context_length_exceeded"
            assert (
                lines[0].request is not None
                and lines[0].request.max_tokens <= CATALOG.resolve(body["model"]).max_model_len
            )
        else:
            assert (lines[0].error.code, lines[0].error.param) == served
        return
    requests, charge = served
    assert checked == (len(requests), charge), "the batch quota charges what the rate limits reserve online"
    assert [line.error for line in lines] == [None] * len(requests)
    ran = [line.request for line in lines]
    # a seed the body does not set is derived from the request id (which each path sets: routing)
    ignored = set() if "seed" in body else {"seed"}
    assert [without_routing(r, ignored) for r in ran] == [without_routing(r, ignored) for r in requests]
    assert {(r.priority, r.principal, r.tenant, getattr(r, "stream", False)) for r in ran} == {
        ("bulk", "ann", "acme", False)
    }
    assert [r.request_id.removeprefix(lines[0].line_request_id) for r in ran] == [
        r.request_id.removeprefix("r") for r in requests
    ]  # the same sibling (or part) suffixes
    results = JobResults(lines)
    for event in replies(ran):
        results.add(event)
    output, errors = results.files(URLS[kind])
    assert errors == ""
    written = orjson.loads(output)["response"]["body"]
    if kind == "embeddings":
        return  # the online embeddings route renders with the same embedding_body (routes/embeddings.py)
    answered = online_body(kind, body, requests)
    assert written.pop("id").endswith(lines[0].line_request_id) and answered.pop("id") == "r"
    assert written == answered
