"""The one way a test waits: until a condition holds, within a stated timeout, saying what it awaited.

    result = wait_until(lambda: stack.dead() == [], timeout_s=30, what="every service alive")
    record = await until(lambda: find(records), timeout_s=20, what="the reply", watch=[batcher_task])

A condition returns something truthy when it holds (that value is returned: the record found, the
status read), anything falsy while it does not. `until` takes a plain function or a coroutine
function, so a condition may read Kafka or HTTP. A timeout fails the test with `what` and how long
it waited; a timeout is a bound on a slow machine, not a guess of how long the work takes, so keep
it generous: a wait that holds returns as soon as the condition does.

A test that must show something did NOT happen cannot wait for an event; it watches for a stated
bound (`stays_false`), and the bound is a named constant whose comment says why it suffices.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

T = TypeVar("T")

POLL_S = 0.05  # between two looks at a condition: cheap for in-memory checks, and Kafka reads wait on their own


class WaitTimeout(AssertionError):
    """A condition did not hold within its timeout, or a watched task ended first (an AssertionError:
    pytest shows it as a failure)."""


def _timed_out(what: str, timeout_s: float, last: Any) -> WaitTimeout:
    tail = f"; last seen: {last!r}"[:300] if last not in (None, False) else ""
    return WaitTimeout(f"timed out after {timeout_s:g} s waiting for {what}{tail}")


def wait_until(condition: Callable[[], T], *, timeout_s: float, what: str, interval_s: float = POLL_S) -> T:
    """Call `condition` until it returns something truthy, and return that; fail after `timeout_s`
    with `what`. For code that blocks (a subprocess, a sync HTTP client); async code uses `until`."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() >= deadline:
            raise _timed_out(what, timeout_s, result)
        time.sleep(interval_s)


async def until(
    condition: Callable[[], T | Awaitable[T]],
    *,
    timeout_s: float,
    what: str,
    interval_s: float = POLL_S,
    watch: Iterable[asyncio.Task[Any]] = (),
    wake: asyncio.Event | None = None,
) -> T:
    """Await `condition` (a function or a coroutine function) until it gives something truthy, and
    return that; fail after `timeout_s` with `what`. Any task in `watch` (the service under test)
    that ends meanwhile fails the wait at once with its error, instead of a timeout later. With
    `wake` (an event the code under test sets when something changed), the condition is looked at
    again when it is set, not every `interval_s`."""
    watched = list(watch)
    deadline = time.monotonic() + timeout_s
    while True:
        if wake is not None:
            wake.clear()
        result = condition()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result
        for task in watched:
            if task.done():  # an AssertionError either way: a SystemExit (uvicorn's failed start) must not escape
                error = None if task.cancelled() else task.exception()
                raise WaitTimeout(f"{task.get_name()} ended ({error!r}) while waiting for {what}") from error
        if time.monotonic() >= deadline:
            raise _timed_out(what, timeout_s, result)
        if wake is None:
            await asyncio.sleep(interval_s)
        else:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), max(0.0, deadline - time.monotonic()))


async def stays_false(
    condition: Callable[[], Any | Awaitable[Any]], *, for_s: float, what: str, interval_s: float = POLL_S
) -> None:
    """Check for `for_s` seconds that `condition` stays falsy: the one way to show an absence ("no
    second batch went out"). Fails as soon as it holds, naming `what` happened. Callers pass a named
    bound with a comment saying why it is long enough for the event to have shown up if it were due."""
    deadline = time.monotonic() + for_s
    while True:
        result = condition()
        if inspect.isawaitable(result):
            result = await result
        assert not result, f"{what} happened within {for_s:g} s: {result!r}"[:500]
        if time.monotonic() >= deadline:
            return
        await asyncio.sleep(interval_s)


def stays_false_sync(condition: Callable[[], Any], *, for_s: float, what: str, interval_s: float = POLL_S) -> None:
    """`stays_false` for blocking code."""
    deadline = time.monotonic() + for_s
    while True:
        result = condition()
        assert not result, f"{what} happened within {for_s:g} s: {result!r}"[:500]
        if time.monotonic() >= deadline:
            return
        time.sleep(interval_s)
