"""Receiving POST /v1/files: a multipart/form-data body parsed as it streams in, its `file` part
spooled to a temporary file (on disk past 1 MiB), never whole in memory, under a size limit that
is enforced while reading (413 as soon as it is passed). The checks of what the file holds are
batch_format.py's; the store's writing to Kafka is batch_store.py's.
"""

from __future__ import annotations

import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from email.parser import BytesHeaderParser
from email.policy import HTTP
from typing import IO

from services.gateway.openai_format import ApiError

MAX_FILE_BYTES = 64 << 20
MAX_FIELD_BYTES = 4096  # a form field (purpose) is a word
MAX_HEADER_BYTES = 8192  # the headers of one part
MAX_PARTS = 8
SPOOL_MEMORY_BYTES = 1 << 20  # the spooled file moves to disk past this
FIELDS = ("purpose",)  # form fields POST /v1/files takes besides `file`; any other is refused


@dataclass
class Upload:
    """A received upload: its form fields, and its file spooled (None when there was no file part)."""

    fields: dict[str, str] = field(default_factory=dict)
    filename: str = "upload.jsonl"
    file: IO[bytes] | None = None
    size: int = 0

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"files are limited to {limit} bytes", code="request_too_large")


def boundary_of(content_type: str) -> bytes:
    """The multipart boundary of a Content-Type; ApiError 400 when it is not multipart/form-data."""
    media, _, params = content_type.partition(";")
    if media.strip().lower() != "multipart/form-data":
        raise ApiError(400, "POST /v1/files takes multipart/form-data", code="invalid_value")
    for param in params.split(";"):
        name, _, value = param.strip().partition("=")
        if name.lower() == "boundary" and value.strip('"'):
            boundary = value.strip('"')
            if len(boundary) <= 70:
                return boundary.encode("latin-1")
    raise ApiError(400, "multipart/form-data needs a boundary of at most 70 characters", code="invalid_value")


async def receive_upload(
    content_type: str, content_length: str | None, stream: AsyncIterator[bytes], max_file_bytes: int = MAX_FILE_BYTES
) -> Upload:
    """Parse a multipart body from `stream`; the caller closes the Upload. ApiError 413 when the
    declared or the received size passes the limit, 400 when the body is not well-formed
    multipart or has a form field other than FIELDS, or repeats one."""
    max_body = max_file_bytes + MAX_PARTS * (MAX_HEADER_BYTES + MAX_FIELD_BYTES)
    if content_length is not None and content_length.isdigit() and int(content_length) > max_body:
        raise too_large(max_file_bytes)
    parser = _Parser(boundary_of(content_type), max_file_bytes)
    received = 0
    try:
        async for piece in stream:
            received += len(piece)
            if received > max_body:
                raise too_large(max_file_bytes)
            parser.feed(piece)
        parser.finish()
    except BaseException:
        parser.upload.close()
        raise
    return parser.upload


class _Parser:
    """An incremental multipart/form-data parser (RFC 7578): preamble, then parts of headers and
    data separated by CRLF--boundary, ended by --boundary--."""

    def __init__(self, boundary: bytes, max_file_bytes: int) -> None:
        self.delimiter = b"\r\n--" + boundary
        self.max_file_bytes = max_file_bytes
        self.buffer = b"\r\n"  # the first delimiter has no CRLF before it
        self.state = "preamble"  # preamble | after_delimiter | headers | data | done
        self.upload = Upload()
        self.num_parts = 0
        self.part_name: str | None = None
        self.field_value = bytearray()

    def feed(self, piece: bytes) -> None:
        if self.state == "done":
            return  # an epilogue is ignored, as RFC 2046 says, and not kept
        self.buffer += piece
        while self._step():
            pass
        if self.state != "data" and len(self.buffer) > 2 * MAX_HEADER_BYTES:
            raise ApiError(400, "malformed multipart body", code="invalid_value")

    def finish(self) -> None:
        if self.state != "done":
            raise ApiError(400, "the multipart body ends before its closing boundary", code="invalid_value")

    def _step(self) -> bool:
        """Advance as far as the buffer allows; False when more bytes are needed."""
        if self.state == "preamble":
            at = self.buffer.find(self.delimiter)
            if at < 0:
                if len(self.buffer) > MAX_HEADER_BYTES:
                    raise ApiError(400, "no multipart boundary found", code="invalid_value")
                return False
            self.buffer = self.buffer[at + len(self.delimiter) :]
            self.state = "after_delimiter"
            return True
        if self.state == "after_delimiter":
            if len(self.buffer) < 2:
                return False
            if self.buffer.startswith(b"--"):
                self.state, self.buffer = "done", b""
                return False
            end = self.buffer.find(b"\r\n")
            if end < 0:
                return False
            if self.buffer[:end].strip(b" \t"):
                raise ApiError(400, "malformed multipart boundary line", code="invalid_value")
            self.buffer = self.buffer[end + 2 :]
            self.state = "headers"
            return True
        if self.state == "headers":
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buffer) > MAX_HEADER_BYTES:
                    raise ApiError(400, "the headers of a multipart part are too long", code="invalid_value")
                return False
            self._start_part(self.buffer[:end])
            self.buffer = self.buffer[end + 4 :]
            self.state = "data"
            return True
        if self.state == "data":
            at = self.buffer.find(self.delimiter)
            if at < 0:
                keep = len(self.delimiter) - 1  # the start of a delimiter may be at the end
                if len(self.buffer) > keep:
                    self._data(self.buffer[:-keep])
                    self.buffer = self.buffer[-keep:]
                return False
            self._data(self.buffer[:at])
            self._end_part()
            self.buffer = self.buffer[at + len(self.delimiter) :]
            self.state = "after_delimiter"
            return True
        return False  # done: an epilogue is ignored, as RFC 2046 says

    def _start_part(self, raw_headers: bytes) -> None:
        self.num_parts += 1
        if self.num_parts > MAX_PARTS:
            raise ApiError(400, f"at most {MAX_PARTS} multipart parts", code="invalid_value")
        headers = BytesHeaderParser(policy=HTTP).parsebytes(raw_headers + b"\r\n\r\n")
        name = headers.get_param("name", header="content-disposition")
        if not isinstance(name, str):
            raise ApiError(400, "a multipart part has no name", code="invalid_value")
        if name == "file":
            if self.upload.file is not None:
                raise ApiError(400, "only one 'file' part is allowed", param="file", code="invalid_value")
            self.upload.file = tempfile.SpooledTemporaryFile(max_size=SPOOL_MEMORY_BYTES)  # noqa: SIM115 - Upload.close
            filename = headers.get_filename()
            if filename:
                self.upload.filename = filename[:512]
        elif name not in FIELDS:
            raise ApiError(
                400,
                f"unknown form field {name!r}: POST /v1/files takes 'file' and 'purpose'",
                param=name,
                code="unknown_parameter",
            )
        elif name in self.upload.fields:
            raise ApiError(400, f"the form field {name!r} is repeated", param=name, code="invalid_value")
        self.part_name = name
        self.field_value = bytearray()

    def _data(self, data: bytes) -> None:
        if not data:
            return
        if self.part_name == "file":
            assert self.upload.file is not None
            self.upload.size += len(data)
            if self.upload.size > self.max_file_bytes:
                raise too_large(self.max_file_bytes)
            self.upload.file.write(data)
            return
        self.field_value += data
        if len(self.field_value) > MAX_FIELD_BYTES:
            raise ApiError(
                400, f"the form field {self.part_name!r} is too long", param=self.part_name, code="invalid_value"
            )

    def _end_part(self) -> None:
        if self.part_name != "file" and self.part_name is not None:
            try:
                self.upload.fields[self.part_name] = self.field_value.decode("utf-8")
            except UnicodeDecodeError:
                raise ApiError(
                    400, f"the form field {self.part_name!r} is not UTF-8", param=self.part_name, code="invalid_value"
                ) from None
        self.part_name = None
