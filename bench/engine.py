"""`weir bench engine`: Weir's engine against Hugging Face transformers' generate(), one run.

At each concurrency c, c requests arrive together (mixed prompt and output lengths, output
lengths forced with ignore_eos / min_new_tokens so every system produces the same number of
tokens):
  (a) generate() one request at a time;
  (b) generate() on one static batch of the c requests (left-padded; runs to the longest);
  (c) Weir's engine (continuous batching, paged KV cache).
Reports tokens/s, TTFT and inter-token latency percentiles, KV-cache memory per token against
the theoretical minimum, the ratios; then time-to-first-token with and without prefix caching
for requests sharing a long system prompt.

With --structured: constrained against unconstrained decoding instead (bench/structured.py), on
the default chat model unless --model says otherwise.
"""

from __future__ import annotations

import argparse
import itertools
import random
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.stats import RunResult, percentile, print_table
from schemas.messages import GenerateRequest, now_ms
from schemas.model_repo import load_model_repo


@dataclass(frozen=True)
class Job:
    prompt_ids: list[int]
    max_tokens: int


def corpus_text() -> str:
    """Source text present on every machine: this repository's own Python files."""
    root = Path(__file__).resolve().parents[1]
    files = sorted(p for d in ("services", "schemas", "weir", "bench") for p in (root / d).rglob("*.py"))
    return "\n".join(p.read_text() for p in files)


def make_jobs(tokenizer, n: int, seed: int, max_len: int) -> list[Job]:
    """n jobs: prompts of 16..192 tokens cut from real source, outputs of 16..128 tokens."""
    rng = random.Random(seed)
    ids = tokenizer.encode(corpus_text())
    jobs = []
    for _ in range(n):
        plen, olen = rng.randint(16, 192), rng.randint(16, 128)
        plen = min(plen, max_len - olen - 1)
        start = rng.randrange(0, len(ids) - plen)
        jobs.append(Job(ids[start : start + plen], olen))
    return jobs


class _FirstTokenTimer:
    """A transformers streamer that records when each generated step arrives."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:  # generate() first puts the prompt
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_hf_sequential(hf, jobs: list[Job]) -> RunResult:
    ttft, itl, tokens = [], [], 0
    start = time.perf_counter()
    for job in jobs:
        timer = _FirstTokenTimer()
        ids = torch.tensor([job.prompt_ids])
        hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=job.max_tokens,
            min_new_tokens=job.max_tokens,
            do_sample=False,
            streamer=timer,
            pad_token_id=0,
        )
        ttft.append((timer.times[0] - start) * 1000)
        itl += [(b - a) * 1000 for a, b in itertools.pairwise(timer.times)]
        tokens += job.max_tokens
    return RunResult("(a) HF generate, one at a time", len(jobs), ttft, itl, tokens, time.perf_counter() - start)


def run_hf_static(hf, jobs: list[Job]) -> tuple[RunResult, float]:
    """One static batch; returns the result and the KV waste % of its padded cache."""
    width = max(len(j.prompt_ids) for j in jobs)
    longest = max(j.max_tokens for j in jobs)
    ids = torch.zeros((len(jobs), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, job in enumerate(jobs):  # left padding, as decoder-only batching needs
        ids[row, width - len(job.prompt_ids) :] = torch.tensor(job.prompt_ids)
        mask[row, width - len(job.prompt_ids) :] = 1
    timer = _FirstTokenTimer()
    start = time.perf_counter()
    hf.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=longest,
        min_new_tokens=longest,
        do_sample=False,
        streamer=timer,
        pad_token_id=0,
    )
    wall = time.perf_counter() - start
    itl = [(b - a) * 1000 for a, b in itertools.pairwise(timer.times)]
    useful = sum(j.max_tokens for j in jobs)
    # every row holds width + longest positions; a request needs only its own prompt + output
    held = len(jobs) * (width + longest)
    needed = sum(len(j.prompt_ids) + j.max_tokens for j in jobs)
    result = RunResult(
        "(b) HF generate, static batch", len(jobs), [(timer.times[0] - start) * 1000] * len(jobs), itl, useful, wall
    )
    return result, 100 * (1 - needed / held)


def run_engine(engine, jobs: list[Job], model: str) -> tuple[RunResult, float]:
    """All jobs arrive together; returns the result and the token-weighted KV waste %."""
    start = time.perf_counter()
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    itl: list[float] = []
    tokens = 0
    for job in jobs:
        req = GenerateRequest(
            request_id=uuid.uuid4().hex,
            model=model,
            prompt="x",
            max_tokens=job.max_tokens,
            temperature=0.0,
            ignore_eos=True,
            deadline_ms=now_ms() + 3_600_000,
            reply_to="-",
        )
        engine.add_tokens(req, job.prompt_ids, now_ms())
    held_slots = used_slots = 0
    while engine.has_work:
        outputs = engine.step(now_ms())
        t = time.perf_counter()
        for seq in engine.scheduler.running:
            held_slots += len(seq.block_table) * engine.blocks.block_size
            used_slots += seq.num_computed
        for out in outputs:
            if out.token_ids:
                if out.request_id in last:
                    itl.append((t - last[out.request_id]) * 1000)
                else:
                    first[out.request_id] = (t - start) * 1000
                last[out.request_id] = t
            if out.is_final:
                tokens += out.completion_tokens
    waste = 100 * (1 - used_slots / held_slots) if held_slots else 0.0
    return RunResult(
        "(c) Weir engine", len(jobs), list(first.values()), itl, tokens, time.perf_counter() - start
    ), waste


def prefix_ttft(engine, tokenizer, model: str, system_tokens: int, n: int) -> list[float]:
    """TTFT (ms) of n requests, one after another, each = shared system prompt + its own question."""
    system = tokenizer.encode(corpus_text())[:system_tokens]
    times = []
    for i in range(n):
        question = tokenizer.encode(f"\n# question {i}: what does function_{i} return?\n")
        req = GenerateRequest(
            request_id=uuid.uuid4().hex,
            model=model,
            prompt="x",
            max_tokens=1,
            temperature=0.0,
            ignore_eos=True,
            deadline_ms=now_ms() + 3_600_000,
            reply_to="-",
        )
        start = time.perf_counter()
        engine.add_tokens(req, system + question, now_ms())
        while engine.has_work:
            engine.step(now_ms())
        times.append((time.perf_counter() - start) * 1000)
    return times[1:]  # the first request fills the cache in both configurations


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="weir bench engine", description=__doc__)
    parser.add_argument("--model", default=None, help="default: weir-tiny-py; with --structured smollm2-135m-instruct")
    parser.add_argument("--model-repo", default="models.toml")
    parser.add_argument("--concurrency", default="1,8,32,64")
    parser.add_argument("--system-prompt-tokens", type=int, default=512)
    parser.add_argument("--systems", default="a,b,c", help="which of (a), (b), (c) to run, e.g. b,c")
    parser.add_argument("--no-prefix", action="store_true", help="skip the shared-system-prompt TTFT part")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: as the worker picks)")
    parser.add_argument(
        "--structured", action="store_true", help="constrained vs unconstrained tokens/s (bench/structured.py)"
    )
    parser.add_argument(
        "--rounds", type=int, default=5, help="--structured: rounds per concurrency (medians and spread)"
    )
    parser.add_argument("--max-tokens", type=int, default=256, help="--structured: max_tokens of each request")
    parser.add_argument(
        "--model-dir", type=Path, default=None, help="the model's directory, instead of the repository's"
    )
    parser.add_argument(
        "--quantization",
        choices=["none", "int8", "int4"],
        default=None,
        help="Weir's weights (default: the model entry's quantization)",
    )
    parser.add_argument(
        "--speed",
        action="store_true",
        help="float32 vs int8 vs int4 engines in alternating rounds "
        "(--rounds): decode tokens/s and TTFT of a 100-token prompt at each --concurrency",
    )
    parser.add_argument(
        "--quality",
        action="store_true",
        help="float32 vs int8 vs int4: top-1 agreement over 20 "
        "prompts x 64 tokens, perplexity on bench/data/quality_text.txt, plain facts (bench/engine_quality.py)",
    )
    args = parser.parse_args(argv)
    if args.model is None:
        args.model = "smollm2-135m-instruct" if args.structured else "weir-tiny-py"
    if args.structured and args.concurrency == parser.get_default("concurrency"):
        args.concurrency = "1,32"
    import transformers

    from services.worker.hosts.hardware import cpu_threads

    torch.set_num_threads(cpu_threads(args.threads))

    from services.worker.engine import Engine, EngineConfig
    from weir.models.sources import ensure_model_dir

    config = load_model_repo(args.model_repo).models[args.model]
    if config.engine != "torch":
        parser.error(f"model {args.model!r} has engine {config.engine!r}: benchmark a torch model with weights")
    path = args.model_dir or ensure_model_dir(
        config, progress=lambda line: print(line, flush=True)
    )  # a GGUF source is imported once
    if args.quality:
        from bench.engine_quality import print_quality, quality_report

        print(f"model {args.model} ({path}), torch threads {torch.get_num_threads()}", flush=True)
        print_quality(quality_report(Path(path)))
        return 0
    if args.speed:
        from bench.engine_quality import print_speed, speed_report

        print(f"model {args.model} ({path}), torch threads {torch.get_num_threads()}", flush=True)
        print_speed(speed_report(Path(path), [int(c) for c in args.concurrency.split(",")], args.rounds))
        return 0
    quantization = args.quantization or config.quantization
    engine_config = EngineConfig(
        max_model_len=config.max_model_len, max_num_seqs=max(64, config.max_num_seqs), quantization=quantization
    )
    engine = Engine(path, engine_config)
    if args.structured:
        from bench.structured import run

        print(
            f"model {args.model} ({path}), torch threads {torch.get_num_threads()}, device {engine.device}", flush=True
        )
        return run(
            engine, args.model, Path(path), [int(c) for c in args.concurrency.split(",")], args.rounds, args.max_tokens
        )
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    levels = [int(c) for c in args.concurrency.split(",")]
    systems = set(args.systems.split(","))
    print(
        f"model {args.model}: {sum(p.numel() for p in hf.parameters()) / 1e6:.1f}M parameters, "
        f"torch threads {torch.get_num_threads()}, device {engine.device}, Weir weights {quantization} "
        f"({engine.model.weight_bytes / 1e6:.0f} MB)",
        flush=True,
    )
    rows, ratios = [], []
    with torch.inference_mode():
        for c in levels:
            jobs = make_jobs(engine.tokenizer, c, args.seed + c, config.max_model_len)
            level_rows, ratio = compare_at(c, systems, jobs, hf, engine, args.model)
            rows += level_rows
            if ratio is not None:
                ratios.append(ratio)
            print(f"  concurrency {c} done", flush=True)
    print_throughput(rows, ratios, engine)
    if args.no_prefix:
        return 0

    cached = Engine(path, engine_config)
    uncached = Engine(path, EngineConfig(**{**engine_config.__dict__, "enable_prefix_caching": False}))
    print_prefix_caching(cached, uncached, args.model, args.system_prompt_tokens)
    return 0


Ratio = tuple[int, float | None, float | None]  # (concurrency, Weir / (a), Weir / (b))


def compare_at(c: int, systems: set[str], jobs, hf, engine, model: str) -> tuple[list[list[str]], Ratio | None]:
    """Run the chosen systems on one concurrency's jobs: their table rows, and Weir's tokens/s ratios when (c) ran."""
    runs: dict[str, tuple[RunResult, float | None]] = {}
    if "a" in systems:
        runs["a"] = (run_hf_sequential(hf, jobs), None)
    if "b" in systems:
        runs["b"] = run_hf_static(hf, jobs)
    if "c" in systems:
        runs["c"] = run_engine(engine, jobs, model)
    rows = []
    for r, waste in runs.values():
        rows.append(
            [
                r.label,
                str(c),
                f"{r.tokens_per_s:.0f}",
                f"{percentile(r.ttft_ms, 50):.0f}",
                f"{percentile(r.ttft_ms, 95):.0f}",
                f"{percentile(r.itl_ms, 50):.1f}",
                f"{percentile(r.itl_ms, 95):.1f}",
                "-" if waste is None else f"{waste:.1f}",
            ]
        )
    if "c" not in runs:
        return rows, None
    tps = {k: r.tokens_per_s for k, (r, _) in runs.items()}
    return rows, (c, tps["c"] / tps["a"] if "a" in tps else None, tps["c"] / tps["b"] if "b" in tps else None)


def print_throughput(rows: list[list[str]], ratios: list[Ratio], engine) -> None:
    """The systems' table, the engine's KV layout, and Weir's speedups against the targets."""
    header = ["system", "conc", "tokens/s", "TTFT p50 ms", "TTFT p95 ms", "ITL p50 ms", "ITL p95 ms", "KV waste %"]
    print()
    print_table(rows, header)
    print(
        f"\nKV bytes per token: {engine.kv_bytes_per_token} (theoretical minimum: 2 x layers x kv_heads x head_dim x "
        f"dtype size); block size {engine.blocks.block_size}"
    )
    for c, ra, rb in ratios:
        vs_a = "-" if ra is None else f"{ra:.1f}x"
        vs_b = "-" if rb is None else f"{rb:.2f}x"
        print(f"concurrency {c:>2}: Weir = {vs_a} (a) one-at-a-time, {vs_b} (b) static batches")
    print("targets at 32: >= 5x (a), >= 1.5x (b); KV waste < 5%")


def print_prefix_caching(cached, uncached, model: str, system_prompt_tokens: int) -> None:
    """TTFT p50 of requests sharing a system prompt, prefix caching on against off, and the hit rate."""
    n = 6
    with_cache = prefix_ttft(cached, cached.tokenizer, model, system_prompt_tokens, n)
    without = prefix_ttft(uncached, uncached.tokenizer, model, system_prompt_tokens, n)
    p_with, p_without = percentile(with_cache, 50), percentile(without, 50)
    print(
        f"\nshared {system_prompt_tokens}-token system prompt, TTFT p50: prefix caching on {p_with:.1f} ms, "
        f"off {p_without:.1f} ms ({p_without / p_with:.1f}x; target >= 2x); hit rate {cached.blocks.prefix_hit_rate:.0%}"
    )
