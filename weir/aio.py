"""The event loop every Weir service runs on.

uvloop (libuv) where it is installed, which uvicorn[standard] brings: each Kafka hop, HTTP request
and SSE write is a handful of loop iterations, and uvloop's are cheaper than asyncio's own. Set
WEIR_EVENT_LOOP=asyncio to run on the standard loop instead.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's new_event_loop, or None (asyncio's default) when unavailable or not wanted."""
    choice = os.environ.get("WEIR_EVENT_LOOP", "uvloop").strip().lower()
    if choice not in ("uvloop", "asyncio"):
        raise ValueError(f"WEIR_EVENT_LOOP={choice!r}: expected uvloop or asyncio")
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run(main) on the loop loop_factory() picks."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main)
