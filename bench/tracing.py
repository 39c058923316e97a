"""`weir bench tracing`: what tracing costs in throughput, sampling 0 against sampling 1.

One stack (auditor, worker, batcher) and two gateways in front of it: one with WEIR_TRACE_SAMPLE=0
(every request's context still travels in the record headers, nothing is recorded) and one with
WEIR_TRACE_SAMPLE=1 (every span of every hop recorded and published to the traces topic). The
services behind them follow the gateway's decision (ParentBased sampling: docs/design.md,
"Observability"), so the two paths differ only by tracing. The same closed-loop load as `weir
bench pipeline` (same prompts, seeds, max_tokens) runs through each, at --concurrency, in
alternating order for --rounds rounds after an unmeasured warm-up of each; the ratio is the median
of the per-round ratios of tokens/s (target: sampling 1 keeps >= 97% of sampling 0's throughput).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import uuid
from pathlib import Path

from bench.pipeline import run_http
from bench.stats import RunResult, percentile, print_table
from schemas.model_repo import load_model_repo
from schemas.topics import Topics

PATHS = {"off": "0", "on": "1"}  # path -> WEIR_TRACE_SAMPLE of its gateway


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="weir bench tracing", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="weir-tiny-py")
    parser.add_argument("--model-repo", default="models.toml")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests-per-lane", type=int, default=4, help="requests per run = concurrency x this")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=6, help="alternating rounds of both paths")
    parser.add_argument(
        "--ports",
        default="",
        help="5 HTTP ports: gateway off, gateway on, auditor, batcher, worker (default: any free ones)",
    )
    args = parser.parse_args(argv)
    runs, ratios, spans = asyncio.run(_runs(args))
    _report(runs, ratios, spans, args)
    return 0


async def _runs(args: argparse.Namespace) -> tuple[dict[str, list[RunResult]], list[float], int]:
    from weir.bus import BusSettings, read_topic
    from weir.kafka import launcher
    from weir.kafka.admin import delete_prefixed_topics, deployment_specs, ensure_topics
    from weir.stack import Stack, free_ports, wait_http_ok

    broker = launcher.BrokerConfig.from_env()
    await launcher.up(broker, 120)
    topics = Topics(f"bench{uuid.uuid4().hex[:6]}")
    await ensure_topics(broker.bootstrap, deployment_specs(topics, load_model_repo(args.model_repo)))
    ports = [int(p) for p in args.ports.split(",")] if args.ports else free_ports(5)
    if len(ports) != 5:
        raise SystemExit("--ports takes 5 ports")
    scratch = Path(tempfile.mkdtemp(prefix="weir-bench-tracing-"))
    env = {
        "WEIR_KAFKA_BOOTSTRAP": broker.bootstrap,
        "WEIR_TOPIC_PREFIX": topics.prefix,
        "WEIR_MODEL_REPO": str(Path(args.model_repo).resolve()),
        "WEIR_MODELS": args.model,
        "WEIR_AUTH_MODE": "open",
        "WEIR_AUDIT_DB": str(scratch / "audit.sqlite"),
        "WEIR_AUDIT_FINGERPRINT_MODEL": "",
        "WEIR_TRACE_SAMPLE": "1",
        "WEIR_AUDIT_API_PORT": str(ports[2]),
        "WEIR_BATCHER_HTTP_PORT": str(ports[3]),
        "WEIR_WORKER_HTTP_PORT": str(ports[4]),
    }
    stack = Stack(env, scratch)
    runs: dict[str, list[RunResult]] = {path: [] for path in PATHS}
    ratios: list[float] = []
    try:
        for name in ("auditor", "worker", "batcher"):
            stack.start(name)
        bases = {}
        for (path, sample), port in zip(PATHS.items(), ports[:2], strict=True):
            stack.start(f"gateway-{path}", "gateway", {"WEIR_GATEWAY_PORT": str(port), "WEIR_TRACE_SAMPLE": sample})
            bases[path] = f"http://127.0.0.1:{port}"
        for base in bases.values():
            await asyncio.to_thread(wait_http_ok, f"{base}/readyz", 300, stack)
        c, n = args.concurrency, args.concurrency * args.requests_per_lane
        for path in PATHS:  # warm-up
            await run_http(bases[path], args.model, c, n, args.max_tokens)
        print(f"model {args.model}, concurrency {c}, {n} requests per run, {args.rounds} rounds", flush=True)
        for r in range(args.rounds):
            order = list(PATHS) if r % 2 == 0 else list(reversed(PATHS))
            got = {path: await run_http(bases[path], args.model, c, n, args.max_tokens) for path in order}
            for path, result in got.items():
                runs[path].append(result)
            ratios.append(got["on"].tokens_per_s / got["off"].tokens_per_s)
            print(
                f"round {r + 1}: off {got['off'].tokens_per_s:.1f} tok/s, on {got['on'].tokens_per_s:.1f} tok/s",
                flush=True,
            )
        await asyncio.sleep(2)  # the last spans go out about once a second
        settings = BusSettings(kafka_bootstrap=broker.bootstrap, topic_prefix=topics.prefix)
        num_spans = len(await read_topic(settings, topics.traces, client_id="bench-tracing"))
    finally:
        stack.stop_all()
        await delete_prefixed_topics(broker.bootstrap, topics.prefix)
    return runs, ratios, num_spans


def _report(runs: dict[str, list[RunResult]], ratios: list[float], num_spans: int, args: argparse.Namespace) -> None:
    rows = []
    for path, results in runs.items():
        ttft = [x for r in results for x in r.ttft_ms]
        tokens, wall = sum(r.num_tokens for r in results), sum(r.wall_s for r in results)
        rows.append(
            [
                f"sampling {PATHS[path]}",
                f"{tokens / wall:.1f}" if wall else "-",
                f"{percentile(ttft, 50):.1f}" if ttft else "-",
                f"{percentile(ttft, 95):.1f}" if ttft else "-",
            ]
        )
    print()
    print_table(rows, ["path", "tokens/s", "TTFT p50 ms", "TTFT p95 ms"])
    if ratios:
        median = statistics.median(ratios)
        print(
            f"\ntracing on / off, tokens/s: median {median:.3f} over {len(ratios)} rounds "
            f"(cost {100 * (1 - median):+.1f}%; target <= 3%); {num_spans} spans on the traces topic"
        )
