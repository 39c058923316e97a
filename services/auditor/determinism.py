"""The determinism comparison of live audit events (docs/design.md, "Structured output, tools and
logprobs": determinism is probed, not assumed).

Two outputs of one version for the same prompt, parameters and seed must be the same text on any
worker: invariant 3's regeneration after a crash relies on it. For the most recent keys, the
auditor holds the output_hmac each worker gave; an event of a key from a worker not seen for it yet
is compared with the first worker's output, `same` or `differs`. The app counts each comparison
(weir_determinism_checks_total) and the health monitor judges them (drift.py, signal
"determinism": any `differs` raises).

The key is (model_version, prompt_hmac, params_sha256, seed), made exact so that a difference is
the model's and not the comparison's:
- seed: the effective seed of a sampled request; none for a greedy one (temperature 0 ignores the
  seed, and params_sha256 leaves it out), so greedy requests with derived seeds compare too;
- hmac_key_id: HMACs made with two keys differ for the same text;
- tenant, for a watermarked output only (watermark_z set): the watermark's bias is the tenant's.
Compared: events with params_sha256 (from a worker that computes it) that ended `stop` or `length`
(an error or a cancel cuts an output anywhere); not mirror copies (shadow_of: a copy is its own
version's comparison, services/auditor/comparison.py). A redelivered event is not new (the
ledger's event_id) and never comes here twice.

Bounded: an LRU of `capacity` keys, each holding at most MAX_WORKERS workers' outputs. After a
restart the app replays the ledger's last `capacity` comparable events (Ledger.comparable_events),
so a pair split by the restart is still compared.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Literal

from schemas.messages import AuditEvent

Result = Literal["same", "differs"]
Key = tuple[str, str, str, int | None, str, str]
COMPARED_ENDINGS = ("stop", "length")
MAX_WORKERS = 8  # workers remembered per key: a comparison needs two; more only repeat the check


def comparison_key(event: AuditEvent) -> Key | None:
    """The key under which `event`'s output must equal other workers', or None: not compared."""
    if event.params_sha256 is None or event.shadow_of is not None or event.finish_reason not in COMPARED_ENDINGS:
        return None
    seed = event.seed if event.temperature > 0 else None
    tenant = event.tenant if event.watermark_z is not None else ""
    return (event.model_version, event.prompt_hmac, event.params_sha256, seed, event.hmac_key_id, tenant)


class DeterminismProbe:
    """The recent keys' outputs per worker; `observe` compares a new worker's output with the first."""

    def __init__(self, capacity: int = 10_000) -> None:
        if capacity < 1:
            raise ValueError("the determinism probe needs room for at least one key")
        self.capacity = capacity
        self.outputs: OrderedDict[Key, dict[str, str]] = OrderedDict()  # key -> worker_id -> output_hmac

    def observe(self, event: AuditEvent) -> Result | None:
        """`same` or `differs` when `event` is the first of its key from its worker and another
        worker gave one before; None otherwise (nothing to compare yet, or not compared)."""
        key = comparison_key(event)
        if key is None:
            return None
        workers = self.outputs.get(key)
        if workers is None:
            self.outputs[key] = {event.worker_id: event.output_hmac}
            if len(self.outputs) > self.capacity:
                self.outputs.popitem(last=False)
            return None
        self.outputs.move_to_end(key)
        if event.worker_id in workers:  # the same worker again: no second instance to compare with
            return None
        first = next(iter(workers.values()))
        if len(workers) < MAX_WORKERS:
            workers[event.worker_id] = event.output_hmac
        return "same" if event.output_hmac == first else "differs"
