"""Say whom a pull waits for when a BSP step or an SSP bound holds it.

Under BSP or SSP the server holds a pull until the slowest live workers catch up
(docs/semantics.md). Usually that takes a blink; a pull held for :data:`PULL_REPORT_AFTER_S` is
a wait a person can see (:mod:`paramserver.waiting`): the client asks the servers for their
status and reports whom the pull waits for, a slow worker by its clock, a silent one (a killed
worker whose lease has not lapsed yet) with when its lease lapses::

    waiting for worker-3 (at clock 4, this worker at 5, silent for 4.1 s; its lease lapses at
    18:22:03, 6 s left)

The pulls themselves pay a clock read and two counter updates: one timer per client, armed
while pulls are in flight (at most one per :data:`PULL_REPORT_AFTER_S`), opens the wait.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Protocol

from paramserver.api.v1 import parameter_server_pb2 as pb
from paramserver.waiting import Wait

__all__ = ["PULL_REPORT_AFTER_S", "PullWatch", "whom_pull_waits_for"]

logger = logging.getLogger(__name__)

#: A pull held this long (seconds) is reported: longer than a BSP step with a straggler on a
#: busy machine usually takes, short enough for a line within 2 s.
PULL_REPORT_AFTER_S = 1.5
#: A worker whose lease has not been renewed for a heartbeat period (a quarter lease) and this
#: many seconds more is called silent.
SILENT_MARGIN_S = 1.0


class _Watched(Protocol):
    """What the watch reads of the client (:class:`~paramserver.worker_client.cluster.
    ClusterWorkerClient`)."""

    address: str
    worker_name: str
    clock_value: int
    view: pb.ClusterView | None

    async def shard_statuses(self) -> list[pb.StatusResponse]: ...


def _names(names: Sequence[str]) -> str:
    shown = list(names[:3])
    if len(names) > 3:
        return f"{', '.join(shown)} and {len(names) - 3} more"
    return shown[0] if len(shown) == 1 else f"{', '.join(shown[:-1])} and {shown[-1]}"


def whom_pull_waits_for(
    statuses: Sequence[pb.StatusResponse],
    *,
    me: str,
    clock: int,
    consistency: int,
    staleness: int,
) -> tuple[list[tuple[str, int, float, float]], int]:
    """The live workers a pull by ``me`` at ``clock`` waits for, slowest first, as
    ``(name, clock, seconds since its lease was renewed, seconds its lease has left)`` (merged
    over shards: the lowest clock, the longest silence, the shortest lease); and the clock they
    must reach (``clock - s``; BSP: s = 0)."""
    need = clock - (staleness if consistency == pb.CONSISTENCY_SSP else 0)
    behind: dict[str, tuple[int, float, float]] = {}
    for status in statuses:
        for w in status.workers:
            if not w.live or w.worker_name == me or w.clock >= need:
                continue
            age, left = w.heartbeat_age_ms / 1000.0, w.lease_remaining_ms / 1000.0
            have = behind.get(w.worker_name)
            if have is not None:
                w_clock = min(have[0], int(w.clock))
                age, left = max(have[1], age), min(have[2], left)
            else:
                w_clock = int(w.clock)
            behind[w.worker_name] = (w_clock, age, left)
    rows = sorted(((n, *v) for n, v in behind.items()), key=lambda r: (r[1], r[0]))
    return rows, need


class PullWatch:
    """Watches one client's pulls; opens a :class:`~paramserver.waiting.Wait` for those held
    longer than :data:`PULL_REPORT_AFTER_S` and closes it when they end.

    Args:
        client: The client whose pulls are watched.
        wait_timeout_s: The client's default pull wait (None: the server's, not known here).
    """

    def __init__(self, client: _Watched, wait_timeout_s: float | None) -> None:
        self.client = client
        self.wait_timeout_s = wait_timeout_s
        self._pulling = 0
        self._since = 0.0
        self._deadline: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._wait: Wait | None = None

    def may_wait(self) -> bool:
        """Whether the server may hold a pull (BSP, SSP; not ASP, or before registering)."""
        view = self.client.view
        return view is not None and view.consistency != pb.CONSISTENCY_ASP

    def enter(self, timeout_s: float | None) -> None:
        """A pull starts (with its own wait deadline, if given)."""
        if self._pulling == 0:
            self._since = time.monotonic()
            wait_s = self.wait_timeout_s if timeout_s is None else timeout_s
            self._deadline = None if wait_s is None else self._since + wait_s
            if self._timer is None:
                self._timer = asyncio.get_running_loop().call_later(
                    PULL_REPORT_AFTER_S, self._check
                )
        self._pulling += 1

    def exit(self) -> None:
        """A pull ended (answered or failed)."""
        self._pulling -= 1
        if self._pulling == 0 and self._wait is not None:
            self._wait.close()
            self._wait = None

    def close(self) -> None:
        """Stop watching (the client closes)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._wait is not None:
            self._wait.close()
            self._wait = None

    def _check(self) -> None:
        self._timer = None
        if self._pulling == 0 or self._wait is not None:
            return  # nothing in flight (the next pull re-arms), or reported already
        now = time.monotonic()
        due = self._since + PULL_REPORT_AFTER_S
        if now < due:  # a later pull than the one that armed the timer
            self._timer = asyncio.get_running_loop().call_later(due - now, self._check)
            return
        client = self.client
        self._wait = Wait(
            f"{client.address} to answer a pull at clock {client.clock_value}",
            address=client.address,
            deadline=self._deadline,
            began=self._since,
            logger=logger,
            probe=self._describe,
            report_after_s=PULL_REPORT_AFTER_S,
        ).open(nest=False)

    async def _describe(self, wait: Wait) -> bool:
        """Ask the servers whom the pull waits for and say so; False (no report now) when
        they cannot be asked: the retry funnel is then reporting the outage itself."""
        client = self.client
        view = client.view
        if view is None:
            return False
        try:
            statuses = await client.shard_statuses()
        except Exception as exc:
            logger.debug("status for a waiting pull failed: %r", exc)
            return False
        rows, need = whom_pull_waits_for(
            statuses,
            me=client.worker_name,
            clock=client.clock_value,
            consistency=view.consistency,
            staleness=view.staleness,
        )
        if not rows:
            wait.update(
                what=f"{client.address} to answer a pull at clock {client.clock_value}",
                detail=f"no live worker is behind clock {need} (any more)",
            )
            return True
        name, clock, age, left = rows[0]
        lease = age + left
        silent = [r for r in rows if r[2] > lease / 4 + SILENT_MARGIN_S]
        detail = f"at clock {clock}, this worker at {client.clock_value}"
        if len(rows) > 1:
            detail = f"the slowest, {name}, {detail}"
        wait.update(what=_names([r[0] for r in rows]), detail=detail)
        if silent:  # a dead peer, most likely: the wait ends when its lease lapses
            s_name, _, s_age, s_left = min(silent, key=lambda r: r[3])
            who = "" if len(rows) == 1 else f"{s_name} "
            wait.detail += f", {who}silent for {s_age:.1f} s"
            wait.deadline = time.monotonic() + s_left
            wait.until = "its lease lapses at"
        else:
            wait.detail += f", last heard from {age:.1f} s ago"
            wait.deadline, wait.until = self._deadline, "gives up at"
        return True
