"""Polling with a deadline: what tests and benchmarks wait with instead of sleeping a fixed time.

`what` names the awaited condition in the failure; it may be a function, called only on failure,
to describe the state at that moment (a log tail, a request count).
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable, TypeVar

T = TypeVar("T")
Description = str | Callable[[], str]


def _timed_out(timeout: float, what: Description, last_error: BaseException | None = None) -> AssertionError:
    text = what() if callable(what) else what
    return AssertionError(f"timed out after {timeout}s waiting for {text}"
                          + (f" (last error: {last_error!r})" if last_error else ""))


def wait_until(predicate: Callable[[], T], timeout: float, what: Description, interval: float = 0.05) -> T:
    """Call `predicate` every `interval` s until it returns something truthy, and return that.

    It usually looks at another process, which may not answer yet: an exception counts as "not yet",
    and the last one is named if the deadline passes."""
    deadline = time.monotonic() + timeout
    last_error = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # noqa: BLE001 - e.g. the agent is not listening yet
            last_error = exc
        if time.monotonic() >= deadline:
            raise _timed_out(timeout, what, last_error)
        time.sleep(interval)


async def until(predicate: Callable[[], T], timeout: float, what: Description, interval: float = 0.005) -> T:
    """`wait_until` for code on the running event loop: it sleeps on the loop, so the code under test
    runs in between. The predicate reads in-process state, so an exception it raises is a failure at
    once (a test may raise in it to stop waiting early)."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() >= deadline:
            raise _timed_out(timeout, what)
        await asyncio.sleep(interval)
    return value
