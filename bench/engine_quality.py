"""What quantized weights cost in quality: `weir bench engine --quality` (and the tests' helpers).

For each quantization against the float32 model of the same directory:

    top-1 agreement    teacher-forced: the float32 model's greedy continuation (64 tokens of each of
                       20 prompts) is fed to both; the share of positions where the quantized model's
                       argmax is float32's. This is the figure the targets use (>= 95% for int8).
    free-run match     the share of the 20 x 64 tokens the quantized engine's own greedy output has
                       equal to float32's, position by position (one early divergence costs the rest).
    perplexity         on bench/data/quality_text.txt (a fixed English text shipped in the repository),
                       in windows of 256 tokens.
    facts              plain completions the float32 model gets right ("The capital of France is" ->
                       Paris): how many each quantization still gets right.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from services.worker.engine.kv_cache import allocate_kv_caches
from services.worker.engine.model import AttentionMetadata, CausalLM, load_model

TEXT = Path(__file__).with_name("data") / "quality_text.txt"
PROMPTS = [
    "The history of the printing press",
    "Here is a recipe for a simple tomato soup:",
    "def fibonacci(n):",
    "Photosynthesis is the process by which",
    "The three primary colors are",
    "Once upon a time, in a small village,",
    "To install Python packages, you",
    "The main causes of the French Revolution were",
    "A healthy breakfast includes",
    "The speed of light is",
    "In computer science, a hash table",
    "Dear hiring manager,",
    "The best way to learn a new language is",
    "Mount Everest is located",
    "import numpy as np\n\n",
    "The water cycle describes",
    "Rain forests are important because",
    "A good night's sleep helps",
    "The Pythagorean theorem states that",
    "Shakespeare wrote many plays, including",
]
FACTS = [
    ("The capital of France is", "Paris"),
    ("The capital of Japan is", "Tokyo"),
    ("The largest planet in our solar system is", "Jupiter"),
    ("Water is made of hydrogen and", "oxygen"),
    ("The first president of the United States was", "Washington"),
    ("The chemical symbol for gold is", "Au"),
    ("The author of Romeo and Juliet is", "Shakespeare"),
    ("The opposite of hot is", "cold"),
]


@torch.inference_mode()
def all_logits(model: CausalLM, ids: list[int], block_size: int = 16) -> torch.Tensor:
    """float32 logits [len(ids), vocab] of one sequence in one prefill (every row's, not only the last)."""
    a = model.args
    device = model.model.norm.weight.device
    blocks = -(-len(ids) // block_size)
    kv = allocate_kv_caches(a.num_layers, blocks, block_size, a.num_kv_heads, a.head_dim, torch.float32, device)
    n = len(ids)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n, device=device),
        prefills=[(0, n, torch.arange(blocks, device=device), n)],
        logits_indices=torch.arange(n, device=device),
    )
    return model(torch.tensor(ids, device=device), torch.arange(n, device=device), kv, meta)


@torch.inference_mode()
def greedy(model: CausalLM, ids: list[int], n: int) -> list[int]:
    """n greedy tokens after `ids` (re-running the whole prefix each step: simple, for short checks)."""
    out = list(ids)
    for _ in range(n):
        out.append(int(all_logits(model, out)[-1].argmax()))
    return out[len(ids) :]


def perplexity(model: CausalLM, ids: list[int], window: int = 256) -> float:
    """exp(mean negative log-likelihood) over non-overlapping windows of `ids`."""
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window + 1]
        if len(chunk) < 2:
            break
        logits = all_logits(model, chunk[:-1])
        nll += float(torch.nn.functional.cross_entropy(logits, torch.tensor(chunk[1:]), reduction="sum"))
        count += len(chunk) - 1
    return math.exp(nll / count)


def top1_agreement(reference: CausalLM, model: CausalLM, prompts_ids: list[list[int]], n: int):
    """(teacher-forced top-1 agreement, free-run match, reference continuations) over the prompts."""
    agree = total = same = 0
    continuations = []
    for ids in prompts_ids:
        ref = greedy_fast(reference, ids, n)
        continuations.append(ref)
        full = ids + ref
        top = all_logits(model, full[:-1]).argmax(-1)[len(ids) - 1 :].tolist()
        agree += sum(int(a == b) for a, b in zip(top, ref, strict=True))
        total += len(ref)
        own = greedy_fast(model, ids, n)
        same += sum(int(a == b) for a, b in zip(own, ref, strict=False))
    return agree / total, same / total, continuations


def greedy_fast(model: CausalLM, ids: list[int], n: int) -> list[int]:
    """greedy_engine() remembered on the model per prompt: the float32 reference is asked once per prompt."""
    cache = model.__dict__.setdefault("_weir_greedy_cache", {})
    key = (tuple(ids), n)
    if key not in cache:
        cache[key] = greedy_engine(model, ids, n)
    return cache[key]


@torch.inference_mode()
def greedy_engine(model: CausalLM, ids: list[int], n: int, block_size: int = 16) -> list[int]:
    """n greedy tokens through the paged KV cache: one prefill, then one decode step per token."""
    a = model.args
    device = model.model.norm.weight.device
    blocks = -(-(len(ids) + n) // block_size)
    kv = allocate_kv_caches(a.num_layers, blocks, block_size, a.num_kv_heads, a.head_dim, torch.float32, device)
    table = torch.arange(blocks, device=device)
    m = len(ids)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(m), prefills=[(0, m, table, m)], logits_indices=torch.tensor([m - 1])
    )
    token = int(model(torch.tensor(ids), torch.arange(m), kv, meta)[-1].argmax())
    out = [token]
    for pos in range(m, m + n - 1):
        meta = AttentionMetadata(
            slot_mapping=torch.tensor([pos]),
            num_decode_tokens=1,
            decode_groups=[(0, 1, table[None].int(), torch.tensor([pos + 1], dtype=torch.int32))],
            logits_indices=torch.tensor([0]),
        )
        token = int(model(torch.tensor([token]), torch.tensor([pos]), kv, meta)[-1].argmax())
        out.append(token)
    return out


def facts_right(model: CausalLM, tokenizer, facts=FACTS) -> list[bool]:
    return [
        answer.lower() in tokenizer.decode(greedy_fast(model, tokenizer.encode(prompt), 8)).lower()
        for prompt, answer in facts
    ]


def quality_report(path: Path, quantizations=("int8", "int4"), prompts: int = 20, tokens: int = 64) -> list[dict]:
    """One row per quantization (float32 first): agreement, perplexity, facts, weight bytes, load time."""
    from services.worker.engine.tokenizer import ModelTokenizer

    tokenizer = ModelTokenizer(path)
    text_ids = tokenizer.encode(TEXT.read_text())
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS[:prompts]]
    rows = []
    started = time.monotonic()
    reference = load_model(path, torch.device("cpu"), torch.float32)
    ref_load = time.monotonic() - started
    ref_ppl = perplexity(reference, text_ids)
    ref_facts = facts_right(reference, tokenizer)
    known = [f for f, ok in zip(FACTS, ref_facts, strict=True) if ok]
    rows.append(
        {
            "quantization": "none",
            "weights_mb": reference.weight_bytes / 1e6,
            "load_s": ref_load,
            "top1": 1.0,
            "free_run": 1.0,
            "perplexity": ref_ppl,
            "facts": f"{len(known)}/{len(FACTS)}",
        }
    )
    for q in quantizations:
        started = time.monotonic()
        model = load_model(path, torch.device("cpu"), torch.float32, q)
        load_s = time.monotonic() - started
        top1, free, _ = top1_agreement(reference, model, prompt_ids, tokens)
        ppl = perplexity(model, text_ids)
        right = sum(facts_right(model, tokenizer, known))
        rows.append(
            {
                "quantization": q,
                "weights_mb": model.weight_bytes / 1e6,
                "load_s": load_s,
                "top1": top1,
                "free_run": free,
                "perplexity": ppl,
                "facts": f"{right}/{len(known)}",
            }
        )
        del model
    return rows


def print_quality(rows: list[dict]) -> None:
    base = rows[0]["perplexity"]
    print("\n| quantization | weights MB | top-1 agreement | free-run match | perplexity | vs float32 | facts |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['quantization']} | {r['weights_mb']:.0f} | {100 * r['top1']:.1f}% | {100 * r['free_run']:.1f}% "
            f"| {r['perplexity']:.3f} | {100 * (r['perplexity'] / base - 1):+.2f}% | {r['facts']} |"
        )


def decode_speed(engine, streams: int, prompt_tokens: int = 100, max_tokens: int = 64) -> tuple[float, float]:
    """(decode tokens/s over all streams after their first token, TTFT ms of the first stream) for
    `streams` greedy requests of `prompt_tokens` tokens added together."""
    import uuid

    from schemas.messages import GenerateRequest, now_ms

    ids = engine.tokenizer.encode(TEXT.read_text())[:prompt_tokens]
    start = time.perf_counter()
    for i in range(streams):
        req = GenerateRequest(
            request_id=uuid.uuid4().hex,
            model="m",
            prompt="x",
            max_tokens=max_tokens,
            temperature=0.0,
            ignore_eos=True,
            deadline_ms=now_ms() + 3_600_000,
            reply_to="-",
        )
        engine.add_tokens(req, ids[i % 7 :] + ids[: i % 7], now_ms())  # rotated: no shared prefix to reuse
    first: float | None = None
    decode_start: float | None = None
    decoded = 0
    while engine.has_work:
        outputs = engine.step(now_ms())
        tokens = sum(len(o.token_ids) for o in outputs)
        if first is None and tokens:
            first = (time.perf_counter() - start) * 1000
        if (
            decode_start is None
            and engine.scheduler.running
            and all(s.num_computed >= len(ids) for s in engine.scheduler.running)
        ):
            decode_start = time.perf_counter()
            continue
        if decode_start is not None:
            decoded += tokens
    if decode_start is None:  # every stream ended before all of them were decoding: no decode phase to time
        raise RuntimeError(f"{streams} streams of {max_tokens} tokens finished without a decode phase to time")
    return decoded / (time.perf_counter() - decode_start), first or 0.0


def speed_report(
    path: Path, streams: list[int], rounds: int, quantizations=("none", "int8", "int4"), max_tokens: int = 32
) -> list[dict]:
    """decode_speed() of one engine per quantization, in alternating rounds; medians per (quantization, streams)."""
    import statistics

    from services.worker.engine import Engine, EngineConfig

    engines = {
        q: Engine(path, EngineConfig(max_model_len=512, max_num_seqs=max(64, *streams), quantization=q))
        for q in quantizations
    }
    runs: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for _ in range(rounds):
        for s in streams:
            for q, engine in engines.items():
                runs.setdefault((q, s), []).append(decode_speed(engine, s, max_tokens=max_tokens))
    return [
        {
            "quantization": q,
            "streams": s,
            "weights_mb": engines[q].model.weight_bytes / 1e6,
            "tokens_per_s": statistics.median(r[0] for r in v),
            "ttft_ms": statistics.median(r[1] for r in v),
        }
        for (q, s), v in runs.items()
    ]


def print_speed(rows: list[dict]) -> None:
    print("\n| weights | resident MB | streams | decode tokens/s | TTFT ms (first stream) |\n|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['quantization']} | {r['weights_mb']:.0f} | {r['streams']} | {r['tokens_per_s']:.1f} | {r['ttft_ms']:.0f} |"
        )
