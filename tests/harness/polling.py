"""Waiting on a condition with a deadline: the suite's one polling loop (no test sleeps to
synchronise). Deadlines scale with the machine's load (:mod:`.timing`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from .timing import scaled


async def eventually(
    predicate: Callable[[], bool | Awaitable[bool]], *, timeout_s: float = 10.0, what: str = ""
) -> None:
    """Poll ``predicate`` (plain or async) until true, backing off from 5 ms to 100 ms;
    AssertionError naming ``what`` after ``timeout_s`` (an idle machine's figure, scaled by
    :func:`.timing.scaled`)."""
    timeout_s = scaled(timeout_s)
    deadline = time.monotonic() + timeout_s
    delay = 0.005
    while True:
        result = predicate()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s:.1f} s: {what}")
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.1)
