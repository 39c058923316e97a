"""The auditor's HTTP API: lookups and watermark tests for the key holder.

    POST /v1/audit/lookup     {"text", "hmac_key"?, "max_distance"?, "limit"?}   bearer admin token
    POST /v1/audit/watermark  {"text", "tenant"? | "key"?, "gamma"?, "model"?}    bearer admin token
    GET  /v1/audit/reviews    ?principal=&limit=: the newest review flags              bearer admin token

The auditor is the only service that holds the ledger, so it serves these (docs/design.md,
invariant 1: services talk over Kafka; this is an operator's endpoint, bound to 127.0.0.1 by
default), on its service port beside /healthz, /readyz and /metrics (app.py). The token is
WEIR_AUDIT_ADMIN_TOKEN; when it is unset those endpoints answer 503.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any

import orjson
from fastapi import Depends, FastAPI, HTTPException, Query, Request
from pydantic import BaseModel, Field

from schemas.fingerprint import parse_key
from services.auditor.config import AuditorSettings
from services.auditor.ledger import Ledger, LedgerError
from services.auditor.lookup import DEFAULT_MAX_DISTANCE, lookup
from services.auditor.watermark import WatermarkDetector


class LookupRequest(BaseModel):
    """A text to look up in the ledger."""

    text: str = Field(description="The text (prompt or output) asked about; never stored.")
    hmac_key: str | None = Field(
        None, description="The fingerprint key ('hex:...' or text); default: the auditor's WEIR_AUDIT_HMAC_KEY."
    )
    max_distance: int = Field(
        DEFAULT_MAX_DISTANCE, ge=0, le=64, description="Most SimHash bits a semantic match may differ by."
    )
    limit: int = Field(100, ge=1, le=1000, description="Most matches returned.")


class WatermarkRequest(BaseModel):
    """A text to test for a watermark."""

    text: str = Field(description="The text to test.")
    tenant: str | None = Field(None, description="Tenant whose watermark (WEIR_WATERMARK_TENANTS) to test for.")
    key: str | None = Field(None, description="Or an explicit watermark key ('hex:...' or text).")
    gamma: float | None = Field(None, gt=0, lt=1, description="Green fraction with an explicit key (default 0.25).")
    model: str | None = Field(None, description="Model whose tokenizer to use (default: the repository's first).")


def create_api(
    settings: AuditorSettings,
    open_ledger: Callable[[], Ledger],
    detector: WatermarkDetector,
    simhash_of: Callable[[str], str | None] | None = None,
) -> FastAPI:
    """The FastAPI app; `open_ledger` opens a read-only Ledger per request, `simhash_of` embeds a
    text for semantic lookups (None: exact lookups only)."""
    api = FastAPI(title="Weir auditor", description=__doc__)

    def require_admin(request: Request) -> None:
        token = settings.audit_admin_token.get_secret_value() if settings.audit_admin_token else ""
        if not token:
            raise HTTPException(503, "WEIR_AUDIT_ADMIN_TOKEN is not set on the auditor")
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            raise HTTPException(401, "a bearer admin token is required", headers={"WWW-Authenticate": "Bearer"})

    @api.post("/v1/audit/lookup", dependencies=[Depends(require_admin)])
    def post_lookup(body: LookupRequest) -> dict[str, Any]:
        try:
            key = parse_key(body.hmac_key) if body.hmac_key else settings.hmac_key()
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from exc
        simhash = simhash_of(body.text) if simhash_of is not None else None
        try:
            with open_ledger() as ledger:
                matches = lookup(
                    ledger, key, body.text, simhash=simhash, max_distance=body.max_distance, limit=body.limit
                )
        except LedgerError as exc:
            raise HTTPException(503, str(exc)) from exc
        return {"simhash": simhash, "matches": [m.as_dict() for m in matches]}

    @api.post("/v1/audit/watermark", dependencies=[Depends(require_admin)])
    def post_watermark(body: WatermarkRequest) -> dict[str, Any]:
        try:
            found = detector.detect(
                body.text,
                tenant=body.tenant,
                key=parse_key(body.key) if body.key else None,
                gamma=body.gamma,
                model=body.model,
            )
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from exc
        return found.as_dict()

    @api.get("/v1/audit/reviews", dependencies=[Depends(require_admin)])
    def get_reviews(
        principal: str | None = Query(None, description="Only this principal's flags."),
        limit: int = Query(100, ge=1, le=1000, description="Most flags returned, the newest."),
    ) -> dict[str, Any]:
        try:
            with open_ledger() as ledger:
                rows = ledger.review_flags.rows(limit=limit, principal=principal)
        except LedgerError as exc:
            raise HTTPException(503, str(exc)) from exc
        return {"flags": [_flag_json(row) for row in rows]}

    return api


def _flag_json(row: dict[str, Any]) -> dict[str, Any]:
    """A stored review flag for the API: the ReviewFlag's fields, then where the ledger holds it."""
    record = orjson.loads(row["canonical_json"])
    return {
        **record["review_flag"],
        "chain_id": row["chain_id"],
        "seq": row["seq"],
        "appended_ms": row["appended_ms"],
        "record_hash": row["record_hash"],
    }
