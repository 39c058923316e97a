"""`weir bench gateway`: what the gateway adds to a bare SSE endpoint, and how many streams it holds.

Two servers, started here as processes and driven by the same HTTP client code:
(a) baseline: a bare uvicorn + Starlette app whose POST /v1/completions streams one OpenAI
    chunk per word of the prompt, then `data: [DONE]`; no Kafka, no auth;
(b) the real `weir gateway` (open auth, private topic prefix) plus a responder process that
    answers its requests over Kafka like a worker with no model: one ReplyDelta per word, then
    ReplyEnd(stop). The responder also sends heartbeats, so the gateway sees a live `echo` worker.
(b) - (a) is the gateway's own cost: HTTP parsing and validation, the guard, the Kafka produce,
the reply consumer, the output guard and the SSE encoding.

Part 1, added latency: closed loop at each concurrency, TTFT (first chunk with text) and total
time. Part 2, streams held: S requests whose prompt starts with "hold"; the baseline parks them
on an asyncio.Event, the responder holds them until all S have come; then both release, and the
clients record when each stream gets its first token and its end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import resource
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import orjson

from bench.stats import percentile, print_table
from schemas.topics import Topics

if TYPE_CHECKING:
    from schemas.messages import GenerateRequest

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "small",
    "birds",
    "sing",
    "in",
    "tall",
    "green",
    "trees",
]
ECHO_REPO = (
    '[models.echo]\nengine = "echo"\nversion = "1"\nmax_batch_size = 32\nmax_wait_ms = 0\nmax_model_len = 2048\n'
)


def prompt_of(num_words: int, offset: int, hold: bool = False) -> str:
    """A prompt of `num_words` words (each answered as one delta "word "), "hold" first when held."""
    words = [WORDS[(offset + i) % len(WORDS)] for i in range(num_words)]
    return " ".join((["hold"] if hold else []) + words)


def reply_words(prompt: str, max_tokens: int) -> list[str]:
    """The texts both servers stream for a prompt: its words (without "hold"), each with a trailing space.

    A trailing space ends each word, so the gateway's output guard has nothing to hold back.
    """
    words = [w for w in prompt.split() if w != "hold"] or ["empty"]
    return [f"{w} " for w in words[:max_tokens]]


# ---------------------------------------------------------------- (a) the baseline server


def baseline_app() -> Any:
    """The baseline: Starlette, one streaming endpoint, a release switch for held streams."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    release = asyncio.Event()
    state = {"held": 0}

    async def completions(request: Request) -> StreamingResponse:
        body = orjson.loads(await request.body())
        rid = f"cmpl-{uuid.uuid4().hex}"
        texts = reply_words(body["prompt"], int(body.get("max_tokens", 16)))
        hold = body["prompt"].startswith("hold")

        def chunk(text: str, finish: str | None) -> bytes:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            obj = {
                "id": rid,
                "object": "text_completion",
                "created": int(time.time()),
                "model": body["model"],
                "choices": [choice],
            }
            return b"data: " + orjson.dumps(obj) + b"\n\n"

        async def events() -> Any:
            if hold:
                state["held"] += 1
                await release.wait()
            for text in texts:
                yield chunk(text, None)
                # Let other streams run between chunks, as the gateway interleaves streams that get
                # their deltas together; without it, 1,000 released streams go out one after another.
                await asyncio.sleep(0)
            yield chunk("", "stop")
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def held(_: Request) -> JSONResponse:
        return JSONResponse({"held": state["held"]})

    async def do_release(_: Request) -> JSONResponse:
        release.set()
        return JSONResponse({"released": state["held"]})

    async def healthz(_: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    return Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/held", held),
            Route("/release", do_release, methods=["POST"]),
            Route("/healthz", healthz),
        ]
    )


def serve_baseline(port: int) -> int:
    """Run the baseline the way the gateway runs: uvicorn.Server inside asyncio.run (no uvloop)."""
    import uvicorn

    config = uvicorn.Config(baseline_app(), host="127.0.0.1", port=port, log_level="warning", access_log=False)
    asyncio.run(uvicorn.Server(config).serve())
    return 0


# ---------------------------------------------------------------- (b) the responder


async def respond(bootstrap: str, prefix: str, hold_target: int) -> None:
    """Answer the gateway's requests as a worker would, with no model; hold "hold" requests.

    Held requests are answered, all together, when "release" comes on stdin; "held <n>" lines on
    stdout say how many are held.
    """
    responder = ModelFreeWorker(bootstrap, prefix, hold_target)
    await responder.producer.start()
    await responder.consumer.start()
    background = [asyncio.create_task(responder.beat()), asyncio.create_task(responder.consume())]
    print("ready", flush=True)
    try:
        while (line := await asyncio.to_thread(sys.stdin.readline)) and line.strip() != "quit":
            if line.strip() == "release":
                batch, responder.held[:] = list(responder.held), []
                await responder.answer(batch)
                print(f"released {len(batch)}", flush=True)
    finally:
        for task in background + list(responder.tasks):
            task.cancel()
        await asyncio.gather(*background, *responder.tasks, return_exceptions=True)
        await responder.consumer.stop()
        await responder.producer.stop()


class ModelFreeWorker:
    """A worker with no model on the gateway's topics: heartbeats as a live `echo` worker, answers
    each request with one ReplyDelta per word then ReplyEnd(stop), or holds it ("hold" prompts)."""

    def __init__(self, bootstrap: str, prefix: str, hold_target: int) -> None:
        from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

        self.topics = Topics(prefix)
        self.hold_target = hold_target
        self.producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True)
        self.consumer = AIOKafkaConsumer(
            self.topics.requests, bootstrap_servers=bootstrap, group_id=None, auto_offset_reset="earliest"
        )
        self.held: list[GenerateRequest] = []
        self.tasks: set[asyncio.Task[None]] = set()

    async def beat(self) -> None:
        from schemas.codec import encode
        from schemas.messages import WorkerHeartbeat

        while True:
            heartbeat = WorkerHeartbeat(
                worker_id="bench-responder",
                models=["echo"],
                is_ready=True,
                num_running=0,
                num_waiting=0,
                max_num_seqs=self.hold_target + 64,
                free_kv_blocks=1 << 20,
                block_size_tokens=16,
            )
            await self.producer.send_and_wait(self.topics.workers, encode(heartbeat), key=b"bench-responder")
            await asyncio.sleep(0.5)

    async def answer(self, requests: list[GenerateRequest]) -> None:
        """Step through the requests together: every request's delta k before any request's k+1."""
        from schemas.codec import encode
        from schemas.messages import ReplyDelta, ReplyEnd, Usage

        texts = {r.request_id: reply_words(r.prompt or "", r.max_tokens) for r in requests}
        futures = []
        for seq in range(max((len(t) for t in texts.values()), default=0) + 1):
            for r in requests:
                mine = texts[r.request_id]
                if seq < len(mine):
                    event: ReplyDelta | ReplyEnd = ReplyDelta(request_id=r.request_id, seq=seq, text=mine[seq])
                elif seq == len(mine):
                    usage = Usage(prompt_tokens=len(mine), completion_tokens=len(mine), total_tokens=2 * len(mine))
                    event = ReplyEnd(request_id=r.request_id, seq=seq, finish_reason="stop", usage=usage)
                else:
                    continue
                futures.append(await self.producer.send(r.reply_to, encode(event), key=r.request_id.encode()))
        await asyncio.gather(*futures)

    async def consume(self) -> None:
        from schemas.codec import decode
        from schemas.messages import GenerateRequest

        while True:
            for records in (await self.consumer.getmany(timeout_ms=500)).values():
                for record in records:
                    request = decode(GenerateRequest, record.value)
                    if (request.prompt or "").startswith("hold"):
                        self.held.append(request)
                        print(f"held {len(self.held)}", flush=True)
                    else:
                        self.tasks.add(asyncio.create_task(self.answer([request])))
                        self.tasks.difference_update([t for t in self.tasks if t.done()])


# ---------------------------------------------------------------- the client (same for both)


@dataclass
class StreamResult:
    """What one client saw of one stream; times in seconds of time.perf_counter()."""

    start: float
    first_text: float | None = None
    end: float | None = None
    num_texts: int = 0
    error: str | None = None


async def one_stream(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> StreamResult:
    """POST a streaming completion and read it to [DONE]; errors are data (the kind in `error`)."""
    body = {
        "model": "echo",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "temperature": 0,
        "timeout_s": 600,
    }
    result = StreamResult(start=time.perf_counter())
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                result.error = f"http {resp.status_code}"
                await resp.aread()
                return result
            async for line in resp.aiter_lines():
                if line == "data: [DONE]":
                    result.end = time.perf_counter()
                elif line.startswith("data: "):
                    chunk = orjson.loads(line[6:])
                    if "error" in chunk:
                        result.error = f"sse error {chunk['error'].get('code')}"
                    elif any(c.get("text") for c in chunk.get("choices", [])):
                        result.num_texts += 1
                        if result.first_text is None:
                            result.first_text = time.perf_counter()
    except httpx.HTTPError as exc:
        result.error = type(exc).__name__
    if result.error is None and result.end is None:
        result.error = "no [DONE]"
    elif result.error is None and result.num_texts != max_tokens:
        result.error = f"{result.num_texts}/{max_tokens} texts"
    return result


def make_client(base_url: str, num_connections: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=num_connections + 8, max_keepalive_connections=num_connections + 8)
    return httpx.AsyncClient(base_url=base_url, limits=limits, timeout=httpx.Timeout(600, connect=60, pool=600))


async def closed_loop(base_url: str, concurrency: int, num_requests: int, max_tokens: int) -> list[StreamResult]:
    """`concurrency` lanes, each sending its next request when the previous one ends."""
    queue = list(range(num_requests))
    results: list[StreamResult] = []
    async with make_client(base_url, concurrency) as client:

        async def lane() -> None:
            while queue:
                i = queue.pop()
                results.append(await one_stream(client, prompt_of(max_tokens, i), max_tokens))

        await asyncio.gather(*(lane() for _ in range(concurrency)))
    return results


@dataclass
class HoldResult:
    """What part 2 measured for one server."""

    num_streams: int
    num_held: int = 0
    open_s: float = 0.0
    idle_rss_mb: float = float("nan")
    rss_mb: float = float("nan")
    release: float = 0.0
    results: list[StreamResult] = field(default_factory=list)


async def hold_streams(
    base_url: str, num_streams: int, max_tokens: int, server: Any, pid: int, open_timeout_s: float
) -> HoldResult:
    """Open `num_streams` held streams, wait until the server holds them all, release, read them out."""
    out = HoldResult(num_streams, idle_rss_mb=rss_mb(pid))
    async with make_client(base_url, num_streams) as client:
        start = time.perf_counter()
        tasks = [
            asyncio.create_task(one_stream(client, prompt_of(max_tokens, i, hold=True), max_tokens))
            for i in range(num_streams)
        ]
        deadline = start + open_timeout_s
        while (held := await server.held()) < num_streams and time.perf_counter() < deadline:
            if all(t.done() for t in tasks):
                break
            await asyncio.sleep(0.2)
        out.open_s, out.num_held = time.perf_counter() - start, held
        await asyncio.sleep(1.0)  # let the last connections settle before reading the memory
        out.rss_mb = rss_mb(pid)
        out.release = time.perf_counter()
        await server.release()
        out.results = list(await asyncio.gather(*tasks))
    return out


def rss_mb(pid: int) -> float:
    """VmRSS of a process, MiB (NaN when it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


# ---------------------------------------------------------------- the two servers under test


class BaselineServer:
    """The baseline process; held()/release() over its own HTTP endpoints."""

    def __init__(self, port: int) -> None:
        self.base_url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.gateway", "--role", "baseline", "--port", str(port)], stdin=subprocess.DEVNULL
        )

    async def held(self) -> int:
        async with httpx.AsyncClient(base_url=self.base_url) as client:
            return int((await client.get("/held")).json()["held"])

    async def release(self) -> None:
        async with httpx.AsyncClient(base_url=self.base_url) as client:
            (await client.post("/release")).raise_for_status()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(15)


class Responder:
    """The responder process; held()/release() over its stdin and stdout."""

    def __init__(self, bootstrap: str, prefix: str, hold_target: int) -> None:
        self.args = [
            sys.executable,
            "-m",
            "bench.gateway",
            "--role",
            "responder",
            "--bootstrap",
            bootstrap,
            "--prefix",
            prefix,
            "--streams",
            str(hold_target),
        ]
        self.num_held = 0
        self.num_released = -1

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            *self.args, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
        )
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), 60)
        if line.strip() != b"ready":
            raise RuntimeError(f"responder did not start: {line!r}")
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            word, _, num = line.decode().partition(" ")
            if word == "held":
                self.num_held = int(num)
            elif word == "released":
                self.num_released = int(num)

    async def held(self) -> int:
        return self.num_held

    async def release(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"release\n")
        await self.proc.stdin.drain()

    async def stop(self) -> None:
        assert self.proc.stdin is not None
        with contextlib.suppress(ConnectionError):
            self.proc.stdin.write(b"quit\n")
            await self.proc.stdin.drain()
        try:
            await asyncio.wait_for(self.proc.wait(), 15)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()
        self.reader.cancel()


def raise_open_files_limit() -> int:
    """Soft RLIMIT_NOFILE up to the hard limit (children inherit it); returns the new soft limit."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


# ---------------------------------------------------------------- the run


async def _bench(args: argparse.Namespace, open_files: int) -> int:
    from weir.kafka.admin import delete_prefixed_topics, ensure_topics, wait_for_broker
    from weir.stack import Stack, free_ports, wait_http_ok

    bootstrap = os.environ.get("WEIR_KAFKA_BOOTSTRAP", "127.0.0.1:9092")
    await wait_for_broker(bootstrap, timeout_s=10)
    topics = Topics(f"benchgw{uuid.uuid4().hex[:6]}")
    await ensure_topics(bootstrap, topics.core_specs())
    scratch = Path(tempfile.mkdtemp(prefix="weir-bench-gateway-"))
    (scratch / "models.toml").write_text(ECHO_REPO)
    max_in_flight = args.streams + 64
    gw_port, base_port = free_ports(2)
    env = {
        "WEIR_KAFKA_BOOTSTRAP": bootstrap,
        "WEIR_TOPIC_PREFIX": topics.prefix,
        "WEIR_GATEWAY_PORT": str(gw_port),
        "WEIR_MODEL_REPO": str(scratch / "models.toml"),
        "WEIR_AUTH_MODE": "open",
        "WEIR_MAX_IN_FLIGHT_INTERACTIVE": str(max_in_flight),
    }
    print(
        f"prefix {topics.prefix}; open files {open_files}; gateway WEIR_MAX_IN_FLIGHT_INTERACTIVE={max_in_flight}; "
        f"gateway log {scratch / 'gateway.log'}",
        flush=True,
    )
    stack = Stack(env, scratch)
    baseline = BaselineServer(base_port)
    responder = Responder(bootstrap, topics.prefix, args.streams)
    gw_url = f"http://127.0.0.1:{gw_port}"
    latency: dict[tuple[str, int], list[StreamResult]] = {}
    holds: dict[str, HoldResult] = {}
    try:
        gateway = stack.start("gateway")
        await responder.start()
        await asyncio.to_thread(wait_http_ok, f"{baseline.base_url}/healthz", 60)
        await asyncio.to_thread(wait_http_ok, f"{gw_url}/readyz", 120, stack)
        for url in (baseline.base_url, gw_url):  # warm both paths
            await closed_loop(url, 4, 40, args.max_tokens)
        for c in args.levels:
            for name, url in (("a", baseline.base_url), ("b", gw_url)):
                latency[(name, c)] = await closed_loop(url, c, args.requests, args.max_tokens)
                print(f"latency {name} c={c} done", flush=True)
        for name, url, server, pid in (
            ("a", baseline.base_url, baseline, baseline.proc.pid),
            ("b", gw_url, responder, gateway.pid),
        ):
            holds[name] = await hold_streams(url, args.streams, args.hold_tokens, server, pid, args.open_timeout_s)
            print(f"hold {name} done", flush=True)
    finally:
        stack.stop_all()
        baseline.stop()
        await responder.stop()
        await delete_prefixed_topics(bootstrap, topics.prefix)
    _report(latency, holds, args)
    return 0


def _row(label: str, a: float, b: float, digits: int = 1) -> list[str]:
    ratio = f"{b / a:.2f}x" if a else "-"
    return [label, f"{a:.{digits}f}", f"{b:.{digits}f}", f"{b - a:+.{digits}f}", ratio]


def _errors(results: list[StreamResult]) -> str:
    kinds: dict[str, int] = {}
    for r in results:
        if r.error:
            kinds[r.error] = kinds.get(r.error, 0) + 1
    return ", ".join(f"{k}: {n}" for k, n in sorted(kinds.items())) or "0"


def _report(
    latency: dict[tuple[str, int], list[StreamResult]], holds: dict[str, HoldResult], args: argparse.Namespace
) -> None:
    rows: list[list[str]] = []
    for c in args.levels:
        a, b = latency[("a", c)], latency[("b", c)]
        for what, pick in (("TTFT", lambda r: r.first_text), ("total", lambda r: r.end)):
            ms = [[(pick(r) - r.start) * 1000 for r in rs if pick(r) is not None] for rs in (a, b)]
            for pct in (50, 95):
                rows.append(_row(f"c={c} {what} p{pct} ms", percentile(ms[0], pct), percentile(ms[1], pct)))
        walls = [max(r.end or r.start for r in rs) - min(r.start for r in rs) for rs in (a, b)]
        rows.append(_row(f"c={c} requests/s", len(a) / walls[0], len(b) / walls[1]))
        rows.append([f"c={c} errors", _errors(a), _errors(b), "", ""])
    ha, hb = holds["a"], holds["b"]
    s = args.streams
    rows.append([f"held of {s} streams", str(ha.num_held), str(hb.num_held), "", ""])
    rows.append(_row("open all s", ha.open_s, hb.open_s))
    rows.append(_row("server RSS before MiB", ha.idle_rss_mb, hb.idle_rss_mb))
    rows.append(_row("server RSS holding MiB", ha.rss_mb, hb.rss_mb))
    firsts = [[(r.first_text - h.release) * 1000 for r in h.results if r.first_text is not None] for h in (ha, hb)]
    for label, pct in (("p50", 50), ("p95", 95), ("max", 100)):
        rows.append(_row(f"release->first token {label} ms", percentile(firsts[0], pct), percentile(firsts[1], pct)))
    ends = [[r.end - h.release for r in h.results if r.end is not None] for h in (ha, hb)]
    rows.append(
        _row("release->all complete s", max(ends[0], default=float("nan")), max(ends[1], default=float("nan")), 2)
    )
    complete = [sum(1 for r in h.results if r.error is None) for h in (ha, hb)]
    rows.append([f"complete of {s} streams", str(complete[0]), str(complete[1]), "", ""])
    tokens = [
        sum(r.num_texts for r in h.results) / max(e, default=float("nan")) for h, e in zip((ha, hb), ends, strict=True)
    ]
    rows.append(_row("tokens/s after release", tokens[0], tokens[1], 0))
    rows.append(["hold errors", _errors(ha.results), _errors(hb.results), "", ""])
    print()
    print_table(rows, ["figure", "(a) bare uvicorn SSE", "(b) weir gateway", "b - a", "b / a"])
    print()
    print(
        f"(a) Starlette on uvicorn, no Kafka; (b) weir gateway + a Kafka responder with no model. "
        f"{args.requests} requests per concurrency, {args.max_tokens} deltas each; TTFT = first chunk with text. "
        f"{s} held streams, {args.hold_tokens} deltas each after release."
    )


def main(argv: list[str] | None = None) -> int:
    """Run both servers side by side and print one table; --role runs one of the helper processes."""
    parser = argparse.ArgumentParser(
        prog="weir bench gateway", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", default="1,16", help="closed-loop concurrencies of part 1")
    parser.add_argument("--requests", type=int, default=200, help="requests per server and concurrency")
    parser.add_argument("--max-tokens", type=int, default=16, help="deltas per request in part 1")
    parser.add_argument("--streams", type=int, default=1000, help="streams held at once in part 2")
    parser.add_argument("--hold-tokens", type=int, default=16, help="deltas per held stream after release")
    parser.add_argument("--open-timeout-s", type=float, default=180, help="how long part 2 waits for all streams")
    parser.add_argument("--role", choices=["bench", "baseline", "responder"], default="bench", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--bootstrap", default="127.0.0.1:9092", help=argparse.SUPPRESS)
    parser.add_argument("--prefix", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role == "baseline":
        return serve_baseline(args.port)
    if args.role == "responder":
        asyncio.run(respond(args.bootstrap, args.prefix, args.streams))
        return 0
    args.levels = [int(c) for c in args.concurrency.split(",")]
    return asyncio.run(_bench(args, raise_open_files_limit()))


if __name__ == "__main__":
    sys.exit(main())
