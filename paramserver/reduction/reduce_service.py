"""Reduction service (``paramserver serve --mode reduce``): gradients in, aggregates out.

Workers submit per-layer gradients for a step and receive the step's aggregate back; the server
holds no parameters, like the reduction server of data-parallel training (Google Cloud Vertex
AI "Reduction Server"; Horovod/NCCL all-reduce with the reduction moved to a server). Every
aggregate is made by :class:`paramserver.core.aggregation.DistributedOptimizer` (one
aggregation pipeline in the product) under the strategy chosen at start:

* ``synchronous`` -- one update per active worker per (layer, step); the step's aggregate is
  made once every active worker (or the first ``replicas_to_aggregate``) has sent it;
* ``asynchronous`` -- each reduce is aggregated on arrival and opens the next step (the step is
  a version counter); staleness ``current - step`` above the threshold is refused (Zhang et
  al. 2016);
* ``federated_average`` -- weighted by ``num_samples`` once ``min_updates`` workers have sent
  the round's update (McMahan et al. 2017);
* ``gossip`` -- the server is only the peer directory (:meth:`ReductionCoordinator.peers`);
  workers average among themselves by push-sum (Kempe et al. 2003), see
  :mod:`paramserver.reduction.gossip_worker`. A reduce is refused (INVALID_ARGUMENT).

Layers of a step and membership (leases, eviction): :mod:`paramserver.reduction.coordinator`.

Layout (docs/architecture.md): :class:`~paramserver.reduction.coordinator.ReductionCoordinator`
is pure synchronous state with time passed in; :class:`ReductionEngine` is the one place that
waits (asyncio, every wait with a deadline that names the workers still missing);
:class:`ReductionServicer` only decodes, calls and encodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Final, Protocol

import grpc
import numpy as np
import numpy.typing as npt

from paramserver.api.v1 import parameter_server_pb2 as ps_pb
from paramserver.api.v1 import reduction_pb2 as pb
from paramserver.api.v1 import reduction_pb2_grpc as pb_grpc
from paramserver.core.aggregation import (
    Asynchronous,
    FederatedAverage,
    GossipAverage,
    Strategy,
    Synchronous,
)
from paramserver.errors import InvalidArgument, Unavailable, WaitTimeout, WorkerNotFound
from paramserver.method_handlers import ServicerContext
from paramserver.protocol import headed_stream, tensor
from paramserver.reduction.coordinator import (
    ReduceOutcome,
    ReductionCoordinator,
    Registration,
    Ticket,
)
from paramserver.security.http_access import HttpSecurity
from paramserver.security.tokens import check_worker_identity
from paramserver.serving.error_status import grpc_errors
from paramserver.serving.lease_reaper import LeaseReaperBase

__all__ = [
    "SERVICE_NAME",
    "ReduceOutcome",
    "ReductionCoordinator",
    "ReductionEngine",
    "ReductionServicer",
    "Registration",
    "Ticket",
    "add_reduction_service",
    "strategy_from_config",
]

logger = logging.getLogger(__name__)

SERVICE_NAME: Final[str] = "paramserver.api.v1.ReductionService"
"""Full gRPC service name (also the health-check service name in ``reduce`` mode)."""

_STRATEGY_PB: Final[dict[type, pb.ReductionStrategy.ValueType]] = {
    Synchronous: pb.REDUCTION_STRATEGY_SYNCHRONOUS,
    Asynchronous: pb.REDUCTION_STRATEGY_ASYNCHRONOUS,
    FederatedAverage: pb.REDUCTION_STRATEGY_FEDERATED_AVERAGE,
    GossipAverage: pb.REDUCTION_STRATEGY_GOSSIP,
}
_AGGREGATION_PB: Final[dict[str, ps_pb.Aggregation.ValueType]] = {
    "mean": ps_pb.AGGREGATION_MEAN,
    "sum": ps_pb.AGGREGATION_SUM,
    "weighted_mean": ps_pb.AGGREGATION_WEIGHTED_MEAN,
}


class ReductionSettings(Protocol):
    """What the reduction server reads of its configuration (``paramserver serve --mode
    reduce`` builds a :class:`~paramserver.server.config.ServerConfig`, which has all of it).
    Units and meaning are the config's."""

    @property
    def host(self) -> str: ...
    @property
    def port(self) -> int: ...
    @property
    def mode(self) -> str: ...
    @property
    def lease_ms(self) -> int: ...
    @property
    def wait_timeout_ms(self) -> int: ...
    @property
    def grace_s(self) -> float: ...
    @property
    def aggregation(self) -> str: ...
    @property
    def allow_non_finite(self) -> bool: ...
    @property
    def max_tensor_bytes(self) -> int | None: ...
    @property
    def max_receive_message_bytes(self) -> int: ...
    @property
    def reduce_strategy(self) -> str: ...
    @property
    def replicas_to_aggregate(self) -> int | None: ...
    @property
    def staleness_threshold(self) -> int: ...
    @property
    def scale_by_staleness(self) -> bool: ...
    @property
    def min_updates(self) -> int: ...
    @property
    def fanout(self) -> int: ...
    @property
    def metrics_host(self) -> str: ...
    @property
    def metrics_port(self) -> int | None: ...
    def metrics_security(self) -> HttpSecurity | None: ...


def strategy_from_config(config: ReductionSettings) -> Strategy:
    """The aggregation strategy a ``reduce``-mode config asks for.

    Args:
        config: Server configuration (``reduce_strategy`` and its parameters).

    Returns:
        ``Synchronous(replicas_to_aggregate)``, ``Asynchronous(staleness_threshold,
        scale_by_staleness)``, ``FederatedAverage(min_updates)`` or ``GossipAverage(fanout)``.

    Raises:
        InvalidArgument: (INVALID_ARGUMENT) an unknown strategy name.
    """
    name = config.reduce_strategy
    if name == "synchronous":
        return Synchronous(replicas_to_aggregate=config.replicas_to_aggregate)
    if name == "asynchronous":
        return Asynchronous(
            staleness_threshold=config.staleness_threshold,
            scale_by_staleness=config.scale_by_staleness,
        )
    if name == "federated_average":
        return FederatedAverage(min_updates=config.min_updates)
    if name == "gossip":
        return GossipAverage(fanout=config.fanout)
    raise InvalidArgument(f"unknown reduce strategy {name!r}")


# --------------------------------------------------------------------------------------------
# Waiting


class ReductionEngine(LeaseReaperBase[ReductionSettings]):
    """Owns the coordinator, wakes waiting reduces on change, and runs the lease reaper.

    Construct and use it inside a running event loop.

    Args:
        config: Server configuration (``reduce_strategy`` and its parameters, ``aggregation``,
            ``lease_ms``, ``wait_timeout_ms``, ``allow_non_finite``, ``max_tensor_bytes``).
        now: Monotonic clock in seconds (injectable for tests).

    Raises:
        InvalidArgument: (INVALID_ARGUMENT) an invalid strategy configuration.
    """

    _reaper_label = "reduction lease reaper"
    _reaper_logger = logger

    def __init__(
        self, config: ReductionSettings, *, now: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__(config, now=now)
        self.coordinator = ReductionCoordinator(
            strategy_from_config(config),
            config.aggregation,
            lease_s=config.lease_ms / 1000.0,
            reject_non_finite=not config.allow_non_finite,
        )

    def _credit_stall(self, stall_s: float) -> None:
        self.coordinator.optimizer.credit_stall(stall_s)

    async def _reap(self) -> None:
        if self.coordinator.expire(self.now()):
            self.notify()

    async def wait(self, ticket: Ticket, timeout_s: float) -> ReduceOutcome:
        """Wait for a ticket's aggregates; the ticket is released on every way out.

        Args:
            ticket: From :meth:`ReductionCoordinator.submit`.
            timeout_s: Deadline of the wait, seconds.

        Returns:
            The outcome.

        Raises:
            WaitTimeout: (DEADLINE_EXCEEDED) not aggregated within ``timeout_s``; names the
                workers whose updates are still missing and the open layers.
            WorkerNotFound: (FAILED_PRECONDITION) the worker was evicted or left while
                waiting.
            Unavailable: (UNAVAILABLE, retryable) the server is shutting down.
        """
        coordinator = self.coordinator
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        try:
            while True:
                outcome = coordinator.outcome(ticket)
                if outcome is not None:
                    return outcome
                if self.shutting_down:
                    raise Unavailable("reduction server is shutting down: retry elsewhere")
                if not coordinator.is_active(ticket.worker_id):
                    raise WorkerNotFound(
                        f"worker {ticket.worker_id!r} was evicted or left while waiting for "
                        f"the aggregate of step {ticket.step}"
                    )
                remaining = deadline - loop.time()
                if remaining <= 0:
                    still_open = {name for name, _, _ in coordinator.open_layers()}
                    open_layers = [layer for layer in ticket.layers if layer in still_open]
                    raise WaitTimeout(
                        f"reduce by {ticket.worker_id!r} for step {ticket.step} waited "
                        f"{timeout_s:.3f} s for workers "
                        f"[{', '.join(coordinator.waiting_for(ticket))}] "
                        f"(layers still open: {', '.join(open_layers) or 'none'})"
                    )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(self._next_change()), remaining)
        finally:
            coordinator.release(ticket)


# --------------------------------------------------------------------------------------------
# gRPC


async def _read_reduce(
    request_iterator: AsyncIterator[pb.ReduceRequest], max_tensor_bytes: int | None
) -> tuple[pb.ReduceHeader, dict[str, npt.NDArray[np.generic]]]:
    header, gradients = await headed_stream.read_headed_stream(
        request_iterator, head="header", what="reduce stream", max_tensor_bytes=max_tensor_bytes
    )
    return header, gradients


class ReductionServicer(pb_grpc.ReductionServiceServicer):
    """Implements ``paramserver.api.v1.ReductionService`` over a :class:`ReductionEngine`."""

    def __init__(self, engine: ReductionEngine) -> None:
        self.engine = engine
        self.coordinator = engine.coordinator

    def _view(self) -> pb.ReductionView:
        strategy = self.coordinator.strategy
        view = pb.ReductionView(
            strategy=_STRATEGY_PB[type(strategy)],
            aggregation=_AGGREGATION_PB[self.coordinator.optimizer.method],
            active_workers=self.coordinator.optimizer.active_worker_count(),
            step=self.coordinator.current_step,
        )
        if isinstance(strategy, Synchronous):
            view.replicas_to_aggregate = strategy.replicas_to_aggregate or 0
        elif isinstance(strategy, Asynchronous):
            view.staleness_threshold = strategy.staleness_threshold
        elif isinstance(strategy, FederatedAverage):
            view.min_updates = strategy.min_updates
        else:
            view.fanout = strategy.fanout
        return view

    @grpc_errors
    async def Register(
        self, request: pb.ReductionRegisterRequest, context: ServicerContext
    ) -> pb.ReductionRegisterResponse:
        check_worker_identity(request.worker_name)  # (per-worker tokens: docs/security.md)
        reg = self.coordinator.register(
            request.worker_name,
            self.engine.now(),
            replace=request.replace,
            client_nonce=request.client_nonce,
            gossip_address=request.gossip_address,
        )
        self.engine.notify()
        return pb.ReductionRegisterResponse(
            worker_id=reg.worker_id, lease_ms=self.engine.config.lease_ms, view=self._view()
        )

    @grpc_errors
    async def Heartbeat(
        self, request: pb.ReductionHeartbeatRequest, context: ServicerContext
    ) -> pb.ReductionHeartbeatResponse:
        check_worker_identity(request.worker_id)
        self.coordinator.heartbeat(request.worker_id, self.engine.now())
        return pb.ReductionHeartbeatResponse(
            lease_ms=self.engine.config.lease_ms, view=self._view()
        )

    @grpc_errors
    async def Leave(
        self, request: pb.ReductionLeaveRequest, context: ServicerContext
    ) -> pb.ReductionLeaveResponse:
        check_worker_identity(request.worker_id)
        self.coordinator.leave(request.worker_id)
        self.engine.notify()
        return pb.ReductionLeaveResponse(view=self._view())

    @grpc_errors
    async def Reduce(
        self, request_iterator: AsyncIterator[pb.ReduceRequest], context: ServicerContext
    ) -> AsyncIterator[pb.ReduceResponse]:
        config = self.engine.config
        header, gradients = await _read_reduce(request_iterator, config.max_tensor_bytes)
        if not header.worker_id:
            raise InvalidArgument("reduce header needs a worker_id")
        check_worker_identity(header.worker_id)
        ticket = self.coordinator.submit(
            header.worker_id,
            int(header.step),
            int(header.request_id),
            gradients,
            max(1, int(header.num_samples)),
            self.engine.now(),
        )
        self.engine.notify()
        timeout_ms = header.timeout_ms or config.wait_timeout_ms
        outcome = await self.engine.wait(ticket, timeout_ms / 1000.0)
        yield pb.ReduceResponse(
            result=pb.ReduceResult(
                step=outcome.step,
                next_step=outcome.next_step,
                layers=[
                    pb.LayerAggregate(
                        layer=layer,
                        contributing_workers=agg.contributing_workers,
                        total_samples=agg.total_samples,
                        worker_ids=list(agg.worker_ids),
                    )
                    for layer, agg in outcome.aggregates.items()
                ],
                view=self._view(),
            )
        )
        for layer, agg in outcome.aggregates.items():
            for frame in tensor.encode_frames(layer, np.asarray(agg.gradient)):
                yield pb.ReduceResponse(frame=frame)

    @grpc_errors
    async def Peers(self, request: pb.PeersRequest, context: ServicerContext) -> pb.PeersResponse:
        check_worker_identity(request.worker_id)
        peers = self.coordinator.peers(request.worker_id, self.engine.now())
        strategy = self.coordinator.strategy
        return pb.PeersResponse(
            peers=[pb.Peer(worker_id=p.worker_id, address=p.gossip_address) for p in peers],
            fanout=strategy.fanout if isinstance(strategy, GossipAverage) else 0,
            view=self._view(),
        )

    @grpc_errors
    async def Status(
        self, request: pb.ReductionStatusRequest, context: ServicerContext
    ) -> pb.ReductionStatusResponse:
        coordinator = self.coordinator
        stats = coordinator.optimizer.stats()
        return pb.ReductionStatusResponse(
            view=self._view(),
            workers=[
                pb.ReductionWorkerInfo(
                    worker_id=r.worker_id, worker_name=r.name, gossip_address=r.gossip_address
                )
                for r in coordinator.registrations()
            ],
            open_layers=[
                pb.OpenLayer(layer=layer, pending_updates=pending, waiting_for=waiting)
                for layer, pending, waiting in coordinator.open_layers()
            ],
            total_aggregations=stats.total_aggregations,
            dropped_updates=stats.dropped_updates,
            evicted_workers=coordinator.evicted_workers,
        )


def add_reduction_service(server: grpc.aio.Server, config: ReductionSettings) -> ReductionEngine:
    """Create a :class:`ReductionEngine` and register its servicer on ``server``.

    Call :meth:`ReductionEngine.start` once the server runs, :meth:`ReductionEngine.stop` after
    it stopped.

    Raises:
        InvalidArgument: (INVALID_ARGUMENT) an invalid strategy configuration.
    """
    engine = ReductionEngine(config)
    pb_grpc.add_ReductionServiceServicer_to_server(ReductionServicer(engine), server)
    return engine
