"""`weir bench engine-step`: one engine's decode step at batch c, where its CPU time goes, or two
engines' code side by side.

c requests of `weir bench engine`'s jobs (same prompts, outputs long enough never to end) are
prefilled; then decode steps only. Times are CPU time (time.process_time) per step, which a busy
shared box distorts less than wall time; torch on one thread.

    weir bench engine-step --concurrency 32                   # step CPU time and its shares by category
    weir bench engine-step --concurrency 32 --against DIR     # DIR's engine (a checkout or `git archive`
                                                              # of an older commit) against this one

With --against both engines are built in this one process (each module tree imported under its own
root) and stepped in alternating rounds; it reports CPU ms per step (median [min-max] of rounds),
the old/new ratio per round, the aten op calls of one step, and whether both produced the same
tokens.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CATEGORIES = (  # (label, test on a profiler key)
    ("matmul (projections, lm_head)", lambda k: k in ("aten::mm", "aten::addmm", "mkldnn::_linear_pointwise")),
    ("attention: SDPA", lambda k: "scaled_dot_product" in k),
    ("attention: K/V gather", lambda k: k == "aten::index_select"),
    ("KV write", lambda k: k == "aten::index_copy_"),
    ("other ops (norms, RoPE, residual, SiLU, masks, sampling)", lambda k: True),
)


def _engine_classes(root: Path):
    """Engine and EngineConfig imported from `root`'s services/ and kernels/, then forgotten by
    sys.modules, so that another root's copies can be imported beside them."""
    sys.path.insert(0, str(root))
    try:
        module = importlib.import_module("services.worker.engine")
        classes = module.Engine, module.EngineConfig
    finally:
        for name in [n for n in sys.modules if n in ("services", "kernels") or n.startswith(("services.", "kernels."))]:
            del sys.modules[name]
        sys.path.remove(str(root))
    return classes


def _prefill(engine, jobs, max_tokens: int) -> float:
    """Queue `jobs` and step until every sequence has its first token; returns the CPU seconds."""
    from schemas.messages import GenerateRequest, now_ms

    for i, job in enumerate(jobs):
        request = GenerateRequest(
            request_id=f"r{i}",
            model="m",
            prompt="x",
            max_tokens=max_tokens,
            temperature=0.0,
            ignore_eos=True,
            deadline_ms=now_ms() + 3_600_000,
            reply_to="-",
        )
        engine.add_tokens(request, job.prompt_ids, now_ms())
    start = time.process_time()
    while engine.scheduler.waiting or any(s.num_output_tokens < 1 for s in engine._seqs.values()):
        engine.step(now_ms())
    return time.process_time() - start


def _steps_cpu_ms(engine, steps: int) -> float:
    from schemas.messages import now_ms

    start = time.process_time()
    for _ in range(steps):
        engine.step(now_ms())
    return (time.process_time() - start) * 1000 / steps


def _profile(engine, steps: int):
    from torch.profiler import ProfilerActivity, profile

    from schemas.messages import now_ms

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step(now_ms())
    return prof.key_averages()


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="weir bench engine-step", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="weir-tiny-py")
    parser.add_argument("--model-repo", default="models.toml")
    parser.add_argument(
        "--model-dir", type=Path, default=None, help="the model's directory, instead of the repository's"
    )
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10, help="decode steps per round")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--against", type=Path, default=None, help="a tree with an older engine to compare with")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from bench.engine import make_jobs
    from schemas.model_repo import load_model_repo
    from weir.models.sources import ensure_model_dir

    config = load_model_repo(args.model_repo).models[args.model]
    path = args.model_dir or ensure_model_dir(config, progress=lambda line: print(line, flush=True))
    systems = {"new": _engine_classes(ROOT)}
    if args.against is not None:
        systems = {"old": _engine_classes(args.against.resolve()), **systems}
    max_tokens = args.rounds * args.steps + 16
    engines = {
        name: engine_cls(
            path,
            config_cls(
                max_model_len=config.max_model_len, max_num_seqs=max(64, args.concurrency), kv_cache_bytes=768 << 20
            ),
        )
        for name, (engine_cls, config_cls) in systems.items()
    }
    jobs = make_jobs(engines["new"].tokenizer, args.concurrency, args.concurrency, config.max_model_len)
    with torch.inference_mode():
        for name, engine in engines.items():
            print(
                f"{name}: prefill of {args.concurrency} prompts {_prefill(engine, jobs, max_tokens):.2f} CPU s",
                flush=True,
            )
        cpu: dict[str, list[float]] = {name: [] for name in engines}
        for r in range(args.rounds):
            for name in list(engines) if r % 2 == 0 else list(engines)[::-1]:
                cpu[name].append(_steps_cpu_ms(engines[name], args.steps))
        events = {name: _profile(engine, 2) for name, engine in engines.items()}
    print(f"\n{args.model} at {args.concurrency}, decode steps, torch threads 1")
    for name in engines:
        calls = sum(e.count for e in events[name] if "::" in e.key) // 2
        print(f"  {name}: CPU ms per step {_spread(cpu[name])}; op calls per step {calls}")
    if "old" in engines:
        print(f"  old/new per round: {_spread([o / n for o, n in zip(cpu['old'], cpu['new'], strict=True)])}")
        old, new = ({s.request_id: s.output_ids for s in engines[k]._seqs.values()} for k in ("old", "new"))
        same = sum(old[r] == new[r] for r in old)
        print(f"  tokens: {same}/{len(old)} sequences identical")
    totals = dict.fromkeys((label for label, _ in CATEGORIES), 0.0)
    for event in events["new"]:
        label = next(label for label, test in CATEGORIES if test(event.key))
        totals[label] += event.self_cpu_time_total
    whole = sum(totals.values()) or 1.0
    print(
        "  new, shares of the ops' self CPU time (torch.profiler): "
        + "; ".join(f"{label} {100 * t / whole:.0f}%" for label, t in totals.items())
    )
    return 0
