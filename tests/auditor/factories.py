"""Factories of auditor test data: AuditEvents and ReviewFlags with stable, distinguishable content."""

from __future__ import annotations

from typing import Any

from schemas.fingerprint import key_id, keyed_hmac
from schemas.messages import AuditEvent, ReviewFlag

KEY = b"test-audit-key-0123456789"
T0_MS = 1_700_000_000_000


def make_event(i: int, **overrides: Any) -> AuditEvent:
    """The i-th audit event of a run: event_id f"ev-{i}", texts f"prompt {i}" / f"output {i}"."""
    fields: dict[str, Any] = {
        "event_id": f"ev-{i}",
        "request_id": f"req-{i}",
        "model": "weir-tiny",
        "model_version": "weir-tiny@1",
        "weights_sha256": "ab" * 32,
        "principal": f"user-{i % 3}",
        "tenant": "default",
        "prompt_hmac": keyed_hmac(KEY, f"prompt {i}"),
        "output_hmac": keyed_hmac(KEY, f"output {i}"),
        "hmac_key_id": key_id(KEY),
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 0,
        "max_tokens": 64,
        "seed": 1000 + i,
        "prompt_tokens": 5 + i,
        "completion_tokens": 10 + i,
        "finish_reason": "stop",
        "worker_id": "worker-1",
        "request_created_ms": T0_MS + i,
        "received_ms": T0_MS + i + 3,
        "first_token_ms": T0_MS + i + 20 if i % 2 else None,
        "finished_ms": T0_MS + i + 90,
    }
    fields.update(overrides)
    return AuditEvent(**fields)


def make_flag(i: int, **overrides: Any) -> ReviewFlag:
    """The i-th review flag of a run: flag_id f"flag-{i}", principal f"user-{i % 3}", 5 detections in an hour."""
    fields: dict[str, Any] = {
        "flag_id": f"flag-{i}",
        "principal": f"user-{i % 3}",
        "tenant": "default",
        "reason": "prompt_injection",
        "num_detections": 5,
        "window_s": 3600,
        "first_detection_ms": T0_MS + i * 1000,
        "last_detection_ms": T0_MS + i * 1000 + 500,
        "rules": ["ignore_previous_instructions", "role_override"],
        "gateway_id": "gateway-1",
        "created_ms": T0_MS + i * 1000 + 501,
    }
    fields.update(overrides)
    return ReviewFlag(**fields)
