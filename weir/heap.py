"""The cyclic garbage collector kept out of serving (docs/design.md, "No collector pauses in serving")."""

from __future__ import annotations

import asyncio
import atexit
import gc
import logging
import time

log = logging.getLogger(__name__)
# At exit the heap is thawed, so the interpreter's last collection still finalizes what was frozen
# (bindings such as Triton's report objects never freed as leaks). Harmless when nothing was.
atexit.register(gc.unfreeze)


def freeze_heap(why: str) -> float:
    """Collect once, then put every object alive now out of the cyclic collector's reach
    (docs/design.md, "No collector pauses in serving"); returns the milliseconds it took.

    A started service holds 100,000-250,000 long-lived objects (modules, pydantic schemas, the
    OpenTelemetry SDK, a model's tokenizer), and every full collection walked them all: in `weir
    bench pipeline`, 100-480 ms stop-the-world pauses in the middle of serving, in every service.
    Frozen, they are not walked again (CPython's gc.freeze, as vLLM does after start-up); what is
    allocated later is collected as before. It thaws first, so what was frozen and has since become
    garbage is collected too.

    The full collection walks the whole heap in one go: 0.7-4 s on a busy 2-core box. So this is
    for a moment when nothing waits on the event loop: before a service's Kafka clients start (a
    consumer group's session is 2 s; issue 35: a worker's freeze expired it), or in a process that
    is not serving yet (an engine process while it warms up). Once serving, use `freeze_new`."""
    started = time.perf_counter()
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    took_ms = (time.perf_counter() - started) * 1000
    log.info("heap frozen (%s): %d objects, %.0f ms", why, gc.get_freeze_count(), took_ms)
    return took_ms


async def freeze_new(why: str) -> float:
    """Freeze what was allocated since the last freeze (a model version's tokenizer and config,
    a started service's clients, modules imported since), while the event loop goes on serving;
    returns the longest pause it made, in milliseconds.

    Nothing frozen is thawed or walked. The young generations are collected one at a time, the
    loop running between them (their garbage: what loading left behind), and the survivors are
    frozen. The old generation is not walked: after a start it holds what survived two collections
    since the last freeze (a worker: 230,000 objects of modules and models loaded meanwhile), and its
    walk paused the loop 0.6 s on a busy 2-core box, where this pauses it a few ms. What this
    leaves: garbage cycles that reached the old generation since the last freeze, and those among
    objects frozen earlier (a swapped-out version's), are not collected until the process
    restarts; objects in no cycle are freed by their reference counts, frozen or not."""
    longest_ms = 0.0
    for generation in (0, 1):
        started = time.perf_counter()
        gc.collect(generation)
        longest_ms = max(longest_ms, (time.perf_counter() - started) * 1000)
        await asyncio.sleep(0)  # the loop's due work (heartbeats, deliveries) runs between the steps
    started = time.perf_counter()
    gc.freeze()
    longest_ms = max(longest_ms, (time.perf_counter() - started) * 1000)
    # Not gc.get_freeze_count(): it walks the frozen list, 100 ms for a worker's 670,000 objects.
    log.info("heap frozen (%s): longest pause %.1f ms", why, longest_ms)
    return longest_ms
