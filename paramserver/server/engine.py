"""The one place that waits: asyncio around the pure :class:`~paramserver.core.shard.ServerCore`.

Every state change of the shard (register, leave, lease eviction, init, push, clock,
init_table, push_rows, expire_rows) passes one funnel, :meth:`ServerEngine.mutate`::

    validate completely -> log -> apply -> wake waiters -> durable -> acknowledge

so a refused request changes nothing, in memory or on disk; a logged record always replays; an
acknowledged one survives a crash; and a retry answered as a duplicate waits until its original
is durable. The records it logs, in order, are the shard's mutation stream
(:mod:`paramserver.server.wal_records`). A lease reaper evicts workers whose lease lapsed
through the same funnel. Every wait has a deadline, and a wait that runs out names the workers
it waited for.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Protocol, TypeVar

from paramserver.api.v1 import wal_pb2 as wal_pb
from paramserver.core.consistency import Admission, Consistency
from paramserver.core.shard import ServerCore
from paramserver.errors import (
    Aborted,
    ReadOnly,
    ResourceExhausted,
    StorageError,
    StorageFull,
    Unavailable,
    WaitTimeout,
)
from paramserver.server import wal_records
from paramserver.server.apply_threads import Offload
from paramserver.server.config import ServerConfig
from paramserver.server.observability.hooks import ServingHooks, ShardObservations
from paramserver.server.wal import WriteAheadLog
from paramserver.serving.lease_reaper import LeaseReaperBase

logger = logging.getLogger(__name__)

T = TypeVar("T")
#: Appends one decided mutation's record to the log, or several records as one all-or-nothing
#: write (a push to several tables: one record per table; see :meth:`ServerEngine.mutate`).
LogFn = Callable[[wal_pb.WalRecord | list[wal_pb.WalRecord]], None]


class ReplicaRole(Protocol):
    """The shard's replica role (:mod:`paramserver.server.replication`), when it has backups."""

    #: Every replica's client address, by replica index, as this replica knows them now.
    addresses: tuple[str, ...]

    def check_primary(self) -> None:
        """Raise :class:`~paramserver.errors.NotPrimary` unless this replica is primary."""

    async def replicated(self, sequence: int) -> None:
        """Return once every backup in sync holds record ``sequence`` durably.

        Raises:
            NotPrimary: (UNAVAILABLE) this replica was deposed: nothing is acknowledged.
        """


class Backpressure:
    """Bounds on pushes in flight, per worker and in total, and on their bytes.

    Beyond a bound the push is refused at once with RESOURCE_EXHAUSTED (retryable; the client
    backs off) instead of being buffered. A single push larger than the byte bound is still
    admitted when nothing else is in flight, so any tensor size can be pushed.

    Args:
        max_per_worker: Pushes one worker may have in flight.
        max_total: Pushes in flight over all workers.
        max_bytes: Tensor bytes of the pushes in flight (declared sizes, reserved as each
            tensor's first frame arrives, before its buffer is allocated).
    """

    def __init__(self, max_per_worker: int, max_total: int, max_bytes: int) -> None:
        self.max_per_worker = max_per_worker
        self.max_total = max_total
        self.max_bytes = max_bytes
        self.per_worker: dict[str, int] = {}
        self.total = 0
        self.bytes = 0
        self.refused = 0

    @contextlib.contextmanager
    def ticket(self) -> Iterator[InflightTicket]:
        ticket = InflightTicket(self)
        try:
            yield ticket
        finally:
            ticket.release()


class InflightTicket:
    """One push's share of the :class:`Backpressure` budget; released when the call ends."""

    def __init__(self, budget: Backpressure) -> None:
        self.budget = budget
        self.worker_id: str | None = None
        self.bytes = 0

    def enter(self, worker_id: str) -> None:
        """Count the push against its worker and the total.

        Raises:
            ResourceExhausted: too many pushes in flight (RESOURCE_EXHAUSTED, retryable).
        """
        b = self.budget
        mine = b.per_worker.get(worker_id, 0)
        if mine >= b.max_per_worker or b.total >= b.max_total:
            b.refused += 1
            raise ResourceExhausted(
                f"too many pushes in flight (worker {worker_id!r}: {mine}/{b.max_per_worker}, "
                f"server: {b.total}/{b.max_total}); retry with backoff"
            )
        b.per_worker[worker_id] = mine + 1
        b.total += 1
        self.worker_id = worker_id

    def reserve(self, nbytes: int) -> None:
        """Reserve a tensor's bytes before its buffer is allocated.

        Raises:
            ResourceExhausted: the in-flight byte bound would be passed (RESOURCE_EXHAUSTED).
        """
        b = self.budget
        if b.bytes and b.bytes + nbytes > b.max_bytes:
            b.refused += 1
            raise ResourceExhausted(
                f"push of {nbytes} bytes refused: {b.bytes} of {b.max_bytes} in-flight bytes "
                "in use; retry with backoff"
            )
        b.bytes += nbytes
        self.bytes += nbytes

    def release(self) -> None:
        b = self.budget
        b.bytes -= self.bytes
        self.bytes = 0
        if self.worker_id is not None:
            left = b.per_worker[self.worker_id] - 1
            if left:
                b.per_worker[self.worker_id] = left
            else:
                del b.per_worker[self.worker_id]
            b.total -= 1
            self.worker_id = None


class ServerEngine(LeaseReaperBase[ServerConfig]):
    """Owns the core, wakes waiters on change, and runs the lease reaper.

    Construct and use it inside a running event loop; it creates its asyncio objects lazily.

    Args:
        config: Server configuration.
        now: Monotonic clock in seconds (injectable for tests).
    """

    _reaper_label = "lease reaper"
    _reaper_logger = logger

    def __init__(self, config: ServerConfig, *, now: Callable[[], float] = time.monotonic) -> None:
        super().__init__(config, now=now)
        self.core = ServerCore(config)
        #: Staleness, drops, barrier waits, checkpoints (plain counters; status and metrics).
        #: Barrier times are wall-clock (they carry over a restart in checkpoints and the log).
        self.obs = ShardObservations(bsp=self.core.consistency is Consistency.BSP)
        self.core.observer = self.obs
        #: Push/pull bytes and latencies at the servicer seams (no-op without metrics).
        self.hooks = ServingHooks()
        #: Write-ahead log; when set, every mutation is durable before it is acknowledged.
        self.wal: WriteAheadLog | None = None
        #: Set when the log failed with memory possibly ahead of it (an fsync error): from
        #: then on every mutation and pull is refused (:meth:`check_serving`).
        self.storage_failure: StorageError | None = None
        #: Told once of that failure (the daemon turns health NOT_SERVING).
        self.on_storage_failure: Callable[[StorageError], None] | None = None
        #: The replica role when the shard has backups: a mutation is acknowledged only once
        #: every backup in sync holds it durably, and only a primary serves.
        self.replication: ReplicaRole | None = None
        #: Big push applies and pull copies in worker threads, keys reserved (see offload.py).
        self.offload = Offload(lambda: self.core.store, min_bytes=config.offload_min_bytes)
        self.core.step_applier = self.offload.apply_detached
        self.backpressure = Backpressure(
            config.max_inflight_pushes_per_worker,
            config.max_inflight_pushes,
            config.max_inflight_push_bytes,
        )

    # ------------------------------------------------------------------ lifecycle
    async def stop(self) -> None:
        """Finish the scheduled applies, stop their threads, then stop the reaper."""
        await self.offload.drain()
        self.offload.close()
        await super().stop()

    def _credit_stall(self, stall_s: float) -> None:
        self.core.cluster.credit_leases(stall_s)

    async def _reap(self) -> None:
        if self.storage_failure is not None:
            return  # serving nothing; a restart replays the log
        lapsed = self.core.lapsed(self.now())
        if not lapsed:
            return

        def evict(log: LogFn) -> None:
            for worker_id in lapsed:  # one sweep: consecutive records, replayed together
                log(wal_records.depart(worker_id, "evicted"))
            for ch in self.core.evict(lapsed):
                logger.warning(
                    "evicted worker %s (clock %d): lease of %d ms lapsed",
                    ch.worker.worker_id,
                    ch.worker.clock,
                    self.config.lease_ms,
                )

        try:
            await self.mutate(evict)
        except (StorageFull, StorageError) as exc:
            # Part of the sweep may be in the log and not applied: stop mutating rather than
            # log the same evictions again (a restart replays the log, which is the truth).
            self._storage_failed(
                exc if isinstance(exc, StorageError) else StorageError(exc.message)
            )

    # ------------------------------------------------------------------ the mutation funnel
    async def mutate(
        self,
        decide: Callable[[LogFn], T],
        *,
        settle: Callable[[T], Awaitable[None] | None] | None = None,
        duplicate: Callable[[T], bool] | None = None,
    ) -> T:
        """Run one state change through the funnel: validate -> log -> apply -> durable.

        Args:
            decide: Runs synchronously (no await inside): validates everything the mutation
                needs (limits and memory included; raising refuses the request with nothing
                changed and nothing logged), then calls ``log(record)`` with the record(s) of
                the decided mutation (records from :mod:`~paramserver.server.wal_records`;
                a list of records is written as one all-or-nothing write) before it changes
                anything, then applies it and returns the answer. A
                ``log`` that raises (disk full, I/O error) leaves the log as it was; ``decide``
                lets the error propagate with nothing applied.
            settle: What the apply scheduled off the event loop (big push applies in worker
                threads), awaited shielded from cancellation before durability; it returns
                None when nothing is pending (small applies ran inline), which costs no task.
            duplicate: Tells whether the answer is that of a retried request already applied;
                such an answer waits until everything logged before it (its original) is
                durable.

        Returns:
            ``decide``'s answer, once its record (or its original's) is durable.

        Raises:
            ReadOnly (FAILED_PRECONDITION): a read-only server (``config.read_only``) refuses
                every mutation here, before ``decide`` runs, whatever its kind.
            StorageError (UNAVAILABLE): the log failed earlier or now (its fsync); StorageFull
                (RESOURCE_EXHAUSTED): the disk is full (nothing applied); whatever ``decide``
                raises.
        """
        if self.config.read_only:
            raise ReadOnly(
                "this server is read-only (serve --read-only --from-export): it answers pulls "
                "and refuses every change (registration, clock, declaration, push); read "
                "with a client that does not register (connect(..., register=False))"
            )
        self.check_serving()
        seq = 0

        def log(record: wal_pb.WalRecord | list[wal_pb.WalRecord]) -> None:
            nonlocal seq
            got = self.log_many(record) if isinstance(record, list) else self.log(record)
            seq = got or seq

        answer = decide(log)
        pending = settle(answer) if settle is not None else None
        if pending is not None:
            await asyncio.shield(pending)  # applied exactly once even if cancelled
        self.notify()
        if seq == 0 and self.wal is not None and duplicate is not None and duplicate(answer):
            seq = self.wal.next_sequence - 1  # the original was logged before: wait for it
        await self.durable(seq)
        if self.replication is not None and seq > 0:
            await self.replication.replicated(seq)  # every backup in sync holds it durably
        return answer

    # ------------------------------------------------------------------ durability
    def check_serving(self) -> None:
        """Refuse a request once the write-ahead log failed (memory may be ahead of it).

        Raises:
            StorageError: (UNAVAILABLE) naming the log and the failure; restart the server.
        """
        if self.storage_failure is not None:
            raise StorageError(self.storage_failure.message)
        if self.replication is not None:
            self.replication.check_primary()

    def log(self, record: wal_pb.WalRecord) -> int:
        """Write a decided mutation's record to the log, before the mutation is applied.

        Returns:
            The record's sequence for :meth:`durable` (0 without a log).

        Raises:
            StorageFull / StorageError: the record was not written (the log is as before);
                the caller must refuse the request without applying it.
        """
        self.check_serving()
        if self.wal is None:
            return 0
        return self.wal.append(record)

    def log_many(self, records: list[wal_pb.WalRecord]) -> int:
        """Write several records of one decided mutation as one write, all or none (see
        :meth:`WriteAheadLog.append_many`).

        Returns:
            The last record's sequence (0 without a log or records).

        Raises:
            StorageFull / StorageError: none of the records was written.
        """
        self.check_serving()
        if self.wal is None or not records:
            return 0
        return self.wal.append_many(records)

    async def durable(self, sequence: int) -> None:
        """Wait until record ``sequence`` is fsynced, before acknowledging its mutation.

        Raises:
            StorageError: (UNAVAILABLE) the fsync failed: the mutation is applied in memory but
                may not survive, so the server stops serving mutations and pulls
                (health NOT_SERVING) until it is restarted.
        """
        if self.wal is None or sequence <= 0:
            return
        try:
            await self.wal.durable(sequence)
        except StorageError as exc:
            self._storage_failed(exc)
            raise

    def _storage_failed(self, exc: StorageError) -> None:
        if self.storage_failure is not None:
            return
        self.storage_failure = exc
        logger.critical("%s", exc.message)
        self.notify()  # waiting pulls re-check and are refused
        if self.on_storage_failure is not None:
            self.on_storage_failure(exc)

    # ------------------------------------------------------------------ waiting
    async def wait_pull(self, worker_id: str, timeout_s: float) -> Admission:
        """Wait until a pull by ``worker_id`` is admitted by the consistency model.

        Args:
            worker_id: Live worker id (empty: observer read, admitted at once).
            timeout_s: Deadline of the wait in seconds.

        Returns:
            The admission decision.

        Raises:
            WaitTimeout: still not admitted after ``timeout_s``; names the workers waited for
                (DEADLINE_EXCEEDED).
            Aborted: the step was aborted by the ``fail_fast`` policy (ABORTED).
            Unavailable: the server is shutting down (UNAVAILABLE, retryable).
            WorkerNotFound: the worker is (or became, while waiting) not live
                (FAILED_PRECONDITION).
        """
        return await self.wait_admitted(
            lambda: self.core.check_pull(worker_id), f"pull by {worker_id!r}", timeout_s
        )

    async def wait_admitted(
        self, decide: Callable[[], Admission], what: str, timeout_s: float
    ) -> Admission:
        """Wait until ``decide()`` admits, re-deciding at every change of the shard: the one
        wait loop of dense pulls and row pulls.

        Args:
            decide: The consistency model's decision now (called with no await before it).
            what: The waiter in messages, e.g. ``"pull by 'w0-1'"``.
            timeout_s: Deadline of the wait in seconds.

        Returns:
            The admitting decision.

        Raises:
            WaitTimeout (DEADLINE_EXCEEDED), Aborted (ABORTED), Unavailable (UNAVAILABLE),
            WorkerNotFound (FAILED_PRECONDITION): as :meth:`wait_pull` says.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            if self.shutting_down:
                raise Unavailable("server is shutting down: retry against its successor")
            self.check_serving()  # the log failed: no reads of state it may not hold
            adm = decide()
            if adm.admitted:
                return adm
            if adm.aborted:
                raise Aborted(adm.reason)
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise WaitTimeout(
                    f"{what} waited {timeout_s:.3f} s for workers "
                    f"[{', '.join(adm.waiting_for)}]: {adm.reason}"
                )
            change = self._next_change()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(change), remaining)
