"""A generation that ends inside a multi-byte character (issue 35, item 2): every generated token
keeps its position and its logprob entry, and the bytes the detokenizer holds come out at the
end as U+FFFD (as vLLM and OpenAI show them), never lost.

The detokenizer is checked on a byte-level BPE and a SentencePiece byte-fallback tokenizer; the
engine and the reply events on the default chat model, SmolLM2-135M-Instruct (its GGUF is
installed: imported once into $WEIR_HOME/models), whose first tokens for the emoji prompt of the
issue are pieces of one emoji."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, normalizers

from schemas.messages import ChatMessage, GenerateRequest, ReplyDelta, ReplyEnd, now_ms
from services.worker.engine import Engine, EngineConfig
from services.worker.engine.tokenizer import IncrementalDetokenizer, ModelTokenizer
from services.worker.kafka.events import reply_events

from .positions import contiguous

REPO = Path(__file__).resolve().parents[2]
WEIR_TINY_PY = REPO / "models" / "weir-tiny-py"
EMOJI_PROMPT = "Reply with three emojis only: 😀😂🎉"
TEXTS = ["s = '世界 → é' # ok", "🙂🎉 naïve", "x\u00e9\u00e9\u00e9"]


def sentencepiece_dir(tmp_path: Path) -> Path:
    """A Llama-2-style tokenizer: characters outside its vocabulary become <0xNN> byte tokens."""
    pieces = {"▁": 257, "h": 258, "i": 259, "▁h": 260, "▁hi": 261}
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, **pieces}
    tok = Tokenizer(models.BPE(vocab, [("▁", "h"), ("▁h", "i")], byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    return tmp_path


def detokenize(tokenizer: ModelTokenizer, ids: list[int]) -> tuple[list[str], str]:
    """What the detokenizer releases at each step of `ids`, and what its flush releases at the end."""
    detok = IncrementalDetokenizer(tokenizer)
    steps = [detok.step(ids[: i + 1]) for i in range(len(ids))]
    return steps, detok.flush(ids)


@pytest.mark.parametrize("kind", ["byte-level", "sentencepiece"])
def test_steps_then_the_flush_give_the_whole_decode_wherever_the_output_is_cut(kind: str, tmp_path: Path) -> None:
    tokenizer = ModelTokenizer(WEIR_TINY_PY if kind == "byte-level" else sentencepiece_dir(tmp_path))
    num_split = 0
    for text in TEXTS:
        ids = tokenizer.encode(text)
        whole = ""  # the decode of the output up to its last complete character
        for end in range(1, len(ids) + 1):  # the output cut after each of its tokens
            steps, held = detokenize(tokenizer, ids[:end])
            got, decoded = "".join(steps) + held, tokenizer.decode(ids[:end])
            if "\ufffd" not in decoded:
                whole = decoded
                assert got == decoded and held == "", (text, end)
                continue
            num_split += 1
            if kind == "byte-level":  # its decode is the lossy UTF-8 of the tokens' bytes, as is ours
                raw = b"".join(bytes(tokenizer.token_piece(i)[1]) for i in ids[:end])
                assert got == decoded == raw.decode("utf-8", errors="replace"), (text, end)
            # (ByteFallback decodes a run of byte tokens with a bad end as U+FFFD whole, so there
            # the whole decode may replace more than the incomplete character; ours keeps the rest)
            assert got.startswith(whole) and set(got[len(whole) :]) == {"\ufffd"}, (text, end)
            assert held.endswith("\ufffd")  # the bytes that never made a character come out
    assert num_split > 0  # some cut fell inside a character: the flush was exercised


def test_a_flush_with_nothing_held_is_empty() -> None:
    tokenizer = ModelTokenizer(WEIR_TINY_PY)
    ids = tokenizer.encode("def main():")
    steps, held = detokenize(tokenizer, ids)
    assert "".join(steps) == "def main():" and held == ""


@pytest.fixture(scope="module")
def smollm2() -> Engine:
    from schemas.model_repo import load_model_repo
    from weir.models.sources import ensure_model_dir

    model_dir = ensure_model_dir(load_model_repo(REPO / "models.toml").models["smollm2-135m-instruct"])
    return Engine(model_dir, EngineConfig(max_model_len=256), torch.device("cpu"))


def emoji_request(max_tokens: int, **overrides) -> GenerateRequest:
    fields = dict(
        request_id=f"emoji-{max_tokens}",
        model="smollm2-135m-instruct@1",
        max_tokens=max_tokens,
        messages=[ChatMessage(role="user", content=EMOJI_PROMPT)],
        temperature=0.0,
        logprobs=2,
        deadline_ms=now_ms() + 600_000,
        reply_to="weir.replies.test",
    )
    return GenerateRequest(**{**fields, **overrides})


def run(engine: Engine, request: GenerateRequest) -> list[ReplyDelta | ReplyEnd]:
    assert engine.add(request, now_ms()) is None
    events: list[ReplyDelta | ReplyEnd] = []
    while engine.has_work:
        for out in engine.step(now_ms()):
            events += reply_events(request, "b1", out, "smollm2-135m-instruct@1")
    return events


@pytest.mark.parametrize("max_tokens", [1, 2, 3])
def test_a_reply_cut_inside_an_emoji_keeps_every_token_and_its_bytes(smollm2: Engine, max_tokens: int) -> None:
    events = run(smollm2, emoji_request(max_tokens))
    deltas, end = [e for e in events if isinstance(e, ReplyDelta)], events[-1]
    assert isinstance(end, ReplyEnd) and contiguous(events)
    assert end.finish_reason == "length" and end.usage.completion_tokens == max_tokens == end.seq
    token_ids = [t for d in deltas for t in d.token_ids]
    entries = [e for d in deltas for e in d.logprobs or []]
    assert len(token_ids) == len(entries) == max_tokens  # a position, a token and a logprob entry each
    assert [e.token_id for e in entries] == token_ids
    assert all(len(e.top_logprobs) == 2 for e in entries)
    raw = b"".join(bytes(e.bytes) for e in entries)
    text = "".join(d.text for d in deltas)
    assert text == raw.decode("utf-8", errors="replace")  # held bytes at the end: U+FFFD
    assert text == smollm2.tokenizer.decode(token_ids)


def test_the_emoji_prompt_does_split_a_character_on_this_model(smollm2: Engine) -> None:
    """The cases above are the issue's only while the first token is part of an emoji: it is."""
    [delta, _end] = run(smollm2, emoji_request(1))
    assert delta.text == "\ufffd" and len(bytes(delta.logprobs[0].bytes)) < 4


def test_the_tokens_of_a_stop_string_keep_their_positions(smollm2: Engine) -> None:
    """Text from a stop string on is no output, but its tokens were generated and counted: each
    has its position (text "") and its logprob entry."""
    reference = run(smollm2, emoji_request(6, request_id="ref"))
    stop = "".join(e.text for e in reference if isinstance(e, ReplyDelta))[:1]  # the first emoji
    events = run(smollm2, emoji_request(6, request_id="stopped", stop=[stop]))
    deltas, end = [e for e in events if isinstance(e, ReplyDelta)], events[-1]
    assert isinstance(end, ReplyEnd) and end.finish_reason == "stop" and contiguous(events)
    assert "".join(d.text for d in deltas) == ""
    assert sum(len(d.token_ids) for d in deltas) == sum(len(d.logprobs or []) for d in deltas)
    assert sum(len(d.token_ids) for d in deltas) == end.usage.completion_tokens == end.seq > 0


def test_bytes_that_never_make_a_character_come_out_at_the_end() -> None:
    """A model that writes lead byte after lead byte (0xC3 0xC3 ...): every step's text ends in
    an incomplete character, so nothing is released until the end, which flushes them all, one
    U+FFFD each, on the last token's position; every token before has its position with ""."""
    engine = Engine(WEIR_TINY_PY, EngineConfig(max_model_len=128, kv_cache_bytes=16 << 20))
    lead = engine.tokenizer.token_id("Ã")  # byte-level BPE's character for the byte 0xC3
    assert lead is not None and engine.tokenizer.token_piece(lead) == ("\ufffd", [0xC3])
    request = GenerateRequest(
        request_id="lead",
        model="weir-tiny-py@1",
        prompt="def f():",
        max_tokens=5,
        logit_bias={str(lead): 100.0},
        logprobs=0,
        temperature=0.0,
        deadline_ms=now_ms() + 600_000,
        reply_to="weir.replies.test",
    )
    events = run(engine, request)
    [delta, end] = events
    assert isinstance(delta, ReplyDelta) and isinstance(end, ReplyEnd) and contiguous(events)
    assert delta.token_ids == [lead] * 5 and len(delta.logprobs or []) == 5
    assert delta.texts == ["", "", "", "", "\ufffd" * 5] and end.seq == end.usage.completion_tokens == 5
