"""The deployment's audit key: made once into $WEIR_HOME (0600), shared by every command, refused
when unsafe; and `weir audit lookup` finds a worker's records with no setup at all."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from schemas.fingerprint import key_id, keyed_hmac
from services.auditor.config import AuditorSettings
from services.auditor.ledger import Ledger
from services.worker.config import WorkerSettings
from tests.auditor.factories import make_event
from weir.audit_key import AuditKeyError, ensure_key_file, key_file, resolve_audit_key

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh $WEIR_HOME, and no key in the environment."""
    monkeypatch.setenv("WEIR_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("WEIR_AUDIT_HMAC_KEY", raising=False)
    return tmp_path / "home"


def test_a_fresh_home_gets_a_private_random_key(home: Path) -> None:
    key = WorkerSettings().hmac_key()
    path = home / "secrets" / "audit-hmac.key"
    assert key_file() == path
    assert len(key) == 32 and path.read_text() == key.hex() + "\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert [p.name for p in path.parent.iterdir()] == ["audit-hmac.key"]  # no staging file left


def test_every_later_use_reads_the_same_key(home: Path) -> None:
    first = WorkerSettings().hmac_key()
    assert WorkerSettings().hmac_key() == first
    assert AuditorSettings().hmac_key(create=False) == first
    assert ensure_key_file(key_file()) is False  # there: never made again, never overwritten
    assert WorkerSettings().hmac_key() == first


def test_processes_starting_together_agree_on_one_key(home: Path) -> None:
    keys: list[bytes] = []
    threads = [threading.Thread(target=lambda: keys.append(resolve_audit_key(None, create=True))) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(keys) == 8 and len(set(keys)) == 1


def test_the_environment_wins_and_makes_no_file(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEIR_AUDIT_HMAC_KEY", "hex:00ff")
    assert WorkerSettings().hmac_key() == b"\x00\xff"
    assert AuditorSettings().hmac_key() == b"\x00\xff"
    assert not key_file().exists()


def test_no_default_key_is_left_in_the_settings(home: Path) -> None:
    assert WorkerSettings().audit_hmac_key is None and AuditorSettings().audit_hmac_key is None


def test_a_key_others_can_read_is_refused(home: Path) -> None:
    WorkerSettings().hmac_key()
    key_file().chmod(0o644)
    with pytest.raises(AuditKeyError, match=r"mode 0644.*chmod 600"):
        WorkerSettings().hmac_key()
    key_file().chmod(0o600)
    key_file().parent.chmod(0o777)
    with pytest.raises(AuditKeyError, match=r"writable by others.*chmod 700"):
        AuditorSettings().hmac_key()


@pytest.mark.parametrize("content", ["weir-dev-audit-key\n", "ab" * 16 + "\n", "zz" * 32, ""])
def test_a_key_file_that_is_not_a_32_byte_hex_key_is_refused(home: Path, content: str) -> None:
    path = key_file()
    path.parent.mkdir(parents=True, mode=0o700)
    path.write_text(content)
    path.chmod(0o600)
    with pytest.raises(AuditKeyError, match=r"audit-hmac.key is not 64 hex digits"):
        WorkerSettings().hmac_key()
    assert path.read_text() == content  # never overwritten


def _weir(*args: str, home: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "WEIR_AUDIT_HMAC_KEY"}
    env.update(WEIR_HOME=str(home), PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-m", "weir.cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def test_audit_lookup_works_with_no_setup(home: Path, tmp_path: Path) -> None:
    key = WorkerSettings().hmac_key()  # what a worker of this deployment keys its events with
    db = tmp_path / "audit.sqlite"
    events = [
        make_event(
            i,
            prompt_hmac=keyed_hmac(key, f"prompt {i}"),
            output_hmac=keyed_hmac(key, f"output {i}"),
            hmac_key_id=key_id(key),
        )
        for i in range(3)
    ]
    with Ledger(db) as ledger:
        for offset, event in enumerate(events):
            ledger.append(event, partition=0, offset=offset)
    found = _weir("audit", "lookup", "--db", str(db), "--text", "output 1", "--exact", home=home, cwd=tmp_path)
    assert found.returncode == 0, found.stderr
    assert "req=req-1" in found.stdout and "1 match(es)" in found.stdout


def test_audit_lookup_without_a_key_says_where_it_looked(tmp_path: Path) -> None:
    db = tmp_path / "audit.sqlite"
    with Ledger(db) as ledger:
        ledger.append(make_event(0), partition=0, offset=0)
    home = tmp_path / "elsewhere"
    found = _weir("audit", "lookup", "--db", str(db), "--text", "output 0", "--exact", home=home, cwd=tmp_path)
    assert found.returncode == 2
    assert f"{home}/secrets/audit-hmac.key does not exist" in found.stderr
    assert not (home / "secrets").exists()  # a lookup never makes a key: a fresh one would match nothing


def test_weir_up_makes_both_keys_before_the_services_start(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from weir.audit_key import checkpoint_key_file
    from weir.stack import prepare_audit_key

    monkeypatch.delenv("WEIR_AUDIT_CHECKPOINT_KEY", raising=False)
    lines = prepare_audit_key().splitlines()
    assert lines == [
        f"audit key: {key_file()} (made now; workers, auditor and `weir audit lookup` use it)",
        f"checkpoint key: {checkpoint_key_file()} (made now; the auditor and `weir audit verify` use it)",
    ]
    assert stat.S_IMODE(checkpoint_key_file().stat().st_mode) == 0o600
    assert checkpoint_key_file().read_text() != key_file().read_text()
    assert AuditorSettings().checkpoint_key(create=False) == bytes.fromhex(checkpoint_key_file().read_text())
    assert "(kept;" in prepare_audit_key().splitlines()[1]
    monkeypatch.setenv("WEIR_AUDIT_CHECKPOINT_KEY", "hex:" + "22" * 32)
    assert prepare_audit_key().splitlines()[1] == "checkpoint key: WEIR_AUDIT_CHECKPOINT_KEY, from the environment"
    assert AuditorSettings().checkpoint_key(create=False) == b"\x22" * 32


def test_no_default_checkpoint_key_is_left_in_the_settings(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WEIR_AUDIT_CHECKPOINT_KEY", raising=False)
    assert AuditorSettings().audit_checkpoint_key is None
    with pytest.raises(AuditKeyError, match="no checkpoint key"):
        AuditorSettings().checkpoint_key(create=False)


def test_weir_up_makes_the_gateway_admin_token_once_and_hands_it_to_the_services(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    from services.gateway.config import GatewaySettings
    from weir.stack import ADMIN_TOKEN_FILE, prepare_admin_token

    monkeypatch.delenv("WEIR_GATEWAY_ADMIN_TOKEN", raising=False)
    path = home / ADMIN_TOKEN_FILE
    assert "(made now;" in prepare_admin_token() and stat.S_IMODE(path.stat().st_mode) == 0o600
    token = os.environ["WEIR_GATEWAY_ADMIN_TOKEN"]  # what the services inherit: the gateway's admin token
    assert len(token) == 64 and GatewaySettings().gateway_admin_token.get_secret_value() == token
    monkeypatch.delenv("WEIR_GATEWAY_ADMIN_TOKEN")
    assert "(kept;" in prepare_admin_token() and os.environ["WEIR_GATEWAY_ADMIN_TOKEN"] == token  # start after start
    monkeypatch.setenv("WEIR_GATEWAY_ADMIN_TOKEN", "mine")
    assert prepare_admin_token() == "admin token: WEIR_GATEWAY_ADMIN_TOKEN, from the environment"
