"""When the worker ends a request before its model sees it: the refusal rules, pure.

A batch can hold a request the model server must not run: one for another model, one of a kind
the model does not serve (generate vs embed), one cancelled before it arrived, one whose
deadline has passed. Each ends at once with a terminal event; the rest of the batch runs.
"""

from __future__ import annotations

from collections.abc import Container
from typing import NamedTuple

from schemas.messages import EmbedRequest, ErrorInfo, FinishReason, GenerateRequest
from schemas.model_repo import ModelConfig
from services.worker.engine.contract import GOLDEN_ID_PREFIX


class Refusal(NamedTuple):
    """How a refused request ends: its finish reason and the error its ReplyEnd carries."""

    finish_reason: FinishReason
    error: ErrorInfo


def refusal(
    request: GenerateRequest | EmbedRequest, config: ModelConfig, now_ms: int, cancelled: Container[str]
) -> Refusal | None:
    """Why `request` ends before `config`'s model runs it, or None when it may run.

    `cancelled` holds the request ids cancelled lately. Checked in this order, the first that
    applies wins: an id reserved for the worker's golden canaries, another model's request, the
    wrong kind for this model, cancelled, expired.
    """
    if request.request_id.startswith(GOLDEN_ID_PREFIX):
        message = f"request ids starting with {GOLDEN_ID_PREFIX!r} are reserved for the worker's golden checks"
        return Refusal("rejected", ErrorInfo(code="reserved_request_id", message=message))
    if request.model not in (config.name, config.served_id):  # a bare name: the batcher resolved it to this version
        message = f"batch for {config.served_id} holds a request for {request.model}"
        return Refusal("rejected", ErrorInfo(code="wrong_model", message=message))
    if (request.kind == "embed") != (config.engine == "onnx"):
        return Refusal("rejected", unsupported_kind(request, config))
    if request.request_id in cancelled:
        return Refusal("cancelled", ErrorInfo(code="cancelled", message="request was cancelled"))
    if request.deadline_ms <= now_ms:
        return Refusal("timeout", ErrorInfo(code="deadline_exceeded", message="deadline passed before the model ran"))
    return None


def unsupported_kind(request: GenerateRequest | EmbedRequest, config: ModelConfig) -> ErrorInfo:
    """Why `config`'s model cannot serve a request of that kind."""
    if request.kind == "embed":
        message = f"model {config.name} generates text; embeddings need an embedding model (engine onnx)"
    else:
        message = f"model {config.name} is an embedding model; it serves EmbedRequests (kind=embed) only"
    return ErrorInfo(code="unsupported_request_kind", message=message)
