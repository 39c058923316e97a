"""Semantic fingerprints: all-MiniLM-L6-v2 (onnxruntime) -> 128-d projection -> 64-bit SimHash,
as the worker's AuditEvents and the auditor's lookups compute them."""

from __future__ import annotations

import numpy as np

from schemas.fingerprint import FINGERPRINT_MODEL, hamming_distance, simhashes
from weir.embedding.embedder import as_json_floats
from weir.embedding.fingerprints import TextFingerprinter


def test_simhash_is_pinned() -> None:
    # The projection and hyperplanes come from a seeded generator: a change here changes every
    # stored fingerprint, and must change FINGERPRINT_MODEL too.
    assert simhashes(np.eye(2, 384)) == ["264e5ebe5188d513", "1f8acbc5ec4dac16"]
    assert FINGERPRINT_MODEL == "all-MiniLM-L6-v2/rp128-s20240601/simhash64"
    assert hamming_distance("00000000000000ff", "0000000000000000") == 8


def test_near_identical_texts_land_close_and_unrelated_ones_far(fingerprinter_float32: TextFingerprinter) -> None:
    # The SimHash scheme itself, on float32 embeddings: int8 moves each hash by a couple of bits
    # (this pair's "near" from 8 to 11); its quality is checked on the fixed paraphrase set in
    # test_fingerprints_int8.py, against float32's.
    fingerprinter = fingerprinter_float32
    base, near, paraphrase, code, finance = fingerprinter.simhash(
        [
            "The quick brown fox jumps over the lazy dog.",
            "The quick brown fox jumped over the lazy dog!",
            "A fast brown fox leaps over a lazy dog.",
            "def main():\n    print(42)",
            "Quarterly revenue grew by ten percent in Europe.",
        ]
    )
    assert all(len(h) == 16 for h in (base, near, paraphrase, code, finance))
    assert hamming_distance(base, near) <= 10 and hamming_distance(base, paraphrase) <= 10
    assert hamming_distance(base, code) > 16 and hamming_distance(base, finance) > 16
    assert fingerprinter.simhash(["The quick brown fox jumps over the lazy dog."]) == [base]  # deterministic


def test_a_text_hashes_the_same_alone_or_in_a_batch_of_mixed_lengths(fingerprinter: TextFingerprinter) -> None:
    texts = ["", "short", "a somewhat longer sentence about the weather today", "word " * 700]
    batched = fingerprinter.simhash(texts)
    assert batched == [fingerprinter.simhash([t])[0] for t in texts]
    assert batched[3] == simhashes(as_json_floats(fingerprinter.embedder.embed([texts[3]])))[0]
