"""Files (batch inputs and outputs) on the `weir.files` topic: chunked FileChunk records keyed by
file_id. Shared by the gateway (uploads, downloads) and the batcher's job runner (inputs, outputs).

Kafka is the only store: a reader rebuilds a file from its chunks. A file written twice under the
same id (a runner that restarted while writing) has identical chunks, so either copy serves.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import IO, Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from schemas.codec import DecodeError, decode, encode
from schemas.messages import MAX_FILE_CHUNK_BYTES, FileChunk
from weir.bus import BusSettings, make_consumer, partitions_of


@dataclass(frozen=True)
class FileHeader:
    """What every chunk of a file repeats: its id, name, purpose and owner (tenant, principal)."""

    file_id: str
    filename: str
    purpose: str
    tenant: str
    credential: str  # with tenant and principal, the owner (docs/design.md, "Ownership")
    principal: str
    created_ms: int


def chunk_file(header: FileHeader, data: bytes, max_chunk_bytes: int = MAX_FILE_CHUNK_BYTES) -> list[FileChunk]:
    """The FileChunks of UTF-8 `data` (raises UnicodeDecodeError otherwise); no chunk splits a character."""
    data.decode("utf-8")
    spans = chunk_spans(lambda at: data[at : at + 4], len(data), max_chunk_bytes)
    return [_chunk(header, i, len(spans), len(data), data[start:end]) for i, (start, end) in enumerate(spans)]


def chunk_spans(
    peek: Callable[[int], bytes], size: int, max_chunk_bytes: int = MAX_FILE_CHUNK_BYTES
) -> list[tuple[int, int]]:
    """[start, end) of each chunk of a `size`-byte UTF-8 file whose bytes from an offset `peek`
    shows (at least one): at most max_chunk_bytes (>= 4) each, never inside a character."""
    spans: list[tuple[int, int]] = []
    start = 0
    while start < size:
        end = min(start + max_chunk_bytes, size)
        while end < size and (peek(end)[0] & 0xC0) == 0x80:  # inside a multi-byte character
            end -= 1
        spans.append((start, end))
        start = end
    return spans or [(0, 0)]


def _chunk(header: FileHeader, index: int, num_chunks: int, num_bytes: int, piece: bytes) -> FileChunk:
    return FileChunk(
        file_id=header.file_id,
        index=index,
        num_chunks=num_chunks,
        filename=header.filename,
        purpose=header.purpose,
        tenant=header.tenant,
        credential=header.credential,
        principal=header.principal,
        num_bytes=num_bytes,
        data=piece.decode("utf-8"),
        created_ms=header.created_ms,
    )


async def write_spooled(
    producer: AIOKafkaProducer,
    topic: str,
    header: FileHeader,
    file: IO[bytes],
    size: int,
    on_chunk: Callable[[FileChunk], None],
    max_in_flight: int = 4,
) -> FileChunk:
    """Produce a `size`-byte UTF-8 file from a seekable binary file, a chunk at a time with at most
    `max_in_flight` chunks unacknowledged, so it is never whole in this function's memory; each
    chunk goes to `on_chunk` once produced. Returns the first chunk (the file's metadata). Raises
    UnicodeDecodeError for a file that is not UTF-8."""

    def peek(at: int) -> bytes:
        file.seek(at)
        return file.read(4)

    spans = chunk_spans(peek, size)
    pending: list[asyncio.Future[Any]] = []
    first: FileChunk | None = None
    for i, (start, end) in enumerate(spans):
        file.seek(start)
        chunk = _chunk(header, i, len(spans), size, file.read(end - start))
        pending.append(await producer.send(topic, encode(chunk), key=header.file_id.encode()))
        on_chunk(chunk)
        first = first or chunk
        if len(pending) >= max_in_flight:
            await pending.pop(0)
    await asyncio.gather(*pending)
    assert first is not None  # chunk_spans gives at least one span
    return first


@dataclass
class StoredFile:
    """A file as its chunks arrive; complete once every index is there."""

    first: FileChunk
    chunks: dict[int, str] = field(default_factory=dict)

    @property
    def is_complete(self) -> bool:
        """True once chunks 0..num_chunks-1 are all read."""
        return len(self.chunks) == self.first.num_chunks

    def content(self) -> bytes:
        """The whole file; call only when complete."""
        return "".join(self.chunks[i] for i in range(self.first.num_chunks)).encode("utf-8")

    def pieces(self) -> Iterator[bytes]:
        """The file's bytes chunk by chunk; call only when complete."""
        return (self.chunks[i].encode("utf-8") for i in range(self.first.num_chunks))

    def is_owned_by(self, tenant: str, credential: str, principal: str) -> bool:
        """True when (tenant, credential kind, principal) owns the file (docs/design.md, "Ownership")."""
        return (self.first.tenant, self.first.credential, self.first.principal) == (tenant, credential, principal)


class FileIndex:
    """Every file seen on the files topic, by id."""

    def __init__(self) -> None:
        self.files: dict[str, StoredFile] = {}

    def add(self, chunk: FileChunk) -> None:
        """Apply one chunk (repeats overwrite with the same text)."""
        stored = self.files.get(chunk.file_id)
        if stored is None or stored.first.num_chunks != chunk.num_chunks:
            stored = self.files[chunk.file_id] = StoredFile(chunk)
        stored.chunks[chunk.index] = chunk.data

    def get(self, file_id: str) -> StoredFile | None:
        """The complete file `file_id`, or None."""
        stored = self.files.get(file_id)
        return stored if stored is not None and stored.is_complete else None

    def complete(self) -> Iterator[StoredFile]:
        """Every complete file."""
        return (stored for stored in self.files.values() if stored.is_complete)


async def write_file(producer: AIOKafkaProducer, topic: str, chunks: list[FileChunk]) -> None:
    """Produce every chunk of a file and wait until all are durable."""
    futures = [await producer.send(topic, encode(c), key=c.file_id.encode()) for c in chunks]
    await asyncio.gather(*futures)


async def read_file(settings: BusSettings, file_id: str, timeout_s: float, client_id: str) -> StoredFile | None:
    """Read the files topic from the start until `file_id` is complete; None if it is not there
    within `timeout_s` (an id no one wrote, or a writer that has not finished yet)."""
    topic = settings.topics.files
    consumer = make_consumer(settings, client_id=client_id, group_id=None)
    await consumer.start()
    try:
        index = FileIndex()
        tps = [TopicPartition(topic, p) for p in sorted(await partitions_of(consumer, topic))]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for records in (await consumer.getmany(timeout_ms=200, max_records=1000)).values():
                for record in records:
                    if record.key == file_id.encode():
                        try:
                            index.add(decode(FileChunk, record.value))
                        except DecodeError:
                            continue
            found = index.get(file_id)
            if found is not None:
                return found
        return None
    finally:
        await consumer.stop()


async def is_behind(consumer: AIOKafkaConsumer, ends: dict[TopicPartition, int]) -> bool:
    """True while the consumer's position on some partition is below its end offset in `ends`."""
    for tp, end in ends.items():
        if await consumer.position(tp) < end:
            return True
    return False
