"""Helpers for unit tests that drive asyncio code."""

from __future__ import annotations

import asyncio


async def until(predicate, what: str = "the condition", timeout: float = 20.0) -> None:
    """Poll `predicate` on the running loop until it is true; fail with `what` after `timeout` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)
