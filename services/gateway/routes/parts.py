"""GatewayParts: what the routes share, built once per app by create_app (app.py)."""

from __future__ import annotations

from dataclasses import dataclass

from schemas.model_repo import ModelConfig
from services.gateway.catalog import Catalog
from services.gateway.config import GatewaySettings
from services.gateway.guard.gate import Guard
from services.gateway.guard.output_guard import OutputGuard
from services.gateway.handlers import GatewayBus
from services.gateway.resume import ResumableStreams, resume_grace_s


@dataclass(frozen=True)
class GatewayParts:
    """The settings, model catalog (the registry followed), Kafka bus, guards and resumable streams of one app."""

    settings: GatewaySettings
    catalog: Catalog
    bus: GatewayBus
    guard: Guard
    output_guard: OutputGuard
    streams: ResumableStreams
    started_s: int  # epoch seconds the app was built: the `created` of every listed model

    def model(self, ref: str) -> ModelConfig:
        """The version a body's `model` names (`name`: its default; `name@version`: that one);
        ApiError 400 for no model reference, 404 for an unknown, unregistered or retired one."""
        return self.catalog.resolve(ref)

    def grace_s(self, headers: dict[str, str]) -> float:
        """The resume grace a request asks for (X-Weir-Resume-Grace-S) within the deployment's bounds."""
        return resume_grace_s(headers, self.settings.resume_grace_s, self.settings.max_resume_grace_s)
