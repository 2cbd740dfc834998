"""What the server engines share around their waits: the change notification that wakes every
waiter, the lease reaper task, and the graceful-shutdown flag.

:class:`LeaseReaperBase` is subclassed by :class:`~paramserver.server.engine.ServerEngine` and
:class:`~paramserver.server.reduction.ReductionEngine`; each supplies its own reap step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar

from paramserver.server.config import ServerConfig


class LeaseReaperBase(ABC):
    """Wakes waiters on change, runs the lease reaper, and flags a graceful shutdown.

    Construct and use it inside a running event loop; it creates its asyncio objects lazily.

    Args:
        config: Server configuration (``lease_ms`` sets the reaper's tick).
        now: Monotonic clock in seconds (injectable for tests).
    """

    #: What the reaper is called: its task is ``paramserver-`` + this, hyphenated, and a
    #: failed sweep is logged as "<this> failed".
    _reaper_label: ClassVar[str]
    #: The logger a failed sweep is reported to.
    _reaper_logger: ClassVar[logging.Logger]

    def __init__(self, config: ServerConfig, *, now: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.now = now
        self._change: asyncio.Future[None] | None = None
        self._reaper: asyncio.Task[None] | None = None
        #: Set at graceful shutdown: waits end at once with UNAVAILABLE.
        self.shutting_down = False

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the lease reaper (call from inside the event loop)."""
        if self._reaper is None:
            self._reaper = asyncio.get_running_loop().create_task(
                self._reap_forever(), name="paramserver-" + self._reaper_label.replace(" ", "-")
            )

    async def stop(self) -> None:
        """Stop the reaper and wake every waiter (they re-check and see the shutdown)."""
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
            self._reaper = None
        self.notify()

    def begin_shutdown(self) -> None:
        """Refuse further waits and end the current ones with UNAVAILABLE (retryable)."""
        self.shutting_down = True
        self.notify()

    @abstractmethod
    async def _reap(self) -> None:
        """One sweep: evict the workers whose lease lapsed at ``self.now()`` (and notify)."""

    async def _reap_forever(self) -> None:
        tick_s = min(self.config.lease_ms / 1000.0 / 8.0, 0.25)
        while True:
            await asyncio.sleep(tick_s)
            try:
                await self._reap()
            except Exception:  # pragma: no cover - a bug; keep serving
                self._reaper_logger.exception("%s failed", self._reaper_label)

    # ------------------------------------------------------------------ waiting
    def notify(self) -> None:
        """Wake every waiter to re-evaluate its condition (after any state change)."""
        fut = self._change
        self._change = None
        if fut is not None and not fut.done():
            fut.set_result(None)

    def _next_change(self) -> asyncio.Future[None]:
        if self._change is None or self._change.done():
            self._change = asyncio.get_running_loop().create_future()
        return self._change
