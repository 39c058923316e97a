"""Tokenizer of a Hugging Face model directory: encoding, chat rendering, incremental decoding."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

from tokenizers import Tokenizer

from schemas.messages import ChatMessage, GenerateRequest, ToolDef
from weir.chat_template import load_chat_template, render_chat


class TokenizerError(ValueError):
    """A prompt the tokenizer cannot handle; ends that request only."""


class SuffixUnsupported(ValueError):
    """A completion with a suffix for a tokenizer without fill-in-the-middle tokens."""


# Fill-in-the-middle special tokens (prefix, suffix, middle): StarCoder's and SmolLM's names, then Qwen's.
FIM_TOKEN_NAMES = (
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
)


class ModelTokenizer:
    """tokenizer.json, plus the chat template and special tokens of tokenizer_config.json."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.exists():
            raise FileNotFoundError(f"{path} has no tokenizer.json")
        self._tok = Tokenizer.from_file(str(file))
        self._template, self.special_tokens = load_chat_template(path)
        self.bos_token = self.special_tokens.get("bos_token")
        self.eos_token = self.special_tokens.get("eos_token")
        self.end_of_turn = self._end_of_turn()
        self.fim_tokens = self._fim_tokens()
        self._pieces: dict[int, tuple[str, list[int]]] = {}  # token id -> (text, bytes), filled as logprobs ask
        self._piece_bytes: Callable[[str], bytes] | None = None

    def _fim_tokens(self) -> tuple[str, str, str] | None:
        """The first set of FIM_TOKEN_NAMES whose three tokens the vocabulary holds, else None."""
        for names in FIM_TOKEN_NAMES:
            if all(self._tok.token_to_id(n) is not None for n in names):
                return names
        return None

    def _end_of_turn(self) -> str | None:
        if self._template is None:
            return None
        specials = [t.content for t in self._tok.get_added_tokens_decoder().values() if t.special]
        return self._template.end_of_turn(specials)

    @property
    def stop_token_ids(self) -> set[int]:
        """Ids that end a generation: the eos token and the chat template's end-of-turn token."""
        ids = {self.token_id(self.eos_token), self.token_id(self.end_of_turn)}
        return {i for i in ids if i is not None}

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
        """The prompt text of a request: the prompt itself (around a suffix, the fill-in-the-middle
        form), or the chat rendered by the template. Raises SuffixUnsupported for a suffix the
        tokenizer has no FIM tokens for (refused, never ignored: docs/design.md, invariant 6)."""
        if request.prompt is not None:
            return request.prompt if request.suffix is None else self.render_fim(request.prompt, request.suffix)
        return self.render_chat(request.messages or [], request.tools)

    def render_fim(self, prefix: str, suffix: str) -> str:
        """prefix-suffix-middle (PSM), the order StarCoder, SmolLM and Qwen were trained on: the
        model writes what goes between `prefix` and `suffix` after the middle token."""
        if self.fim_tokens is None:
            raise SuffixUnsupported(
                "its tokenizer has no fill-in-the-middle tokens (<fim_prefix>, <fim_suffix>, "
                "<fim_middle> or Qwen's <|fim_prefix|>...)"
            )
        pre, suf, mid = self.fim_tokens
        return f"{pre}{prefix}{suf}{suffix}{mid}"

    def token_piece(self, token_id: int) -> tuple[str, list[int]]:
        """A token's text and exact UTF-8 bytes, as logprobs report them: a piece of a multi-byte
        character keeps its bytes and shows as U+FFFD. Cached per id (a vocabulary is bounded)."""
        piece = self._pieces.get(token_id)
        if piece is None:
            raw = self._token_bytes(token_id)
            piece = self._pieces[token_id] = (raw.decode("utf-8", errors="replace"), list(raw))
        return piece

    def vocabulary_bytes(self) -> list[bytes]:
        """Every token id's bytes, as token_piece gives them, in one pass (its added-token table
        read once: ~1 s less on a 49k vocabulary)."""
        added = self._tok.get_added_tokens_decoder()
        return [self._token_bytes(i, added) for i in range(self.vocab_size)]

    def _token_bytes(self, token_id: int, added_tokens: dict | None = None) -> bytes:
        added = (added_tokens if added_tokens is not None else self._tok.get_added_tokens_decoder()).get(token_id)
        if added is not None:  # special and added tokens are kept whole, as their content
            return added.content.encode()
        if self._piece_bytes is None:
            decoder = self._tok.decoder
            self._piece_bytes = _piece_decoder(json.loads(decoder.__getstate__()) if decoder is not None else {})
        return self._piece_bytes(self._tok.id_to_token(token_id) or "")

    def render_chat(self, messages: list[ChatMessage], tools: list[ToolDef] | None = None) -> str:
        """Chat turns (and the tools the model may call) as text, through the model's chat
        template when it has one (weir/chat_template.py: render_chat, the function the gateway's
        /tokenize renders with). Raises ChatTemplateError when the template refuses the chat."""
        return render_chat(self._template, messages, tools, add_generation_prompt=True)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed: the character a byte-level BPE writes for each byte
    (printable bytes as themselves, the rest shifted past U+0100)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(shifted)}}


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _decoder_types(config: dict) -> set[str]:
    """The types of a tokenizer.json decoder, those inside a Sequence included."""
    return {config.get("type", ""), *(t for d in config.get("decoders", []) for t in _decoder_types(d))}


def _piece_decoder(config: dict) -> Callable[[str], bytes]:
    """How a vocabulary piece becomes bytes under the tokenizer's decoder: byte-level BPE's
    alphabet (GPT-2, Llama 3, Qwen, SmolLM), or SentencePiece's byte fallback (<0xE2>) and
    metaspace (▁ for a space); otherwise the piece's own UTF-8."""
    types = _decoder_types(config)
    if "ByteLevel" in types:
        table = _byte_decoder()
        return lambda piece: bytes(table[c] for c in piece) if all(c in table for c in piece) else piece.encode()

    def sentencepiece(piece: str) -> bytes:
        byte = _BYTE_TOKEN.fullmatch(piece) if "ByteFallback" in types else None
        return bytes([int(byte.group(1), 16)]) if byte else piece.replace("\u2581", " ").encode()

    return sentencepiece


class IncrementalDetokenizer:
    """Turns a growing list of output ids into text deltas without splitting a UTF-8 character.

    Decodes a small window (vLLM's prefix/read offsets) rather than the whole output each step.
    Text whose last character is not complete yet is held; `flush` releases what is held at the
    end, bytes that never made a character as U+FFFD (as vLLM and OpenAI show them).
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

    def flush(self, ids: list[int]) -> str:
        """The text `step` still holds for `ids` (the whole output), at the end of the output:
        an incomplete UTF-8 character's bytes come out as U+FFFD. "" when nothing is held."""
        prefix_text = self._tok.decode(ids[self._prefix_offset : self._read_offset])
        new_text = self._tok.decode(ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(ids)
        return new_text[len(prefix_text) :]
