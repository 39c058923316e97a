"""Raw logprobs, the cumulative logprob and fill-in-the-middle (docs/design.md, "Structured output,
tools and logprobs"): on the trained default model (weir-tiny-py) against transformers, through the
wire mapping, and the tokenizer's token bytes and FIM rendering."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, normalizers

from schemas.messages import ReplyDelta, ReplyEnd
from services.worker.engine import EchoEngine, Engine, EngineConfig
from services.worker.engine.sampler import raw_logprobs
from services.worker.engine.tokenizer import ModelTokenizer
from services.worker.kafka.events import reply_events

from .factories import make_request, make_tokenizer
from .positions import contiguous

transformers = pytest.importorskip("transformers")

WEIR_TINY_PY = Path(__file__).resolve().parents[2] / "models" / "weir-tiny-py"
PROMPT = "def parse_args(argv):\n"


@pytest.fixture(scope="module")
def tiny_py() -> Engine:
    return Engine(WEIR_TINY_PY, EngineConfig(max_model_len=256, kv_cache_bytes=32 << 20))


@pytest.fixture(scope="module")
def hf_model():
    return transformers.AutoModelForCausalLM.from_pretrained(WEIR_TINY_PY, dtype=torch.float32).eval()


def run(engine: Engine, *requests) -> dict[str, list]:
    """Run `requests` together to the end; each one's engine outputs."""
    for request in requests:
        assert engine.add(request, 0) is None
    outputs: dict[str, list] = {r.request_id: [] for r in requests}
    while engine.has_work:
        for out in engine.step(0):
            outputs[out.request_id].append(out)
    return outputs


def hf_logprobs(hf_model, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax over the vocabulary at each output position: [len(output), vocab]."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt_ids + output_ids])).logits[0].float()
    return torch.log_softmax(logits[len(prompt_ids) - 1 : -1], dim=-1)


def test_logprobs_are_the_models_raw_distribution_whatever_the_sampling(tiny_py, hf_model) -> None:
    """Greedy and sampled-with-penalty rows in one batch: each token's logprob and its top
    alternatives are transformers' log-softmax before temperature and penalties; the top list is
    sorted and holds the sampled token's own entry when it ranks; the cumulative logprob is their
    sum, and the same greedy request without logprobs gets the same sum and no per-token entries."""
    greedy = make_request(PROMPT, max_tokens=12, logprobs=5, ignore_eos=True)
    sampled = make_request(
        PROMPT, max_tokens=12, logprobs=3, temperature=0.7, frequency_penalty=1.5, seed=3, ignore_eos=True
    )
    silent = make_request(PROMPT, max_tokens=12, ignore_eos=True)
    outputs = run(tiny_py, greedy, sampled, silent)
    prompt_ids = tiny_py.tokenizer.encode(PROMPT)
    for request in (greedy, sampled):
        events = outputs[request.request_id]
        ids = [t for e in events for t in e.token_ids]
        entries = [lp for e in events for lp in e.logprobs]
        assert [e.token_id for e in entries] == ids and len(ids) == 12
        expected = hf_logprobs(hf_model, prompt_ids, ids)
        for step, entry in enumerate(entries):
            assert entry.logprob == pytest.approx(float(expected[step, entry.token_id]), abs=1e-4)
            top_values, top_ids = torch.topk(expected[step], request.logprobs)
            assert [t.token_id for t in entry.top_logprobs] == top_ids.tolist()
            assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top_values.tolist(), abs=1e-4)
            top = [t.logprob for t in entry.top_logprobs]
            assert top == sorted(top, reverse=True)
            own = [t for t in entry.top_logprobs if t.token_id == entry.token_id]
            assert not own or own[0].logprob == entry.logprob
            assert entry.bytes == list(tiny_py.tokenizer.token_piece(entry.token_id)[1])
        assert events[-1].cumulative_logprob == pytest.approx(math.fsum(e.logprob for e in entries), abs=1e-4)
    assert all(lp.logprob == lp.top_logprobs[0].logprob for o in outputs[greedy.request_id] for lp in o.logprobs)
    assert all(o.logprobs is None for o in outputs[silent.request_id])
    cumulative = outputs[greedy.request_id][-1].cumulative_logprob
    assert outputs[silent.request_id][-1].cumulative_logprob == pytest.approx(cumulative)


def test_logprobs_follow_token_ids_across_events_with_a_stop_string(tiny_py) -> None:
    """Held-back text (a possible stop string) moves text between events, never tokens: every
    ReplyDelta's logprobs match its token_ids, and the ReplyEnd's cumulative logprob sums them all."""
    probe = make_request("import os\n", max_tokens=16)
    full = "".join(o.text for o in run(tiny_py, probe)[probe.request_id])
    stop = full[12:17]  # five characters over several tokens, some way in
    request = make_request("import os\n", max_tokens=16, logprobs=0, stop=[stop])
    outputs = run(tiny_py, request)[request.request_id]
    assert outputs[-1].finish_reason == "stop"
    events = [ev for out in outputs for ev in reply_events(request, "b-1", out, "weir-tiny-py@1")]
    deltas = [ev for ev in events if isinstance(ev, ReplyDelta)]
    assert any(tiny_py.tokenizer.decode(out.token_ids) != out.text for out in outputs)  # text was held back
    for delta in deltas:
        assert [lp.token_id for lp in delta.logprobs] == delta.token_ids
        assert all(lp.top_logprobs == [] for lp in delta.logprobs)
    end = events[-1]
    assert isinstance(end, ReplyEnd) and contiguous(events)
    engine_entries = [lp.logprob for out in outputs for lp in out.logprobs]
    assert len(engine_entries) == end.usage.completion_tokens
    assert end.cumulative_logprob == pytest.approx(math.fsum(engine_entries), abs=1e-4)


def test_raw_logprobs_gathers_every_row_and_tops_only_the_rows_that_ask() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 0.0], [0.5, 0.25, 4.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    logp = torch.log_softmax(logits, dim=-1)
    logprobs, tops = raw_logprobs(logp, [1, 2, 0, None], [None, 0, 2, 3])
    assert logprobs[:3] == pytest.approx([float(logp[0, 1]), float(logp[1, 2]), float(logp[2, 0])])
    assert logprobs[3] is None
    assert tops[:2] == [None, None] and tops[3] is None  # not asked, asked for none, a failed row
    assert [i for i, _ in tops[2]] == [2, 3]
    assert [v for _, v in tops[2]] == pytest.approx([float(logp[2, 2]), float(logp[2, 3])])


def test_token_bytes_are_exact_for_a_character_split_over_tokens() -> None:
    tokenizer = ModelTokenizer(WEIR_TINY_PY)
    text = "s = '世界 → é'"
    pieces = [tokenizer.token_piece(i) for i in tokenizer.encode(text)]
    assert b"".join(bytes(raw) for _, raw in pieces) == text.encode()
    split = [(t, raw) for t, raw in pieces if "\ufffd" in t]
    assert split and all(bytes(raw).decode("utf-8", errors="replace") == t for t, raw in split)
    assert tokenizer.token_piece(0) == ("<|endoftext|>", list(b"<|endoftext|>"))  # a special token whole


def test_token_bytes_of_sentencepiece_byte_fallback_and_metaspace(tmp_path) -> None:
    """Llama-2-style pieces: <0xC3> is the byte itself, ▁ a space (the decoder's own rules)."""
    pieces = {"▁": 257, "h": 258, "i": 259, "▁h": 260, "▁hi": 261}
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, **pieces}
    tok = Tokenizer(models.BPE(vocab, [("▁", "h"), ("▁h", "i")], byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    tokenizer = ModelTokenizer(tmp_path)
    ids = tokenizer.encode("hi é")
    assert ids == [261, 257, 196, 170]  # ▁hi ▁ <0xC3> <0xA9>: é is not in the vocabulary, so its bytes
    assert [tokenizer.token_piece(i) for i in ids] == [
        (" hi", list(b" hi")),
        (" ", [32]),
        ("\ufffd", [0xC3]),
        ("\ufffd", [0xA9]),
    ]


@pytest.mark.parametrize(
    "names", [("<fim_prefix>", "<fim_suffix>", "<fim_middle>"), ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")]
)
def test_a_suffix_renders_prefix_suffix_middle_with_the_tokenizers_fim_tokens(tmp_path, names) -> None:
    make_tokenizer(tmp_path, special_tokens=names)
    tokenizer = ModelTokenizer(tmp_path)
    text = tokenizer.render(make_request("def add(a, b):\n", suffix="\n    return c\n"))
    assert text == f"{names[0]}def add(a, b):\n{names[1]}\n    return c\n{names[2]}"
    ids = tokenizer.encode(text)
    fim_ids = [tokenizer.token_id(n) for n in names]
    assert ids[0] == fim_ids[0] and ids[-1] == fim_ids[2] and fim_ids[1] in ids


def test_a_suffix_without_fim_tokens_is_refused_naming_the_model(tiny_py) -> None:
    assert ModelTokenizer(WEIR_TINY_PY).fim_tokens is None
    out = tiny_py.add(make_request(PROMPT, model="weir-tiny-py", suffix="    return args\n"), 0)
    assert out is not None and out.finish_reason == "rejected" and out.error.code == "suffix_unsupported"
    assert "weir-tiny-py" in out.error.message and "fill-in-the-middle" in out.error.message


def test_the_echo_model_refuses_logprobs_and_suffix() -> None:
    echo = EchoEngine()
    for fields, named in [({"logprobs": 0}, "logprobs"), ({"suffix": "x"}, "suffix")]:
        out = echo.add(make_request("hello world", **fields), 0)
        assert out is not None and out.finish_reason == "rejected" and out.error.code == "unsupported_by_model"
        assert named in out.error.message
    assert echo.add(make_request("hello world"), 0) is None
