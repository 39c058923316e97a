"""`weir bench grammar-libs`: xgrammar against llguidance and outlines-core on each model's vocabulary.

Why the engine uses xgrammar (docs/design.md, "Structured output, tools and logprobs"). Per
library and vocabulary: the tokenizer-info build, the nested schema's compile cold and cached
(llguidance: matcher creation; outlines-core: index build, no cache), and the per-token mask fill
median and max while walking a conforming document token by token. llguidance and outlines-core
are not Weir's dependencies: a library that is not installed is skipped.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from bench.stats import print_table

SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age", "tags", "address", "role"],
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "additionalProperties": False,
            "required": ["city", "zip"],
            "properties": {"city": {"type": "string"}, "zip": {"type": ["string", "null"]}},
        },
    },
}
DOC = json.dumps(
    {
        "name": "Ada Lovelace",
        "age": 36,
        "tags": ["math", "poetry", "engines"],
        "role": "admin",
        "address": {"city": "London", "zip": None},
    }
)
REPO = Path(__file__).resolve().parents[1]


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


def us(seconds: list[float]) -> tuple[str, str]:
    return f"{statistics.median(seconds) * 1e6:.0f}", f"{max(seconds) * 1e6:.0f}"


def timed(fn: Callable):
    t = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - t


def bench_xgrammar(tok, vocab_size: int, ids: list[int]) -> list[str]:
    import xgrammar as xgr

    info, t_info = timed(lambda: xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab_size))
    compiler = xgr.GrammarCompiler(info, cache_enabled=True)
    _, cold = timed(lambda: compiler.compile_json_schema(json.dumps(SCHEMA)))
    compiled, cached = timed(lambda: compiler.compile_json_schema(json.dumps(SCHEMA)))
    matcher, bitmask, fills = xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask(1, vocab_size), []
    for i in ids:
        fills.append(timed(lambda: matcher.fill_next_token_bitmask(bitmask))[1])
        if not matcher.accept_token(i):
            raise RuntimeError(f"xgrammar rejected token {i}")
    return ["xgrammar", ms(t_info), ms(cold), ms(cached), *us(fills)]


def bench_llguidance(tok, vocab_size: int, ids: list[int]) -> list[str]:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    info, t_info = timed(lambda: llguidance.hf.from_tokenizer(tok, n_vocab=vocab_size))

    def create():
        return llguidance.LLMatcher(info, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA)))

    _, cold = timed(create)
    matcher, cached = timed(create)
    if matcher.is_error():
        raise RuntimeError(matcher.get_error())
    bitmask, fills = lt.allocate_token_bitmask(1, vocab_size), []
    for i in ids:
        fills.append(timed(lambda: lt.fill_next_token_bitmask(matcher, bitmask, 0))[1])
        if not matcher.consume_token(i):
            raise RuntimeError(f"llguidance rejected token {i}: {matcher.get_error()}")
    return ["llguidance (matcher creation)", ms(t_info), ms(cold), ms(cached), *us(fills)]


def bench_outlines(tok, vocab_size: int, ids: list[int]) -> list[str]:
    from outlines_core import Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    def vocabulary():
        eos = tok.eos_token_id if tok.eos_token_id is not None else 0
        vocab: dict[str, list[int]] = {}
        for piece, i in tok.get_vocab().items():
            if i != eos:
                vocab.setdefault(tok.convert_tokens_to_string([piece]), []).append(i)
        return Vocabulary(eos, vocab)

    voc, t_info = timed(vocabulary)
    index, cold = timed(lambda: Index(build_regex_from_schema(json.dumps(SCHEMA)), voc))
    state, fills = index.get_initial_state(), []
    for i in ids:
        fills.append(timed(lambda state=state: index.get_allowed_tokens(state))[1])
        state = index.get_next_state(state, i)
        if state is None:
            raise RuntimeError(f"outlines-core rejected token {i}")
    return ["outlines-core (index build)", ms(t_info), ms(cold), "-", *us(fills)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="weir bench grammar-libs", description=__doc__)
    parser.add_argument(
        "model_dirs",
        nargs="*",
        type=Path,
        default=[REPO / "models" / "weir-tiny-py", REPO / "var" / "models" / "smollm2-135m-instruct"],
        help="Hugging Face model directories (tokenizer.json, config.json)",
    )
    args = parser.parse_args(argv)
    from transformers import PreTrainedTokenizerFast

    rows = []
    for model_dir in args.model_dirs:
        if not (model_dir / "tokenizer.json").exists():
            print(f"skipped {model_dir}: no tokenizer.json (import the model first)")
            continue
        tok = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
        vocab_size = max(len(tok), json.loads((model_dir / "config.json").read_text()).get("vocab_size", 0))
        ids = tok.encode(DOC, add_special_tokens=False)
        print(f"{model_dir.name}: vocabulary {vocab_size}, document {len(ids)} tokens", flush=True)
        for bench in (bench_xgrammar, bench_llguidance, bench_outlines):
            try:
                row = bench(tok, vocab_size, ids)
            except ImportError as exc:
                print(f"  skipped {bench.__name__[6:]}: not installed ({exc.name})")
                continue
            except Exception as exc:  # noqa: BLE001 - a library failing on this vocabulary is reported; the others run
                print(f"  {bench.__name__[6:]} failed: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            rows.append([model_dir.name, *row])
    print()
    print_table(
        rows,
        [
            "vocabulary",
            "library",
            "tokenizer info ms",
            "compile cold ms",
            "compile cached ms",
            "mask fill median us",
            "mask fill max us",
        ],
    )
    return 0
