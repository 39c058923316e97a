"""The words of a context-length refusal, the same wherever Weir refuses one (the gateway's checks,
a batch line's, the worker's engines): OpenAI's and vLLM's, which clients match.

LiteLLM, for one, turns an error whose message contains "This model's maximum context length is"
into its ContextWindowExceededError, the exception its context-window fallbacks act on; other
clients look for "maximum context length". The HTTP code stays `context_length_exceeded`; a
worker's refusal keeps its wire code (`prompt_too_long`, `input_too_long`: docs/wire-contract.md)
and the gateway answers it as `context_length_exceeded`. Pure: strings from numbers.
"""

from __future__ import annotations

from typing import Literal

# What the prompt is called: a chat's `messages`, a completion's `prompt`, an embedding's `input`.
PromptWord = Literal["messages", "prompt", "input"]


def requested_too_much(
    max_model_len: int, prompt_tokens: int, completion_tokens: int, word: PromptWord = "messages"
) -> str:
    """The prompt and the completion asked for do not fit the context together (OpenAI's and vLLM's
    sentence, word for word on a chat)."""
    return (
        f"This model's maximum context length is {max_model_len} tokens. However, you requested "
        f"{prompt_tokens + completion_tokens} tokens ({prompt_tokens} in the {word}, {completion_tokens} in the "
        f"completion). Please reduce the length of the {word} or completion."
    )


def prompt_too_long(max_model_len: int, prompt_tokens: int, word: PromptWord = "messages") -> str:
    """The prompt alone leaves no room for one generated token (OpenAI's sentence when the
    messages alone exceed the context)."""
    return (
        f"This model's maximum context length is {max_model_len} tokens. However, your {word} resulted in "
        f"{prompt_tokens} tokens, which leaves no room for the completion. Please reduce the length of the {word}."
    )


def input_over_limit(
    max_model_len: int, max_input_tokens: int, prompt_tokens: int, word: PromptWord = "messages"
) -> str:
    """The prompt is over a deployment's own bound on input tokens (WEIR_MAX_INPUT_TOKENS), below
    the model's context."""
    return (
        f"This model's maximum context length is {max_model_len} tokens, and this deployment accepts at most "
        f"{max_input_tokens} tokens of {word} (WEIR_MAX_INPUT_TOKENS). However, your {word} resulted in "
        f"{prompt_tokens} tokens. Please reduce the length of the {word}."
    )


def completion_too_long(
    max_model_len: int, completion_tokens: int, param: str = "max_tokens", word: PromptWord = "messages"
) -> str:
    """The completion asked for (`param`) exceeds the context by itself, before the prompt is counted."""
    return (
        f"This model's maximum context length is {max_model_len} tokens. However, you requested "
        f"{completion_tokens} tokens in the completion alone ({param}), and the {word} need some too. "
        f"Please reduce the length of the {word} or completion."
    )


def input_too_long(max_tokens: int, index: int, num_tokens: int) -> str:
    """Input `index` of an embedding request is longer than the model takes."""
    return (
        f"This model's maximum context length is {max_tokens} tokens. However, input {index} resulted in "
        f"{num_tokens} tokens. Please reduce the length of the input."
    )
