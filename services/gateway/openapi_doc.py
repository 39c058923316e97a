"""GET /openapi.json: every endpoint with its request and response schemas, auth and errors.

The completion endpoints read their bodies themselves (strict parsing, OpenAI's error format), so
FastAPI cannot infer them: this module documents them from the same pydantic types the gateway
parses with, adds the response types, the bearer security scheme (API key or JWT; none in open
mode), and the error responses each endpoint really gives, all with OpenAI's error schema.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, Field

from services.gateway.openai_format import ChatCompletionBody, CompletionBody

REF = "#/components/schemas/{model}"


class ErrorObject(BaseModel):
    message: str = Field(description="Human-readable explanation.")
    type: str = Field(description="invalid_request_error (4xx), rate_limit_error (429) or server_error (5xx).")
    param: str | None = Field(description="The request field or header at fault, when there is one.")
    code: str | None = Field(description="Stable machine-readable code, e.g. invalid_api_key, rate_limit_exceeded.")


class ErrorResponse(BaseModel):
    """OpenAI's error body; every error of the gateway has it."""

    error: ErrorObject


class UsageOut(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None
    finish_reason: Literal["stop", "length"]


class ChatCompletion(BaseModel):
    """Body of a stream=false chat completion."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str | None
    choices: list[ChatChoice]
    usage: UsageOut


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None
    finish_reason: Literal["stop", "length"]


class Completion(BaseModel):
    """Body of a stream=false completion."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str | None
    choices: list[CompletionChoice]
    usage: UsageOut


class ModelObject(BaseModel):
    id: str = Field(description="A name (served by its default version) or name@version.")
    object: Literal["model"]
    created: int
    owned_by: str
    weir_version: str = Field(description="The version that serves this id.")
    weir_state: Literal["ready"] = Field(description="Only versions some live worker reports ready are listed.")
    weir_quantization: Literal["none", "int8", "int4"] = Field(
        description="How the version's weights are held on a CPU worker (models.toml `quantization`)."
    )


class ModelList(BaseModel):
    """The models that are ready and the caller may use."""

    object: Literal["list"]
    data: list[ModelObject]


class Health(BaseModel):
    status: Literal["ok"]
    gateway_id: str


class Readiness(BaseModel):
    ready: bool
    reason: str
    gateway_id: str
    live_workers: dict[str, int] = Field(description="Workers with a live heartbeat, per model.")


class RepositoryIndexBody(BaseModel):
    ready: bool = Field(False, description="Only the versions some live worker reports ready.")


class RepositoryEntry(BaseModel):
    """One model version, as Triton's repository index shows it, with Weir's fields."""

    name: str
    version: str
    state: str = Field(
        description="The best state a live worker reports (ready, draining, golden, loading, "
        "verifying, unhealthy, failed, refused), or unavailable."
    )
    reason: str = Field(description="Why failed, refused or unhealthy; or why unavailable.")
    desired: Literal["loaded", "unloaded", "retired"] = Field(description="What operators asked of it.")
    registered: bool = Field(description="False: a models.toml entry the registry does not hold yet.")
    default: bool = Field(description="It serves requests for the bare name.")
    workers: dict[str, str] = Field(description="Each live worker that reports it, with its state there.")


class RepositoryVersionBody(BaseModel):
    version: str = Field(description="The version of the model the path names.")


class RepositoryPromoteBody(RepositoryVersionBody):
    force: bool = Field(
        False, description="Promote even if no live worker reports the version ready (else 409 version_not_ready)."
    )


class RepositoryRouteBody(BaseModel):
    """A name's traffic policy (docs/design.md, "Traffic policies"); an omitted field stays as it is."""

    default: str | None = Field(None, description="The version the bare name goes to.")
    canary: dict[str, float] | None = Field(
        None, description="Canary versions and their share of requests, percent (sticky per user); {} clears them."
    )
    mirror: dict[str, float] | None = Field(
        None, description="Mirror versions and the share of requests each gets a copy of, percent; {} clears them."
    )


class RepositoryRoute(BaseModel):
    name: str
    default: str
    canary: dict[str, float]
    mirror: dict[str, float]
    records: list[str] = Field(description="The registry keys written.")
    applied: bool = Field(description="False: written, but this gateway had not read them back within 5 s.")


class RepositoryChange(BaseModel):
    name: str
    version: str
    action: Literal["load", "unload", "promote"]
    records: list[str] = Field(description="The registry keys written.")
    applied: bool = Field(description="False: written, but this gateway had not read them back within 5 s.")


_MODELS: list[type[BaseModel]] = [
    ErrorResponse,
    ChatCompletion,
    Completion,
    ModelList,
    Health,
    Readiness,
    ChatCompletionBody,
    CompletionBody,
    RepositoryIndexBody,
    RepositoryEntry,
    RepositoryVersionBody,
    RepositoryPromoteBody,
    RepositoryChange,
    RepositoryRouteBody,
    RepositoryRoute,
]

_ERRORS: dict[int, str] = {
    400: "Invalid body, parameter or header (param names it); JSON nested deeper than WEIR_MAX_JSON_DEPTH "
    "(json_too_deep); context length exceeded; a prompt the input guard blocks for its tenant "
    "(prompt_injection_detected).",
    401: "Missing, invalid, revoked or expired API key or JWT.",
    403: "The credential may not use this model.",
    404: "Unknown model, or a version of it (name@version) that is not registered or is retired; (GET "
    "/v1/models/{model_id}) a model that is not ready or the caller may not use; or (GET /v1/streams) no "
    "resumable stream of the caller with that id on this instance.",
    413: "Body larger than WEIR_MAX_BODY_BYTES.",
    431: "More headers than WEIR_MAX_HEADERS, or more bytes of them than WEIR_MAX_HEADER_BYTES.",
    429: "Rate limit (per key or tenant), full in-flight lane, overloaded workers, a queue longer than the "
    "request's deadline (queue_too_long), or a retryable rejection.",
    503: "No live worker serves the model version's name (breaker open, with Retry-After); the version failed or "
    "was refused on every live worker reporting it, or is unloaded (model_unavailable, the reason); or Kafka "
    "did not take the request.",
    504: "No result before the request's deadline.",
}

_ADMIN_ERRORS: dict[int, str] = {
    400: "The body is not a JSON object of the call's fields, or the name or version is malformed.",
    401: "Missing or invalid credentials.",
    403: "Not the gateway's admin token (WEIR_GATEWAY_ADMIN_TOKEN); every caller when it is unset.",
    404: "The registry does not hold that version (route: that name).",
    409: "The registry's state does not allow it (e.g. unloading the default version, promoting an unloaded one, "
    "a canary of an unregistered or unloaded version, canaries over 100%: registry_conflict), or promote "
    "without force of a version no live worker reports ready (version_not_ready).",
    413: "Body larger than WEIR_MAX_BODY_BYTES.",
    431: "More headers than WEIR_MAX_HEADERS, or more bytes of them than WEIR_MAX_HEADER_BYTES.",
}

_STATUSES: dict[str, list[int]] = {
    "/v1/models": [401, 431],
    "/v1/models/{model_id}": [401, 404, 431],
    "/v1/streams/{request_id}": [400, 401, 404, 431],
}

_SSE = "An SSE stream (stream=true): `id: <seq>` and `data: <chunk JSON>` events, ending with `data: [DONE]`."


def _ref(name: str) -> dict[str, str]:
    return {"$ref": REF.format(model=name)}


def _header(description: str, schema_type: str = "string") -> dict[str, Any]:
    return {"description": description, "schema": {"type": schema_type}}


def _error(status: int, descriptions: dict[int, str] = _ERRORS) -> dict[str, Any]:
    response: dict[str, Any] = {
        "description": descriptions[status],
        "content": {"application/json": {"schema": _ref("ErrorResponse")}},
        "headers": {"x-request-id": _header("Id of the request, when one was assigned.")},
    }
    if status in (429, 503):
        response["headers"]["retry-after"] = _header("Seconds to wait before retrying.", "integer")
    if status == 401:
        response["headers"]["www-authenticate"] = _header("Bearer challenge.")
    return response


def _completion_operation(body: str, result: str, example: dict[str, Any], summary: str) -> dict[str, Any]:
    return {
        "summary": summary,
        "parameters": [
            {
                "name": "X-Weir-Timeout-S",
                "in": "header",
                "required": False,
                "description": "Timeout in seconds, from 0.001 to WEIR_MAX_TIMEOUT_S (600 by default); lowers the "
                "model's default_timeout_s, never raises it.",
                "schema": {"type": "number", "minimum": 0.001},
            },
            {
                "name": "X-Weir-Priority",
                "in": "header",
                "required": False,
                "description": "Scheduling lane.",
                "schema": {"type": "string", "enum": ["interactive", "bulk"]},
            },
            {
                "name": "X-Weir-Resume-Grace-S",
                "in": "header",
                "required": False,
                "description": "Makes a stream resumable: after a dropped connection it runs on for this many "
                "seconds (0, or 0.001 to WEIR_MAX_RESUME_GRACE_S), readable again at "
                "GET /v1/streams/{request_id}; 0: cancel at once.",
                "schema": {"type": "number", "minimum": 0},
            },
        ],
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": _ref(body), "example": example}},
        },
        "responses": {
            "200": {
                "description": "The result; an SSE stream when stream=true.",
                "headers": {
                    "x-request-id": _header("Id of the request (also on Kafka and in every chunk)."),
                    "x-weir-resume-url": _header("Where a resumable stream can be read again (stream=true only)."),
                    "x-weir-model-version": _header(
                        "name@version:<first 12 hex of the version's manifest digest> "
                        "of the version that serves it ('unregistered' for a models.toml "
                        "entry no registry record or worker reports a digest of)."
                    ),
                    "x-weir-assignment": _header(
                        "How that version was chosen: default, canary (the name's traffic "
                        "policy, sticky per user) or pinned (model named name@version)."
                    ),
                },
                "content": {
                    "application/json": {"schema": _ref(result)},
                    "text/event-stream": {"schema": {"type": "string", "description": _SSE}},
                },
            },
            **{str(status): _error(status) for status in _ERRORS},
        },
    }


def _json_ok(name: str, description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ref(name)}}}


def _admin_operation(summary: str, body: str, result: dict[str, Any], is_body_required: bool) -> dict[str, Any]:
    return {
        "summary": summary,
        "security": [{"bearer": []}],  # the admin token, in open mode too
        "requestBody": {"required": is_body_required, "content": {"application/json": {"schema": _ref(body)}}},
        "responses": {
            "200": {"description": summary, "content": {"application/json": {"schema": result}}},
            **{str(status): _error(status, _ADMIN_ERRORS) for status in _ADMIN_ERRORS},
        },
    }


def _admin_operations() -> dict[tuple[str, str], dict[str, Any]]:
    out = {
        ("post", "/v2/repository/index"): _admin_operation(
            "Every model version with its state on the workers",
            "RepositoryIndexBody",
            {"type": "array", "items": _ref("RepositoryEntry")},
            False,
        )
    }
    for action, what in (
        ("load", "Ask workers to load a version (desired = loaded)"),
        ("unload", "Ask workers to drain and unload a version (desired = unloaded)"),
        ("promote", "Make a version the default of its name; the old default is unloaded"),
    ):
        body = "RepositoryPromoteBody" if action == "promote" else "RepositoryVersionBody"
        operation = _admin_operation(what, body, _ref("RepositoryChange"), True)
        operation["parameters"] = [
            {
                "name": "name",
                "in": "path",
                "required": True,
                "schema": {"type": "string"},
                "description": "The model name (without @version).",
            }
        ]
        out[("post", f"/v2/repository/models/{{name}}/{action}")] = operation
    route = _admin_operation(
        "Set the traffic policy of a name: default, canaries, mirrors",
        "RepositoryRouteBody",
        _ref("RepositoryRoute"),
        True,
    )
    route["parameters"] = operation["parameters"]
    out[("post", "/v2/repository/models/{name}/route")] = route
    return out


def _operations() -> dict[tuple[str, str], dict[str, Any]]:
    chat_example = {"model": "echo", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16}
    completion_example = {"model": "echo", "prompt": "Hello", "max_tokens": 16}
    return {
        ("post", "/v1/chat/completions"): _completion_operation(
            "ChatCompletionBody", "ChatCompletion", chat_example, "Chat completion (OpenAI-compatible)"
        ),
        ("post", "/v1/completions"): _completion_operation(
            "CompletionBody", "Completion", completion_example, "Completion (OpenAI-compatible)"
        ),
        ("get", "/v1/streams/{request_id}"): {
            "summary": "Read a resumable stream again (SSE reconnect)",
            "parameters": [
                {
                    "name": "request_id",
                    "in": "path",
                    "required": True,
                    "schema": {"type": "string"},
                    "description": "x-request-id of a stream asked with X-Weir-Resume-Grace-S.",
                },
                {
                    "name": "Last-Event-ID",
                    "in": "header",
                    "required": False,
                    "schema": {"type": "string"},
                    "description": "The id of the last event received; the stream goes on after it.",
                },
                {
                    "name": "last_event_id",
                    "in": "query",
                    "required": False,
                    "schema": {"type": "string"},
                    "description": "Same as Last-Event-ID, for clients that cannot set headers.",
                },
            ],
            "responses": {
                "200": {
                    "description": "The events after Last-Event-ID, live until `data: [DONE]`.",
                    "content": {"text/event-stream": {"schema": {"type": "string", "description": _SSE}}},
                },
            },
        },
        ("get", "/v1/models"): {
            "summary": "Models the caller may use",
            "responses": {"200": _json_ok("ModelList", "OpenAI's model list.")},
        },
        ("get", "/v1/models/{model_id}"): {
            "summary": "One model the caller may use",
            "parameters": [
                {
                    "name": "model_id",
                    "in": "path",
                    "required": True,
                    "schema": {"type": "string"},
                    "description": "An id GET /v1/models lists: a name or name@version.",
                }
            ],
            "responses": {"200": _json_ok("ModelObject", "The model, the object GET /v1/models lists for it.")},
        },
        ("get", "/healthz"): {
            "summary": "Liveness",
            "security": [],
            "responses": {"200": _json_ok("Health", "The process runs.")},
        },
        ("get", "/readyz"): {
            "summary": "Readiness",
            "security": [],
            "responses": {
                "200": _json_ok("Readiness", "Kafka connected and a worker live."),
                "503": _json_ok("Readiness", "Not ready; reason says why."),
            },
        },
        ("get", "/metrics"): {
            "summary": "Prometheus metrics",
            "security": [],
            "responses": {
                "200": {
                    "description": "Prometheus text format 0.0.4.",
                    "content": {"text/plain": {"schema": {"type": "string"}}},
                }
            },
        },
        **_admin_operations(),
    }


def build_openapi(app: FastAPI, is_open: bool) -> dict[str, Any]:
    """The OpenAPI document of `app`: FastAPI's, completed with bodies, responses, auth, errors."""
    schema = get_openapi(
        title=app.title,
        version="1",
        description=(
            "Weir's OpenAI-compatible gateway. Authenticate with `Authorization: Bearer <API key or JWT>`"
            + (" (this instance runs in open mode: no credentials needed)." if is_open else ".")
            + " Streaming over WebSocket: GET /v1/stream (not describable in OpenAPI; see docs/gateway.md)."
        ),
        routes=app.routes,
    )
    components = schema.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    for model in _MODELS:
        model_schema = model.model_json_schema(ref_template=REF)
        schemas.update(model_schema.pop("$defs", {}))
        schemas[model.__name__] = model_schema
    components["securitySchemes"] = {
        "bearer": {"type": "http", "scheme": "bearer", "bearerFormat": "API key (weir_<key_id>_<secret>) or JWT"}
    }
    security: list[dict[str, list[str]]] = [{}] if is_open else [{"bearer": []}]
    known = _operations()
    for path, item in schema.get("paths", {}).items():
        for method, operation in item.items():
            spec = known.get((method, path))
            if spec is not None:
                operation.update(spec)
            if path.startswith("/v1/"):
                operation["security"] = security
                responses = operation.setdefault("responses", {})
                responses.pop("422", None)  # the gateway answers 400, never FastAPI's 422
                statuses = _STATUSES.get(path, list(_ERRORS))
                for status in statuses:
                    if not (is_open and status in (401, 403)):
                        responses.setdefault(str(status), _error(status))
                if is_open:
                    responses.pop("401", None)
                    responses.pop("403", None)
    return schema


def install_openapi(app: FastAPI) -> None:
    """Serve build_openapi's document at /openapi.json (built once, on first request)."""
    is_open = app.state.settings.auth_mode == "open"

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app, is_open)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented override
