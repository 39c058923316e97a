"""Factories of auditor test data: AuditEvents with stable, distinguishable content."""

from __future__ import annotations

from typing import Any

from schemas.fingerprint import key_id, keyed_hmac
from schemas.messages import AuditEvent

KEY = b"test-audit-key-0123456789"
T0_MS = 1_700_000_000_000


def make_event(i: int, **overrides: Any) -> AuditEvent:
    """The i-th audit event of a run: event_id f"ev-{i}", texts f"prompt {i}" / f"output {i}"."""
    fields: dict[str, Any] = dict(
        event_id=f"ev-{i}",
        request_id=f"req-{i}",
        model="weir-tiny",
        model_version="weir-tiny@1",
        weights_sha256="ab" * 32,
        principal=f"user-{i % 3}",
        tenant="default",
        prompt_hmac=keyed_hmac(KEY, f"prompt {i}"),
        output_hmac=keyed_hmac(KEY, f"output {i}"),
        hmac_key_id=key_id(KEY),
        temperature=0.7,
        top_p=0.9,
        top_k=0,
        max_tokens=64,
        seed=1000 + i,
        prompt_tokens=5 + i,
        completion_tokens=10 + i,
        finish_reason="stop",
        worker_id="worker-1",
        request_created_ms=T0_MS + i,
        received_ms=T0_MS + i + 3,
        first_token_ms=T0_MS + i + 20 if i % 2 else None,
        finished_ms=T0_MS + i + 90,
    )
    fields.update(overrides)
    return AuditEvent(**fields)
