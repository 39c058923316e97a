"""Files (batch inputs and outputs) on the `weir.files` topic: chunked FileChunk records keyed by
file_id. Shared by the gateway (uploads, downloads) and the batcher's job runner (inputs, outputs).

Kafka is the only store: a reader rebuilds a file from its chunks. A file written twice under the
same id (a runner that restarted while writing) has identical chunks, so either copy serves.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from schemas.codec import DecodeError, decode, encode
from schemas.messages import MAX_FILE_CHUNK_BYTES, FileChunk
from weir.bus import BusSettings, make_consumer, partitions_of


def chunk_file(file_id: str, filename: str, purpose: str, data: bytes, created_ms: int,
               max_chunk_bytes: int = MAX_FILE_CHUNK_BYTES) -> list[FileChunk]:
    """The FileChunks of UTF-8 `data` (raises UnicodeDecodeError otherwise); no chunk splits a character."""
    data.decode("utf-8")
    pieces: list[bytes] = []
    start = 0
    while start < len(data):
        end = min(start + max_chunk_bytes, len(data))
        while end < len(data) and (data[end] & 0xC0) == 0x80:  # inside a multi-byte character
            end -= 1
        pieces.append(data[start:end])
        start = end
    pieces = pieces or [b""]
    return [
        FileChunk(file_id=file_id, index=i, num_chunks=len(pieces), filename=filename, purpose=purpose,
                  num_bytes=len(data), data=piece.decode("utf-8"), created_ms=created_ms)
        for i, piece in enumerate(pieces)
    ]


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


async def write_file(producer: AIOKafkaProducer, topic: str, chunks: list[FileChunk]) -> None:
    """Produce every chunk of a file and wait until all are durable."""
    futures = [await producer.send(topic, encode(c), key=c.file_id.encode()) for c in chunks]
    await asyncio.gather(*futures)


async def read_file(settings: BusSettings, file_id: str, timeout_s: float, client_id: str) -> bytes | None:
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
                return found.content()
        return None
    finally:
        await consumer.stop()


async def is_behind(consumer: AIOKafkaConsumer, ends: dict[TopicPartition, int]) -> bool:
    """True while the consumer's position on some partition is below its end offset in `ends`."""
    for tp, end in ends.items():
        if await consumer.position(tp) < end:
            return True
    return False


