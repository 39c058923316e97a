"""The cyclic garbage collector kept out of serving (docs/design.md, "No collector pauses in serving")."""

from __future__ import annotations

import atexit
import gc
import logging
import time

log = logging.getLogger(__name__)
# At exit the heap is thawed, so the interpreter's last collection still finalizes what was frozen
# (bindings such as Triton's report objects never freed as leaks). Harmless when nothing was.
atexit.register(gc.unfreeze)


def freeze_heap(why: str) -> None:
    """Collect once, then put every object alive now out of the cyclic collector's reach
    (docs/design.md, "No collector pauses in serving").

    A started service holds 100,000-250,000 long-lived objects (modules, pydantic schemas, the
    OpenTelemetry SDK, a model's tokenizer), and every full collection walked them all: in `weir
    bench pipeline`, 100-480 ms stop-the-world pauses in the middle of serving, in every service.
    Frozen, they are not walked again (CPython's gc.freeze, as vLLM does after start-up); what is
    allocated later is collected as before. Called again (after a model version loads), it thaws
    first, so what was frozen and has since become garbage is collected then, not kept."""
    started = time.perf_counter()
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    log.info("heap frozen (%s): %d objects, %.0f ms", why, gc.get_freeze_count(), (time.perf_counter() - started) * 1000)
