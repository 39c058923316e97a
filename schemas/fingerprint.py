"""Keyed fingerprints of text: how a worker hashes a prompt or output for the audit log.

Shared contract: the worker computes these HMACs when it emits an AuditEvent, and the auditor
recomputes them from a text someone asks about ("was this text served?"). Both sides must
therefore normalise exactly the same way; changing `normalise` changes every fingerprint, so
bump NORMALISATION_VERSION when it does.

Raw text never leaves the process that holds it: only `keyed_hmac(key, text)` does (DESIGN.md,
invariant 7). The key makes the hash useless for dictionary attacks by anyone without it;
`key_id` names the key in the log without revealing it, so a lookup knows which key to use.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import unicodedata

# Version of the normalisation below; a change of `normalise` must bump it.
NORMALISATION_VERSION = 1

# `\s` on str patterns is Unicode-aware: ASCII whitespace, NBSP, the U+2000 spaces, U+2028/2029,
# U+3000 and the other characters str.isspace() accepts. Zero-width characters (U+200B, U+FEFF)
# are not whitespace and are kept.
_WHITESPACE_RUN = re.compile(r"\s+")

_KEY_ID_DOMAIN = b"weir-key-id"


def normalise(text: str) -> str:
    """The canonical form of `text` that fingerprints are computed over.

    1. Unicode NFKC: composed characters and compatibility forms fold together, so "é" typed as
       e + U+0301 and as U+00E9 match, and so do "ﬁ" and "fi", or full-width and ASCII letters.
    2. Every run of whitespace (newlines and tabs included) becomes one ASCII space.
    3. Leading and trailing whitespace is removed.

    Case, punctuation and zero-width characters are kept: "Hello" and "hello" are different
    texts. Idempotent: normalise(normalise(t)) == normalise(t).
    """
    return _WHITESPACE_RUN.sub(" ", unicodedata.normalize("NFKC", text)).strip()


def keyed_hmac(key: bytes, text: str) -> str:
    """HMAC-SHA256 of normalise(text) encoded as UTF-8, as 64 lowercase hex digits.

    Called by the worker for each finished request (prompt and output) and by the auditor's
    lookup for a text it is asked about. Raises ValueError for an empty key.
    """
    if not key:
        raise ValueError("the HMAC key is empty; set WEIR_AUDIT_HMAC_KEY to a secret of 16+ bytes")
    return hmac.new(key, normalise(text).encode("utf-8"), hashlib.sha256).hexdigest()


def key_id(key: bytes) -> str:
    """A short, non-reversible name of `key` (16 hex digits): sha256(b"weir-key-id" + key)[:16].

    Stored with each fingerprint (AuditEvent.hmac_key_id) so that, after a key rotation, a lookup
    knows which key a record was made with. It reveals nothing usable about the key.
    """
    return hashlib.sha256(_KEY_ID_DOMAIN + key).hexdigest()[:16]


def parse_key(value: str) -> bytes:
    """Turn the text of a key setting into key bytes: "hex:<digits>" is hex, anything else UTF-8.

    Every service that reads WEIR_AUDIT_HMAC_KEY goes through this, so they agree on the bytes.
    """
    if value.startswith("hex:"):
        try:
            return bytes.fromhex(value[4:])
        except ValueError as exc:
            raise ValueError(f"WEIR_AUDIT_HMAC_KEY starts with 'hex:' but is not hex: {exc}") from exc
    return value.encode("utf-8")
