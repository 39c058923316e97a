"""The watermark detector of the auditor: tokenize a text with the model's tokenizer, run the z-test.

The split and the test are schemas/watermark.py, the same code the workers watermark with. The
tokenizer is the served model's tokenizer.json (found through the model repository), encoded
without special tokens exactly as the worker encodes.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from schemas.model_repo import load_model_repo
from schemas.watermark import Detection, WatermarkConfig, detect


class WatermarkDetector:
    """Detects tenants' watermarks in texts of the models of one model repository."""

    def __init__(self, model_repo: str | Path, tenants: dict[str, WatermarkConfig]) -> None:
        self.model_repo = Path(model_repo)
        self.tenants = tenants
        self._tokenizers: dict[str, Tokenizer] = {}

    def tokenizer(self, model: str | None) -> Tokenizer:
        """The tokenizer of `model` (default: the repository's first model with a tokenizer.json)."""
        key = model or ""
        if key not in self._tokenizers:
            repo = load_model_repo(self.model_repo)
            names = [model] if model else list(repo.models)
            for name in names:
                config = repo.models.get(name)
                if config is None:
                    raise ValueError(f"model {name!r} is not in {self.model_repo}")
                if config.path is not None and (config.path / "tokenizer.json").exists():
                    self._tokenizers[key] = Tokenizer.from_file(str(config.path / "tokenizer.json"))
                    break
            else:
                raise ValueError(f"no tokenizer.json for {model or 'any model'} in {self.model_repo}")
        return self._tokenizers[key]

    def config(self, tenant: str | None, key: bytes | None, gamma: float | None) -> WatermarkConfig:
        """The watermark to test for: a configured tenant's, or an explicit key (gamma default 0.25)."""
        if key is not None:
            return WatermarkConfig(gamma=gamma if gamma is not None else 0.25, delta=0.0, key=key)
        if tenant is None:
            raise ValueError("give a tenant (WEIR_WATERMARK_TENANTS) or a watermark key")
        config = self.tenants.get(tenant)
        if config is None:
            raise ValueError(f"tenant {tenant!r} has no watermark in WEIR_WATERMARK_TENANTS")
        return config

    def detect(
        self,
        text: str,
        *,
        tenant: str | None = None,
        key: bytes | None = None,
        gamma: float | None = None,
        model: str | None = None,
    ) -> Detection:
        """z-score and p-value of the watermark in `text`. ValueError when it cannot be tested."""
        config = self.config(tenant, key, gamma)
        ids = self.tokenizer(model).encode(text, add_special_tokens=False).ids
        return detect(config, ids)
