"""POST /tokenize and POST /detokenize, as vLLM's OpenAI server has them (evaluation harnesses and
clients that count tokens ask them).

Answered by the gateway itself, with the model's tokenizer.json: the gateway already loads it to
count the prompt tokens a rate limit reserves (guard/validation.py: TokenCounter), so a round trip
through Kafka to a worker would add latency and load for the same answer (docs/gateway.md,
"Tokenize and detokenize"). A model whose tokenizer the gateway does not have (the echo model; a
GGUF import not made yet) gets a 400, never an estimate.

A chat (`messages`, vLLM's TokenizeChatRequest) is rendered by the model's chat template with the
function the worker's engine renders it with (weir/chat_template.py: render_chat, same messages,
tools and add_generation_prompt), its messages and tools checked as /v1/chat/completions checks
them, then tokenized as vLLM does (add_special_tokens false by default: the template writes its
BOS itself). So a chat's ids here are the prompt ids the engine runs (tests/gateway/test_tokenize.py
proves it). The template is loaded once per model, as the tokenizer is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from tokenizers import Tokenizer

from schemas.messages import ChatMessage, ToolDef
from schemas.model_repo import ModelConfig
from schemas.openai_bodies import BodyError, ChatCompletionBody
from services.gateway.openai_format import ApiError, api_error, validation_error
from services.gateway.routes.parts import GatewayParts
from services.gateway.routes.reading import read_body
from weir.chat_template import ChatTemplate, ChatTemplateError, load_chat_template, render_chat
from weir.home import served_model_dir

MAX_TOKENS_PER_CALL = 1 << 17  # token ids one /detokenize takes (a prompt's worth, whatever the model)


# vLLM's TokenizeChatRequest fields Weir's chats cannot honour: /v1/chat/completions takes none of
# them, so a count with them would be of a prompt no request can run. Refused unless neutral.
_CHAT_ONLY_NEUTRAL: dict[str, tuple[object, str]] = {
    "continue_final_message": (
        False,
        "continuing the final message is not supported (chat completions always start a new assistant turn)",
    ),
    "chat_template": (None, "a chat template of the request's own is not supported; the model's is used"),
    "chat_template_kwargs": ({}, "chat template arguments are not supported (chat completions take none)"),
    "mm_processor_kwargs": ({}, "multimodal inputs are not supported"),
}


class TokenizeBody(BaseModel):
    """vLLM's TokenizeCompletionRequest (`prompt`) or TokenizeChatRequest (`messages`): exactly one."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field(min_length=1, max_length=193)
    prompt: str | None = None
    messages: list[Any] | None = None  # checked as /v1/chat/completions checks them (ChatCompletionBody)
    tools: list[Any] | None = None
    add_special_tokens: bool | None = None  # vLLM's defaults: true for a prompt, false for a chat
    add_generation_prompt: bool | None = None  # a chat's; vLLM's default true
    continue_final_message: bool | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = False


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field(min_length=1, max_length=193)
    tokens: list[int] = Field(max_length=MAX_TOKENS_PER_CALL)


def add_tokenize_routes(router: APIRouter, parts: GatewayParts) -> None:
    """Add /tokenize and /detokenize to `router` (the app's)."""
    templates = _ChatTemplates()

    @router.post(
        "/tokenize",
        tags=["tokenizer"],
        summary="The token ids of a prompt, or of a chat as its chat template renders it (vLLM's)",
    )
    async def tokenize(request: Request) -> Response:
        body = _parse(TokenizeBody, await read_body(request, parts.settings.max_body_bytes))
        model, tokenizer = _tokenizer(parts, request, body.model)
        if body.messages is not None:
            text = _render_chat(body, model, templates)
            add_special_tokens = False if body.add_special_tokens is None else body.add_special_tokens
        else:
            _refuse_chat_fields(body)
            if body.prompt is None:
                raise ApiError(
                    400,
                    "missing required parameter: 'prompt' (or 'messages')",
                    param="prompt",
                    code="missing_required_parameter",
                )
            text = body.prompt
            add_special_tokens = True if body.add_special_tokens is None else body.add_special_tokens
        encoding = tokenizer.encode(text, add_special_tokens=add_special_tokens)
        result = {
            "count": len(encoding.ids),
            "max_model_len": model.max_model_len,
            "tokens": encoding.ids,
            "token_strs": encoding.tokens if body.return_token_strs else None,
        }
        return Response(orjson.dumps(result), media_type="application/json")

    @router.post("/detokenize", tags=["tokenizer"], summary="The text of token ids with the model's tokenizer (vLLM's)")
    async def detokenize(request: Request) -> Response:
        body = _parse(DetokenizeBody, await read_body(request, parts.settings.max_body_bytes))
        _model, tokenizer = _tokenizer(parts, request, body.model)
        vocab = tokenizer.get_vocab_size(with_added_tokens=True)
        if any(not 0 <= t < vocab for t in body.tokens):
            raise ApiError(
                400,
                f"token ids must be 0 to {vocab - 1}, the vocabulary of {body.model}",
                param="tokens",
                code="invalid_value",
            )
        return Response(
            orjson.dumps({"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}),
            media_type="application/json",
        )


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
        raise ApiError(
            400,
            f"{model.name} has no tokenizer the gateway can read (tokenizer.json)",
            param="model",
            code="unsupported_model",
        )
    return model, tokenizer


class _ChatTemplates:
    """Each model's chat template, loaded once (as TokenCounter loads its tokenizer): the template,
    None for a model without one, or the ChatTemplateError of one that does not compile."""

    def __init__(self) -> None:
        self._loaded: dict[str, ChatTemplate | ChatTemplateError | None] = {}

    def get(self, model: ModelConfig) -> ChatTemplate | None:
        """The template; ApiError 400 when the model has none or it does not compile."""
        if model.name not in self._loaded:
            served = served_model_dir(model.name, model.path, model.source)
            self._loaded[model.name] = _load_template(served) if served is not None else None
        template = self._loaded[model.name]
        if isinstance(template, ChatTemplateError):
            raise ApiError(
                400,
                f"{model.name}'s chat template cannot be used: {template}",
                param="model",
                code="chat_template_error",
            )
        if template is None:
            raise ApiError(
                400,
                f"{model.name} has no chat template (chat_template.jinja, or chat_template in "
                "tokenizer_config.json), so a chat has no token ids to give; send prompt",
                param="messages",
                code="chat_template_missing",
            )
        return template


def _load_template(path: Path) -> ChatTemplate | ChatTemplateError | None:
    try:
        return load_chat_template(path)[0]
    except ChatTemplateError as exc:
        return exc
    except (OSError, ValueError) as exc:  # an unreadable or malformed tokenizer_config.json
        return ChatTemplateError(f"cannot read {path}'s chat template: {exc}")


def _refuse_chat_fields(body: TokenizeBody) -> None:
    """A prompt body that sets a chat's fields: refused, never ignored."""
    for name in ("tools", "add_generation_prompt", *_CHAT_ONLY_NEUTRAL):
        if getattr(body, name) is not None:
            raise ApiError(400, f"{name} applies to messages, not prompt", param=name, code="invalid_value")


def _render_chat(body: TokenizeBody, model: ModelConfig, templates: _ChatTemplates) -> str:
    """The chat's prompt text, as the worker's engine renders it (weir/chat_template.py: render_chat).

    The messages and tools are checked by ChatCompletionBody, as /v1/chat/completions checks them,
    and become the same wire ChatMessages and ToolDefs a GenerateRequest carries."""
    if body.prompt is not None:
        raise ApiError(400, "give prompt or messages, not both", param="prompt", code="invalid_value")
    for name, (neutral, why) in _CHAT_ONLY_NEUTRAL.items():
        value = getattr(body, name)
        if value is not None and value != neutral:
            raise ApiError(400, f"{name}: {why}", param=name, code="unsupported_parameter")
    chat = {"model": "tokenize", "messages": body.messages, **({"tools": body.tools} if body.tools is not None else {})}
    try:
        parsed = ChatCompletionBody.model_validate_json(orjson.dumps(chat))
        parsed.refuse_unsupported()
        tools: list[ToolDef] | None = parsed.tool_fields().get("tools")
    except ValidationError as exc:
        raise validation_error(exc) from None
    except BodyError as exc:
        raise api_error(exc) from None
    messages: list[ChatMessage] = [m.to_wire() for m in parsed.messages]
    template = templates.get(model)
    add_generation_prompt = True if body.add_generation_prompt is None else body.add_generation_prompt
    try:
        return render_chat(template, messages, tools, add_generation_prompt=add_generation_prompt)
    except ChatTemplateError as exc:  # the template refused this chat (e.g. a role order): the client's to fix
        raise ApiError(400, str(exc), param="messages", code="chat_template_error") from None
