"""A Hugging Face tokenizer (tokenizer.json, tokenizer_config.json) from a GGUF file's metadata.

A GGUF file keeps its tokenizer as llama.cpp reads it: the vocabulary (`tokenizer.ggml.tokens`),
the BPE merges or the SentencePiece scores, a type per token (normal, control, user-defined,
byte...), the special token ids, and the name of the pre-tokenizer (`tokenizer.ggml.pre`), which
llama.cpp maps to a fixed list of split regexes (llama-vocab.cpp). This module rebuilds the same
tokenizer with the `tokenizers` library:

    tokenizer.ggml.model = gpt2    byte-level BPE; the split regexes of `tokenizer.ggml.pre`
                                   (e.g. smollm: single digits, then GPT-2's regex), ByteLevel decoder
    tokenizer.ggml.model = llama   SentencePiece BPE: merges derived from the token scores, byte
                                   fallback (<0x0A>), "▁" for spaces and a space prefix

Control tokens (type 3) become special added tokens, user-defined ones (type 4) plain added
tokens, so both stay whole in a prompt, as llama.cpp keeps them.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from weir.models.gguf_file import GGUFError, GGUFFile

TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the regexes llama.cpp splits with, applied in turn (llama-vocab.cpp).
SPLITS: dict[str, list[str]] = {
    "default": [_GPT2], "gpt-2": [_GPT2], "gpt2": [_GPT2], "mpt": [_GPT2], "olmo": [_GPT2], "jais": [_GPT2],
    "smollm": [r"\p{N}", _GPT2], "starcoder": [r"\p{N}", _GPT2], "refact": [r"\p{N}", _GPT2],
    "codeshell": [r"\p{N}", _GPT2], "command-r": [r"\p{N}", _GPT2], "exaone": [r"\p{N}", _GPT2],
    "llama3": [_LLAMA3], "llama-v3": [_LLAMA3], "llama-bpe": [_LLAMA3], "falcon3": [_LLAMA3],
    "dbrx": [_LLAMA3], "smaug-bpe": [_LLAMA3], "pixtral": [_LLAMA3],
    "qwen2": [_QWEN2], "deepseek-r1-qwen": [_QWEN2], "stablelm2": [_QWEN2], "megrez": [_QWEN2],
}
_NFC_PRE = {"qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"}  # their tokenizer.json normalizes to NFC


def build_tokenizer(gguf: GGUFFile) -> Tokenizer:
    """The tokenizer the file's metadata describes; GGUFError for a kind llama.cpp would not run either."""
    kind = gguf.require("tokenizer.ggml.model")
    tokens: list[str] = gguf.require("tokenizer.ggml.tokens")
    types: list[int] = gguf.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise GGUFError(f"{gguf.path}: {len(types)} token types for {len(tokens)} tokens")
    if kind == "gpt2":
        tokenizer = _byte_level_bpe(gguf, tokens)
    elif kind == "llama":
        tokenizer = _sentencepiece_bpe(gguf, tokens, types)
    else:
        raise GGUFError(f"{gguf.path}: tokenizer.ggml.model={kind!r} is not supported (supported: gpt2, llama)")
    _add_special_tokens(tokenizer, tokens, types)
    return tokenizer


def _byte_level_bpe(gguf: GGUFFile, tokens: list[str]) -> Tokenizer:
    pre = gguf.get("tokenizer.ggml.pre") or "default"  # llama.cpp too falls back to GPT-2's regex
    if pre not in SPLITS:
        raise GGUFError(f"{gguf.path}: pre-tokenizer tokenizer.ggml.pre={pre!r} is not supported "
                        f"(supported: {', '.join(sorted(SPLITS))})")
    merges = [_merge(gguf, m) for m in gguf.require("tokenizer.ggml.merges")]
    tokenizer = Tokenizer(models.BPE(_vocab(tokens), merges, fuse_unk=False, byte_fallback=False))
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in SPLITS[pre]]
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    if pre in _NFC_PRE:
        tokenizer.normalizer = normalizers.NFC()
    return tokenizer


def _merge(gguf: GGUFFile, merge: str) -> tuple[str, str]:
    left, sep, right = merge.partition(" ")
    if not sep or not left or not right or " " in right:
        raise GGUFError(f"{gguf.path}: merge {merge!r} is not two tokens separated by one space")
    return left, right


def _vocab(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)  # a repeated token keeps its first id, as llama.cpp's lookup does
    return vocab


def _sentencepiece_bpe(gguf: GGUFFile, tokens: list[str], types: list[int]) -> Tokenizer:
    scores: list[float] = gguf.require("tokenizer.ggml.scores")
    unk_id = gguf.get("tokenizer.ggml.unknown_token_id")
    vocab = _vocab(tokens)
    mergeable = [(t, s) for t, s, k in zip(tokens, scores, types, strict=True) if k in (TOKEN_NORMAL, TOKEN_USER_DEFINED)]
    bpe = models.BPE(vocab, _merges_from_scores(vocab, mergeable), unk_token=tokens[unk_id] if unk_id is not None else None,
                     fuse_unk=True, byte_fallback=True)
    tokenizer = Tokenizer(bpe)
    add_prefix = gguf.get("tokenizer.ggml.add_space_prefix", True)
    replace = normalizers.Replace(" ", "\u2581")
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), replace]) if add_prefix else replace
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)] if add_prefix else steps)
    return tokenizer


def _merges_from_scores(vocab: dict[str, int], scored: list[tuple[str, float]]) -> list[tuple[str, str]]:
    """SentencePiece BPE as merges: every split of a token into two known tokens, best score first
    (llama.cpp merges the pair whose joined token scores highest)."""
    found: list[tuple[float, int, int, str, str]] = []
    for token, score in scored:
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                found.append((-score, vocab[left], vocab[right], left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def _add_special_tokens(tokenizer: Tokenizer, tokens: list[str], types: list[int]) -> None:
    special = [t for t, k in zip(tokens, types, strict=True) if k in (TOKEN_CONTROL, TOKEN_UNKNOWN)]
    user = [t for t, k in zip(tokens, types, strict=True) if k == TOKEN_USER_DEFINED]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])


def tokenizer_config(gguf: GGUFFile) -> dict[str, Any]:
    """tokenizer_config.json: the chat template, the special tokens by role and the BOS/EOS flags."""
    tokens: list[str] = gguf.require("tokenizer.ggml.tokens")
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    for role in ("bos", "eos", "unk", "pad"):
        key = "unknown" if role == "unk" else "padding" if role == "pad" else role
        token_id = gguf.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None:
            if not 0 <= token_id < len(tokens):
                raise GGUFError(f"{gguf.path}: tokenizer.ggml.{key}_token_id={token_id} is outside the vocabulary")
            config[f"{role}_token"] = tokens[token_id]
    default_bos = gguf.get("tokenizer.ggml.model") == "llama"  # llama.cpp adds BOS to SentencePiece by default
    config["add_bos_token"] = bool(gguf.get("tokenizer.ggml.add_bos_token", default_bos))
    config["add_eos_token"] = bool(gguf.get("tokenizer.ggml.add_eos_token", False))
    template = gguf.get("tokenizer.chat_template")
    if isinstance(template, str):
        config["chat_template"] = template
    return config
