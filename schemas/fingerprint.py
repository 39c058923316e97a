"""Keyed fingerprints of text: how a worker hashes a prompt or output for the audit log.

Shared contract: the worker computes these HMACs when it emits an AuditEvent, and the auditor
recomputes them from a text someone asks about ("was this text served?"). Both sides must
therefore normalise exactly the same way; changing `normalise` changes every fingerprint, so
bump NORMALISATION_VERSION when it does.

Raw text never leaves the process that holds it: only `keyed_hmac(key, text)` does (docs/design.md,
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


# -- semantic fingerprints ------------------------------------------------------------------------
#
# simhash(text) = sign bits of H^T (P^T e), where e is the L2-normalised all-MiniLM-L6-v2 embedding
# of the text (384-d, as /v1/embeddings returns it), P [384, 128] a fixed random projection and
# H [128, 64] 64 random hyperplanes, both standard normal from numpy's PCG64 seeded with
# SIMHASH_SEED. Texts whose embeddings are at angle theta differ in about 64 * theta / pi bits, so
# near-identical texts land within a few bits. Bit i of the 64-bit value is hyperplane i; written
# as 16 lowercase hex digits. Changing any of this changes FINGERPRINT_MODEL.

SIMHASH_SEED = 20240601
SIMHASH_PROJECTION_DIMS = 128
SIMHASH_BITS = 64
FINGERPRINT_MODEL = f"all-MiniLM-L6-v2/rp{SIMHASH_PROJECTION_DIMS}-s{SIMHASH_SEED}/simhash{SIMHASH_BITS}"


def _simhash_planes(dims: int):  # -> (P [dims, 128], H [128, 64]) float64
    import numpy as np

    rng = np.random.Generator(np.random.PCG64(SIMHASH_SEED))
    projection = rng.standard_normal((dims, SIMHASH_PROJECTION_DIMS)) / SIMHASH_PROJECTION_DIMS**0.5
    planes = rng.standard_normal((SIMHASH_PROJECTION_DIMS, SIMHASH_BITS))
    return projection, planes


def simhashes(embeddings) -> list[str]:  # embeddings: [n, dims] array-like of float
    """The 64-bit SimHash (16 hex digits) of each embedding row.

    Called by the worker's fingerprint batcher for each finished request's prompt and output,
    and by the auditor's lookup for the asked text.
    """
    import numpy as np

    vectors = np.asarray(embeddings, dtype=np.float64)
    projection, planes = _simhash_planes(vectors.shape[1])
    bits = (vectors @ projection @ planes) > 0  # [n, 64]
    weights = np.left_shift(np.uint64(1), np.arange(SIMHASH_BITS, dtype=np.uint64))
    values = (bits.astype(np.uint64) * weights).sum(axis=1, dtype=np.uint64)
    return [f"{int(v):016x}" for v in values]


def hamming_distance(a: str, b: str) -> int:
    """How many of the 64 bits differ between two SimHashes."""
    return (int(a, 16) ^ int(b, 16)).bit_count()
