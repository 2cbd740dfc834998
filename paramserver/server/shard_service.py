"""The funnel of a server shard: every push, pull and membership change of every transport.

The gRPC servicer, the ``Session`` stream and the same-host local link decode their requests and
call a :class:`ShardService`; it builds every write-ahead-log record of a dense-key mutation
(register, leave, init, push, clock), waits as the consistency model requires, hands big work
to worker threads and answers once the change is durable. The transports encode the answers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from paramserver.api.v1 import parameter_server_pb2 as pb
from paramserver.core.consistency import Consistency, WorkerRecord
from paramserver.core.decompress import Encoded, decode
from paramserver.core.optimizers import HALF_DTYPES, UpdateRule
from paramserver.core.shard import PushResult
from paramserver.errors import InvalidArgument
from paramserver.protocol import tensor
from paramserver.security.tokens import check_worker_identity
from paramserver.server import wal_records
from paramserver.server.engine import LogFn, ServerEngine
from paramserver.server.observability.hooks import (
    observed_admit,
    observed_push,
    observed_snapshot,
    observed_snapshots,
)

if TYPE_CHECKING:
    from paramserver.core.sharding import ShardMap
    from paramserver.server.checkpoint import CheckpointManager

logger = logging.getLogger(__name__)

_CONSISTENCY_PB = {
    Consistency.BSP: pb.CONSISTENCY_BSP,
    Consistency.SSP: pb.CONSISTENCY_SSP,
    Consistency.ASP: pb.CONSISTENCY_ASP,
}


class ShardHost(Protocol):
    """What the daemon serving a shard offers its RPCs: checkpoints and the shard map."""

    @property
    def checkpoints(self) -> CheckpointManager | None: ...

    @property
    def shard_map(self) -> ShardMap | None: ...

    def request_checkpoint(self) -> asyncio.Task[Path | None]: ...


class PulledFrames(list[bytes]):
    """The wire frames of one pulled key; ``nbytes`` is the value's size in bytes (what the
    pull metrics count), not the frames' (which add their headers)."""

    def __init__(self, frames: Iterable[bytes], *, nbytes: int) -> None:
        super().__init__(frames)
        self.nbytes = nbytes


class ShardService:
    """The one path of every dense-key request of a shard, whatever transport brought it.

    Args:
        engine: The shard's engine (core state, write-ahead log, worker threads, waits).
    """

    def __init__(self, engine: ServerEngine) -> None:
        self.engine = engine
        self.core = engine.core

    def view(self) -> pb.ClusterView:
        view = pb.ClusterView()
        self.view_into(view)
        return view

    def view_into(self, view: pb.ClusterView) -> None:
        """Fill ``view`` (e.g. a response's own field: no message copy) with the cluster now."""
        cluster = self.core.cluster
        view.consistency = _CONSISTENCY_PB[self.core.consistency]
        view.staleness = cluster.staleness
        view.live_workers = len(cluster.live_workers())
        view.min_clock = cluster.min_clock()
        view.membership_epoch = cluster.epoch

    async def register(self, request: pb.RegisterRequest) -> pb.RegisterResponse:
        """Register a worker (a new registration, a replacement or a resumption); logged and
        durable before the answer.

        Raises:
            AlreadyExists (ALREADY_EXISTS), InvalidArgument (INVALID_ARGUMENT), Unavailable.
        """
        check_worker_identity(request.worker_name)  # (per-worker tokens: docs/security.md)

        def decide(log: LogFn) -> WorkerRecord:
            return self.core.register(
                request.worker_name,
                self.engine.now(),
                replace=request.replace,
                client_nonce=request.client_nonce,
                resume_worker_id=request.resume_worker_id,
                resume=request.resume,
                log=lambda worker_id: log(
                    wal_records.register(
                        request.worker_name,
                        request.replace,
                        request.client_nonce,
                        worker_id,
                        request.resume_worker_id,
                        request.resume,
                    )
                ),
            )

        rec = await self.engine.mutate(decide)
        logger.info("registered %s at clock %d", rec.worker_id, rec.clock)
        return pb.RegisterResponse(
            worker_id=rec.worker_id,
            lease_ms=self.engine.config.lease_ms,
            clock=rec.clock,
            view=self.view(),
        )

    def heartbeat(self, request: pb.HeartbeatRequest) -> pb.HeartbeatResponse:
        """Renew a worker's lease; a replicated shard's answer names its replicas' addresses
        as they are now (a replica placed again on another host serves at a new one).

        Raises:
            WorkerNotFound (FAILED_PRECONDITION): the lease expired or the worker left.
        """
        check_worker_identity(request.worker_id)
        self.core.heartbeat(request.worker_id, self.engine.now())
        role = self.engine.replication
        return pb.HeartbeatResponse(
            lease_ms=self.engine.config.lease_ms,
            view=self.view(),
            replicas=role.addresses if role is not None else (),
        )

    async def leave(self, request: pb.LeaveRequest) -> pb.LeaveResponse:
        """A worker leaves; logged and durable before the answer."""
        check_worker_identity(request.worker_id)
        record = wal_records.depart(request.worker_id, "left")
        change = await self.engine.mutate(
            lambda log: self.core.leave(request.worker_id, log=lambda: log(record))
        )
        logger.info("worker %s left at clock %d", change.worker.worker_id, change.worker.clock)
        return pb.LeaveResponse(view=self.view())

    async def init(self, header: pb.InitHeader, tensors: dict[str, np.ndarray]) -> pb.InitResponse:
        """Declare keys with their initial values (first writer wins; logged when any key is
        created).

        Raises:
            KeyConflict (ALREADY_EXISTS), InvalidArgument (INVALID_ARGUMENT).
        """
        rule = UpdateRule.from_proto(header.rule) if header.HasField("rule") else UpdateRule()
        logging_on = self.engine.wal is not None

        def decide(log: LogFn) -> dict[str, bool]:
            def log_created(will_create: dict[str, bool]) -> None:
                if logging_on and any(will_create.values()):
                    created = {k: tensors[k] for k, c in will_create.items() if c}
                    log(wal_records.init(rule, created))

            # Receive buffers: stored, not copied.
            return self.core.init(tensors, rule, take=True, log=log_created)

        created = await self.engine.mutate(decide)
        return pb.InitResponse(keys=[pb.KeyInit(key=k, created=c) for k, c in created.items()])

    async def apply_push_header(
        self,
        header: pb.PushHeader,
        grads: dict[str, np.ndarray],
        *,
        encoded: dict[str, Encoded] | None = None,
        finite: bool = False,
    ) -> pb.PushResponse:
        """:meth:`apply_push` of a push as a transport hands it: its wire ``PushHeader``, its
        dense gradients, and its compressed ones as received.

        Args:
            encoded: key -> compressed gradient (cast or top-k; keys not in ``grads``), decoded
                here, the one place for every transport, into a dense gradient of the key's
                dtype and shape (:func:`paramserver.core.decompress.decode`).

        Raises:
            KeyNotFound, InvalidArgument, DimensionMismatch, MalformedStream: a compressed
                gradient that does not fit its key (see ``decode``); then as :meth:`apply_push`.
        """
        if encoded:
            store = self.core.store
            grads = {**grads, **{key: decode(store, key, enc) for key, enc in encoded.items()}}
        return await self.apply_push(
            worker_id=header.worker_id,
            request_id=header.request_id,
            clock=header.clock,
            num_samples=header.num_samples,
            base_version=header.base_version if header.HasField("base_version") else None,
            grads=grads,
            finite=finite,
        )

    @observed_push
    async def apply_push(
        self,
        *,
        worker_id: str,
        request_id: int,
        clock: int,
        num_samples: int,
        base_version: int | None,
        grads: dict[str, np.ndarray],
        finite: bool = False,
    ) -> pb.PushResponse:
        """Apply one decoded push (the seam every push path shares: Push stream, Session).

        Args:
            grads: key -> decoded gradient (dtype and shape checked by the core). The arrays may
                be views of a receive buffer or shared memory; they are not kept after return.
            finite: The transport already found every gradient free of NaN/Inf (one scan of
                the bytes they were read from); the per-key scan is skipped.

        Raises:
            InvalidArgument, KeyNotFound, WorkerNotFound, StaleUpdate (see ``ServerCore.push``).
        """
        if not worker_id:
            raise InvalidArgument("push header needs a worker_id")
        check_worker_identity(worker_id)
        if not grads:
            raise InvalidArgument("a push needs at least one gradient; it carried none")
        offload = self.engine.offload
        # Big gradients: the NaN/Inf scan runs in a worker thread (a failed scan leaves it to
        # the core, which refuses the push with its usual bookkeeping). Small ones (the
        # common case) skip the coroutine hops: the core scans them inline.
        finite = finite or (
            not self.engine.config.allow_non_finite
            and offload.worth_a_thread(grads)
            and await offload.all_finite(grads)
        )
        # Half-precision keys are range-checked when the push is decided (before it is
        # logged), which reads their values: wait until no earlier update of them is still
        # applying. Both waits are re-checked together; no await between them and the decision.
        ranged = [k for k, g in grads.items() if g.dtype in HALF_DTYPES]
        while offload.holding_writers or (ranged and not offload.idle(ranged)):
            if offload.holding_writers:  # (a checkpoint may hold decisions back)
                await offload.admit_writer()
            else:
                await offload.settled(ranged)
        applied: list[asyncio.Future[None]] = []
        logging_on = self.engine.wal is not None

        def decide(log: LogFn) -> PushResult:
            def log_push() -> None:  # decided: the record goes to the log before any apply
                if logging_on:
                    log(
                        wal_records.push(
                            worker_id, request_id, clock, num_samples, base_version, grads
                        )
                    )

            return self.core.push(
                worker_id,
                request_id,
                clock,
                grads,
                self.engine.now(),
                num_samples=num_samples,
                base_version=base_version,
                applier=lambda checked: applied.append(offload.apply(checked)),
                finite_checked=finite,
                log=log_push,
            )

        def settle(_: PushResult) -> Awaitable[None] | None:
            pending = [done for done in applied if not done.done()]
            return _each(pending) if pending else None  # (small applies ran inline)

        result = await self.engine.mutate(
            decide, settle=settle, duplicate=lambda r: bool(r.duplicate)
        )
        resp = pb.PushResponse(
            duplicate=result.duplicate,
            applied_updates=result.applied_updates,
            dropped_stale=result.dropped_stale,
        )
        self.view_into(resp.view)
        return resp

    @observed_admit
    async def admit_pull(self, worker_id: str, keys: Iterable[str], timeout_ms: int) -> list[str]:
        """Check the keys and wait as the consistency model requires (every pull path shares it).

        Args:
            worker_id: The pulling worker; "" reads as an observer (no wait).
            keys: Keys to read; empty means every key.
            timeout_ms: Wait deadline in milliseconds; 0 means the server's default.

        Returns:
            The keys to send, in order.

        Raises:
            KeyNotFound (NOT_FOUND), WaitTimeout (DEADLINE_EXCEEDED), Aborted (ABORTED).
        """
        check_worker_identity(worker_id)
        key_list = self.core.require_keys(keys)
        wait_ms = timeout_ms or self.engine.config.wait_timeout_ms
        await self.engine.wait_pull(worker_id, wait_ms / 1000.0)
        return key_list

    @observed_snapshot
    async def pull_frame_bytes(self, key: str) -> PulledFrames:
        """A consistent value of one key as the wire bytes of its ``PullResponse(frame=...)``
        messages (:func:`paramserver.protocol.tensor.encode_frame_bytes`): taken after every
        push of the key decided before the call has been applied, every frame made at once, the
        value copied once straight into them (big keys in a worker thread; see
        :mod:`paramserver.server.apply_threads`)."""
        wait_s = self.engine.config.wait_timeout_ms / 1000.0

        def frames(value: np.ndarray) -> PulledFrames:
            return PulledFrames(tensor.encode_frame_bytes(key, value), nbytes=value.nbytes)

        return await self.engine.offload.read_with(key, frames, timeout_s=wait_s)

    @observed_snapshots
    async def pull_snapshots_bytes(self, keys: Sequence[str]) -> list[bytes]:
        """Consistent values of several keys as raw little-endian C-order bytes (inline wire
        payloads), in order: when every key is small and no update of any is still applying,
        all are copied now in one pass (no ``await`` between the check and the copies); else
        key by key, each taken as :meth:`pull_frame_bytes` takes its value.

        Raises:
            KeyNotFound: (NOT_FOUND) an unknown key.
            WaitTimeout: (DEADLINE_EXCEEDED) earlier updates did not finish in time.
        """
        values = self.engine.offload.read_all_now(keys)
        if values is not None:
            return [value.tobytes() for value in values]
        offload = self.engine.offload
        wait_s = self.engine.config.wait_timeout_ms / 1000.0
        out = []
        for key in keys:
            value = offload.read_now(key)
            if value is None:
                value = await offload.snapshot(key, timeout_s=wait_s)
            out.append(value.tobytes())  # taken before the next await
        return out

    async def pull_snapshot_into(self, key: str, out: np.ndarray) -> None:
        """A consistent value of one key written into ``out`` (one copy, e.g. into a client's shared
        memory): a consistent copy of one key's value.

        Args:
            out: Array of the key's dtype and shape to overwrite.
        """
        wait_s = self.engine.config.wait_timeout_ms / 1000.0
        await self.engine.offload.snapshot(key, out, timeout_s=wait_s)

    async def pull_snapshots_into(self, keys: Sequence[str], outs: Sequence[np.ndarray]) -> None:
        """:meth:`pull_snapshot_into` of several keys at once (one decision and at most one
        worker-thread hop for the request; see :meth:`Offload.snapshot_many`).

        Args:
            keys: Declared keys.
            outs: One array per key, of its dtype and shape, to overwrite.
        """
        wait_s = self.engine.config.wait_timeout_ms / 1000.0
        await self.engine.offload.snapshot_many(keys, outs, timeout_s=wait_s)

    async def clock(self, request: pb.ClockRequest) -> pb.ClockResponse:
        """A worker ends an iteration; logged and durable before the answer."""
        check_worker_identity(request.worker_id)
        record = wal_records.clock(request.worker_id, request.clock)
        new = await self.engine.mutate(
            lambda log: self.core.clock(request.worker_id, request.clock, log=lambda: log(record))
        )
        return pb.ClockResponse(clock=new, view=self.view())


async def _each(futures: Sequence[asyncio.Future[None]]) -> None:
    """Wait for each of ``futures`` in turn (the first failure is raised)."""
    for future in futures:
        await future
