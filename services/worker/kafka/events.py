"""What an engine output becomes on the wire: reply events for the requester, an AuditEvent for
the auditor, and for a live request that was mirrored its answer (ShadowLive) for the comparison.
Pure: the time and the keys come in as arguments.
"""

from __future__ import annotations

import hashlib

import orjson

from schemas.fingerprint import key_id, keyed_hmac
from schemas.messages import AuditEvent, EmbedRequest, GenerateRequest, ReplyDelta, ReplyEnd, Usage
from schemas.model_repo import ModelConfig
from schemas.registry import ShadowLive
from services.worker.engine import EngineOutput


def model_version(config: ModelConfig) -> str:
    """The name@version that replies and audit events report."""
    return f"{config.name}@{config.version}"


def reply_events(
    request: GenerateRequest | EmbedRequest, batch_id: str, out: EngineOutput, version: str
) -> list[ReplyDelta | ReplyEnd]:
    """The reply events of one engine output, in order: a delta when it carries tokens, text or
    tool call pieces, with the logprobs of its tokens when the request asked, then on the final
    output the ReplyEnd, at the position after the delta's (the output's own when it has no
    delta), with the output's cumulative logprob and the reply's complete tool calls.

    The delta covers one position per token of the output, from `out.seq`; its text and tool call
    pieces are its last token's (the step that released them), or a tail position's when the
    final output has no token (docs/wire-contract.md, "Reading replies"). Every generated token
    gets its position, those of a final output whose text is "" too (the end of a run cut by
    max_tokens inside a character): `completion_tokens` tokens, each with its logprob entry. An
    EmbedRequest generates none: its final output is the end alone."""
    events: list[ReplyDelta | ReplyEnd] = []
    seq = out.seq
    if out.text or out.tool_call_deltas or (out.token_ids and isinstance(request, GenerateRequest)):
        count = max(1, len(out.token_ids))
        texts = [""] * (count - 1) + [out.text] if count > 1 else None
        events.append(
            ReplyDelta(
                request_id=request.request_id,
                batch_id=batch_id,
                seq=seq,
                count=count,
                text=out.text,
                texts=texts,
                token_ids=out.token_ids,
                logprobs=out.logprobs,
                tool_calls=out.tool_call_deltas,
            )
        )
        seq += count
    if out.is_final:
        events.append(
            ReplyEnd(
                request_id=request.request_id,
                batch_id=batch_id,
                seq=seq,
                finish_reason=out.finish_reason,
                usage=Usage(
                    prompt_tokens=out.prompt_tokens,
                    completion_tokens=out.completion_tokens,
                    total_tokens=out.prompt_tokens + out.completion_tokens,
                    cached_prompt_tokens=out.cached_prompt_tokens,
                ),
                error=out.error,
                model_version=version,
                received_ms=out.received_ms,
                first_token_ms=out.first_token_ms,
                embeddings=out.embeddings,
                cumulative_logprob=out.cumulative_logprob,
                tool_calls=out.tool_calls,
                structured_valid=out.structured_valid,
                prompt_logprobs=out.prompt_logprobs,
            )
        )
    return events


# The GenerateRequest fields that can change its text, besides the prompt (docs/design.md, "Structured
# output, tools and logprobs": the auditor compares outputs of equal version, prompt, parameters and
# seed). Not logprobs (it adds numbers, not text), nor the routing and accounting fields.
OUTPUT_PARAMS = frozenset(
    {
        "temperature",
        "top_p",
        "top_k",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "stop",
        "max_tokens",
        "ignore_eos",
        "structured",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "suffix",
    }
)
_GREEDY_IGNORES = frozenset({"top_p", "top_k"})  # with temperature 0 (services/worker/engine/sampler.py)


def params_sha256(request: GenerateRequest) -> str:
    """sha256 (hex) of the sorted-key JSON of the request's OUTPUT_PARAMS and effective seed. A
    greedy request's seed, top_p and top_k cannot change its tokens and are left out, so greedy
    requests that differ only in them compare equal."""
    greedy = request.temperature == 0.0
    params = request.model_dump(mode="json", include=set(OUTPUT_PARAMS - (_GREEDY_IGNORES if greedy else frozenset())))
    if not greedy:
        params["seed"] = request.effective_seed
    return hashlib.sha256(orjson.dumps(params, option=orjson.OPT_SORT_KEYS)).hexdigest()


def audit_event(
    request: GenerateRequest | EmbedRequest,
    out: EngineOutput,
    config: ModelConfig,
    *,
    weights_sha256: str,
    worker_id: str,
    audit_key: bytes,
    now_ms: int,
) -> AuditEvent:
    """The AuditEvent of a request's final output: what was served, with keyed HMACs of the
    prompt and output text instead of the text. `now_ms` stands in for the times the output
    lacks (a request refused before the engine saw it). Without SimHashes (see Publisher)."""
    params = None
    if isinstance(request, GenerateRequest):
        temperature, top_p, top_k, max_tokens, seed = (
            request.temperature,
            request.top_p,
            request.top_k,
            request.max_tokens,
            request.effective_seed,
        )
        params = params_sha256(request)
    else:  # an embedding samples nothing
        temperature, top_p, top_k, max_tokens, seed = 0.0, 1.0, 0, 0, 0
    version = model_version(config)
    return AuditEvent(
        event_id=f"{request.request_id}:{version}",
        request_id=request.request_id,
        model=request.model,
        model_version=version,
        weights_sha256=weights_sha256,
        principal=request.principal,
        tenant=request.tenant,
        prompt_hmac=keyed_hmac(audit_key, out.prompt_text or ""),
        output_hmac=keyed_hmac(audit_key, out.output_text or ""),
        hmac_key_id=key_id(audit_key),
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        max_tokens=max_tokens,
        seed=seed,
        prompt_tokens=out.prompt_tokens,
        completion_tokens=out.completion_tokens,
        cached_prompt_tokens=out.cached_prompt_tokens,
        finish_reason=out.finish_reason,
        assignment=request.assignment,
        shadow_of=request.shadow_of,
        worker_id=worker_id,
        request_created_ms=request.created_ms,
        received_ms=out.received_ms or now_ms,
        first_token_ms=out.first_token_ms,
        finished_ms=out.finished_ms or now_ms,
        mean_token_entropy=out.mean_token_entropy,
        watermark_z=out.watermark_z,
        structured_valid=out.structured_valid,
        params_sha256=params,
    )


_MAX_SHADOW_TEXT = 1_000_000  # ShadowLive.text's bound


def shadow_live(
    request: GenerateRequest | EmbedRequest, out: EngineOutput, token_ids: list[int], version: str
) -> ShadowLive | None:
    """The live answer of a request whose `mirrors` lists copies (docs/design.md, "Traffic
    policies"), from its final output and the tokens of its run; None for any other request.
    TTFT is the worker's (received to first token); tokens/s is the decode rate after it."""
    if not request.mirrors or request.shadow_of is not None or not out.is_final:
        return None
    ttft_ms = tokens_per_s = None
    if out.received_ms is not None and out.first_token_ms is not None:
        ttft_ms = float(max(0, out.first_token_ms - out.received_ms))
        if out.finished_ms is not None and out.finished_ms > out.first_token_ms and out.completion_tokens > 1:
            tokens_per_s = (out.completion_tokens - 1) * 1000 / (out.finished_ms - out.first_token_ms)
    return ShadowLive(
        request_id=request.request_id,
        model=version,
        assignment=request.assignment or "default",
        text=(out.output_text or "")[:_MAX_SHADOW_TEXT],
        token_ids=token_ids,
        finish_reason=out.finish_reason or "",
        ttft_ms=ttft_ms,
        tokens_per_s=tokens_per_s,
    )
