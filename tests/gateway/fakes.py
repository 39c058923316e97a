"""A tiny fake worker and a gateway server for the gateway's Kafka tests.

FakeWorker answers GenerateRequests straight from the requests topic (no batcher), by what the
prompt asks for:
- default: deltas "Hello", ", ", "world" with seq 0, 1, 1 (a repeat), 2, then ReplyEnd(stop) at 3;
- "slow": one delta ("Hello, "), then waits for a Cancellation and answers ReplyEnd(cancelled);
- "hang": never answers; "reject": ReplyEnd(rejected, queue_full) at seq 0;
- "drip": deltas "t0 " .. "t19 " every 50 ms, then ReplyEnd(stop); a Cancellation ends it early
  (ReplyEnd(cancelled)); `generated[request_id]` counts the deltas it produced; "crawl": the
  same every 150 ms (a stream still running while its gateway is killed);
- "pii": PII_DELTAS, personal data split across deltas, then ReplyEnd(stop);
- "variants": VARIANT_DELTAS, the same in disguise (groups, full-width, zero-width, spelled out);
- a request whose model may call tools: "Checking." then a call of its first tool, whose
  arguments (CALL_ARGUMENTS, a phone number in them) come in pieces, then ReplyEnd(stop) with the call.
Its ReplyEnd names the version the request was pinned to (request.model, name@version). It also
sends a heartbeat every 0.5 s, reporting `versions` (default: echo@1 ready; a test may change it)
with the ready ones in `models`, and `num_waiting`, `finished_per_s` and `next_offsets` (a test
may set them: a queue ahead), and records every Cancellation on the control topic.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable
from typing import Any

import uvicorn
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from schemas.codec import decode, encode
from schemas.messages import (
    Cancellation,
    ErrorInfo,
    GenerateRequest,
    ReplyDelta,
    ReplyEnd,
    ToolCall,
    ToolCallDelta,
    Usage,
    VersionStatus,
    WorkerHeartbeat,
)
from schemas.topics import Topics
from tests.waiting import WaitTimeout, until

TEXT = ["Hello", ", ", "world"]
DRIP = [f"t{i} " for i in range(20)]
# An identity number (check digit X), a Luhn-valid card, a phone and an e-mail, cut mid-number.
PII_DELTAS = [
    "My ID is 1101",
    "0519491231",
    "002X, card 4111 ",
    "1111 1111",
    " 1111, call +86 138",
    "1234 5678 or mail li.wei",
    "@example",
    ".com now.",
]
# An ID in groups, a full-width card, an e-mail with a zero-width space and one spelled out, bracketed.
VARIANT_DELTAS = [
    "ID 110105 1949",
    "1231 002X, card ４１１１ １１",
    "１１ １１１１ １１１１, mail al\u200bice",
    " at exam",
    "ple dot com, or bob [at] ",
    "example [dot] org now.",
]

CALL_ARGUMENTS = ['{"city": "Paris", "phone": "+1 415-5', '55-0132"}']


class FakeWorker:
    """Answers requests and records cancellations; runs on the test's event loop."""

    def __init__(self, bootstrap: str, topics: Topics) -> None:
        self.bootstrap = bootstrap
        self.topics = topics
        self.worker_id = "fake-worker-1"
        self.requests: list[GenerateRequest] = []
        self.cancels: list[Cancellation] = []
        self.generated: dict[str, int] = {}
        self.versions: dict[str, VersionStatus] = {"echo@1": VersionStatus(state="ready", engine="echo")}
        self.num_waiting = 0
        self.finished_per_s: float | None = None
        self.next_offsets: dict[str, dict[int, int]] = {}
        self._tasks: list[asyncio.Task[Any]] = []
        self._clients: list[Any] = []

    async def start(self) -> None:
        self.producer = AIOKafkaProducer(bootstrap_servers=self.bootstrap, acks="all", enable_idempotence=True)
        await self.producer.start()
        self._clients.append(self.producer)
        for topic, on_record in ((self.topics.requests, self._on_request), (self.topics.control, self._on_cancel)):
            consumer = AIOKafkaConsumer(
                topic,
                bootstrap_servers=self.bootstrap,
                group_id=None,
                auto_offset_reset="earliest",
                fetch_max_wait_ms=10,
            )
            await consumer.start()
            self._clients.insert(0, consumer)
            self._tasks.append(asyncio.create_task(self._consume(consumer, on_record)))
        self._tasks.append(asyncio.create_task(self._beat()))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for client in self._clients:
            await client.stop()

    def cancels_of(self, request_id: str) -> list[Cancellation]:
        return [c for c in self.cancels if c.request_id == request_id]

    async def _consume(self, consumer: AIOKafkaConsumer, on_record: Callable[[bytes], None]) -> None:
        while True:
            for records in (await consumer.getmany(timeout_ms=200)).values():
                for record in records:
                    on_record(record.value)

    def _on_cancel(self, value: bytes) -> None:
        self.cancels.append(decode(Cancellation, value))

    def _on_request(self, value: bytes) -> None:
        request = decode(GenerateRequest, value)
        self.requests.append(request)
        self._tasks.append(asyncio.create_task(self._answer(request)))

    async def _answer(self, request: GenerateRequest) -> None:
        prompt = request.prompt if request.prompt is not None else (request.messages or [])[-1].content
        rid = request.request_id
        if "hang" in prompt:
            return
        if request.calls_tools:
            return await self._call_tool(request)
        if "reject" in prompt:
            end = ReplyEnd(
                request_id=rid, seq=0, finish_reason="rejected", error=ErrorInfo(code="queue_full", message="too busy")
            )
            await self._send(request, end)
            return
        if "slow" in prompt:
            # "Hello," leaves at once; the output guard holds the trailing space (and a bare trailing
            # word) until the next delta shows it does not start a spelled-out address (" at ...")
            await self._send(request, ReplyDelta(request_id=rid, seq=0, text="Hello, "))
            with contextlib.suppress(WaitTimeout):  # the fake worker ends the request when a cancel comes (or at 20 s)
                await until(lambda: self.cancels_of(rid), timeout_s=20, what=f"a cancel of {rid}")
            await self._send(request, ReplyEnd(request_id=rid, seq=1, finish_reason="cancelled"))
            return
        if "variants" in prompt:
            return await self._stream(request, VARIANT_DELTAS, 0)
        if "crawl" in prompt:
            return await self._stream(request, DRIP, 0.15)
        if "drip" in prompt or "pii" in prompt:
            return await self._stream(
                request, DRIP if "drip" in prompt else PII_DELTAS, 0.05 if "drip" in prompt else 0
            )
        for seq in (0, 1, 1, 2):  # seq 1 twice: the gateway must drop the repeat
            await self._send(request, ReplyDelta(request_id=rid, seq=seq, text=TEXT[seq]))
        end = ReplyEnd(
            request_id=rid,
            seq=3,
            finish_reason="stop",
            model_version=request.model,
            usage=Usage(prompt_tokens=2, completion_tokens=3, total_tokens=5),
        )
        await self._send(request, end)

    async def _stream(self, request: GenerateRequest, texts: list[str], interval_s: float) -> None:
        rid = request.request_id
        for seq, text in enumerate(texts):
            if self.cancels_of(rid):
                await self._send(request, ReplyEnd(request_id=rid, seq=seq, finish_reason="cancelled"))
                return
            await self._send(request, ReplyDelta(request_id=rid, seq=seq, text=text))
            self.generated[rid] = self.generated.get(rid, 0) + 1
            await asyncio.sleep(interval_s)  # the fake's generation pace (DRIP, crawl): what the tests stream
        usage = Usage(prompt_tokens=1, completion_tokens=len(texts), total_tokens=1 + len(texts))
        await self._send(request, ReplyEnd(request_id=rid, seq=len(texts), finish_reason="stop", usage=usage))

    async def _call_tool(self, request: GenerateRequest) -> None:
        rid, name = request.request_id, (request.tools or [])[0].function.name
        pieces = [
            ToolCallDelta(index=0, id=f"call_{rid}_0", name=name),
            *(ToolCallDelta(index=0, arguments=a) for a in CALL_ARGUMENTS),
        ]
        await self._send(request, ReplyDelta(request_id=rid, seq=0, text="Checking."))
        for seq, piece in enumerate(pieces, 1):
            await self._send(request, ReplyDelta(request_id=rid, seq=seq, text="", tool_calls=[piece]))
        call = ToolCall.model_validate(
            {"id": f"call_{rid}_0", "function": {"name": name, "arguments": "".join(CALL_ARGUMENTS)}}
        )
        end = ReplyEnd(
            request_id=rid,
            seq=len(pieces) + 1,
            finish_reason="stop",
            model_version=request.model,
            tool_calls=[call],
            usage=Usage(prompt_tokens=4, completion_tokens=12, total_tokens=16),
        )
        await self._send(request, end)

    async def _send(self, request: GenerateRequest, event: ReplyDelta | ReplyEnd) -> None:
        await self.producer.send_and_wait(request.reply_to, encode(event), key=request.request_id.encode())

    async def _beat(self) -> None:
        while True:
            heartbeat = WorkerHeartbeat(
                worker_id=self.worker_id,
                models=[served_id for served_id, s in self.versions.items() if s.state == "ready"],
                is_ready=True,
                num_running=0,
                num_waiting=self.num_waiting,
                max_num_seqs=8,
                free_kv_blocks=64,
                block_size_tokens=16,
                versions=dict(self.versions),
                finished_per_s=self.finished_per_s,
                next_offsets=dict(self.next_offsets),
                partitions={m: sorted(o) for m, o in self.next_offsets.items()},
            )
            await self.producer.send_and_wait(self.topics.workers, encode(heartbeat), key=self.worker_id.encode())
            await asyncio.sleep(0.5)  # the fake's heartbeat interval


class GatewayServer:
    """The gateway app under uvicorn on a free port of 127.0.0.1, inside the test's event loop."""

    def __init__(self, app: Any) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.server.capture_signals = contextlib.nullcontext  # leave Ctrl-C to pytest
        self.task: asyncio.Task[None] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self.task = asyncio.create_task(self.server.serve(sockets=[self.sock]))
        await until(lambda: self.server.started, timeout_s=60, what="the gateway's uvicorn started", watch=[self.task])

    async def stop(self) -> None:
        self.server.should_exit = True
        if self.task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        self.sock.close()


async def eventually(check: Callable[[], Any], timeout_s: float = 10.0) -> Any:
    """Deprecated: kept importable only for branches written before tests/waiting.py; new tests
    call `until(check, timeout_s=..., what=...)`, which says what it waited for."""
    return await until(check, timeout_s=timeout_s, what="a condition (tests/gateway/fakes.py: eventually)")
