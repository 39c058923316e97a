"""The worker's side of the green-list watermark: per-tenant logit bias, cached per previous token.

The split itself is schemas/watermark.py (shared with the auditor's detector). Each step of a
watermarked request adds `delta` to the green logits; a mask depends only on (tenant, previous
token), so masks are cached (LRU) and most steps cost one dictionary lookup.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from schemas.watermark import WatermarkConfig, detect, green_mask


class Watermarker:
    """Bias vectors for the tenants that have a watermark; others get None (no watermark)."""

    def __init__(self, tenants: dict[str, WatermarkConfig], max_cached: int = 4096) -> None:
        self.tenants = tenants
        self.max_cached = max_cached
        self._cache: OrderedDict[tuple[str, int, int], torch.Tensor] = OrderedDict()

    def bias(self, tenant: str, prev_token: int, vocab_size: int) -> torch.Tensor | None:
        """float32 [vocab_size]: delta on the green tokens after `prev_token`, 0 elsewhere; None if off."""
        config = self.tenants.get(tenant)
        if config is None:
            return None
        key = (tenant, prev_token, vocab_size)
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            return cached
        bias = torch.from_numpy(green_mask(config, prev_token, vocab_size)).float() * config.delta
        self._cache[key] = bias
        if len(self._cache) > self.max_cached:
            self._cache.popitem(last=False)
        return bias

    def z_score(self, tenant: str, output_ids: list[int]) -> float | None:
        """The detector's z over a finished request's output tokens; None when the tenant has no watermark."""
        config = self.tenants.get(tenant)
        return None if config is None else detect(config, output_ids).z_score
