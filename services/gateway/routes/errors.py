"""The one place errors become responses: OpenAI's {"error": {...}} with a fitting status."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.gateway.metrics import note_error_code
from services.gateway.openai_format import ApiError, error_body, error_type, validation_error

log = logging.getLogger(__name__)

# What create_app routes to on_error: the gateway's own errors, the framework's, and anything else.
HANDLED = (ApiError, StarletteHTTPException, RequestValidationError, ValidationError, Exception)


def known_error(exc: Exception) -> tuple[int, dict[str, Any]] | None:
    """(status, OpenAI error body) of an error the gateway expects; None for anything else (a bug)."""
    if isinstance(exc, ApiError):
        return exc.status, exc.body()
    if isinstance(exc, StarletteHTTPException):
        status = exc.status_code
        code = "not_found" if status == 404 else "method_not_allowed" if status == 405 else None
        return status, error_body(str(exc.detail), error_type(status), None, code)
    if isinstance(exc, ValidationError):
        error = validation_error(exc)
        return error.status, error.body()
    if isinstance(exc, RequestValidationError):
        return 400, error_body(str(exc.errors()[:1]), "invalid_request_error", None, "invalid_value")
    return None


async def on_error(request: Request, exc: Exception) -> JSONResponse:
    """The response of any error raised while handling `request`; logs the request's end unless
    it was published (then its Exchange does), and the traceback of an unexpected error."""
    known = known_error(exc)
    if known is None:
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        known = 500, error_body("internal error", "server_error", None, "internal_error")
    status, body = known
    note_error_code(request.scope, body["error"]["code"])
    headers = dict(getattr(exc, "headers", None) or {})  # Retry-After, WWW-Authenticate
    request_id = getattr(request.state, "request_id", None)
    if request_id:
        headers["x-request-id"] = request_id
    if not getattr(request.state, "is_submitted", False):  # else the Exchange logs the request's end
        log.info(
            "request_end request_id=%s path=%s status=%d code=%s",
            request_id or "-",
            request.url.path,
            status,
            body["error"]["code"],
        )
    return JSONResponse(body, status_code=status, headers=headers)
