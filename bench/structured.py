"""`weir bench engine --structured`: what a JSON-schema constraint costs the engine, one run.

At each concurrency c, c chat requests asking for a JSON record arrive together, once
unconstrained and once constrained by a nested schema (objects in arrays, enums, nullable),
alternating for `--rounds` rounds. Neither ignores EOS (a constrained output ends where its JSON
closes), so the runs differ in length: compare tokens/s, not wall time. Reports per mode the
median tokens/s over rounds and its spread (min-max), the ratio constrained / unconstrained
(target >= 0.9x at 32: the mask is one reused bitmask, filled and applied only for constrained
rows), the share of outputs valid; then each schema's compile time, cold and cached, and the
tokenizer-info build that the first constraint of a model pays.
"""

from __future__ import annotations

import statistics
import time
import uuid
from pathlib import Path

import torch

from bench.stats import print_table
from schemas.messages import ChatMessage, GenerateRequest, StructuredOutputs, now_ms

PERSON = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age", "role", "email", "addresses"],
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "role": {"enum": ["admin", "user", "guest"]},
        "email": {"type": ["string", "null"], "maxLength": 60},
        "addresses": {
            "type": "array",
            "maxItems": 3,
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["city", "zip", "kind"],
                "properties": {
                    "city": {"type": "string", "maxLength": 30},
                    "zip": {"type": ["string", "null"], "maxLength": 10},
                    "kind": {"enum": ["home", "work"]},
                },
            },
        },
    },
}
SCHEMAS = {
    "nested (objects in arrays, enums, nullable)": PERSON,
    "flat (3 fields)": {
        "type": "object",
        "additionalProperties": False,
        "required": ["ok", "count", "label"],
        "properties": {"ok": {"type": "boolean"}, "count": {"type": "integer"}, "label": {"type": "string"}},
    },
    "enum of 200 strings": {"enum": [f"option-{i}" for i in range(200)]},
}
TOPICS = ["a librarian", "a ship's cook", "a chess coach", "a beekeeper", "a pilot", "a potter", "a nurse", "a farmer"]


def requests_for(model: str, c: int, max_tokens: int, structured: StructuredOutputs | None) -> list[GenerateRequest]:
    """c chat requests asking for a JSON record; the same prompts and seeds whether constrained or not."""
    out = []
    for i in range(c):
        ask = (
            f"Write a JSON object describing {TOPICS[i % len(TOPICS)]} with fields name, age, role "
            f"(admin, user or guest), email and addresses (city, zip, kind). Only the JSON."
        )
        out.append(
            GenerateRequest(
                request_id=uuid.uuid4().hex,
                model=model,
                messages=[ChatMessage(role="user", content=ask)],
                max_tokens=max_tokens,
                temperature=0.7,
                seed=i,
                structured=structured,
                deadline_ms=now_ms() + 3_600_000,
                reply_to="-",
            )
        )
    return out


def run_once(engine, requests: list[GenerateRequest]) -> tuple[float, int, int]:
    """All requests arrive together: (tokens/s, tokens, outputs valid)."""
    start = time.perf_counter()
    tokens = valid = 0
    for request in requests:
        refused = engine.add(request, now_ms())
        if refused is not None:
            raise RuntimeError(f"refused: {refused.error}")
    while engine.has_work:
        for out in engine.step(now_ms()):
            if out.is_final:
                tokens += out.completion_tokens
                valid += bool(out.structured_valid)
    return tokens / (time.perf_counter() - start), tokens, valid


def compile_times(model_dir: Path, vocab_size: int, stop_ids: set[int]) -> list[list[str]]:
    """Per schema: compile ms cold (in the compile child, serialized back) and cached, on a fresh
    grammar cache, after the child's start (its first trivial compile: what prewarm pays)."""
    from services.worker.engine.grammar import Grammars

    grammars = Grammars(model_dir, vocab_size, stop_ids)
    t = time.perf_counter()
    grammars.prewarm().result()
    rows = [["compile child start + tokenizer info (prewarm)", f"{(time.perf_counter() - t) * 1000:.0f}", "-"]]
    for name, schema in SCHEMAS.items():
        spec = StructuredOutputs(json_schema=schema)
        t = time.perf_counter()
        grammars.compile(spec, timeout_s=600)
        cold = (time.perf_counter() - t) * 1000
        t = time.perf_counter()
        grammars.compile(spec)
        cached = (time.perf_counter() - t) * 1000
        rows.append([name, f"{cold:.1f}", f"{cached:.3f}"])
    grammars.close()
    return rows


def run(engine, model: str, model_dir: Path, levels: list[int], rounds: int, max_tokens: int) -> int:
    spec = StructuredOutputs(json_schema=PERSON)
    engine.grammars.compile(spec, timeout_s=600)  # compiled before timing: the runs measure decoding
    run_once(engine, requests_for(model, 1, 8, None))  # warm-up
    rows, ratios = [], []
    with torch.inference_mode():
        for c in levels:
            tps: dict[str, list[float]] = {"unconstrained": [], "constrained": []}
            tokens = {"unconstrained": 0, "constrained": 0}
            valid = 0
            for _ in range(rounds):
                for mode, structured in (("unconstrained", None), ("constrained", spec)):
                    rate, n, ok = run_once(engine, requests_for(model, c, max_tokens, structured))
                    tps[mode].append(rate)
                    tokens[mode] += n
                    valid += ok if structured else 0
            for mode in tps:
                rows.append(
                    [
                        mode,
                        str(c),
                        f"{statistics.median(tps[mode]):.0f}",
                        f"{min(tps[mode]):.0f}-{max(tps[mode]):.0f}",
                        f"{tokens[mode] / (rounds * c):.0f}",
                        f"{valid}/{rounds * c}" if mode == "constrained" else "-",
                    ]
                )
            ratios.append((c, statistics.median(tps["constrained"]) / statistics.median(tps["unconstrained"])))
            print(f"  concurrency {c} done", flush=True)
    print()
    print_table(rows, ["mode", "conc", "tokens/s median", "spread (min-max)", "tokens/request", "valid"])
    for c, ratio in ratios:
        print(f"concurrency {c:>2}: constrained / unconstrained tokens/s = {ratio:.2f}x")
    print("target at 32: >= 0.9x")
    print()
    print_table(
        compile_times(model_dir, engine.model.args.vocab_size, engine.eos_ids),
        ["schema", "compile cold ms", "cached ms"],
    )
    return 0
