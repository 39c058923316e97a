"""Ed25519 signatures of model manifests (docs/design.md, "The model registry", invariant 10).

A signature covers ModelManifest.canonical(): every file's sha256 and size, the format, the
location and the serving settings, so a manifest changed after signing (another file, another
engine) no longer verifies. Keys are PEM files:

    weir models keygen --private signer.key --public signer.pub     (private key: mode 0600)

A worker trusts the public keys in WEIR_MODEL_TRUSTED_KEYS (a directory of *.pub files) and, with
WEIR_REQUIRE_SIGNED_MODELS=true, refuses an unsigned manifest; it always refuses one signed by a
key it does not trust or whose signature does not verify (signature_problem). A key is named by
its key_id: the first 16 hex digits of the sha256 of its raw 32 bytes.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from schemas.registry import ManifestSignature, ModelManifest, ModelVersionRecord

PUBLIC_SUFFIX = ".pub"


class SigningError(ValueError):
    """A key file that cannot be made, read or used; the message names the file."""


def key_id(public_key: Ed25519PublicKey) -> str:
    """The first 16 hex digits of sha256(raw public key): how a signature names its key."""
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def _write_new(path: Path, data: bytes, mode: int) -> None:
    """Write `path`, which must not exist, with `mode` from its creation on (no window in which
    another user could read a private key)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as out:
        out.write(data)


def generate_keypair(private_path: Path, public_path: Path) -> str:
    """Make a new Ed25519 key pair into two PEM files (the private one mode 0600); refuses to
    overwrite either file. Returns the key_id."""
    private_path, public_path = Path(private_path), Path(public_path)
    for path in (private_path, public_path):
        if path.exists():
            raise SigningError(f"{path} exists; refusing to overwrite a key file (remove it or pick another name)")
    if private_path.resolve() == public_path.resolve():
        raise SigningError(f"the private and public key files must differ ({private_path})")
    private = Ed25519PrivateKey.generate()
    public = private.public_key()
    pem_private = private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                        serialization.NoEncryption())
    pem_public = public.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    try:
        _write_new(private_path, pem_private, 0o600)
        _write_new(public_path, pem_public, 0o644)
    except OSError as exc:
        raise SigningError(f"cannot write the key pair: {exc}") from exc
    return key_id(public)


def _load_private(path: Path) -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise SigningError(f"cannot read the private key {path}: {exc}") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise SigningError(f"{path} is not an Ed25519 private key (make one with `weir models keygen`)")
    return key


def _load_public(path: Path) -> Ed25519PublicKey:
    try:
        key = serialization.load_pem_public_key(path.read_bytes())
    except (OSError, ValueError, TypeError) as exc:
        raise SigningError(f"cannot read the public key {path}: {exc}") from exc
    if not isinstance(key, Ed25519PublicKey):
        raise SigningError(f"{path} is not an Ed25519 public key")
    return key


def sign(manifest: ModelManifest, private_key_path: Path) -> ManifestSignature:
    """The signature of `manifest` by the key in `private_key_path`."""
    private = _load_private(Path(private_key_path))
    return ManifestSignature(key_id=key_id(private.public_key()), signature_hex=private.sign(manifest.canonical()).hex())


def load_trusted_keys(directory: Path) -> dict[str, Ed25519PublicKey]:
    """Every *.pub PEM file in `directory`, by key_id; SigningError naming a file that is not
    an Ed25519 public key, or a directory that does not exist."""
    directory = Path(directory)
    if not directory.is_dir():
        raise SigningError(f"trusted keys directory {directory} does not exist")
    keys: dict[str, Ed25519PublicKey] = {}
    for path in sorted(directory.glob(f"*{PUBLIC_SUFFIX}")):
        key = _load_public(path)
        keys[key_id(key)] = key
    return keys


def signature_problem(record: ModelVersionRecord, trusted: dict[str, Ed25519PublicKey], required: bool) -> str | None:
    """Why the worker must not load `record` for its signature, or None: fine when unsigned and
    signatures are not required, or signed by a trusted key with a valid signature. A signature
    that cannot be checked (unknown key) is refused even when not required: it claims an origin
    that this worker cannot confirm."""
    signature = record.signature
    if signature is None:
        return "unsigned manifest, signatures are required" if required else None
    public = trusted.get(signature.key_id)
    if public is None:
        return f"signed by unknown key {signature.key_id}"
    try:
        public.verify(bytes.fromhex(signature.signature_hex), record.manifest.canonical())
    except InvalidSignature:
        return "bad signature: the manifest was changed after signing"
    return None
