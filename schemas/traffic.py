"""Traffic policies (docs/design.md, "Traffic policies"): which version of a name serves a request,
and which versions receive a mirrored copy of it. Pure: the same inputs give the same answer in
the gateway and in the batcher, on every replica.

A name's ModelRoute (schemas/registry.py) holds its default version, canary versions with their
share of requests in percent (`canary`), and mirror versions with the share of requests each
receives a copy of (`mirror`). Assignment is sticky: a request's key (its `user` field, else its
principal, else its request id) is hashed with the name into one of 10,000 buckets; the canaries
take consecutive ranges of buckets in version order and the default takes the rest, so one user
sees one version for as long as the policy holds, and a change of weights moves only the users
whose bucket changes hands. Mirroring is decided per request (hash of the request id, another
salt), so P% of requests are copied whoever sends them.
"""

from __future__ import annotations

import hashlib
from typing import Literal

Assignment = Literal["default", "canary", "pinned", "mirror"]
BUCKETS = 10_000


def assignment_key(user: str | None, principal: str | None, request_id: str) -> str:
    """What sticks a request to a version: the `user` field, else the principal, else the request id."""
    if user:
        return f"user:{user}"
    if principal and principal != "anonymous":
        return f"principal:{principal}"
    return f"request:{request_id}"


def bucket(salt: str, name: str, key: str) -> int:
    """A stable bucket in [0, BUCKETS) for `key` under model `name` (blake2b, not Python's hash)."""
    digest = hashlib.blake2b(f"{salt}\0{name}\0{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % BUCKETS


def assign(name: str, default_version: str, canary: dict[str, float], key: str) -> tuple[str, Assignment]:
    """(version, "default" | "canary") for a request of `name` with assignment key `key`."""
    b = bucket("assign", name, key)
    edge = 0
    for version in sorted(canary):
        edge += round(canary[version] * BUCKETS / 100)
        if b < edge:
            return version, "canary"
    return default_version, "default"


def mirrors(name: str, mirror: dict[str, float], request_id: str) -> list[str]:
    """The versions that receive a copy of request `request_id` (each mirror's share decided alone)."""
    b = bucket("mirror", name, request_id)
    return [v for v in sorted(mirror) if b < round(mirror[v] * BUCKETS / 100)]
