"""The keyed green-list watermark (Kirchenbauer et al., 2023): shared by the worker and the auditor.

At each generation step the vocabulary is split by a key and the previous token: a token t is
green when mix(seed(key, prev), t) < gamma * 2^64, so a fraction gamma of the vocabulary is green,
a different fraction at every step and unpredictable without the key. The worker adds `delta` to
the green logits before sampling (services/worker/engine/sampler.py); the detector counts green tokens in
a text and computes the one-proportion z-score against gamma:

    z = (num_green - gamma * T) / sqrt(T * gamma * (1 - gamma)),   p = P(N(0,1) > z)

over the T scored tokens (each token after the first, a repeated (prev, token) pair scored once,
so a text that repeats itself cannot inflate z). Membership is a keyed hash per token, so the
detector needs no vocabulary-sized work and no torch.

Changing `green_mask` changes every watermark: bump WATERMARK_VERSION when it does.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from dataclasses import dataclass

import numpy as np
import orjson

WATERMARK_VERSION = 1

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


@dataclass(frozen=True)
class WatermarkConfig:
    """A tenant's watermark: green fraction gamma, logit bias delta, and the secret key."""

    gamma: float
    delta: float
    key: bytes

    def __post_init__(self) -> None:
        if not 0.0 < self.gamma < 1.0:
            raise ValueError(f"watermark gamma={self.gamma} must be in (0, 1)")
        if self.delta < 0:
            raise ValueError(f"watermark delta={self.delta} must be >= 0")
        if not self.key:
            raise ValueError("watermark key is empty")


def parse_tenants(text: str) -> dict[str, WatermarkConfig]:
    """WEIR_WATERMARK_TENANTS: JSON {tenant: {"gamma": .25, "delta": 2.0, "key": "..."}}; "" is none.

    The key is text, or "hex:<digits>" (as WEIR_AUDIT_HMAC_KEY). ValueError naming the setting.
    """
    if not text.strip():
        return {}
    try:
        raw = orjson.loads(text)
        return {
            str(tenant): WatermarkConfig(
                float(v.get("gamma", 0.25)), float(v.get("delta", 2.0)), parse_key(str(v["key"]))
            )
            for tenant, v in raw.items()
        }
    except (orjson.JSONDecodeError, AttributeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(
            f'WEIR_WATERMARK_TENANTS must be JSON {{tenant: {{"gamma", "delta", "key"}}}}: {exc!r}'
        ) from exc


def parse_key(value: str) -> bytes:
    """Key bytes of a setting: "hex:<digits>" is hex, anything else UTF-8."""
    return bytes.fromhex(value[4:]) if value.startswith("hex:") else value.encode("utf-8")


def _seed(key: bytes, prev_token: int) -> np.uint64:
    digest = hashlib.blake2b(prev_token.to_bytes(8, "little", signed=True), key=key[:64], digest_size=8).digest()
    return np.uint64(int.from_bytes(digest, "little"))


def _mix(seed: np.uint64, token_ids: np.ndarray) -> np.ndarray:
    # splitmix64 of seed + t * golden: a keyed, uniform 64-bit value per token (uint64 wraps)
    x = token_ids.astype(np.uint64) * _GOLDEN + seed
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def _threshold(gamma: float) -> np.uint64:
    return np.uint64(min(int(gamma * 2.0**64), 2**64 - 1))


def green_mask(config: WatermarkConfig, prev_token: int, vocab_size: int) -> np.ndarray:
    """bool[vocab_size]: which tokens are green after `prev_token`."""
    with np.errstate(over="ignore"):
        return _mix(_seed(config.key, prev_token), np.arange(vocab_size)) < _threshold(config.gamma)


def is_green(config: WatermarkConfig, prev_token: int, token: int) -> bool:
    """Whether `token` is green after `prev_token` (the same answer as green_mask)."""
    with np.errstate(over="ignore"):
        return bool(_mix(_seed(config.key, prev_token), np.array([token]))[0] < _threshold(config.gamma))


@dataclass(frozen=True)
class Detection:
    """The detector's verdict over one token sequence."""

    num_tokens: int
    num_scored: int
    num_green: int
    z_score: float
    p_value: float

    def as_dict(self) -> dict[str, float | int]:
        return {
            "num_tokens": self.num_tokens,
            "num_scored": self.num_scored,
            "num_green": self.num_green,
            "z_score": self.z_score,
            "p_value": self.p_value,
        }


def detect(config: WatermarkConfig, token_ids: list[int]) -> Detection:
    """z-score and one-sided p-value that `token_ids` carry this watermark.

    The first token has no previous token and is not scored; a repeated (prev, token) pair is
    scored once. With fewer than 1 scored token z is 0 and p is 1.
    """
    pairs = list(dict.fromkeys(itertools.pairwise(token_ids)))
    num_green = sum(is_green(config, prev, tok) for prev, tok in pairs)
    n, g = len(pairs), config.gamma
    if n == 0:
        return Detection(len(token_ids), 0, 0, 0.0, 1.0)
    z = (num_green - g * n) / math.sqrt(n * g * (1 - g))
    return Detection(len(token_ids), n, num_green, z, 0.5 * math.erfc(z / math.sqrt(2)))
