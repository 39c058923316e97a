"""The audit keys of a deployment: random keys per $WEIR_HOME, made once, never in the code.

Workers key the prompt and output hashes of every AuditEvent with it; the auditor and
`weir audit lookup` need the same key to find a text's records. When WEIR_AUDIT_HMAC_KEY is not
set, every command of a deployment uses the key file

    $WEIR_HOME/secrets/audit-hmac.key    64 hex digits (32 random bytes), mode 0600, folder 0700

The services (worker, auditor) and `weir up` make it on first use; commands that only read the
ledger (`weir audit lookup`) never make one, since a fresh key would match nothing. It is made
atomically (written to a private temporary file, then hard-linked into place, which fails when
the file exists), so processes that start together agree on one key, and it is never
overwritten. A file another user could read or write, or one that does not hold a 32-byte hex
key, is refused with a message saying how to fix it.

The auditor's checkpoint key is made and kept the same way, apart from the fingerprint key:

    $WEIR_HOME/secrets/audit-checkpoint.key    (or WEIR_AUDIT_CHECKPOINT_KEY)

It keys the MAC of every ledger checkpoint and Kafka anchor (services/auditor/anchors.py); only
the auditor and `weir audit verify` read it, so a worker that holds the fingerprint key cannot
forge checkpoints. `weir audit verify` never makes one (a fresh key would vouch for nothing).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from pathlib import Path

from schemas.fingerprint import parse_key
from weir.home import weir_home

KEY_BYTES = 32
KEY_FILE = Path("secrets") / "audit-hmac.key"  # under $WEIR_HOME
CHECKPOINT_KEY_FILE = Path("secrets") / "audit-checkpoint.key"  # under $WEIR_HOME


class AuditKeyError(ValueError):
    """The key file is missing (where it may not be made), unsafe or malformed; says the fix."""


def key_file(home: Path | None = None) -> Path:
    """Where the deployment's key lives: $WEIR_HOME/secrets/audit-hmac.key."""
    return (home if home is not None else weir_home()) / KEY_FILE


def resolve_audit_key(setting: str | None, *, create: bool, home: Path | None = None) -> bytes:
    """The key bytes: WEIR_AUDIT_HMAC_KEY's value (`setting`) when given, else the key file,
    made first when `create` (services, `weir up`). Raises AuditKeyError."""
    if setting:
        return parse_key(setting)
    return _key_from_file(
        key_file(home), create, "audit key", "WEIR_AUDIT_HMAC_KEY", "the workers of this deployment make it"
    )


def checkpoint_key_file(home: Path | None = None) -> Path:
    """Where the deployment's checkpoint key lives: $WEIR_HOME/secrets/audit-checkpoint.key."""
    return (home if home is not None else weir_home()) / CHECKPOINT_KEY_FILE


def resolve_checkpoint_key(setting: str | None, *, create: bool, home: Path | None = None) -> bytes:
    """The checkpoint key bytes: WEIR_AUDIT_CHECKPOINT_KEY's value (`setting`) when given, else the
    key file, made first when `create` (the auditor, `weir up`). Raises AuditKeyError."""
    if setting:
        key = parse_key(setting)
        if len(key) < 16:
            raise AuditKeyError(
                "WEIR_AUDIT_CHECKPOINT_KEY is shorter than 16 bytes; use 32 random bytes as hex:<64 digits>"
            )
        return key
    return _key_from_file(
        checkpoint_key_file(home),
        create,
        "checkpoint key",
        "WEIR_AUDIT_CHECKPOINT_KEY",
        "the auditor of this deployment makes it",
    )


def _key_from_file(path: Path, create: bool, what: str, variable: str, who_makes_it: str) -> bytes:
    """The key in `path`, made first when `create`; AuditKeyError saying the fix when it is missing."""
    if create:
        ensure_key_file(path)
    elif not path.exists():
        raise AuditKeyError(
            f"no {what}: {variable} is not set and {path} does not exist ({who_makes_it} on its first start, "
            f"as `weir up` does; or set WEIR_HOME to that deployment's, or {variable} to its key)"
        )
    return read_key_file(path, what)


def ensure_key_file(path: Path) -> bool:
    """Make the key file at `path` unless it exists; True when this call made it."""
    if path.exists():
        return False
    folder = path.parent
    folder.mkdir(parents=True, exist_ok=True)
    if stat.S_IMODE(folder.stat().st_mode) != 0o700 and not any(folder.iterdir()):
        folder.chmod(0o700)  # a folder just made (or empty): private; an existing one is checked on read
    staging = folder / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, (secrets.token_hex(KEY_BYTES) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(staging, path)  # atomic, and never replaces a file that is there
    except FileExistsError:
        return False  # another process made it first: everyone uses that one
    finally:
        staging.unlink()
    with contextlib.suppress(OSError):  # the new name durable too
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    return True


def read_key_file(path: Path, what: str = "audit key") -> bytes:
    """The 32 key bytes of `path`, after checking that only its owner (this user) can use it;
    `what` names the key in the messages."""
    try:
        info = path.stat()
        folder = path.parent.stat()
        text = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise AuditKeyError(f"cannot read the {what} {path}: {exc}") from exc
    if info.st_uid != os.getuid():
        raise AuditKeyError(
            f"the {what} {path} belongs to uid {info.st_uid}, not to this user "
            f"(uid {os.getuid()}); run as its owner, or `chown` it"
        )
    if stat.S_IMODE(info.st_mode) & 0o077:
        raise AuditKeyError(
            f"the {what} {path} has mode {stat.S_IMODE(info.st_mode):04o}: others can read it; run `chmod 600 {path}`"
        )
    if stat.S_IMODE(folder.st_mode) & 0o022:
        raise AuditKeyError(
            f"the folder of the {what}, {path.parent}, is writable by others (mode "
            f"{stat.S_IMODE(folder.st_mode):04o}); run `chmod 700 {path.parent}`"
        )
    if len(text) != 2 * KEY_BYTES or any(c not in "0123456789abcdefABCDEF" for c in text):
        raise AuditKeyError(
            f"the {what} {path} is not {2 * KEY_BYTES} hex digits (a {KEY_BYTES}-byte key); "
            "restore it from a backup (records made with a key match only that key), or "
            "delete it to have a new one made"
        )
    return bytes.fromhex(text)
