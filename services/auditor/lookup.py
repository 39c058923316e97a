"""Lookup: "was this text served, when, by which model version, for whom?"

Given a text and the fingerprint key (only its holder can ask: the ledger holds keyed HMACs, not
text), the auditor returns the records whose prompt or output is

- exactly the text: keyed_hmac(key, text) equals prompt_hmac or output_hmac (distance 0), or
- semantically close: the SimHash of the text's embedding is within `max_distance` bits of the
  record's prompt_simhash or output_simhash (when the caller can compute that SimHash).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

from schemas.fingerprint import keyed_hmac
from services.auditor.ledger import Ledger

Side = Literal["prompt", "output"]  # the field of a record a match is in

DEFAULT_MAX_DISTANCE = 10  # of 64 bits; paraphrases of one sentence land around 3-12


@dataclass(frozen=True)
class Match:
    """One record that matches the asked text, and how."""

    chain_id: int
    seq: int
    event_id: str
    request_id: str
    model_version: str
    weights_sha256: str
    principal: str
    tenant: str
    finished_ms: int
    appended_ms: int
    field: Literal["prompt", "output"]
    match: Literal["exact", "semantic"]
    distance: int  # Hamming distance of the SimHashes in bits; 0 for an exact match

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def hamming(a: str, b: str) -> int:
    """Bits that differ between two SimHashes (16 hex digits each)."""
    return (int(a, 16) ^ int(b, 16)).bit_count()


def lookup(
    ledger: Ledger,
    key: bytes,
    text: str,
    *,
    simhash: str | None = None,
    max_distance: int = DEFAULT_MAX_DISTANCE,
    limit: int = 100,
) -> list[Match]:
    """Records matching `text`: exact ones first (oldest first), then semantic ones by distance.

    `simhash` is the text's SimHash (None skips the semantic search). A record that matches
    exactly is not listed again as a semantic match of the same field.
    """
    digest = keyed_hmac(key, text)
    matches: list[Match] = []
    exact: set[tuple[int, int, str]] = set()
    for record in ledger.find_by_hmac([digest]):
        for field in ("prompt", "output"):
            if record[f"{field}_hmac"] == digest:
                matches.append(_match(record, field, "exact", 0))
                exact.add((record["chain_id"], record["seq"], field))
    if simhash is not None:
        near: list[tuple[int, int, int, Side]] = []
        for chain_id, seq, prompt_sh, output_sh in ledger.iter_simhashes():
            sides: tuple[tuple[Side, str | None], ...] = (("prompt", prompt_sh), ("output", output_sh))
            for field, value in sides:
                if value is None or (chain_id, seq, field) in exact:
                    continue
                distance = hamming(simhash, value)
                if distance <= max_distance:
                    near.append((distance, chain_id, seq, field))
        for distance, chain_id, seq, field in sorted(near)[: max(limit - len(matches), 0)]:
            found = ledger.record(chain_id, seq)
            if found is not None:
                matches.append(_match(found, field, "semantic", distance))
    return matches[:limit]


def _match(
    record: dict[str, Any], field: Literal["prompt", "output"], kind: Literal["exact", "semantic"], distance: int
) -> Match:
    return Match(
        chain_id=record["chain_id"],
        seq=record["seq"],
        event_id=record["event_id"],
        request_id=record["request_id"],
        model_version=record["model_version"],
        weights_sha256=record["weights_sha256"],
        principal=record["principal"],
        tenant=record["tenant"],
        finished_ms=record["finished_ms"],
        appended_ms=record["appended_ms"],
        field=field,
        match=kind,
        distance=distance,
    )
