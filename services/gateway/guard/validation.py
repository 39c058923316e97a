"""Checks of a parsed body against the model it names: prompt tokens, context length, stops.

Prompt tokens are counted with the model's tokenizer.json (the `tokenizers` package) when the
model has one (its `path`, or the import of its GGUF `source`), and estimated otherwise (4 UTF-8 bytes a token, rounded
up, never fewer than the whitespace-separated words). Chat prompts count each message's text plus
a few tokens per message for the chat template. The count is what a rate limit reserves, so an
estimate that errs a little high is the safe side.
"""

from __future__ import annotations

import logging
import math

from tokenizers import Tokenizer

from schemas import context_length
from schemas.messages import GenerateRequest
from schemas.model_repo import ModelConfig
from weir.home import served_model_dir
from services.gateway.openai_format import ApiError, ChatCompletionBody, CompletionBody

log = logging.getLogger(__name__)

TOKENS_PER_MESSAGE = 4  # role markers and separators a chat template adds around each turn
_BYTES_PER_TOKEN = 4


class TokenCounter:
    """Counts prompt tokens per model; tokenizers load once, on first use."""

    def __init__(self) -> None:
        self._tokenizers: dict[str, Tokenizer | None] = {}

    def tokenizer(self, model: ModelConfig) -> Tokenizer | None:
        """The model's tokenizer, or None when it has no tokenizer.json (then counts are estimates)."""
        if model.name in self._tokenizers:
            return self._tokenizers[model.name]
        # a GGUF-sourced entry's tokenizer is in its import, once weir up or the worker made it; until
        # then counts are estimates and the next request looks again
        served = served_model_dir(model.name, model.path, model.source)
        file = served / "tokenizer.json" if served is not None else None
        if file is not None and not file.is_file() and model.source is not None:
            return None
        tokenizer = None
        if file is not None and file.is_file():
            try:
                tokenizer = Tokenizer.from_file(str(file))
            except Exception as exc:  # noqa: BLE001 - tokenizers raises plain Exceptions
                log.warning("cannot load %s (%s); estimating %s's token counts", file, exc, model.name)
        self._tokenizers[model.name] = tokenizer
        return tokenizer

    def count(self, model: ModelConfig, text: str) -> int:
        """Tokens of `text` for `model` (special tokens not added)."""
        tokenizer = self.tokenizer(model)
        if tokenizer is not None:
            return len(tokenizer.encode(text, add_special_tokens=False).ids)
        return estimate_tokens(text)

    def count_prompt(self, model: ModelConfig, body: ChatCompletionBody | CompletionBody) -> int:
        """Prompt tokens of a body: the prompt, or every message plus the per-message overhead."""
        if isinstance(body, CompletionBody):
            return self.count(model, body.prompt)
        texts = [m.to_wire().content for m in body.messages]
        return sum(self.count(model, t) for t in texts) + TOKENS_PER_MESSAGE * len(texts)


def estimate_tokens(text: str) -> int:
    """A tokenizer-free estimate: ceil(bytes / 4), at least the number of words."""
    return max(math.ceil(len(text.encode()) / _BYTES_PER_TOKEN), len(text.split()))


def check_request(
    body: ChatCompletionBody | CompletionBody,
    request: GenerateRequest,
    model: ModelConfig,
    prompt_tokens: int,
    *,
    max_input_tokens: int | None,
    max_stop_sequences: int,
) -> GenerateRequest:
    """The request, with a defaulted max_tokens fitted into the context; 400 naming the field when
    the prompt is too long, prompt + max_tokens exceeds max_model_len, or there are too many stops."""
    prompt_param = "prompt" if isinstance(body, CompletionBody) else "messages"
    if len(request.stop) > max_stop_sequences:
        raise ApiError(400, f"at most {max_stop_sequences} stop sequences are allowed, got {len(request.stop)}",
                       param="stop", code="invalid_value")  # fmt: skip
    is_explicit = body.max_tokens is not None or (
        isinstance(body, ChatCompletionBody) and body.max_completion_tokens is not None
    )
    # in OpenAI's and vLLM's words, which clients match (LiteLLM's context-window fallbacks)
    if max_input_tokens is not None and max_input_tokens < model.max_model_len - 1 and prompt_tokens > max_input_tokens:
        message = context_length.input_over_limit(model.max_model_len, max_input_tokens, prompt_tokens, prompt_param)
        raise ApiError(400, message, param=prompt_param, code="context_length_exceeded")
    if prompt_tokens > model.max_model_len - 1:  # at least one token must remain for the output
        if is_explicit:
            message = context_length.requested_too_much(model.max_model_len, prompt_tokens, request.max_tokens,
                                                        prompt_param)  # fmt: skip
        else:
            message = context_length.prompt_too_long(model.max_model_len, prompt_tokens, prompt_param)
        raise ApiError(400, message, param=prompt_param, code="context_length_exceeded")
    room = model.max_model_len - prompt_tokens
    if request.max_tokens <= room:
        return request
    if not is_explicit:  # a default is fitted, not refused
        return request.model_copy(update={"max_tokens": room})
    is_completion_param = isinstance(body, ChatCompletionBody) and body.max_completion_tokens is not None
    param = "max_completion_tokens" if is_completion_param else "max_tokens"
    message = context_length.requested_too_much(model.max_model_len, prompt_tokens, request.max_tokens, prompt_param)
    raise ApiError(400, message, param=param, code="context_length_exceeded")
