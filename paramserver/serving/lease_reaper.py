"""What the engines of the daemons that lease workers share around their waits: the change
notification that wakes every waiter, the lease reaper task, and the graceful-shutdown flag.

:class:`LeaseReaperBase` is subclassed by :class:`~paramserver.server.engine.ServerEngine` and
:class:`~paramserver.reduction.reduce_service.ReductionEngine`; each supplies its own reap step
and its own configuration type (any with ``lease_ms``: :class:`LeaseSettings`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar, Generic, Protocol, TypeVar

from paramserver.closing import cancelled

__all__ = ["LeaseReaperBase", "LeaseSettings"]


class LeaseSettings(Protocol):
    """What the reaper reads of its engine's configuration."""

    @property
    def lease_ms(self) -> int:
        """Worker lease in milliseconds (the reaper ticks every eighth of it, at most 0.25 s)."""
        ...


ConfigT = TypeVar("ConfigT", bound=LeaseSettings)


class LeaseReaperBase(ABC, Generic[ConfigT]):
    """Wakes waiters on change, runs the lease reaper, and flags a graceful shutdown.

    Construct and use it inside a running event loop; it creates its asyncio objects lazily.

    Args:
        config: The engine's configuration (``lease_ms`` sets the reaper's tick).
        now: Monotonic clock in seconds (injectable for tests).
    """

    #: What the reaper is called: its task is ``paramserver-`` + this, hyphenated, and a
    #: failed sweep is logged as "<this> failed".
    _reaper_label: ClassVar[str]
    #: The logger a failed sweep is reported to.
    _reaper_logger: ClassVar[logging.Logger]

    def __init__(self, config: ConfigT, *, now: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.now = now
        self._change: asyncio.Future[None] | None = None
        self._reaper: asyncio.Task[None] | None = None
        #: Set at graceful shutdown: waits end at once with UNAVAILABLE.
        self.shutting_down = False
        #: Reaper ticks that found this server stalled, and the seconds credited to leases.
        self.stalls = 0
        self.stalled_s = 0.0

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the lease reaper (call from inside the event loop)."""
        if self._reaper is None:
            self._reaper = asyncio.get_running_loop().create_task(
                self._reap_forever(), name="paramserver-" + self._reaper_label.replace(" ", "-")
            )

    async def stop(self) -> None:
        """Stop the reaper and wake every waiter (they re-check and see the shutdown)."""
        await cancelled(self._reaper)
        self._reaper = None
        self.notify()

    def begin_shutdown(self) -> None:
        """Refuse further waits and end the current ones with UNAVAILABLE (retryable)."""
        self.shutting_down = True
        self.notify()

    @abstractmethod
    async def _reap(self) -> None:
        """One sweep: evict the workers whose lease lapsed at ``self.now()`` (and notify)."""

    @abstractmethod
    def _credit_stall(self, stall_s: float) -> None:
        """Extend every live lease by ``stall_s`` seconds: the server itself could not hear
        anyone for that long (see :meth:`_reap_forever`)."""

    async def _reap_forever(self) -> None:
        """Sweep every tick; a tick that runs late is a server stall, not the workers' silence.

        When a tick wakes more than one tick late, this process did not run for that long
        (SIGSTOP, a long GC or disk stall, a request that held the loop): heartbeats sent
        meanwhile are still waiting in the sockets. Leases measure a worker's silence, not
        the server's, so every live lease is extended by the lateness
        (:meth:`_credit_stall`) and the sweep is skipped for this tick, which lets the loop read
        the backlog first. A worker is evicted only after ``lease_ms`` of its own silence.
        """
        loop = asyncio.get_running_loop()
        tick_s = min(self.config.lease_ms / 1000.0 / 8.0, 0.25)
        lease_s = self.config.lease_ms / 1000.0
        due = loop.time() + tick_s
        while True:
            await asyncio.sleep(max(due - loop.time(), 0.0))
            late_s = loop.time() - due
            if late_s > tick_s:
                self.stalls += 1
                self.stalled_s += late_s
                self._credit_stall(late_s)
                self._reaper_logger.log(
                    logging.WARNING if late_s > lease_s / 4 else logging.DEBUG,
                    "%s: this server did not run for %.3f s (stalled); every lease is "
                    "extended by that much and the sweep waits a tick for the heartbeats",
                    self._reaper_label,
                    late_s,
                )
                due = loop.time() + tick_s
                continue
            due = loop.time() + tick_s
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
