"""POST /tokenize and POST /detokenize, as vLLM's OpenAI server has them (evaluation harnesses and
clients that count tokens ask them).

Answered by the gateway itself, with the model's tokenizer.json: the gateway already loads it to
count the prompt tokens a rate limit reserves (guard/validation.py: TokenCounter), so a round trip
through Kafka to a worker would add latency and load for the same answer (docs/gateway.md,
"Tokenize and detokenize"). A model whose tokenizer the gateway does not have (the echo model; a
GGUF import not made yet) gets a 400, never an estimate. `messages` are refused: a chat's tokens
are its chat template's rendering, which only the worker makes.
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from tokenizers import Tokenizer

from schemas.model_repo import ModelConfig
from services.gateway.openai_format import ApiError, validation_error
from services.gateway.routes.parts import GatewayParts
from services.gateway.routes.reading import read_body

MAX_TOKENS_PER_CALL = 1 << 17  # token ids one /detokenize takes (a prompt's worth, whatever the model)


class TokenizeBody(BaseModel):
    """vLLM's TokenizeCompletionRequest; its TokenizeChatRequest (`messages`) is refused by name."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field(min_length=1, max_length=193)
    prompt: str | None = None
    messages: list[Any] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool | None = None
    return_token_strs: bool = False


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field(min_length=1, max_length=193)
    tokens: list[int] = Field(max_length=MAX_TOKENS_PER_CALL)


def add_tokenize_routes(router: APIRouter, parts: GatewayParts) -> None:
    """Add /tokenize and /detokenize to `router` (the app's)."""

    @router.post("/tokenize", tags=["tokenizer"], summary="A prompt's token ids with the model's tokenizer (vLLM's)")
    async def tokenize(request: Request) -> Response:
        body = _parse(TokenizeBody, await read_body(request, parts.settings.max_body_bytes))
        model, tokenizer = _tokenizer(parts, request, body.model)
        if body.messages is not None:
            raise ApiError(400, "tokenizing messages needs the model's chat template, which only the worker renders; "
                           "send prompt", param="messages", code="unsupported_parameter")  # fmt: skip
        if body.add_generation_prompt is not None:
            raise ApiError(400, "add_generation_prompt applies to messages", param="add_generation_prompt",
                           code="unsupported_parameter")  # fmt: skip
        if body.prompt is None:
            raise ApiError(400, "missing required parameter: 'prompt'", param="prompt",
                           code="missing_required_parameter")  # fmt: skip
        encoding = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        result = {"count": len(encoding.ids), "max_model_len": model.max_model_len, "tokens": encoding.ids,
                  "token_strs": encoding.tokens if body.return_token_strs else None}  # fmt: skip
        return Response(orjson.dumps(result), media_type="application/json")

    @router.post("/detokenize", tags=["tokenizer"], summary="The text of token ids with the model's tokenizer (vLLM's)")
    async def detokenize(request: Request) -> Response:
        body = _parse(DetokenizeBody, await read_body(request, parts.settings.max_body_bytes))
        _model, tokenizer = _tokenizer(parts, request, body.model)
        vocab = tokenizer.get_vocab_size(with_added_tokens=True)
        if any(not 0 <= t < vocab for t in body.tokens):
            raise ApiError(400, f"token ids must be 0 to {vocab - 1}, the vocabulary of {body.model}", param="tokens",
                           code="invalid_value")  # fmt: skip
        return Response(orjson.dumps({"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}),
                        media_type="application/json")


def _parse(model: type[BaseModel], raw: bytes) -> Any:
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise validation_error(exc) from None


def _tokenizer(parts: GatewayParts, request: Request, ref: str) -> tuple[ModelConfig, Tokenizer]:
    """The model `ref` names (the caller's to use) and its tokenizer; ApiError 400 when the gateway has none."""
    identity = parts.guard.authenticate(dict(request.headers))
    model, _ = parts.model(ref, identity, None, "tokenize")
    parts.guard.authorize(identity, model.served_id)
    tokenizer = parts.guard.counter.tokenizer(model)
    if tokenizer is None:
        raise ApiError(400, f"{model.name} has no tokenizer the gateway can read (tokenizer.json)", param="model",
                       code="unsupported_model")  # fmt: skip
    return model, tokenizer
