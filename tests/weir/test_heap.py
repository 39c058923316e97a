"""weir/heap.py: the heap frozen after start, and thawed again so nothing frozen is kept for good."""

from __future__ import annotations

import gc
import weakref

from weir.heap import freeze_heap


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
