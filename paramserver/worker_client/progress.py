"""A worker name's recorded progress and the start barrier, for every client of the cluster
(one shard's :class:`~paramserver.worker_client.client.WorkerClient` and the sharded client)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from paramserver.api.v1 import parameter_server_pb2 as pb
from paramserver.errors import InvalidArgument, WaitTimeout
from paramserver.waiting import Wait

__all__ = ["WorkerProgress", "await_workers", "progress_of"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerProgress:
    """What the registrations of one worker name completed, as the cluster records it (kept
    across re-registration and replacement, in checkpoints and the write-ahead log).

    Attributes:
        worker_name: The name.
        steps: Iterations completed: ``clock()`` calls of this name that advanced its clock,
            by every registration of the name (0 for a name the cluster never saw). A worker
            that trains one batch per iteration has trained this many of its batches.
        clock: The clock its newest registration reached (a registration that joins late
            starts at the cluster's minimum clock, so this may exceed ``steps``).
    """

    worker_name: str
    steps: int
    clock: int


def progress_of(statuses: Iterable[pb.StatusResponse], worker_name: str) -> WorkerProgress:
    """``worker_name``'s progress over shards' statuses: the fewest iterations any shard
    counted (every shard counts each iteration; the fewest is what all of them saw end)."""
    found = []
    for st in statuses:
        mine = [(int(p.steps), int(p.clock)) for p in st.progress if p.worker_name == worker_name]
        found.append(mine[0] if mine else (0, 0))  # a shard that never saw it: nothing done
    steps, clock = min(found, default=(0, 0))
    return WorkerProgress(worker_name, steps, clock)


class _Polled(Protocol):
    async def heartbeat(self) -> pb.HeartbeatResponse: ...

    async def status(self) -> pb.StatusResponse: ...


async def await_workers(
    client: _Polled, n: int, timeout_s: float, *, where: str | None = None
) -> int:
    """The start barrier of :meth:`WorkerClient.wait_for_workers`, polling ``client`` (the
    server at ``where``); a wait a person can see (:mod:`paramserver.waiting`)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InvalidArgument(f"wait_for_workers: n must be an int >= 1, got {n!r}")
    if not isinstance(timeout_s, int | float) or not timeout_s > 0:
        raise InvalidArgument(
            f"wait_for_workers: timeout_s must be a number > 0, got {timeout_s!r}"
        )
    deadline = time.monotonic() + timeout_s
    delay = 0.01
    what = f"{n} workers to register" + (f" at {where}" if where else "")
    with Wait(what, address=where, deadline=deadline, logger=logger) as waiting:
        while True:
            view = (await client.heartbeat()).view
            if view.live_workers >= n:
                return int(view.live_workers)
            if (await client.status()).applied_updates > 0:
                return 0  # the others passed it and trained (and may have left)
            if time.monotonic() >= deadline:
                raise WaitTimeout(
                    f"start barrier: {view.live_workers} of {n} workers registered after "
                    f"{timeout_s} s"
                )
            waiting.update(detail=f"{view.live_workers} of {n} registered")
            await asyncio.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 0.2)
