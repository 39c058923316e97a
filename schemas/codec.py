"""orjson encoding and decoding of the wire types, and their JSON Schemas."""

from __future__ import annotations

from typing import Any, TypeVar

import orjson
from pydantic import BaseModel, TypeAdapter, ValidationError

from schemas.messages import (
    AnyRequest,
    ApiKeyRecord,
    AuditAnchor,
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
    StreamRecord,
    UsageRecord,
    WorkerHeartbeat,
)
from schemas.registry import (
    ModelComparison,
    ModelHealthEvent,
    ModelRoute,
    ModelVersionRecord,
    RegistryRecord,
    ShadowLive,
    TrafficCounts,
)
from schemas.telemetry import HealthAlert, RateCard, SpanRecord, UsageTotals
from schemas.topics import Topics

M = TypeVar("M", bound=BaseModel)

_REPLY = TypeAdapter(ReplyEvent)
_REQUEST: TypeAdapter[GenerateRequest | EmbedRequest] = TypeAdapter(AnyRequest)
_REGISTRY_RECORD: TypeAdapter[RegistryRecord] = TypeAdapter(RegistryRecord)
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
    "AuditAnchor": AuditAnchor,
    "DeadLetter": DeadLetter,
    "ApiKeyRecord": ApiKeyRecord,
    "UsageRecord": UsageRecord,
    "FileChunk": FileChunk,
    "BatchJob": BatchJob,
    "JobCommand": JobCommand,
    "ModelVersionRecord": ModelVersionRecord,
    "ModelRoute": ModelRoute,
    "RegistryRecord": _REGISTRY_RECORD,
    "ModelHealthEvent": ModelHealthEvent,
    "ShadowLive": ShadowLive,
    "ModelComparison": ModelComparison,
    "TrafficCounts": TrafficCounts,
    "SpanRecord": SpanRecord,
    "UsageTotals": UsageTotals,
    "RateCard": RateCard,
    "HealthAlert": HealthAlert,
    "StreamRecord": StreamRecord,
}


class DecodeError(ValueError):
    """A message that is not valid JSON or not a valid instance of its wire type."""


def encode(message: BaseModel) -> bytes:
    """Serialise a wire message to JSON bytes (None fields kept, so the shape is stable)."""
    return orjson.dumps(message.model_dump(mode="json"))


def decode(kind: type[M], data: bytes | None) -> M:
    """Parse bytes into `kind`; raises DecodeError with the reason on any defect."""
    return _validated(kind.model_validate_json, kind.__name__, data)


def decode_reply(data: bytes | None) -> Any:
    """Parse a ReplyDelta or ReplyEnd by its `type` field."""
    return _validated(_REPLY.validate_json, "ReplyEvent", data)


def decode_request(data: bytes | None) -> GenerateRequest | EmbedRequest:
    """Parse a record of `weir.requests` by its `kind` field ("generate" when absent, "embed")."""
    return _validated(_REQUEST.validate_json, "request", data)


def reply_address(data: bytes | None, topics: Topics) -> tuple[str, str] | None:
    """(request_id, reply_to) of a request record that failed validation, when both can be read:
    a JSON object whose `request_id` is a string of 1-128 characters and whose `reply_to` is a
    reply topic of the deployment of `topics` (Topics.reply_to_problem). Enough to tell its
    producer why with a ReplyEnd (`rejected`), rather than leave it waiting for an answer that
    never comes; None when the record names neither, or names a topic no reply may go to."""
    try:
        obj = orjson.loads(data or b"")
    except orjson.JSONDecodeError:
        return None
    if not isinstance(obj, dict):
        return None
    request_id, reply_to = obj.get("request_id"), obj.get("reply_to")
    if not isinstance(request_id, str) or not 1 <= len(request_id) <= 128:
        return None
    if not isinstance(reply_to, str) or topics.reply_to_problem(reply_to) is not None:
        return None
    return request_id, reply_to


def decode_audit_record(data: bytes | None) -> AuditEvent | ReviewFlag:
    """Parse a record of `weir.audit` by its `kind` field (AuditEvent when absent, "review_flag")."""
    return _validated(_AUDIT_RECORD.validate_json, "audit record", data)


def decode_registry_record(data: bytes | None) -> ModelVersionRecord | ModelRoute:
    """Parse a record of the model registry topic by its `kind` field ("version" or "route")."""
    return _validated(_REGISTRY_RECORD.validate_json, "registry record", data)


def _validated(validate: Any, what: str, data: bytes | None) -> Any:
    """validate(JSON bytes) in strict mode, as the exported JSON Schemas say (no "8" for an
    integer), with every defect turned into a DecodeError that a person can read."""
    try:
        return validate(data or b"", strict=True)
    except ValidationError as exc:
        if exc.errors()[0]["type"] == "json_invalid":
            raise DecodeError(f"not JSON: {exc.errors()[0]['msg']}") from exc
        raise DecodeError(f"invalid {what}: {describe_errors(exc)}") from exc
    except ValueError as exc:
        raise DecodeError(f"invalid {what}: {_short(exc)}") from exc


# pydantic error type -> what the field expected, in words
_EXPECTED = {
    "int_type": "expected an integer",
    "int_parsing": "expected an integer",
    "int_from_float": "expected an integer",
    "float_type": "expected a number",
    "float_parsing": "expected a number",
    "string_type": "expected a string",
    "bool_type": "expected true or false",
    "bool_parsing": "expected true or false",
    "dict_type": "expected an object",
    "model_type": "expected an object",
    "model_attributes_type": "expected an object",
    "list_type": "expected an array",
    "tuple_type": "expected an array",
    "none_required": "expected null",
}
_MAX_ERRORS_SHOWN = 5


def describe_errors(exc: ValidationError) -> str:
    """Each defect as `field: what was wrong, got <the value as JSON>`, joined by "; " (at most
    five, then how many more); e.g. `max_tokens: expected an integer, got "8"`."""
    parts = [_describe(error) for error in exc.errors()]
    shown = "; ".join(parts[:_MAX_ERRORS_SHOWN])
    if len(parts) > _MAX_ERRORS_SHOWN:
        shown += f"; and {len(parts) - _MAX_ERRORS_SHOWN} more"
    return shown


def _describe(error: Any) -> str:
    # A tagged union's loc starts with the tag ("generate", "embed"): not a field name.
    loc = [str(part) for part in error["loc"] if not (isinstance(part, str) and part in _UNION_TAGS)]
    where = ".".join(loc) or "the record"
    kind = error["type"]
    if kind == "missing":
        return f"{where}: required, missing"
    if kind == "extra_forbidden":
        return f"{where}: not a field of this message"
    if kind in _EXPECTED:
        said = _EXPECTED[kind]
    else:
        said = str(error["msg"]).replace("Value error, ", "").replace("Input should be", "must be")
    return f"{where}: {said}, got {_json_excerpt(error.get('input'))}"


_UNION_TAGS = {"generate", "embed", "audit_event", "review_flag", "delta", "end"}


def _json_excerpt(value: Any, max_chars: int = 80) -> str:
    try:
        text = orjson.dumps(value).decode()
    except TypeError:
        text = repr(value)
    return text if len(text) <= max_chars else text[: max_chars - 3] + "..."


def json_schema(name: str) -> dict[str, Any]:
    """The JSON Schema of one wire type, by name."""
    kind = WIRE_TYPES[name]
    if isinstance(kind, TypeAdapter):
        return kind.json_schema()
    return kind.model_json_schema()


def _short(exc: Exception) -> str:
    text = str(exc).replace("\n", "; ")
    return text[:500]
