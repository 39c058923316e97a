"""GatewayParts: what the routes share, built once per app by create_app (app.py)."""

from __future__ import annotations

from dataclasses import dataclass

from schemas.model_repo import ModelConfig, ModelRepository
from services.gateway.config import GatewaySettings
from services.gateway.guard.gate import Guard
from services.gateway.guard.output_guard import OutputGuard
from services.gateway.handlers import GatewayBus
from services.gateway.openai_format import ApiError
from services.gateway.resume import ResumableStreams, resume_grace_s


@dataclass(frozen=True)
class GatewayParts:
    """The settings, model repository, Kafka bus, guards and resumable streams of one app."""

    settings: GatewaySettings
    repo: ModelRepository
    bus: GatewayBus
    guard: Guard
    output_guard: OutputGuard
    streams: ResumableStreams
    started_s: int  # epoch seconds the app was built: the `created` of every listed model

    def model(self, name: str) -> ModelConfig:
        """The model a body names; ApiError 404 when the repository has none of that name."""
        model = self.repo.get(name)
        if model is None:
            raise ApiError(404, f"The model {name!r} does not exist", param="model", code="model_not_found")
        return model

    def grace_s(self, headers: dict[str, str]) -> float:
        """The resume grace a request asks for (X-Weir-Resume-Grace-S) within the deployment's bounds."""
        return resume_grace_s(headers, self.settings.resume_grace_s, self.settings.max_resume_grace_s)
