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
from collections.abc import Callable

from tokenizers import Tokenizer

from schemas.messages import GenerateRequest
from schemas.model_repo import ModelConfig
from schemas.openai_translate import check_context
from services.gateway.openai_format import BodyError, ChatCompletionBody, CompletionBody, api_error
from weir.home import served_model_dir

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
        """Prompt tokens of a body: its prompts', or every message plus the per-message overhead."""
        return sum(self.count_prompts(model, body))

    def count_prompts(self, model: ModelConfig, body: ChatCompletionBody | CompletionBody) -> list[int]:
        """Prompt tokens of each prompt of a body (a chat is one: every message plus the
        per-message overhead; a prompt of token ids is its length)."""
        if isinstance(body, CompletionBody):
            return [self.count(model, p) if isinstance(p, str) else len(p) for p in body.prompts]
        texts = [m.to_wire().content for m in body.messages]
        return [sum(self.count(model, t) for t in texts) + TOKENS_PER_MESSAGE * len(texts)]

    def decoder(self, model: ModelConfig) -> Callable[[list[int]], str] | None:
        """The text of token ids for `model` (its tokenizer's), or None without a tokenizer."""
        tokenizer = self.tokenizer(model)
        return None if tokenizer is None else tokenizer.decode


def estimate_tokens(text: str) -> int:
    """A tokenizer-free estimate: ceil(bytes / 4), at least the number of words."""
    return max(math.ceil(len(text.encode()) / _BYTES_PER_TOKEN), len(text.split()))


def check_request(
    body: ChatCompletionBody | CompletionBody,
    request: GenerateRequest,
    model: ModelConfig,
    prompt_tokens: int | list[int],
    *,
    max_input_tokens: int | None,
    max_stop_sequences: int,
) -> int:
    """The tokens one request of `body` is charged (schemas/openai_translate.py: check_context:
    the prompt + max_tokens, a default fitted into the room the prompt leaves); 400 naming the
    field when the prompt is too long, prompt + max_tokens exceeds max_model_len, or there are
    too many stops."""
    try:
        return check_context(
            body,
            request,
            model,
            prompt_tokens,
            max_input_tokens=max_input_tokens,
            max_stop_sequences=max_stop_sequences,
        )
    except BodyError as exc:
        raise api_error(exc) from None
