"""Where a request a model server took runs: ended here, or on one of the version's engines.

A request the refusal rules end (refusals.py) never reaches an engine: its terminal output is made
here; any other runs on the least busy engine host of the version. The model server sends every
new request through a Dispatch, and the publisher every request whose run could not be written
(run again from the start). Built before both and handed to both, so neither calls back into the
other (docs/worker.md, "Code layout").
"""

from __future__ import annotations

from schemas.model_repo import ModelConfig
from services.worker.engine import EngineOutput
from services.worker.hosts.runner import EngineHost
from services.worker.kafka.intake import InFlight
from services.worker.kafka.refusals import refusal


class Dispatch:
    """One version's engine hosts, and the cancels read lately (a cancel may overtake its batch)."""

    def __init__(self, config: ModelConfig, hosts: list[EngineHost]) -> None:
        self.config = config
        self.hosts = hosts  # opened and warmed up before the server is built; never changed after
        self.recent_cancels: dict[str, int] = {}  # request_id -> when its cancel was read

    def run(self, flight: InFlight, now_ms: int) -> EngineOutput | None:
        """Submit the flight's request to the least busy engine host (None), or return the
        terminal output that ends it here when the refusal rules say so."""
        request = flight.request
        refused = refusal(request, self.config, now_ms, self.recent_cancels)
        if refused is not None:
            return EngineOutput(
                request.request_id, 0, finish_reason=refused.finish_reason, error=refused.error, received_ms=now_ms
            )
        flight.host = min(self.hosts, key=lambda h: h.num_pending)
        flight.host.submit(request)
        return None

    def weights_sha256(self, flight: InFlight) -> str:
        """The weights that answered the flight: its host's, else (refused before any engine ran it)
        the version's first engine's (every instance loads the same verified files)."""
        host = flight.host or self.hosts[0]
        return host.weights_sha256
