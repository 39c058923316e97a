"""Kafka's own security for one deployment: SASL/SCRAM-SHA-512 principals, their passwords, and
the ACLs of each (docs/design.md, "The Kafka trust boundary"; docs/kafka.md, "Secure mode").

Every principal's password is made once, at random, into

    $WEIR_HOME/secrets/kafka/<user>.password    64 hex digits, mode 0600, folder 0700

and never appears in the code, on a command line, or in a log. The broker's own logins (its
super user `admin`, and `controller`, its SASL/PLAIN login to its KRaft controller: KRaft cannot
use SCRAM on the controller listener, since the SCRAM credentials live in the metadata that
listener serves) are kept the same way.

A client of Weir (a service, a CLI, an outside producer) turns SASL on with

    WEIR_KAFKA_SECURITY=sasl  WEIR_KAFKA_USER=<user>  [WEIR_KAFKA_PASSWORD_FILE=<file>]

(the file defaults to that user's file above). With WEIR_KAFKA_SECURITY unset or `plaintext`
clients connect without credentials, as to the default local broker; a user or password file
given then is refused rather than ignored.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from schemas import access
from schemas.topics import Topics
from weir.audit_key import ensure_key_file
from weir.home import weir_home

MECHANISM = "SCRAM-SHA-512"
ADMIN = "admin"  # super user: the launcher, topic creation, ACLs, `weir kafka user add`
CONTROLLER = "controller"  # the broker's login to its own KRaft controller (SASL/PLAIN)
SERVICES = access.SERVICES
DEFAULT_CLIENT = "client"  # the outside producer every secure broker is formatted with
# Names an outside producer may not take: the broker's and the services' principals, and `job`,
# whose reply-topic prefix (<prefix>.replies.job.) is the batch jobs' namespace.
RESERVED_USERS = frozenset({ADMIN, CONTROLLER, *SERVICES, "job", "ANONYMOUS"})
# No dot: a client's reply topics are <prefix>.replies.<user>.<anything>, and the dot ends its
# prefix, so no user's prefix contains another's.
_USER_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")
SECURITY_MODES = ("plaintext", "sasl")
SCRAM_ITERATIONS = 8192  # Kafka accepts 4096..16384 for SCRAM-SHA-512


class KafkaSecurityError(ValueError):
    """A setting, name or secret file that secure mode cannot use; the message says the fix."""


def secrets_dir(home: Path | None = None) -> Path:
    """$WEIR_HOME/secrets/kafka: one password file per principal."""
    return (home if home is not None else weir_home()) / "secrets" / "kafka"


def password_path(user: str, folder: Path) -> Path:
    return folder / f"{user}.password"


def check_user_name(name: str) -> str:
    """`name` when an outside producer may have it; else KafkaSecurityError."""
    if not _USER_NAME.fullmatch(name):
        raise KafkaSecurityError(
            f"{name!r} is not a Kafka user name Weir makes: 1-63 of a-z 0-9 _ -, "
            "starting with a letter or digit (no dots: a dot ends the reply-topic prefix)"
        )
    if name in RESERVED_USERS:
        raise KafkaSecurityError(f"{name!r} is reserved (one of {', '.join(sorted(RESERVED_USERS))})")
    return name


def ensure_password(user: str, folder: Path) -> str:
    """The password of `user` in `folder`, made first (random, 0600) when there is none."""
    folder.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    folder.mkdir(mode=0o700, exist_ok=True)
    ensure_key_file(password_path(user, folder))  # atomic, never overwrites: see weir/audit_key.py
    return read_password(password_path(user, folder))


def read_password(path: Path) -> str:
    """The password in `path`, after checking that only its owner (this user) can read it."""
    try:
        info = path.stat()
        text = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise KafkaSecurityError(f"cannot read the Kafka password file {path}: {exc}") from exc
    if info.st_uid != os.getuid():
        raise KafkaSecurityError(f"the Kafka password file {path} belongs to uid {info.st_uid}, not to this user")
    if stat.S_IMODE(info.st_mode) & 0o077:
        raise KafkaSecurityError(
            f"the Kafka password file {path} has mode {stat.S_IMODE(info.st_mode):04o}: "
            f"others can read it; run `chmod 600 {path}`"
        )
    if not text or any(c.isspace() or c in "\"'\\;" for c in text):
        raise KafkaSecurityError(f"the Kafka password file {path} is empty or holds a space, quote or ';'")
    return text


@dataclass(frozen=True)
class Credentials:
    """One principal's SCRAM login, as aiokafka and FastStream take it."""

    user: str
    password: str = field(repr=False)

    def client_options(self) -> dict[str, Any]:
        """aiokafka producer/consumer/admin keyword arguments (SASL without TLS: loopback only)."""
        return {
            "security_protocol": "SASL_PLAINTEXT",
            "sasl_mechanism": MECHANISM,
            "sasl_plain_username": self.user,
            "sasl_plain_password": self.password,
        }


def client_credentials(
    mode: str, user: str | None, password_file: Path | str | None, home: Path | None = None
) -> Credentials | None:
    """The credentials these settings name; None for `plaintext`. KafkaSecurityError when they
    are inconsistent (a user without `sasl`, `sasl` without a user) or the file is unusable."""
    if mode not in SECURITY_MODES:
        raise KafkaSecurityError(f"WEIR_KAFKA_SECURITY={mode!r}: use one of {', '.join(SECURITY_MODES)}")
    if mode == "plaintext":
        if user or password_file:
            raise KafkaSecurityError(
                "WEIR_KAFKA_USER or WEIR_KAFKA_PASSWORD_FILE is set but WEIR_KAFKA_SECURITY "
                "is not `sasl`: set WEIR_KAFKA_SECURITY=sasl, or unset them"
            )
        return None
    if not user:
        raise KafkaSecurityError(
            "WEIR_KAFKA_SECURITY=sasl needs WEIR_KAFKA_USER (gateway, batcher, worker, "
            "auditor, admin, or a user from `weir kafka user add`)"
        )
    path = Path(password_file) if password_file else password_path(user, secrets_dir(home))
    return Credentials(user, read_password(path))


def client_options_from_env(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """aiokafka keyword arguments from WEIR_KAFKA_SECURITY, WEIR_KAFKA_USER, WEIR_KAFKA_PASSWORD_FILE
    ({} for a plaintext deployment)."""
    env = os.environ if env is None else env
    creds = client_credentials(
        env.get("WEIR_KAFKA_SECURITY", "plaintext") or "plaintext",
        env.get("WEIR_KAFKA_USER") or None,
        env.get("WEIR_KAFKA_PASSWORD_FILE") or None,
    )
    return creds.client_options() if creds else {}


def salted_password(password: str, salt: bytes, iterations: int = SCRAM_ITERATIONS) -> bytes:
    """RFC 5802's SaltedPassword (Hi) for SCRAM-SHA-512: what the broker derives its keys from."""
    return hashlib.pbkdf2_hmac("sha512", password.encode(), salt, iterations)


def new_salt() -> bytes:
    return secrets.token_bytes(32)


# --- ACLs ----------------------------------------------------------------------------------------

# Kafka's protocol codes (org.apache.kafka.common.acl / resource).
RESOURCE_TYPES = {"topic": 2, "group": 3}
PATTERN_TYPES = {"literal": 3, "prefixed": 4}
OPERATIONS = {"read": 3, "write": 4, "create": 5, "describe": 8}
ALLOW = 3


@dataclass(frozen=True)
class Grant:
    """ALLOW `operations` on one resource pattern to User:`user`, from any host."""

    user: str
    resource: str  # "topic" | "group"
    name: str
    pattern: str  # "literal" | "prefixed"
    operations: tuple[str, ...]


def _grants(user: str, resource: str, pattern: str, operations: tuple[str, ...], names: list[str]) -> list[Grant]:
    return [Grant(user, resource, name, pattern, operations) for name in names]


# Reply-topic prefixes, built with Topics' own naming (docs/design.md, invariant 2):
# Topics.reply_namespace is "<prefix>.replies.", the namespace of every reply topic.
def gateway_reply_prefix(topics: Topics) -> str:
    """Gateway reply topics: <prefix>.replies.gateway-<id> (its WEIR_GATEWAY_ID must start `gateway-`)."""
    return topics.replies("gateway-")


def client_reply_prefix(topics: Topics, user: str) -> str:
    """An outside producer's reply topics (and consumer groups): <prefix>.replies.<user>.<anything>."""
    return topics.producer_replies(user)


def service_grants(topics: Topics) -> list[Grant]:
    """Each service's ACLs, exactly what it declares it uses in `schemas/access.py` (the topics and
    prefixes it reads, writes and creates, its consumer groups), and DESCRIBE on the deployment's
    core topics and batch topics (every service checks at start that they exist). Nothing here is
    written by hand: a service that starts using a topic declares it there, and tests/schemas/
    test_access.py fails when its code names one it does not declare. docs/kafka.md, "Secure mode",
    has the table."""
    core = [spec.name for spec in topics.core_specs()]
    grants: list[Grant] = []
    for user in SERVICES:
        grants += _grants(user, "topic", "literal", ("describe",), core)
        grants += _grants(user, "topic", "prefixed", ("describe",), [topics.batches("")])
        for use in access.uses(user):
            grants.append(
                Grant(user, use.resource, use.name(topics), "prefixed" if use.prefixed else "literal", use.operations)
            )
    return grants


def client_grants(topics: Topics, user: str) -> list[Grant]:
    """An outside producer: writes its own request topic only (<prefix>.requests.<user>, where the
    batcher binds each request to it: schemas/producers.py), not the shared requests topic; reads,
    creates and names only its own reply topics (and consumer groups) under client_reply_prefix.
    Nothing else: no control, keys, usage, audit, dead letters, nor anyone else's replies."""
    check_user_name(user)
    prefix = client_reply_prefix(topics, user)
    return [
        Grant(user, "topic", topics.producer_requests(user), "literal", ("write", "describe")),
        Grant(user, "topic", prefix, "prefixed", ("read", "create", "describe")),
        Grant(user, "group", prefix, "prefixed", ("read",)),
    ]


def acl_creations(grants: list[Grant]) -> list[tuple[int, str, int, str, str, int, int]]:
    """CreateAcls v1 entries: (resource type, name, pattern type, principal, host, operation, permission)."""
    return [
        (RESOURCE_TYPES[g.resource], g.name, PATTERN_TYPES[g.pattern], f"User:{g.user}", "*", OPERATIONS[op], ALLOW)
        for g in grants
        for op in g.operations
    ]
