"""The ledger on a real PostgreSQL server, started here as a plain process in a temporary directory.

Skips, saying why, when no PostgreSQL server binaries exist. CI installs them with
`apt-get install -y postgresql` (Debian/Ubuntu; the binaries land in /usr/lib/postgresql/<v>/bin)
or uses any image with initdb and postgres on PATH; WEIR_TEST_PG_DSN points the test at an existing
server instead (a scratch database: the test creates and drops its own schema).
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.auditor.chain import chain_hash
from services.auditor.ledger import CHECKPOINTS, TABLE, Ledger, LedgerError
from tests.waiting import wait_until
from weir.stack import free_ports

from .factories import T0_MS, make_event, make_flag


def _pg_bin(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    versions = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return versions[-1] if versions else None


@pytest.fixture(scope="module")
def server_dsn(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if dsn := os.environ.get("WEIR_TEST_PG_DSN"):
        yield dsn
        return
    initdb, postgres = _pg_bin("initdb"), _pg_bin("postgres")
    if initdb is None or postgres is None:
        reason = "no PostgreSQL server binaries (initdb, postgres) here; apt-get install -y postgresql"
        print(f"SKIP: {reason}")
        pytest.skip(reason)
    prefix: list[str] = []
    # Not under pytest's tmp dir: as root that is 0700 root, and the server runs as another user.
    root = Path(tempfile.mkdtemp(prefix="weir-pg-"))
    if os.geteuid() == 0:  # PostgreSQL refuses to run as root
        if (
            shutil.which("runuser") is None
            or subprocess.run(["id", "postgres"], capture_output=True, check=False).returncode
        ):
            pytest.skip("running as root and there is no 'postgres' user to run PostgreSQL as")
        prefix = ["runuser", "-u", "postgres", "--"]
        shutil.chown(root, "postgres")
    data = root / "data"
    subprocess.run(
        [*prefix, initdb, "-D", str(data), "-U", "weir", "--auth=trust", "-E", "UTF8", "--no-sync"],
        check=True,
        capture_output=True,
    )
    (port,) = free_ports(1)
    proc = subprocess.Popen(
        [
            *prefix,
            postgres,
            "-D",
            str(data),
            "-k",
            str(root),
            "-p",
            str(port),
            "-c",
            "listen_addresses=127.0.0.1",
            "-c",
            "fsync=off",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    dsn = f"postgresql://weir@127.0.0.1:{port}/postgres"
    import psycopg

    def answers() -> bool:
        assert proc.poll() is None, "postgres exited"
        try:
            psycopg.connect(dsn).close()
            return True
        except psycopg.OperationalError:
            return False

    try:
        wait_until(answers, timeout_s=30, interval_s=0.2, what="postgres to accept connections")
    except AssertionError as exc:
        proc.kill()
        said = proc.stderr.read().decode()[-2000:] if proc.stderr else ""
        raise RuntimeError(f"postgres did not start ({exc}): {said}") from exc
    try:
        yield dsn
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def dsn(server_dsn: str) -> Iterator[str]:
    """A fresh schema per test (search_path), dropped afterwards."""
    import psycopg

    schema = f"t{uuid.uuid4().hex[:10]}"
    with psycopg.connect(server_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    sep = "&" if "?" in server_dsn else "?"
    yield f"{server_dsn}{sep}options=-csearch_path%3D{schema}"
    with psycopg.connect(server_dsn, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA {schema} CASCADE")


def test_postgres_ledger_chains_checkpoints_and_lookups(dsn: str) -> None:
    with Ledger(dsn, checkpoint_every_records=3, checkpoint_every_s=3600) as ledger:
        for i in range(1, 8):
            assert ledger.append(make_event(i), partition=i % 2, offset=i, now_ms=T0_MS + i)
        assert ledger.append(make_event(3), partition=1, offset=3) is False  # idempotent
        assert ledger.num_records() == 7 and ledger.chain_ids() == [0, 1]
        assert [(c.first_seq, c.last_seq) for c in ledger.checkpoints(1)] == [(1, 3)]
        assert [r["event_id"] for r in ledger.find_by_hmac([make_event(5).output_hmac])] == ["ev-5"]
        assert ledger.append(make_event(8, seed=2**63 - 1), partition=0, offset=8) is True  # 64-bit columns
    with Ledger(dsn, readonly=True) as ledger:
        report = ledger.verify()
        assert report.is_ok, report.describe()
        assert report.describe().startswith("OK: 8 records in 2 chains, 2 checkpoints, all intact")


def test_postgres_ledger_refuses_updates_and_verify_names_tampering(dsn: str) -> None:
    import psycopg

    with Ledger(dsn, checkpoint_every_records=3, checkpoint_every_s=3600) as ledger:
        for i in range(1, 7):
            ledger.append(make_event(i), partition=0, offset=i, now_ms=T0_MS + i)
    with psycopg.connect(dsn, autocommit=True) as conn:
        with pytest.raises(psycopg.errors.RaiseException, match="append-only"):
            conn.execute(f"UPDATE {TABLE} SET tenant = 'x' WHERE seq = 2")
        with pytest.raises(psycopg.errors.RaiseException, match="append-only"):
            conn.execute(f"DELETE FROM {CHECKPOINTS}")
        conn.execute(f"ALTER TABLE {TABLE} DISABLE TRIGGER USER")
        row = conn.execute(f"SELECT prev_hash, canonical_json FROM {TABLE} WHERE seq = 4").fetchone()
        forged = row[1].replace('"principal":"user-1"', '"principal":"mallory"')
        conn.execute(
            f"UPDATE {TABLE} SET principal = 'mallory', canonical_json = %s, record_hash = %s WHERE seq = 4",
            (forged, chain_hash(row[0], forged)),
        )
    with Ledger(dsn, readonly=True) as ledger:
        broken = ledger.verify().chain(0)
    assert (broken.broken_seq, broken.broken_event_id, broken.kind) == (4, "ev-4", "edited"), broken.describe()


def test_postgres_readonly_without_tables_is_refused(dsn: str) -> None:
    with pytest.raises(LedgerError, match="no audit_log table"):
        Ledger(dsn, readonly=True)


def test_unreachable_postgres_names_the_database(tmp_path: Path) -> None:
    with pytest.raises(LedgerError, match=re.escape("cannot connect to the audit database 127.0.0.1:1/x")):
        Ledger("postgresql://u:secret@127.0.0.1:1/x?connect_timeout=2")


def test_postgres_ledger_stores_review_flags_once_and_verify_names_tampering(dsn: str) -> None:
    import psycopg

    with Ledger(dsn) as ledger:
        assert ledger.append(make_event(1), partition=0, offset=1, now_ms=T0_MS)
        for i in (1, 2, 3):
            assert ledger.append_flag(make_flag(i), partition=0, offset=10 + i, now_ms=T0_MS + i)
        assert not ledger.append_flag(make_flag(2), partition=0, offset=99)
        report = ledger.verify()
        assert report.is_ok and report.num_flags == 3, report.describe()
        assert [f["flag_id"] for f in ledger.review_flags.rows(principal="user-2")] == ["flag-2"]
    with psycopg.connect(dsn, autocommit=True) as conn:
        with pytest.raises(psycopg.errors.RaiseException, match="append-only"):
            conn.execute("UPDATE review_flags SET num_detections = 1")
        conn.execute("ALTER TABLE review_flags DISABLE TRIGGER review_flags_append_only")
        conn.execute("UPDATE review_flags SET tenant = 'other' WHERE flag_id = 'flag-2'")
    with Ledger(dsn, readonly=True) as ledger:
        [broken] = ledger.verify().broken
    assert (broken.log, broken.broken_seq, broken.broken_event_id, broken.kind) == (
        "review_flags",
        2,
        "flag-2",
        "edited",
    )


def test_postgres_checkpoints_are_keyed_anchored_and_migrated(dsn: str) -> None:
    """Flag checkpoints, MACs and anchors on PostgreSQL; a checkpoints table without the mac column
    (the previous auditor's) gets it when opened for writing."""
    import psycopg

    from schemas.codec import encode
    from services.auditor.anchors import AnchorRecord

    key = b"k" * 32
    with Ledger(dsn, checkpoint_every_records=2, checkpoint_every_s=3600, checkpoint_key=key) as ledger:
        for i in range(1, 5):
            ledger.append(make_event(i), partition=0, offset=i, now_ms=T0_MS + i)
            ledger.append_flag(make_flag(i), partition=0, offset=10 + i, now_ms=T0_MS + i)
        anchors = [AnchorRecord(n, encode(a)) for n, a in enumerate(ledger.latest_anchors())]
        assert sorted((a.log, a.num, a.last_seq) for a in ledger.latest_anchors()) == [
            ("audit", 2, 4),
            ("review_flags", 2, 4),
        ]
    with Ledger(dsn, readonly=True, checkpoint_key=key) as ledger:
        report, anchored = ledger.verify_with_anchors("t.audit.anchors", anchors)
    assert report.is_ok and anchored.is_ok, report.describe() + anchored.describe()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("ALTER TABLE review_flag_checkpoints DISABLE TRIGGER USER")
        conn.execute("ALTER TABLE review_flags DISABLE TRIGGER USER")
        conn.execute("DELETE FROM review_flag_checkpoints WHERE num = 2")
        conn.execute("DELETE FROM review_flags WHERE seq > 2")
        conn.execute(f"ALTER TABLE {CHECKPOINTS} DISABLE TRIGGER USER")
        conn.execute(f"ALTER TABLE {CHECKPOINTS} DROP COLUMN mac")
    with Ledger(dsn, checkpoint_every_records=2, checkpoint_every_s=3600, checkpoint_key=key) as ledger:
        assert all(cp.mac is None for cp in ledger.checkpoints(0))  # migrated: the column is back, empty
        report, anchored = ledger.verify_with_anchors("t.audit.anchors", anchors)
    assert [(b.log, b.broken_checkpoint, b.kind) for b in report.broken] == [("audit", 1, "forged")]
    assert [p.split(":")[0] for p in anchored.problems] == ["TRUNCATED review flags chain 0"]
