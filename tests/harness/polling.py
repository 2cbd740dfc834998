"""Waiting on a condition with a deadline: the suite's one polling loop (no test sleeps to
synchronise)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable


async def eventually(
    predicate: Callable[[], bool | Awaitable[bool]], *, timeout_s: float = 10.0, what: str = ""
) -> None:
    """Poll ``predicate`` (plain or async) until true, backing off from 5 ms to 100 ms;
    AssertionError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    delay = 0.005
    while True:
        result = predicate()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s: {what}")
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.1)
