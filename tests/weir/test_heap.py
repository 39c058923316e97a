"""weir/heap.py: the heap frozen after start, and thawed again so nothing frozen is kept for good."""

from __future__ import annotations

import gc
import weakref

from weir.heap import freeze_heap, freeze_new


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def test_freeze_moves_live_objects_out_of_collections_and_a_later_freeze_collects_frozen_garbage() -> None:
    try:
        a, b = Node(), Node()
        a.other, b.other = b, a  # a cycle: only the cyclic collector frees it
        gone = weakref.ref(a)
        freeze_heap("test")
        assert gc.get_freeze_count() > 0
        del a, b
        gc.collect()  # a frozen cycle is not walked: it survives a full collection
        assert gone() is not None
        freeze_heap("test again")  # thaws first: the cycle that became garbage is collected now
        assert gone() is None
    finally:
        gc.unfreeze()


async def test_freeze_new_walks_only_the_young_generations_one_at_a_time_with_the_loop_between() -> None:
    """issue 35: a freeze while serving (a version loaded) paused the worker's loop 3.9 s and its
    consumer group's session expired. freeze_new thaws nothing and runs the loop between the steps."""
    import asyncio

    collections: list[tuple[int, int]] = []  # (generation, loop ticks so far), per collection
    ticks = 0

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            collections.append((info["generation"], ticks))

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    try:
        freeze_heap("base")
        frozen = gc.get_freeze_count()
        a, b = Node(), Node()
        a.other, b.other = b, a
        old = weakref.ref(a)
        del a, b  # a cycle allocated after the freeze: garbage that freeze_new collects
        kept = [Node() for _ in range(1000)]
        task = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        gc.callbacks.append(on_gc)
        try:
            longest_ms = await freeze_new("test")
        finally:
            gc.callbacks.remove(on_gc)
            task.cancel()
        assert [g for g, _ in collections] == [0, 1]  # the young generations only: no walk of the old one
        assert collections[0][1] < collections[1][1]  # the loop ran between the steps
        assert old() is None  # the new garbage cycle was collected
        # the new survivors frozen: in no generation a collection walks (the freeze count itself also drops as
        # other frozen objects are freed by their reference counts, so it cannot tell)
        ids = {id(node) for node in kept}
        assert not [o for o in gc.get_objects() if id(o) in ids]
        assert gc.get_freeze_count() > frozen  # nothing thawed
        assert longest_ms >= 0
    finally:
        gc.unfreeze()
