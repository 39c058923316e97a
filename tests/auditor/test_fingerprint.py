"""The shared fingerprint contract: normalisation, keyed HMACs and key ids."""

from __future__ import annotations

import hashlib
import hmac

import pytest

from schemas.fingerprint import key_id, keyed_hmac, normalise, parse_key


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("  hello   world \n", "hello world"),
        ("a\t\tb\r\nc", "a b c"),
        ("caf\u0065\u0301", "caf\u00e9"),  # combining accent composes
        ("\ufb01ne", "fine"),  # ligature folds
        ("\uff28\uff49", "Hi"),  # full-width letters fold
        ("a\u00a0\u2003b\u3000c", "a b c"),  # NBSP, em space, ideographic space
        ("line\u2028break", "line break"),
        ("Hello", "Hello"),  # case is kept
        ("zero\u200bwidth", "zero\u200bwidth"),  # zero-width space is not whitespace
        ("", ""),
        (" \n\t ", ""),
    ],
)
def test_normalise(text: str, expected: str) -> None:
    assert normalise(text) == expected
    assert normalise(normalise(text)) == normalise(text)


def test_keyed_hmac_is_hmac_sha256_of_normalised_utf8() -> None:
    key = b"k" * 32
    expected = hmac.new(key, "déjà vu".encode(), hashlib.sha256).hexdigest()
    assert keyed_hmac(key, "  de\u0301ja\u0300 \n vu ") == expected
    assert len(expected) == 64 and expected == expected.lower()


def test_keyed_hmac_depends_on_key_and_text() -> None:
    assert keyed_hmac(b"key-one", "text") != keyed_hmac(b"key-two", "text")
    assert keyed_hmac(b"key-one", "text") != keyed_hmac(b"key-one", "Text")
    assert keyed_hmac(b"key-one", "a  b") == keyed_hmac(b"key-one", "a b")


def test_keyed_hmac_refuses_empty_key() -> None:
    with pytest.raises(ValueError, match="WEIR_AUDIT_HMAC_KEY"):
        keyed_hmac(b"", "text")


def test_key_id_is_short_stable_and_not_the_key() -> None:
    key = b"secret-key"
    assert key_id(key) == hashlib.sha256(b"weir-key-id" + key).hexdigest()[:16]
    assert len(key_id(key)) == 16
    assert key_id(key) != key_id(b"other-key")
    assert key.hex() not in key_id(key)


def test_parse_key() -> None:
    assert parse_key("hex:00ff") == b"\x00\xff"
    assert parse_key("plain text") == b"plain text"
    with pytest.raises(ValueError, match="hex"):
        parse_key("hex:zz")
