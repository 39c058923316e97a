"""The deployment `weir up` runs, recorded under $WEIR_HOME, so the other commands of that home find
it (issue 35: after `weir up --kafka-port 9292`, `weir models list` used 127.0.0.1:9092, another
stack's broker if any).

    $WEIR_HOME/deployment.json   {"bootstrap", "topic_prefix", "security", "pid", "gateways", "state"}

`weir up` writes it as soon as it has chosen its broker, prefix and security, before any service
starts (`state: "starting"`: a start takes a minute or more, and a command run meanwhile must not
go to 127.0.0.1:9092, another stack's broker, and say "no models registered"), rewrites it with
`state: "up"` once Kafka and its services are ready, and removes it when it stops. A command
that talks to a deployment (`weir models`, `weir topics create`, `weir keys`, `weir usage`, ...)
reads it for what neither a flag nor the environment says: WEIR_KAFKA_BOOTSTRAP, WEIR_TOPIC_PREFIX
and, on a secure deployment, WEIR_KAFKA_SECURITY=sasl with WEIR_KAFKA_USER=admin (the operator's
login: whoever can read $WEIR_HOME/secrets holds it anyway). Explicit flags and variables always
win. A record whose `weir up` is no longer running (killed before it could remove it) is ignored,
with a line that says so. The services never read it: `weir up` and compose give them their
settings.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

from weir.home import weir_home

FILE = "deployment.json"
# The settings a recorded deployment supplies, as the variables every command already reads.
VARIABLES = {"bootstrap": "WEIR_KAFKA_BOOTSTRAP", "topic_prefix": "WEIR_TOPIC_PREFIX"}
# A record's `state`: written "starting" before the services start, "up" once they are ready.
STARTING, UP = "starting", "up"
STATES = (STARTING, UP)


def path(home: Path | None = None) -> Path:
    return (home if home is not None else weir_home()) / FILE


def record(
    bootstrap: str,
    topic_prefix: str,
    secure: bool,
    gateways: list[str],
    home: Path | None = None,
    state: str = UP,
) -> Path:
    """Write this process's deployment in `state` (atomically: a reader never sees half a file); returns where."""
    if state not in STATES:
        raise ValueError(f"a deployment's state is one of {STATES}, not {state!r}")
    target = path(home)
    target.parent.mkdir(parents=True, exist_ok=True)
    body = {
        "bootstrap": bootstrap,
        "topic_prefix": topic_prefix,
        "security": "sasl" if secure else "plaintext",
        "pid": os.getpid(),
        "gateways": gateways,
        "state": state,
    }
    partial = target.with_name(f".{FILE}.{os.getpid()}")
    partial.write_text(json.dumps(body, indent=1) + "\n")
    partial.replace(target)
    return target


def forget(home: Path | None = None) -> None:
    """Remove the record if it is this process's (a later `weir up` of the same home may own it now)."""
    target = path(home)
    try:
        if json.loads(target.read_text()).get("pid") == os.getpid():
            target.unlink()
    except (OSError, ValueError):
        pass


def _alive(pid: object) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def load(home: Path | None = None) -> dict[str, Any] | None:
    """The recorded deployment, starting or up, or None when there is none, it is unreadable, or its
    `weir up` is gone (then a line on stderr says so). A record without `state` (written before it
    existed) is one that is up."""
    target = path(home)
    try:
        body = json.loads(target.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        print(f"weir: ignoring {target}: {exc}", file=sys.stderr)
        return None
    if not isinstance(body, dict) or not isinstance(body.get("bootstrap"), str):
        print(f"weir: ignoring {target}: not a record of `weir up`", file=sys.stderr)
        return None
    body.setdefault("state", UP)
    if body["state"] not in STATES:
        print(f"weir: ignoring {target}: unknown state {body['state']!r}", file=sys.stderr)
        return None
    if not _alive(body.get("pid")):
        print(
            f"weir: ignoring {target}: the `weir up` that wrote it (pid {body.get('pid')}) is not running",
            file=sys.stderr,
        )
        return None
    return body


def apply(
    env: MutableMapping[str, str] | None = None, home: Path | None = None, body: dict[str, Any] | None = None
) -> dict[str, str]:
    """Fill in `env` (default os.environ) from the recorded deployment (`body` when the caller
    loaded it, else `load(home)`) where it says nothing; returns what was filled in (nothing
    without a record)."""
    env = os.environ if env is None else env
    body = load(home) if body is None else body
    if body is None:
        return {}
    filled = {var: str(body[key]) for key, var in VARIABLES.items() if body.get(key) and not env.get(var)}
    if body.get("security") == "sasl" and not env.get("WEIR_KAFKA_SECURITY"):
        filled["WEIR_KAFKA_SECURITY"] = "sasl"
        if not env.get("WEIR_KAFKA_USER"):
            filled["WEIR_KAFKA_USER"] = "admin"  # weir/kafka/security.py: ADMIN, the operator's login
    env.update(filled)
    return filled


def export_line(bootstrap: str, topic_prefix: str, secure: bool, home: Path | None = None) -> str:
    """The shell line that points another terminal's commands (and any Kafka tool) at this deployment."""
    line = (
        f"export WEIR_HOME={home if home is not None else weir_home()} WEIR_KAFKA_BOOTSTRAP={bootstrap} "
        f"WEIR_TOPIC_PREFIX={topic_prefix}"
    )
    return line + (" WEIR_KAFKA_SECURITY=sasl WEIR_KAFKA_USER=admin" if secure else "")
