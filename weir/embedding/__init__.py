"""The sentence-embedding runtime shared by the worker and the auditor.

    onnx_export.py    the source model -> an ONNX export in $WEIR_HOME/models (once, idempotent)
    embedder.py       SentenceEmbedder: tokenize, fragment, run the session, pool, L2-normalise
    fingerprints.py   TextFingerprinter: texts -> SimHashes (schemas/fingerprint.py)

The worker serves /v1/embeddings and fingerprints its AuditEvents with these; the auditor
fingerprints the texts it looks up, so both compute a text's SimHash the same way. Nothing is
imported here: onnxruntime and torch load only when a module is.
"""
