"""The longest event-loop stall of a heap freeze while serving (docs/design.md, "No collector pauses
in serving"): `python scripts/measure_freeze_stall.py none|old|new` in a process holding the
worker's imports and 400,000 objects allocated since its first freeze (a model version's load).
none: this box's scheduling noise; old: thaw + full collect + freeze (what a version load did,
issue 35); new: weir/heap.py's freeze_new."""

import asyncio
import gc
import sys
import time

import services.worker.app  # noqa: F401 - the worker's modules (torch, tokenizers, pydantic, ...)
from weir.heap import freeze_heap, freeze_new


async def measure(step) -> float:
    longest = 0.0
    stop = False

    async def ticker() -> None:
        nonlocal longest
        last = time.perf_counter()
        while not stop:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            longest = max(longest, now - last)
            last = now

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.05)
    longest = 0.0
    await step()
    await asyncio.sleep(0.05)
    stop = True
    await task
    return longest * 1000


def load_something() -> list:
    """What a model version's load leaves on a worker's heap: modules imported, objects kept."""
    import transformers  # noqa: F401

    return [{"k": [i, str(i)]} for i in range(200_000)]


async def main() -> None:
    mode = sys.argv[1]
    freeze_heap("built")  # the same start for both
    kept = load_something()
    if mode == "none":

        async def step() -> None:  # the noise floor: this box's scheduling under its load
            await asyncio.sleep(0.3)
    elif mode == "old":

        async def step() -> None:  # what versions.py did: freeze_heap while serving
            freeze_heap("version loaded")
    else:

        async def step() -> None:
            t = time.perf_counter()
            await freeze_new("version loaded")
            print("freeze_new itself", f"{(time.perf_counter() - t) * 1000:.1f} ms")

    print(mode, f"{gc.get_freeze_count()} frozen after, longest loop stall {await measure(step):.0f} ms", len(kept))


asyncio.run(main())
