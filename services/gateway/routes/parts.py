"""GatewayParts: what the routes share, built once per app by create_app (app.py)."""

from __future__ import annotations

from dataclasses import dataclass

from schemas.model_repo import ModelConfig
from schemas.traffic import Assignment, assignment_key
from services.gateway.catalog import Catalog
from services.gateway.config import GatewaySettings
from services.gateway.guard.auth import Identity
from services.gateway.guard.gate import Guard
from services.gateway.guard.output_guard import OutputGuard
from services.gateway.kafka_bus import GatewayBus
from services.gateway.resume import ResumableStreams, resume_grace_s
from services.gateway.stream_index import RemoteResumes
from weir.lag import LagMonitor


@dataclass(frozen=True)
class GatewayParts:
    """The settings, model catalog (the registry followed), Kafka bus, guards and resumable streams
    (this gateway's, and other gateways' read from Kafka) of one app."""

    settings: GatewaySettings
    catalog: Catalog
    bus: GatewayBus
    guard: Guard
    output_guard: OutputGuard
    streams: ResumableStreams
    started_s: int  # epoch seconds the app was built: the `created` of every listed model
    lag: LagMonitor  # consumer lag of the deployment's groups, for /metrics (weir/lag.py)
    remote: RemoteResumes  # streams of other gateways, resumed from weir.streams (stream_index.py)

    def model(self, ref: str, identity: Identity, user: str | None, request_id: str) -> tuple[ModelConfig, Assignment]:
        """The version that serves a body's `model` and how it was chosen (`name@version`: that one,
        pinned; `name`: its default or a canary, sticky per `user`, else the principal, else the
        request: docs/design.md, "Traffic policies"); ApiError 400 for no model reference, 404 for
        an unknown, unregistered or retired one."""
        return self.catalog.assign(ref, assignment_key(user, identity.principal, request_id), identity.may_use)

    def grace_s(self, headers: dict[str, str]) -> float:
        """The resume grace a request asks for (X-Weir-Resume-Grace-S) within the deployment's bounds."""
        return resume_grace_s(headers, self.settings.resume_grace_s, self.settings.max_resume_grace_s)
