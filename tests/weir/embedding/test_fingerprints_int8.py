"""int8 audit fingerprints (the default on the CPU) against float32's, on the fixed paraphrase set
tests/data/fingerprints/paraphrases.jsonl: SimHash bits moved, lookup recall, batching."""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

import pytest

from bench.fingerprints import load_pairs, recall
from schemas.fingerprint import hamming_distance
from schemas.model_repo import ModelConfig
from services.auditor.lookup import DEFAULT_MAX_DISTANCE
from weir.digests import file_sha256
from weir.embedding.fingerprints import TextFingerprinter
from weir.embedding.onnx_export import INT8_FILE, INT8_MANIFEST, ensure_int8, int8_dir
from weir.models.manifest import ManifestError, pack, verify_files

PAIRS = load_pairs()
TEXTS = [text for pair in PAIRS for text in pair]


def test_the_fingerprinters_are_what_they_say(
    fingerprinter: TextFingerprinter, fingerprinter_float32: TextFingerprinter
) -> None:
    assert fingerprinter.precision == "int8" and fingerprinter_float32.precision == "float32"
    assert fingerprinter.embedder.weights_sha256 != fingerprinter_float32.embedder.weights_sha256
    assert fingerprinter.model == fingerprinter_float32.model  # one SimHash space: either matches the other


def test_int8_simhashes_stay_within_a_few_bits_of_float32(
    fingerprinter: TextFingerprinter, fingerprinter_float32: TextFingerprinter
) -> None:
    bits = [
        hamming_distance(a, b)
        for a, b in zip(fingerprinter.simhash(TEXTS), fingerprinter_float32.simhash(TEXTS), strict=True)
    ]
    # Measured 2.2 mean, 6 max over the 84 texts; the bound leaves room for another CPU's kernels,
    # and stays well inside the lookup's distance of 10.
    assert statistics.mean(bits) <= 3.5 and max(bits) <= 9, bits


def test_int8_lookup_recall_is_no_worse_than_float32(
    fingerprinter: TextFingerprinter, fingerprinter_float32: TextFingerprinter
) -> None:
    int8, f32 = fingerprinter.simhash(TEXTS), fingerprinter_float32.simhash(TEXTS)
    before, before_false = recall(f32[0::2], f32[1::2], DEFAULT_MAX_DISTANCE)
    after, after_false = recall(int8[0::2], int8[1::2], DEFAULT_MAX_DISTANCE)
    old_ledger, old_false = recall(f32[0::2], int8[1::2], DEFAULT_MAX_DISTANCE)  # made before, asked after
    assert after >= before and old_ledger >= before, (before, after, old_ledger)
    assert after_false <= before_false + 1 and old_false <= before_false + 1
    # the fixed set's texts found as themselves across precisions (a record made before the change)
    exact, _ = recall(f32[0::2], int8[0::2], DEFAULT_MAX_DISTANCE)
    assert exact == len(PAIRS)


def test_int8_batched_equals_one_at_a_time(fingerprinter: TextFingerprinter) -> None:
    # Dynamic quantization scales each call's activations as a whole: a text must not hash
    # differently beside others (the worker batches, the auditor asks one text at a time).
    long_text = " ".join(TEXTS) * 2  # over the 512-token window: several fragments
    texts = [TEXTS[0], long_text, "", TEXTS[5], TEXTS[80]]
    assert fingerprinter.simhash(texts) == [fingerprinter.simhash([t])[0] for t in texts]


def test_int8_model_is_made_once_beside_its_export(fingerprinter: TextFingerprinter) -> None:
    export_dir = fingerprinter.embedder.model_dir
    int8 = int8_dir(export_dir) / INT8_FILE
    assert int8.parent == export_dir.parent / f"{export_dir.name}-int8"
    made = int8.stat().st_mtime_ns
    assert ensure_int8(export_dir) == int8 and int8.stat().st_mtime_ns == made  # reused, not quantized again
    record = json.loads((int8.parent / INT8_MANIFEST).read_text())
    assert record["from_onnx_sha256"] == file_sha256(export_dir / "model.onnx")
    assert record["int8_sha256"] == file_sha256(int8) == fingerprinter.embedder.weights_sha256
    assert not (export_dir / INT8_FILE).exists() and not (export_dir / INT8_MANIFEST).exists()


def test_int8_model_leaves_the_served_export_verifiable(fingerprinter: TextFingerprinter, tmp_path: Path) -> None:
    # The export is also the served embedding version's directory: its manifest is packed when the
    # version is registered (the first `weir up`), before any fingerprinter ran, and every later load
    # verifies the directory against it. Quantizing must not add a file there (it did: every load
    # after the first answered 503 "model.int8.onnx ... is not in the manifest"); an int8 model an
    # earlier Weir left inside is removed.
    export = tmp_path / "all-MiniLM-L6-v2-onnx"
    shutil.copytree(
        fingerprinter.embedder.model_dir, export, ignore=shutil.ignore_patterns(".*", "model.int8.onnx", INT8_MANIFEST)
    )
    manifest = pack(ModelConfig(name="all-MiniLM-L6-v2", engine="onnx", version="1", path=export))
    assert {f.path for f in manifest.files} == {"model.onnx", "tokenizer.json", "config.json", "weir-export.json"}
    # as an earlier Weir left it: the int8 model inside the export, after the manifest was packed
    shutil.copyfile(int8_dir(fingerprinter.embedder.model_dir) / INT8_FILE, export / INT8_FILE)
    (export / INT8_MANIFEST).write_text("{}\n")
    with pytest.raises(ManifestError, match="not in the manifest"):
        verify_files(manifest)

    int8 = ensure_int8(export)
    verify_files(manifest)  # the served version loads again, now and after every later start
    assert int8 == tmp_path / "all-MiniLM-L6-v2-onnx-int8" / INT8_FILE and int8.is_file()
    assert ensure_int8(export) == int8  # reused: the second start adds nothing either
    verify_files(manifest)
