"""Who is asking: API keys (hashed records from the keys topic) and JWT bearer tokens.

An API key reads `weir_<key_id>_<secret>`. The key_id is public (it names the key in `weir keys`
and in logs); the secret is 32 random bytes, shown once at creation, and only sha256(salt ||
secret) with a per-key random salt is ever stored or published. JWTs (HS256, RS256) are checked
against a configured JWKS. Each credential becomes an Identity: principal, tenant, allowed
models, limits. Pure: no I/O here; KeyStore is fed by the gateway's keys consumer.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import jwt
import orjson

from schemas.messages import ApiKeyRecord, now_ms
from schemas.registry import split_ref
from services.gateway.guard.settings import GuardSettings
from services.gateway.openai_format import ApiError

KEY_PREFIX = "weir_"
_KEY_ID_HEX = 12
_JWT_ALGORITHMS = ("HS256", "RS256")


class GuardError(ApiError):
    """An ApiError that carries response headers (WWW-Authenticate, Retry-After)."""

    def __init__(self, status: int, message: str, *, headers: dict[str, str] | None = None, **kw: Any) -> None:
        super().__init__(status, message, **kw)
        self.headers = headers or {}


def unauthorized(message: str, code: str) -> GuardError:
    """401 in OpenAI's format (the openai client raises AuthenticationError)."""
    return GuardError(401, message, code=code, headers={"www-authenticate": 'Bearer realm="weir"'})


@dataclass(frozen=True)
class Owner:
    """Who owns a resource (a stream, a file, a batch): docs/design.md, "Ownership". Two
    identities own the same things only when tenant, kind of credential and principal all match:
    a JWT whose subject names an API key's principal is someone else, in any tenant."""

    tenant: str
    credential: str  # "key" (API key), "jwt" (bearer token) or "open" (open mode: one anonymous owner)
    principal: str


_CREDENTIAL_OF_SCOPE = {"key": "key", "sub": "jwt", "open": "open"}


def jwt_scope(tenant: str, subject: str) -> str:
    """The rate-limit scope of a JWT subject: `sub:<tenant>:<subject>`, keyed like its Owner
    (docs/design.md, "Ownership"): the same `sub` in another tenant is another principal with its
    own buckets. The tenant is percent-encoded (no `:` left in it), so no two (tenant, subject)
    pairs give one scope; an API key's scope is its key_id, which names one tenant and principal."""
    return f"sub:{quote(tenant, safe='')}:{subject}"


@dataclass(frozen=True)
class Identity:
    """Who a request is from, and what it may do."""

    principal: str
    tenant: str
    scope: str  # rate-limit scope of the credential: "key:<key_id>", "sub:<tenant>:<principal>" (jwt_scope) or "open"
    models: frozenset[str] | None = None  # None: every model
    max_requests_per_min: int | None = None
    max_tokens_per_min: int | None = None

    def may_use(self, model: str) -> bool:
        """True when this identity may call `model`, a name or the `name@version` a request is
        served by: an allowed `name` allows every version of it, an allowed `name@version` only
        that one (also when a bare `name` resolves to it; docs/gateway.md, "Model versions")."""
        return self.models is None or model in self.models or split_ref(model)[0] in self.models

    @property
    def owner(self) -> Owner:
        """The owner of what this identity creates; only the same owner may read it again."""
        return Owner(self.tenant, _CREDENTIAL_OF_SCOPE[self.scope.partition(":")[0]], self.principal)


def hash_secret(salt_hex: str, secret: str) -> str:
    """sha256(salt || secret) as hex: what a key record stores instead of the secret."""
    return hashlib.sha256(bytes.fromhex(salt_hex) + secret.encode()).hexdigest()


def new_api_key(
    principal: str,
    tenant: str,
    models: list[str] | None = None,
    max_requests_per_min: int | None = None,
    max_tokens_per_min: int | None = None,
) -> tuple[str, ApiKeyRecord]:
    """A fresh key: (the key to show once, the record to publish, which holds only its hash)."""
    key_id = secrets.token_hex(_KEY_ID_HEX // 2)
    secret = secrets.token_urlsafe(32)
    salt_hex = secrets.token_hex(16)
    record = ApiKeyRecord(
        key_id=key_id,
        principal=principal,
        tenant=tenant,
        models=sorted(set(models or [])),
        max_requests_per_min=max_requests_per_min,
        max_tokens_per_min=max_tokens_per_min,
        salt_hex=salt_hex,
        secret_sha256=hash_secret(salt_hex, secret),
    )
    return f"{KEY_PREFIX}{key_id}_{secret}", record


def revoked(record: ApiKeyRecord) -> ApiKeyRecord:
    """The record that revokes `record`'s key."""
    return record.model_copy(update={"is_revoked": True, "updated_ms": now_ms()})


def split_api_key(token: str) -> tuple[str, str] | None:
    """(key_id, secret) of a well-formed API key, else None."""
    if not token.startswith(KEY_PREFIX):
        return None
    key_id, sep, secret = token[len(KEY_PREFIX) :].partition("_")
    if not sep or len(key_id) != _KEY_ID_HEX or not secret:
        return None
    return key_id, secret


class KeyStore:
    """The latest ApiKeyRecord of every key_id, as read from the compacted keys topic."""

    def __init__(self) -> None:
        self._records: dict[str, ApiKeyRecord] = {}

    def observe(self, record: ApiKeyRecord) -> None:
        """Keep a record unless a newer one of that key is known. Revocation is final: a replayed
        or reordered older record never brings a revoked key back."""
        known = self._records.get(record.key_id)
        if known is not None and known.is_revoked and not record.is_revoked:
            return
        if known is None or record.updated_ms >= known.updated_ms or record.is_revoked:
            self._records[record.key_id] = record

    def get(self, key_id: str) -> ApiKeyRecord | None:
        """The latest record of `key_id`, revoked or not."""
        return self._records.get(key_id)

    def records(self) -> list[ApiKeyRecord]:
        """Every key's latest record, oldest key first."""
        return sorted(self._records.values(), key=lambda r: r.created_ms)

    def __len__(self) -> int:
        return len(self._records)

    def verify(self, token: str) -> Identity:
        """The Identity of an API key; raises a 401 GuardError when it is unknown, wrong or revoked."""
        parts = split_api_key(token)
        if parts is None:
            raise unauthorized("Incorrect API key provided", "invalid_api_key")
        key_id, secret = parts
        record = self._records.get(key_id)
        # Compare a hash even for an unknown key_id, so timing does not tell which ids exist.
        salt, expected = (record.salt_hex, record.secret_sha256) if record else ("00" * 16, "0" * 64)
        is_match = hmac.compare_digest(hash_secret(salt, secret), expected)
        if record is None or not is_match:
            raise unauthorized("Incorrect API key provided", "invalid_api_key")
        if record.is_revoked:
            raise unauthorized(f"API key {key_id} has been revoked", "revoked_api_key")
        return Identity(
            principal=record.principal,
            tenant=record.tenant,
            scope=f"key:{key_id}",
            models=frozenset(record.models) if record.models else None,
            max_requests_per_min=record.max_requests_per_min,
            max_tokens_per_min=record.max_tokens_per_min,
        )


def load_jwks(value: str) -> dict[str, Any]:
    """A JWKS from inline JSON or a file path; raises ValueError naming WEIR_JWT_KEYS."""
    text = value.strip()
    if not text.startswith("{"):
        path = Path(text)
        if not path.is_file():
            raise ValueError(f"WEIR_JWT_KEYS={value!r} is neither inline JSON nor a readable file")
        text = path.read_text()
    try:
        jwks = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"WEIR_JWT_KEYS is not valid JSON: {exc}") from exc
    if isinstance(jwks, dict) and "kty" in jwks:
        jwks = {"keys": [jwks]}
    if not isinstance(jwks, dict) or not isinstance(jwks.get("keys"), list) or not jwks["keys"]:
        raise ValueError('WEIR_JWT_KEYS must be a JWKS: {"keys": [{"kty": "oct" | "RSA", ...}]}')
    return jwks


class JwtVerifier:
    """Checks JWT bearer tokens (HS256, RS256) against a key set: signature, exp, nbf, iss, aud."""

    def __init__(self, jwks: dict[str, Any], settings: GuardSettings) -> None:
        self.settings = settings
        self._keys: list[jwt.PyJWK] = []
        for i, entry in enumerate(jwks["keys"]):
            try:
                key = jwt.PyJWK(entry)
            except jwt.PyJWTError as exc:
                raise ValueError(f"WEIR_JWT_KEYS key #{i}: {exc}") from exc
            if key.algorithm_name not in _JWT_ALGORITHMS:
                raise ValueError(f"WEIR_JWT_KEYS key #{i}: alg {key.algorithm_name} is not one of {_JWT_ALGORITHMS}")
            self._keys.append(key)

    def verify(self, token: str) -> Identity:
        """The Identity of a valid token; raises a 401 GuardError naming what is wrong."""
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError:
            raise unauthorized("The bearer token is neither an API key nor a JWT", "invalid_api_key") from None
        key = self._key_for(header)
        s = self.settings
        try:
            claims = jwt.decode(
                token,
                key.key,
                algorithms=[key.algorithm_name],
                audience=s.jwt_audience,
                issuer=s.jwt_issuer,
                leeway=s.jwt_leeway_s,
                options={"require": ["exp", "sub"]},
            )
        except jwt.ExpiredSignatureError:
            raise unauthorized("The token has expired", "token_expired") from None
        except jwt.ImmatureSignatureError:
            raise unauthorized("The token is not valid yet (nbf)", "token_not_yet_valid") from None
        except jwt.PyJWTError as exc:
            raise unauthorized(f"Invalid token: {exc}", "invalid_token") from None
        return self._identity(claims)

    def _key_for(self, header: dict[str, Any]) -> jwt.PyJWK:
        alg, kid = header.get("alg"), header.get("kid")
        candidates = [k for k in self._keys if k.algorithm_name == alg and (kid is None or k.key_id == kid)]
        if not candidates:
            raise unauthorized(f"No configured key verifies alg={alg} kid={kid}", "invalid_token")
        return candidates[0]

    def _identity(self, claims: dict[str, Any]) -> Identity:
        s = self.settings
        subject = claims["sub"]
        tenant = claims.get(s.jwt_tenant_claim, s.default_tenant)
        models = claims.get(s.jwt_models_claim)
        rpm, tpm = claims.get("rpm", s.jwt_max_requests_per_min), claims.get("tpm", s.jwt_max_tokens_per_min)
        if not isinstance(subject, str) or not subject or not isinstance(tenant, str) or not tenant:
            raise unauthorized(f"Token claims sub and {s.jwt_tenant_claim} must be non-empty strings", "invalid_token")
        if models is not None and not (isinstance(models, list) and all(isinstance(m, str) for m in models)):
            raise unauthorized(f"Token claim {s.jwt_models_claim} must be a list of model names", "invalid_token")
        for name, limit in (("rpm", rpm), ("tpm", tpm)):
            if limit is not None and not (isinstance(limit, int) and limit >= 1):
                raise unauthorized(f"Token claim {name} must be a positive integer", "invalid_token")
        return Identity(
            principal=subject,
            tenant=tenant,
            scope=jwt_scope(tenant, subject),
            models=frozenset(models) if models is not None else None,
            max_requests_per_min=rpm,
            max_tokens_per_min=tpm,
        )


class Authenticator:
    """Turns a request's headers into an Identity, by the configured mode."""

    def __init__(self, settings: GuardSettings, keys: KeyStore) -> None:
        self.settings = settings
        self.keys = keys
        self.jwt = JwtVerifier(load_jwks(settings.jwt_keys), settings) if settings.jwt_keys else None
        self.open_identity = Identity(principal="anonymous", tenant=settings.default_tenant, scope="open")

    @property
    def is_open(self) -> bool:
        return self.settings.auth_mode == "open"

    def authenticate(self, headers: dict[str, str]) -> Identity:
        """The Identity behind `Authorization: Bearer ...`; raises 401 when missing or invalid.

        In open mode credentials are not looked at: every request is `anonymous` of the default
        tenant.
        """
        if self.is_open:
            return self.open_identity
        scheme, _, token = headers.get("authorization", "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise unauthorized(
                "You didn't provide an API key: send `Authorization: Bearer <key or JWT>`", "missing_api_key"
            )
        if token.startswith(KEY_PREFIX):
            return self.keys.verify(token)
        if token.count(".") == 2 and self.jwt is not None:
            return self.jwt.verify(token)
        raise unauthorized("Incorrect API key provided", "invalid_api_key")

    @staticmethod
    def authorize(identity: Identity, model: str) -> None:
        """403 (PermissionDeniedError in the openai client) when `identity` may not use `model`."""
        if not identity.may_use(model):
            raise GuardError(
                403, f"{identity.principal} may not use the model {model!r}", param="model", code="model_not_allowed"
            )
