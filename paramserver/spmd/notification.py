"""One completion per logical transfer, merged over every rank (Dynamo KVBM's
``TransferCompleteNotification::aggregate``, corrected).

The group starts one task per rank; :class:`TransferCompleteNotification` completes only when
*every* rank task has finished — successfully, with a refusal, with a timeout, or because the
rank server died — and then either succeeds with every rank's result or fails with
:class:`~paramserver.spmd.transfer_errors.TransferFailed` carrying the error of **every** failing
rank
(each naming its rank) and the results of the ranks that succeeded. It never waits on a rank
forever: every rank call carries the command's deadline.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Generator, Mapping

from paramserver.errors import ParamServerError
from paramserver.spmd.planning import RankTransferResult
from paramserver.spmd.transfer_errors import TransferFailed

__all__ = ["TransferCompleteNotification", "TransferResult"]


@dataclasses.dataclass(frozen=True)
class TransferResult:
    """Successful merged completion of one logical transfer.

    Attributes:
        operation: the group method.
        results: rank -> that rank's completion (every rank of the group).
        elapsed_s: client wall time from dispatch to the last rank's completion, seconds.
    """

    operation: str
    results: Mapping[int, RankTransferResult]
    elapsed_s: float

    @property
    def bytes_moved(self) -> int:
        """Payload bytes moved over all ranks, bytes."""
        return sum(r.bytes_moved for r in self.results.values())


class TransferCompleteNotification:
    """Awaitable, pollable merged completion of one transfer over all ranks.

    ``await notification`` returns a :class:`TransferResult` or raises
    :class:`~paramserver.spmd.transfer_errors.TransferFailed`; :meth:`poll` does the same without
    waiting (``None`` while ranks are still running). Created by the group inside the running
    loop; never constructed at import time.

    Args:
        operation: name of the group method, for messages.
        tasks: rank -> task resolving to that rank's :class:`RankTransferResult` or raising a
            :class:`~paramserver.errors.ParamServerError` that names the rank.
        worker_count: ranks in the group.
    """

    def __init__(
        self,
        operation: str,
        tasks: Mapping[int, asyncio.Task[RankTransferResult]],
        worker_count: int,
    ) -> None:
        self.operation = operation
        self.worker_count = worker_count
        self._tasks = dict(tasks)
        self._started = time.perf_counter()
        self._done = asyncio.Event()
        self._outcome: TransferResult | TransferFailed | None = None
        self._merger = asyncio.get_running_loop().create_task(self._merge())

    async def _merge(self) -> None:
        if self._tasks:
            await asyncio.wait(self._tasks.values())
        results: dict[int, RankTransferResult] = {}
        failures: dict[int, ParamServerError] = {}
        for rank, task in self._tasks.items():
            if task.cancelled():
                failures[rank] = ParamServerError(f"rank {rank}: cancelled")
                continue
            exc = task.exception()
            if exc is None:
                results[rank] = task.result()
            elif isinstance(exc, ParamServerError):
                failures[rank] = exc
            else:
                failures[rank] = ParamServerError(f"rank {rank}: {type(exc).__name__}: {exc}")
        elapsed = time.perf_counter() - self._started
        if failures:
            self._outcome = TransferFailed(self.operation, failures, results, self.worker_count)
        else:
            self._outcome = TransferResult(self.operation, results, elapsed)
        self._done.set()

    def done(self) -> bool:
        """True when every rank has finished."""
        return self._outcome is not None

    def poll(self) -> TransferResult | None:
        """The result if complete, ``None`` while ranks are still running.

        Raises:
            TransferFailed: complete and at least one rank failed.
        """
        outcome = self._outcome
        if outcome is None:
            return None
        if isinstance(outcome, TransferFailed):
            raise outcome
        return outcome

    async def wait(self, timeout_s: float | None = None) -> TransferResult:
        """Wait for every rank (at most ``timeout_s`` seconds when given).

        Raises:
            TransferFailed: at least one rank failed (code: the failing ranks' common code).
            TimeoutError: ``timeout_s`` passed first (the ranks' own deadlines still apply).
        """
        if timeout_s is None:
            await self._done.wait()
        else:
            async with asyncio.timeout(timeout_s):
                await self._done.wait()
        result = self.poll()
        assert result is not None
        return result

    def __await__(self) -> Generator[object, None, TransferResult]:
        return self.wait().__await__()

    @property
    def failure(self) -> TransferFailed | None:
        """The merged failure once complete, else ``None``."""
        return self._outcome if isinstance(self._outcome, TransferFailed) else None

    @property
    def pending_ranks(self) -> list[int]:
        """Ranks whose task has not finished yet."""
        return [r for r, t in self._tasks.items() if not t.done()]

    def __repr__(self) -> str:
        state = "pending" if self._outcome is None else type(self._outcome).__name__
        return f"<TransferCompleteNotification {self.operation} {state}>"
