"""API keys and JWTs become Identities; anything else is a 401 naming why (no broker needed)."""

from __future__ import annotations

import base64
import time
from typing import Any

import jwt
import orjson
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa

from services.gateway.guard.auth import (
    Authenticator,
    GuardError,
    KeyStore,
    Owner,
    hash_secret,
    jwt_scope,
    load_jwks,
    new_api_key,
    revoked,
    split_api_key,
)
from services.gateway.guard.settings import GuardSettings

HS_SECRET = b"a-test-secret-of-at-least-32-bytes!!"


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


@pytest.fixture(scope="module")
def rsa_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def jwks_of(rsa_key: rsa.RSAPrivateKey) -> dict[str, Any]:
    public = jwt.algorithms.RSAAlgorithm.to_jwk(rsa_key.public_key(), as_dict=True)
    return {
        "keys": [
            {"kty": "oct", "k": b64url(HS_SECRET), "kid": "hs", "alg": "HS256"},
            {**public, "kid": "rs", "alg": "RS256", "use": "sig"},
        ]
    }


def auth_of(rsa_key: rsa.RSAPrivateKey, keys: KeyStore | None = None, **settings: Any) -> Authenticator:
    s = GuardSettings(
        jwt_keys=orjson.dumps(jwks_of(rsa_key)).decode(), jwt_issuer="weir-tests", jwt_audience="weir", **settings
    )
    return Authenticator(s, keys or KeyStore())


def token(key: Any, alg: str, kid: str, **claims: Any) -> str:
    now = int(time.time())
    body = {"sub": "svc-a", "tenant": "acme", "iss": "weir-tests", "aud": "weir", "exp": now + 60, **claims}
    return jwt.encode({k: v for k, v in body.items() if v is not None}, key, algorithm=alg, headers={"kid": kid})


def bearer(value: str) -> dict[str, str]:
    return {"authorization": f"Bearer {value}"}


def test_a_new_key_is_stored_only_hashed_and_verifies() -> None:
    key, record = new_api_key("alice", "acme", ["echo"], 60, 1000)
    key_id, secret = split_api_key(key) or ("", "")
    assert key_id == record.key_id and secret not in record.model_dump_json()
    assert record.secret_sha256 == hash_secret(record.salt_hex, secret)
    other_key, other = new_api_key("alice", "acme")
    assert other.salt_hex != record.salt_hex  # per-key salt
    store = KeyStore()
    store.observe(record)
    identity = store.verify(key)
    assert (identity.principal, identity.tenant, identity.scope) == ("alice", "acme", f"key:{key_id}")
    assert identity.may_use("echo") and not identity.may_use("weir-tiny-py")
    assert (identity.max_requests_per_min, identity.max_tokens_per_min) == (60, 1000)
    with pytest.raises(GuardError) as unknown:
        store.verify(other_key)
    assert (unknown.value.status, unknown.value.code) == (401, "invalid_api_key")


@pytest.mark.parametrize(
    "mangle",
    [
        lambda k: k[:-1] + ("A" if k[-1] != "A" else "B"),
        lambda k: k + "x",
        lambda k: k.replace("weir_", "weir-"),
        lambda k: "weir_short_x",
    ],
)
def test_a_tampered_key_is_refused(mangle: Any) -> None:
    key, record = new_api_key("alice", "acme")
    store = KeyStore()
    store.observe(record)
    with pytest.raises(GuardError) as refused:
        store.verify(mangle(key))
    assert refused.value.status == 401 and refused.value.headers["www-authenticate"].startswith("Bearer")


def test_revocation_wins_and_an_old_record_does_not_undo_it() -> None:
    key, record = new_api_key("alice", "acme")
    store = KeyStore()
    store.observe(record)
    gone = revoked(record)
    store.observe(gone)
    store.observe(record)  # a replay of the older record
    with pytest.raises(GuardError) as refused:
        store.verify(key)
    assert refused.value.code == "revoked_api_key"


def test_required_mode_needs_a_bearer_and_open_mode_ignores_it(rsa_key: rsa.RSAPrivateKey) -> None:
    auth = auth_of(rsa_key)
    for headers in ({}, {"authorization": "Basic abc"}, bearer(""), bearer("sk-something")):
        with pytest.raises(GuardError) as refused:
            auth.authenticate(headers)
        assert refused.value.status == 401
    assert GuardSettings().auth_mode == "required"  # the default
    open_auth = Authenticator(GuardSettings(auth_mode="open"), KeyStore())
    identity = open_auth.authenticate(bearer("anything"))
    assert (identity.principal, identity.tenant, identity.models) == ("anonymous", "default", None)


def test_jwt_hs256_and_rs256_are_accepted(rsa_key: rsa.RSAPrivateKey) -> None:
    auth = auth_of(rsa_key)
    hs = auth.authenticate(bearer(token(HS_SECRET, "HS256", "hs", models=["echo"])))
    assert (hs.principal, hs.tenant, hs.scope, hs.models) == ("svc-a", "acme", "sub:acme:svc-a", frozenset({"echo"}))
    rs = auth.authenticate(bearer(token(rsa_key, "RS256", "rs", sub="svc-b", tenant="beta", rpm=7)))
    assert (rs.principal, rs.tenant, rs.models, rs.max_requests_per_min) == ("svc-b", "beta", None, 7)


def test_a_jwt_subjects_limit_scope_is_keyed_by_its_tenant_like_its_owner(rsa_key: rsa.RSAPrivateKey) -> None:
    auth = auth_of(rsa_key)
    globex = auth.authenticate(bearer(token(HS_SECRET, "HS256", "hs", sub="zed", tenant="globex")))
    acme = auth.authenticate(bearer(token(HS_SECRET, "HS256", "hs", sub="zed", tenant="acme")))
    assert globex.scope != acme.scope and globex.owner != acme.owner
    assert (globex.scope, acme.scope) == ("sub:globex:zed", "sub:acme:zed")
    # A tenant or subject with the separator in it cannot make another pair's scope.
    assert jwt_scope("a:b", "c") != jwt_scope("a", "b:c")
    assert jwt_scope("a%3Ab", "c") != jwt_scope("a:b", "c")


@pytest.mark.parametrize(
    ("claims", "code"),
    [
        ({"exp": int(time.time()) - 3600}, "token_expired"),
        ({"nbf": int(time.time()) + 3600}, "token_not_yet_valid"),
        ({"iss": "someone-else"}, "invalid_token"),
        ({"aud": "other"}, "invalid_token"),
        ({"exp": None}, "invalid_token"),
        ({"models": "echo"}, "invalid_token"),
    ],
)
def test_bad_jwts_are_401(rsa_key: rsa.RSAPrivateKey, claims: dict[str, Any], code: str) -> None:
    with pytest.raises(GuardError) as refused:
        auth_of(rsa_key).authenticate(bearer(token(HS_SECRET, "HS256", "hs", **claims)))
    assert (refused.value.status, refused.value.code) == (401, code)


def test_a_jwt_signed_with_another_key_or_alg_is_refused(rsa_key: rsa.RSAPrivateKey) -> None:
    auth = auth_of(rsa_key)
    other = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    for forged in (token(other, "RS256", "rs"), token(b"x" * 40, "HS256", "hs"), token(HS_SECRET, "HS512", "hs")):
        with pytest.raises(GuardError) as refused:
            auth.authenticate(bearer(forged))
        assert refused.value.status == 401


def test_jwks_from_a_file_and_bad_values(tmp_path: Any, rsa_key: rsa.RSAPrivateKey) -> None:
    path = tmp_path / "jwks.json"
    path.write_bytes(orjson.dumps(jwks_of(rsa_key)))
    assert len(load_jwks(str(path))["keys"]) == 2
    with pytest.raises(ValueError, match="WEIR_JWT_KEYS"):
        load_jwks(str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="WEIR_JWT_KEYS"):
        load_jwks('{"keys": []}')


def test_a_model_outside_the_identity_is_403() -> None:
    key, record = new_api_key("alice", "acme", ["weir-tiny-py"])
    store = KeyStore()
    store.observe(record)
    with pytest.raises(GuardError) as refused:
        Authenticator.authorize(store.verify(key), "echo")
    assert (refused.value.status, refused.value.code, refused.value.param) == (403, "model_not_allowed", "model")


def test_an_owner_is_tenant_kind_of_credential_and_principal(rsa_key: rsa.RSAPrivateKey) -> None:
    auth = auth_of(rsa_key)
    key, record = new_api_key("svc-a", "acme")
    other_key, other_record = new_api_key("svc-a", "acme")  # a second key of the same principal
    for each in (record, other_record):
        auth.keys.observe(each)
    by_key = auth.authenticate(bearer(key)).owner
    assert by_key == Owner("acme", "key", "svc-a") == auth.authenticate(bearer(other_key)).owner
    by_jwt = auth.authenticate(bearer(token(HS_SECRET, "HS256", "hs"))).owner  # sub svc-a, tenant acme
    assert by_jwt == Owner("acme", "jwt", "svc-a") != by_key
    other_tenant = auth.authenticate(bearer(token(rsa_key, "RS256", "rs", sub="svc-a", tenant="beta"))).owner
    assert other_tenant == Owner("beta", "jwt", "svc-a") != by_jwt
    open_auth = Authenticator(GuardSettings(auth_mode="open"), KeyStore())
    assert open_auth.authenticate({}).owner == Owner("default", "open", "anonymous")
