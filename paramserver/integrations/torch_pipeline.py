"""A training pipeline for a
:class:`~paramserver.integrations.torch_collection.RemoteEmbeddingBagCollection` (after
TorchRec's ``TrainPipelineSparseDist``): the rows of batch r+1 are pulled, and batch r-1's
row gradients pushed, while batch r runs forward and backward.

Needs the optional extra ``pip install 'paramserver[torch]'`` and the async client. Each
step's compute (your ``step`` function: forward, loss, backward, the dense optimizer) runs in
a worker thread, so the event loop moves rows meanwhile; torch and numpy release the GIL in
their kernels. A step r of the pipelined loop::

    compute(r)      in a thread: forward on rows(r), backward -> row gradients g(r)
    meanwhile:      push g(r-1) (clock r-1), clock() -> r, then pull rows(r+1) at clock r

What step r sees, exactly (for r >= 2; with ``pipelined=False`` read r-1 for r-2 below):
rows(r) are pulled after this worker's push of g(r-2) was acknowledged and its clock() ending
step r-2 returned, and before g(r-1) is pushed. So step r's rows hold every gradient this
worker pushed through step r-2 and none of step r-1: the worker reads its own updates one
step late (the pipeline's staleness, one clock). Other workers' updates are what the table's
consistency admits to a pull at clock r-1: ``asp`` whatever has arrived; ``ssp(s)`` at least
every update of clocks <= r-2-s; ``bsp`` every step through r-2 (the pull waits for it).
Without the pipeline a step r reads at clock r and holds its own step r-1. Rows read by step
r and r+1 alike therefore see g(r) only from step r+2 on; a row-wise rule still applies each
gradient once, in step order, so the table's update sequence is the plain loop's (the values
of g(r) differ only through the one step of staleness they were computed under).

One pull request and one push request per shard per step (``pull_rows_many`` /
``push_rows_many``), whatever the number of features.
"""

from __future__ import annotations

import asyncio
import enum
import inspect
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Generic, Protocol, TypeGuard, TypeVar

import numpy as np

from paramserver.errors import InvalidArgument
from paramserver.integrations.torch_collection import (
    Features,
    KeyedJagged,
    Pending,
    RemoteEmbeddingBagCollection,
    RowsManyClient,
    Staged,
)
from paramserver.worker_client.embedding import RowPushAck
from paramserver.worker_client.keyed import KeyedIds

__all__ = ["PipelineStats", "TrainPipeline"]

B = TypeVar("B")
T = TypeVar("T")


class _End(enum.Enum):
    """The end of the batches (a batch may be anything, None too)."""

    END = enum.auto()


class _PipelineClient(Protocol):
    """What the pipeline calls of the collection's async client (or a row cache over it)."""

    async def pull_rows_many(self, ids: dict[str, np.ndarray], /) -> dict[str, np.ndarray]: ...

    async def push_rows_many(
        self, ids: dict[str, np.ndarray], grads: dict[str, np.ndarray], /
    ) -> dict[str, RowPushAck] | None: ...

    async def clock(self) -> int: ...


def _is_async(client: RowsManyClient) -> TypeGuard[_PipelineClient]:
    return inspect.iscoroutinefunction(getattr(client, "pull_rows_many", None))


@dataclass
class PipelineStats:
    """Seconds spent per phase over a run (a pipelined run overlaps them).

    Attributes:
        steps: Steps run.
        compute_s: In ``step`` (forward, backward, dense optimizer), summed.
        pull_s: In row pulls, summed.
        push_s: In row pushes and clocks, summed.
        wait_s: Time the compute of a step waited for its rows (pipelined: the rows were not
            there yet when the previous step's compute ended).
    """

    steps: int = 0
    compute_s: float = 0.0
    pull_s: float = 0.0
    push_s: float = 0.0
    wait_s: float = 0.0


class TrainPipeline(Generic[B, T]):
    """Run training steps with the row traffic of neighbouring steps overlapped.

    Args:
        collection: The remote collection, built on the async client (or anything with async
            ``pull_rows_many`` / ``push_rows_many`` / ``clock``, such as a row cache).
        step: ``step(batch) -> result``: forward (calling ``collection`` on the batch's
            features inside the model), loss, backward and the dense optimizer's step. Runs
            in a worker thread; it must not call the client.
        features: ``features(batch)``: the batch's keyed jagged ids, as the model passes them
            to ``collection`` (default: the batch itself).
        pipelined: False runs the same steps one after another (pull, compute, push, clock):
            the baseline, bit for bit the plain prefetch / forward / backward / push_pending
            loop.
        clock: Call the client's ``clock()`` after each step's push (False: the caller
            clocks; then the pipeline's staleness is stated per step, not per clock).

    Raises:
        InvalidArgument: a collection on a blocking client (INVALID_ARGUMENT).
    """

    def __init__(
        self,
        collection: RemoteEmbeddingBagCollection,
        step: Callable[[B], T],
        *,
        features: Callable[[B], Features] | None = None,
        pipelined: bool = True,
        clock: bool = True,
    ) -> None:
        client = collection.client
        if not _is_async(client):
            raise InvalidArgument(
                "TrainPipeline needs the collection on the async client (connect(...)); a "
                "blocking client pulls and pushes inside forward and backward"
            )
        self.collection = collection
        self.client = client
        self.step = step
        self.features: Callable[[B], Features] = features or _batch_is_features
        self.pipelined = pipelined
        self.clock = clock
        self.stats = PipelineStats()
        self._compute_end = self._traffic_end = 0.0

    # ------------------------------------------------------------------ row traffic
    async def _pull(self, batch: B) -> Staged:
        t0 = asyncio.get_running_loop().time()
        feats = self.features(batch)
        plan = self.collection._plan(feats)
        rows = await self.client.pull_rows_many(plan.uniq)
        self.stats.pull_s += asyncio.get_running_loop().time() - t0
        return feats, plan, {t: np.asarray(r) for t, r in rows.items()}

    async def _push(self, pending: list[Pending]) -> None:
        t0 = asyncio.get_running_loop().time()
        for ids, grads in pending:
            await self.client.push_rows_many(ids, grads)
        if self.clock:
            await self.client.clock()
        self.stats.push_s += asyncio.get_running_loop().time() - t0

    def _compute(self, batch: B, staged: Staged) -> tuple[T, list[Pending]]:
        """One step's compute in a worker thread, on its staged rows; returns its result and
        the row gradients its backward produced."""
        feats, plan, rows = staged
        self.collection._stage(feats, plan, rows)
        try:
            result = self.step(batch)
        finally:
            self.collection._unstage()
        return result, self.collection._take_pending()

    async def _timed_compute(self, batch: B, staged: Staged) -> tuple[T, list[Pending]]:
        t0 = asyncio.get_running_loop().time()
        try:
            return await asyncio.to_thread(self._compute, batch, staged)
        finally:
            self._compute_end = asyncio.get_running_loop().time()
            self.stats.compute_s += self._compute_end - t0

    # ------------------------------------------------------------------ the loop
    async def run(self, batches: Iterable[B]) -> AsyncIterator[T]:
        """Train on ``batches`` in order, yielding each step's result as its compute ends.

        The last step's gradients are pushed (and clocked) before the iterator ends. An error
        in a step cancels the row traffic in flight (a push cut off may or may not have been
        applied); an error in the row traffic is raised once the step's compute ended.
        Nothing of a later step is started either way.
        """
        run = self._pipelined if self.pipelined else self._plain
        async for result in run(iter(batches)):
            yield result

    async def _plain(self, it: Iterator[B]) -> AsyncIterator[T]:
        for batch in it:
            staged = await self._pull(batch)
            result, pending = await self._timed_compute(batch, staged)
            await self._push(pending)
            self.stats.steps += 1
            yield result

    async def _pipelined(self, it: Iterator[B]) -> AsyncIterator[T]:
        first = next(it, _End.END)
        if first is _End.END:
            return
        batch = first
        staged = await self._pull(batch)
        pending: list[Pending] | None = None  # the previous step's row gradients
        while True:
            nxt = next(it, _End.END)
            compute = asyncio.ensure_future(self._timed_compute(batch, staged))
            traffic = asyncio.ensure_future(self._traffic(pending, nxt))
            try:
                await asyncio.wait([compute, traffic], return_when=asyncio.FIRST_EXCEPTION)
            finally:
                if not compute.done() or not traffic.done():
                    # One failed: let the other end (a thread cannot be cancelled), then raise.
                    traffic.cancel()
                    await asyncio.wait([compute, traffic])
            result, pending = compute.result()
            next_staged = traffic.result()
            self.stats.wait_s += max(0.0, self._traffic_end - self._compute_end)
            self.stats.steps += 1
            yield result
            if nxt is _End.END or next_staged is None:
                await self._push(pending)
                return
            batch, staged = nxt, next_staged

    async def _traffic(self, pending: list[Pending] | None, nxt: B | _End) -> Staged | None:
        """Push the previous step's gradients and clock, then pull the next step's rows."""
        try:
            if pending is not None:
                await self._push(pending)
            return None if nxt is _End.END else await self._pull(nxt)
        finally:
            self._traffic_end = asyncio.get_running_loop().time()


def _batch_is_features(batch: object) -> Features:
    """The default ``features``: the batch is the keyed jagged ids itself.

    Raises:
        InvalidArgument: a batch that is not keyed jagged ids (INVALID_ARGUMENT).
    """
    if isinstance(batch, (KeyedIds, KeyedJagged)):
        return batch
    raise InvalidArgument(
        f"a batch of type {type(batch).__name__} is not keyed jagged ids: pass "
        "features=(batch -> its keyed jagged ids) to TrainPipeline"
    )
