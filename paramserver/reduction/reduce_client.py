"""Async client of the reduction service (``paramserver serve --mode reduce``).

Usage::

    async with connect_reduction("127.0.0.1:50052", worker_name="w0") as rs:
        await rs.wait_for_workers(4, timeout_s=30)       # optional: the whole quorum is in
        for step in range(rs.step, rs.step + 100):
            agg = await rs.reduce(step, {"fc.w": g_w, "fc.b": g_b}, num_samples=32)
            # agg["fc.w"]: the step's aggregate, float64 (float32 for half inputs)

The server waits until the strategy's quorum for the step is met (every active worker under
``synchronous``), then every waiting worker receives the same aggregate. ``reduce`` has a
deadline; a :class:`~paramserver.errors.WaitTimeout` (DEADLINE_EXCEEDED) names the workers the
server still waits for, and calling ``reduce`` again for the same step resumes that wait (the
gradients of the first call count). A background task renews the lease every quarter lease, so
a worker that dies (no heartbeats) leaves the quorum once its lease lapses; ``close`` leaves at
once. Retries (UNAVAILABLE, RESOURCE_EXHAUSTED) use exponential backoff with full jitter and
reuse the request id, so a retried reduce is never counted twice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Unpack

import grpc
import numpy as np
import numpy.typing as npt

from paramserver.api.v1 import reduction_pb2 as pb
from paramserver.api.v1 import reduction_pb2_grpc as pb_grpc
from paramserver.errors import (
    AlreadyExists,
    InvalidArgument,
    MalformedStream,
    WaitTimeout,
)
from paramserver.protocol import headed_stream, tensor
from paramserver.waiting import Wait
from paramserver.worker_client.client import normalized_tensors
from paramserver.worker_client.lifecycle import ServiceSession, name_taken
from paramserver.worker_client.options import SessionOptions

__all__ = ["LayerInfo", "ReduceInfo", "ReductionClient", "ReductionOptions", "connect_reduction"]

logger = logging.getLogger(__name__)


#: Payload bytes per frame sent: 16 KiB under 1 MiB, so a whole message stays within a server
#: receive limit as low as 1 MiB (as the parameter-server client does).
_SEND_CHUNK_BYTES = tensor.DEFAULT_CHUNK_BYTES - (16 << 10)


@dataclass(frozen=True)
class LayerInfo:
    """Provenance of one layer's aggregate.

    Attributes:
        contributing_workers: Distinct workers whose updates were reduced.
        total_samples: Sum of their ``num_samples``.
        worker_ids: Contributing worker ids, in order of arrival.
    """

    contributing_workers: int
    total_samples: int
    worker_ids: tuple[str, ...]


@dataclass(frozen=True)
class ReduceInfo:
    """Metadata of the last reduce's answer.

    Attributes:
        step: Step the aggregate belongs to.
        next_step: The open step after it (what the next reduce carries).
        layers: Layer -> provenance.
        active_workers: Active workers as the server saw them.
    """

    step: int
    next_step: int
    layers: dict[str, LayerInfo]
    active_workers: int


class ReductionClient(ServiceSession["pb_grpc.ReductionServiceAsyncStub"]):
    """One worker's session with a reduction server.

    Args:
        address: ``host:port`` of the server.
        worker_name: Stable name; one live registration per name.
        wait_timeout_s: Default deadline of a reduce's wait for the aggregate, seconds.
        gossip_address: ``host:port`` of this worker's push-sum endpoint (gossip strategy).
        **options: Those of every worker session
            (:class:`~paramserver.worker_client.options.SessionOptions`): ``replace`` (fence a
            live registration of the same name, a restarted worker), ``rpc_timeout_s`` (the
            deadline of each unary call, and the transfer margin of a reduce beyond its wait,
            seconds; default 30), ``retry`` (backoff for UNAVAILABLE / RESOURCE_EXHAUSTED),
            ``heartbeat`` (renew the lease in the background; default on),
            ``channel_options`` (extra grpc channel options) and ``security`` (TLS / mutual
            TLS and bearer token, :class:`paramserver.security.tls.ClientSecurity`; None:
            plain text, no token).
    """

    _heartbeat_task_prefix = "paramserver-reduce-heartbeat-"
    _connect_name = "connect_reduction"

    def __init__(
        self,
        address: str,
        worker_name: str,
        *,
        wait_timeout_s: float = 60.0,
        gossip_address: str = "",
        **options: Unpack[SessionOptions],
    ) -> None:
        super().__init__(
            address, worker_name, wait_timeout_s=wait_timeout_s, close_timeout_s=None, **options
        )
        self.gossip_address = gossip_address
        #: The open step as last seen: the step the next reduce should carry.
        self.step = 0
        self.view: pb.ReductionView | None = None
        self.last: ReduceInfo | None = None
        self._unanswered: tuple[int, int] | None = None  # (step, request id) to resume

    # ------------------------------------------------------------------ lifecycle
    async def open(self) -> None:
        """Open the channel, register, and start heartbeats.

        Raises:
            AlreadyExists: (ALREADY_EXISTS) the name is live and ``replace`` is False.
            InvalidArgument: (INVALID_ARGUMENT) a gossip server and no ``gossip_address``.
            Unavailable: (UNAVAILABLE) the server cannot be reached within the retry deadline.
        """
        await super().open()

    def _new_stub(self, channel: grpc.aio.Channel) -> pb_grpc.ReductionServiceAsyncStub:
        return pb_grpc.ReductionServiceStub(channel)

    def _heartbeat_request(self) -> pb.ReductionHeartbeatRequest:
        return pb.ReductionHeartbeatRequest(worker_id=self.worker_id)

    def _leave_request(self) -> pb.ReductionLeaveRequest:
        return pb.ReductionLeaveRequest(worker_id=self.worker_id)

    # ------------------------------------------------------------------ membership
    def _seen(self, view: pb.ReductionView) -> None:
        self.view = view
        self.step = int(view.step)

    async def register(self) -> str:
        """Register (idempotent across retries); returns the worker id.

        Raises:
            AlreadyExists: (ALREADY_EXISTS) the name is live and ``replace`` is False (the
                message says to pass ``replace=True``; ``exc.hint``).
        """
        req = pb.ReductionRegisterRequest(
            worker_name=self.worker_name,
            replace=self.replace,
            client_nonce=self._nonce,
            gossip_address=self.gossip_address,
        )
        try:
            resp = await self._call(
                lambda: self.stub.Register(req, timeout=self.rpc_timeout_s), "register"
            )
        except AlreadyExists as exc:
            raise name_taken(exc) from exc.__cause__  # (the RpcError, as every mapped error)
        self.worker_id = resp.worker_id
        self.lease_ms = int(resp.lease_ms)
        self._seen(resp.view)
        self.evicted = False
        self._left = False
        return str(resp.worker_id)

    async def heartbeat(self) -> pb.ReductionView:
        """Renew the lease now; returns the server's view.

        Raises:
            WorkerNotFound: (FAILED_PRECONDITION) evicted or departed.
        """
        resp = await self._renew_lease()
        view: pb.ReductionView = resp.view
        return view

    async def wait_for_workers(self, count: int, *, timeout_s: float = 30.0) -> int:
        """Poll (with backoff) until at least ``count`` workers are active.

        Args:
            count: Active workers to wait for (this one included).
            timeout_s: Deadline, seconds.

        Returns:
            The active worker count seen.

        Raises:
            WaitTimeout: (DEADLINE_EXCEEDED) fewer than ``count`` after ``timeout_s``.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        delay = 0.005
        with Wait(
            f"{count} workers to be active at {self.address}",
            address=self.address,
            deadline=time.monotonic() + timeout_s,
            logger=logger,
        ) as waiting:
            while True:
                view = await self.heartbeat()
                if view.active_workers >= count:
                    return int(view.active_workers)
                if loop.time() >= deadline:
                    raise WaitTimeout(
                        f"{view.active_workers} of {count} workers active after {timeout_s:.3f} s"
                    )
                waiting.update(detail=f"{view.active_workers} of {count} active")
                await asyncio.sleep(min(delay, max(0.0, deadline - loop.time())))
                delay = min(delay * 2, 0.1)

    async def status(self) -> pb.ReductionStatusResponse:
        """The server's status: workers, open layers (and whom they wait for), counters."""
        return await self._call(
            lambda: self.stub.Status(pb.ReductionStatusRequest(), timeout=self.rpc_timeout_s),
            "status",
        )

    async def peers(self) -> pb.PeersResponse:
        """Gossip strategy: the other live workers and their push-sum endpoints.

        Raises:
            FailedPrecondition: (FAILED_PRECONDITION) not a gossip server, or this worker was
                evicted.
        """
        return await self._call(
            lambda: self.stub.Peers(
                pb.PeersRequest(worker_id=self.worker_id), timeout=self.rpc_timeout_s
            ),
            "peers",
        )

    # ------------------------------------------------------------------ data plane
    async def reduce(
        self,
        step: int | None,
        grads: Mapping[str, npt.NDArray[np.generic]],
        *,
        num_samples: int = 1,
        timeout_s: float | None = None,
    ) -> dict[str, npt.NDArray[np.generic]]:
        """Submit gradients for a step and wait for the step's aggregate.

        Args:
            step: Step the gradients were computed at (None: :attr:`step`, the open step last
                seen). Synchronous and federated servers accept only the open step.
            grads: Layer -> gradient, any shape; float16, bfloat16, float32, float64, int32 or
                int64 (the caller's arrays are never modified). A layer's shape is fixed by
                its first update on the server.
            num_samples: Examples behind the gradients (``weighted_mean`` and federated
                averaging weight them); ``>= 1``.
            timeout_s: Deadline of the wait for the aggregate, seconds (default
                ``wait_timeout_s``).

        Returns:
            Layer -> aggregate (a fresh writeable ndarray, the layer's shape; float64, or
            float32 when every input was float16/bfloat16), in the order of ``grads``. The
            answer's metadata is in :attr:`last`; :attr:`step` becomes the next open step.

        Raises:
            DimensionMismatch: (INVALID_ARGUMENT) a layer's shape differs from its first
                update; the message names the layer.
            InvalidArgument: (INVALID_ARGUMENT) NaN/Inf, no layers, a gossip server,
                ``num_samples < 1`` (raised here, before sending).
            StaleUpdate: (FAILED_PRECONDITION) a stale, future or duplicate step.
            WorkerNotFound: (FAILED_PRECONDITION) evicted or departed.
            WaitTimeout: (DEADLINE_EXCEEDED) the quorum was not met in time; the message names
                the workers still missing. Calling ``reduce`` again for the same step resumes.
            Unavailable: (UNAVAILABLE) the server could not be reached within the retry
                deadline.
        """
        if step is None:
            step = self.step
        if num_samples < 1:
            raise InvalidArgument(f"num_samples must be >= 1, got {num_samples}")
        wait_s = timeout_s if timeout_s is not None else (self.wait_timeout_s or 60.0)
        if self._unanswered is not None and self._unanswered[0] == step:
            request_id = self._unanswered[1]
        else:
            request_id = self._next_request_id
            self._next_request_id += 1
        self._unanswered = (step, request_id)
        arrays = normalized_tensors(grads)
        header = pb.ReduceHeader(
            worker_id=self.worker_id,
            request_id=request_id,
            step=step,
            num_samples=num_samples,
            timeout_ms=max(1, int(wait_s * 1000)),
        )

        def messages() -> Iterator[pb.ReduceRequest]:
            yield pb.ReduceRequest(header=header)
            for key, value in arrays.items():
                for frame in tensor.encode_frames(key, value, _SEND_CHUNK_BYTES):
                    yield pb.ReduceRequest(frame=frame)

        async def attempt() -> tuple[pb.ReduceResult, dict[str, npt.NDArray[np.generic]]]:
            call = self.stub.Reduce(messages(), timeout=wait_s + self.rpc_timeout_s)
            result, out = await headed_stream.read_headed_stream(
                call, head="result", what="reduce answer", head_first=False
            )
            return result, out

        result, out = await self._call(attempt, "reduce")
        self._unanswered = None
        self._seen(result.view)
        self.step = int(result.next_step)
        self.last = ReduceInfo(
            step=int(result.step),
            next_step=int(result.next_step),
            layers={
                layer.layer: LayerInfo(
                    contributing_workers=int(layer.contributing_workers),
                    total_samples=int(layer.total_samples),
                    worker_ids=tuple(layer.worker_ids),
                )
                for layer in result.layers
            },
            active_workers=int(result.view.active_workers),
        )
        missing = [k for k in arrays if k not in out]
        if missing:
            raise MalformedStream(f"reduce answer lacks layers {missing}")
        return {k: out[k] for k in arrays}


class ReductionOptions(SessionOptions, total=False):
    """The keyword arguments of :class:`ReductionClient` (and :func:`connect_reduction`)."""

    wait_timeout_s: float
    gossip_address: str


def connect_reduction(
    address: str, worker_name: str, **kwargs: Unpack[ReductionOptions]
) -> ReductionClient:
    """Open a reduction session: ``async with connect_reduction(addr, worker_name="w0") as rs``.

    Keyword arguments are those of :class:`ReductionClient`.
    """
    return ReductionClient(address, worker_name, **kwargs)
