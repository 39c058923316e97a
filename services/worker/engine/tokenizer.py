"""Tokenizer of a Hugging Face model directory: encoding, chat rendering, incremental decoding."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
from tokenizers import Tokenizer

from schemas.messages import ChatMessage, GenerateRequest


class TokenizerError(ValueError):
    """A prompt the tokenizer cannot handle; ends that request only."""


class ModelTokenizer:
    """tokenizer.json plus the chat template and special tokens of tokenizer_config.json."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.exists():
            raise FileNotFoundError(f"{path} has no tokenizer.json")
        self._tok = Tokenizer.from_file(str(file))
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.exists() else {}
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        template = config.get("chat_template")
        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)
        self._template = env.from_string(template) if isinstance(template, str) else None

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_id(self, text: str | None) -> int | None:
        """Id of a special token's text, or None."""
        return self._tok.token_to_id(text) if text else None

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no special tokens added)."""
        try:
            return self._tok.encode(text, add_special_tokens=False).ids
        except Exception as exc:  # tokenizers raises plain Exceptions
            raise TokenizerError(f"cannot tokenize prompt: {exc}") from exc

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`, special tokens skipped."""
        return self._tok.decode(ids, skip_special_tokens=True)

    def render(self, request: GenerateRequest) -> str:
        """The prompt text of a request: the prompt itself, or the chat rendered by the template."""
        if request.prompt is not None:
            return request.prompt
        return self.render_chat(request.messages or [])

    def render_chat(self, messages: list[ChatMessage]) -> str:
        """Chat turns as text, through the model's chat template when it has one."""
        turns = [m.model_dump() for m in messages]
        if self._template is not None:
            try:
                return self._template.render(
                    messages=turns, add_generation_prompt=True, bos_token=self.bos_token or "", eos_token=self.eos_token or ""
                )
            except jinja2.TemplateError as exc:
                raise TokenizerError(f"chat template failed: {exc}") from exc
        # No template (a base model): a plain transcript that ends where the assistant speaks.
        lines = [f"{t['role']}: {t['content']}" for t in turns]
        return "\n".join(lines) + "\nassistant:"


def _token_text(value: object) -> str | None:
    if isinstance(value, dict):
        content = value.get("content")
        return content if isinstance(content, str) else None
    return value if isinstance(value, str) else None


class IncrementalDetokenizer:
    """Turns a growing list of output ids into text deltas without splitting a UTF-8 character.

    Decodes a small window (vLLM's prefix/read offsets) rather than the whole output each step.
    """

    def __init__(self, tokenizer: ModelTokenizer) -> None:
        self._tok = tokenizer
        self._prefix_offset = 0
        self._read_offset = 0

    def step(self, ids: list[int]) -> str:
        """New text made by the ids appended since the last call ("" while a character is incomplete)."""
        prefix_text = self._tok.decode(ids[self._prefix_offset : self._read_offset])
        new_text = self._tok.decode(ids[self._prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self._prefix_offset = self._read_offset
            self._read_offset = len(ids)
            return new_text[len(prefix_text) :]
        return ""
