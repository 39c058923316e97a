"""orjson encoding and decoding of the wire types, and their JSON Schemas."""

from __future__ import annotations

import re
from typing import Any, TypeVar

import orjson
from pydantic import BaseModel, TypeAdapter

from schemas.messages import (
    AnyRequest,
    ApiKeyRecord,
    AuditEvent,
    AuditRecord,
    Batch,
    BatchJob,
    Cancellation,
    DeadLetter,
    EmbedRequest,
    FileChunk,
    GenerateRequest,
    JobCommand,
    ReplyEvent,
    ReviewFlag,
    UsageRecord,
    WorkerHeartbeat,
)

M = TypeVar("M", bound=BaseModel)

_REPLY = TypeAdapter(ReplyEvent)
_REQUEST: TypeAdapter[GenerateRequest | EmbedRequest] = TypeAdapter(AnyRequest)
_AUDIT_RECORD: TypeAdapter[AuditEvent | ReviewFlag] = TypeAdapter(AuditRecord)

# name -> type; the JSON Schema of each is exported to schemas/json/ and pinned by golden tests.
WIRE_TYPES: dict[str, Any] = {
    "GenerateRequest": GenerateRequest,
    "EmbedRequest": EmbedRequest,
    "AnyRequest": _REQUEST,
    "ReplyEvent": _REPLY,
    "Cancellation": Cancellation,
    "Batch": Batch,
    "WorkerHeartbeat": WorkerHeartbeat,
    "AuditEvent": AuditEvent,
    "ReviewFlag": ReviewFlag,
    "AuditRecord": _AUDIT_RECORD,
    "DeadLetter": DeadLetter,
    "ApiKeyRecord": ApiKeyRecord,
    "UsageRecord": UsageRecord,
    "FileChunk": FileChunk,
    "BatchJob": BatchJob,
    "JobCommand": JobCommand,
}


class DecodeError(ValueError):
    """A message that is not valid JSON or not a valid instance of its wire type."""


def encode(message: BaseModel) -> bytes:
    """Serialise a wire message to JSON bytes (None fields kept, so the shape is stable)."""
    return orjson.dumps(message.model_dump(mode="json"))


def decode(kind: type[M], data: bytes | None) -> M:
    """Parse bytes into `kind`; raises DecodeError with the reason on any defect."""
    return _validated(kind.model_validate, kind.__name__, data)


def decode_reply(data: bytes | None) -> Any:
    """Parse a ReplyDelta or ReplyEnd by its `type` field."""
    return _validated(_REPLY.validate_python, "ReplyEvent", data)


def decode_request(data: bytes | None) -> GenerateRequest | EmbedRequest:
    """Parse a record of `weir.requests` by its `kind` field ("generate" when absent, "embed")."""
    return _validated(_REQUEST.validate_python, "request", data)


_TOPIC_NAME = re.compile(r"[A-Za-z0-9._-]{1,249}")


def reply_address(data: bytes | None) -> tuple[str, str] | None:
    """(request_id, reply_to) of a request record that failed validation, when both can be read:
    a JSON object whose `request_id` is a string of 1-128 characters and whose `reply_to` is a
    legal Kafka topic name. Enough to tell its producer why with a ReplyEnd (`rejected`), rather
    than leave it waiting for an answer that never comes; None when the record names neither."""
    try:
        obj = orjson.loads(data or b"")
    except orjson.JSONDecodeError:
        return None
    if not isinstance(obj, dict):
        return None
    request_id, reply_to = obj.get("request_id"), obj.get("reply_to")
    if not isinstance(request_id, str) or not 1 <= len(request_id) <= 128:
        return None
    if not isinstance(reply_to, str) or not _TOPIC_NAME.fullmatch(reply_to) or reply_to in (".", ".."):
        return None
    return request_id, reply_to


def decode_audit_record(data: bytes | None) -> AuditEvent | ReviewFlag:
    """Parse a record of `weir.audit` by its `kind` field (AuditEvent when absent, "review_flag")."""
    return _validated(_AUDIT_RECORD.validate_python, "audit record", data)


def _validated(validate: Any, what: str, data: bytes | None) -> Any:
    """validate(parsed JSON), with every defect turned into a DecodeError that says what and why."""
    try:
        return validate(orjson.loads(data or b""))
    except orjson.JSONDecodeError as exc:
        raise DecodeError(f"not JSON: {exc}") from exc
    except ValueError as exc:  # pydantic.ValidationError is a ValueError
        raise DecodeError(f"invalid {what}: {_short(exc)}") from exc


def json_schema(name: str) -> dict[str, Any]:
    """The JSON Schema of one wire type, by name."""
    kind = WIRE_TYPES[name]
    if isinstance(kind, TypeAdapter):
        return kind.json_schema()
    return kind.model_json_schema()


def _short(exc: Exception) -> str:
    text = str(exc).replace("\n", "; ")
    return text[:500]
