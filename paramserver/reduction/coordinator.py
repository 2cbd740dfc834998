"""The reduction server's pure state: membership, leases and step bookkeeping.

:class:`ReductionCoordinator` wraps one :class:`~paramserver.core.aggregation.DistributedOptimizer`
for :mod:`paramserver.reduction.reduce_service` (whose engine waits and whose servicer decodes
and encodes). Every method that depends on time takes ``now`` (seconds on a monotonic clock);
nothing waits and nothing speaks gRPC.

Layers of a step: the step closes (the optimizer advances) once every layer submitted in it has
its aggregate; the first update of a layer fixes its shape for good. Under partial quorums
(backup workers, federated average) a worker late for a closed step gets that step's aggregate
(its own gradients dropped and counted), so every worker applies the same update.

Membership: register -> worker id ``"{name}#{incarnation}"`` and a lease; heartbeats, reduces
and directory look-ups renew it (the optimizer's last-seen time); a lapsed lease evicts the
worker through :meth:`DistributedOptimizer.evict_stale_workers`, which drops its pending
updates and re-evaluates every open quorum, so the others' reduces return without it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

from paramserver.core.aggregation import (
    AggregatedGradient,
    DistributedOptimizer,
    FederatedAverage,
    GossipAverage,
    GradientUpdate,
    Strategy,
    Synchronous,
)
from paramserver.errors import (
    AlreadyExists,
    DimensionMismatch,
    FailedPrecondition,
    InvalidArgument,
    StaleUpdate,
    WorkerNotFound,
)

__all__ = ["RETAIN_STEPS", "ReduceOutcome", "ReductionCoordinator", "Registration", "Ticket"]

logger = logging.getLogger(__name__)

#: Steps whose aggregates are kept after they closed (for a retried reduce whose answer was
#: lost); steps with a waiting reduce are kept regardless.
RETAIN_STEPS: Final[int] = 8


@dataclass(frozen=True)
class Registration:
    """One registration (incarnation) of a worker.

    Attributes:
        worker_id: Opaque id ``"{name}#{incarnation}"``.
        name: Stable human name; at most one live registration per name.
        gossip_address: ``host:port`` of the worker's push-sum endpoint (gossip only).
        client_nonce: Random per client session; makes a retried register idempotent.
    """

    worker_id: str
    name: str
    gossip_address: str = ""
    client_nonce: str = ""


@dataclass(frozen=True)
class Ticket:
    """A reduce waiting for its step's aggregate.

    Attributes:
        worker_id: The submitting worker.
        step: Step whose aggregate it waits for (the optimizer's step when it was accepted).
        layers: Layers it submitted, in the order it sent them.
        request_id: The reduce's request id.
    """

    worker_id: str
    step: int
    layers: tuple[str, ...]
    request_id: int


@dataclass(frozen=True)
class ReduceOutcome:
    """The answer to a reduce.

    Attributes:
        step: Step the aggregates belong to.
        next_step: The open step when the outcome was read (the next reduce carries it).
        aggregates: Layer -> aggregate, in the ticket's layer order; each gradient is
            read-only, in the accumulation dtype (float64, or float32 when every input was
            float16/bfloat16), the layer's shape.
    """

    step: int
    next_step: int
    aggregates: dict[str, AggregatedGradient]


@dataclass(frozen=True)
class _Accepted:
    step_sent: int
    request_id: int
    target_step: int
    layers: tuple[str, ...]


class ReductionCoordinator:
    """Membership, leases and step bookkeeping around one :class:`DistributedOptimizer`.

    Pure synchronous logic: every method that depends on time takes ``now`` (seconds on a
    monotonic clock); nothing waits.

    Args:
        strategy: Aggregation strategy (see :mod:`paramserver.core.aggregation`).
        method: ``mean``, ``sum`` or ``weighted_mean`` (forced to ``weighted_mean`` by
            :class:`FederatedAverage`).
        lease_s: Lease length in seconds; a worker not seen for longer is evicted by
            :meth:`expire`.
        reject_non_finite: Refuse NaN/Inf gradients (INVALID_ARGUMENT).
        retain_steps: Closed steps whose aggregates are kept for retried reduces.

    Raises:
        InvalidArgument: (INVALID_ARGUMENT) a non-positive lease or an unknown method.
    """

    def __init__(
        self,
        strategy: Strategy,
        method: str = "mean",
        *,
        lease_s: float = 10.0,
        reject_non_finite: bool = True,
        retain_steps: int = RETAIN_STEPS,
    ) -> None:
        if not lease_s > 0:
            raise InvalidArgument(f"lease must be > 0 s, got {lease_s}")
        self.optimizer = DistributedOptimizer(strategy, method, reject_non_finite=reject_non_finite)
        self.lease_s = lease_s
        self.retain_steps = retain_steps
        self.evicted_workers = 0
        self._registrations: dict[str, Registration] = {}
        self._by_name: dict[str, str] = {}
        self._incarnations = 0
        self._open_layers: dict[str, None] = {}
        self._results: dict[int, dict[str, AggregatedGradient]] = {}
        self._tickets_per_step: dict[int, int] = {}
        self._accepted: dict[str, _Accepted] = {}

    # ---------------------------------------------------------------- views

    @property
    def strategy(self) -> Strategy:
        """The optimizer's strategy."""
        return self.optimizer.strategy

    @property
    def current_step(self) -> int:
        """The open step: the step the next synchronous/federated reduce must carry."""
        return self.optimizer.current_step

    def registrations(self) -> list[Registration]:
        """Live registrations, sorted by worker id."""
        return [self._registrations[w] for w in sorted(self._registrations)]

    def is_active(self, worker_id: str) -> bool:
        """Whether ``worker_id`` is a live registration."""
        return worker_id in self._registrations

    def open_layers(self) -> list[tuple[str, int, list[str]]]:
        """Layers of the open step not yet aggregated: ``(layer, pending updates, waiting for)``."""
        done = self._results.get(self.current_step, {})
        return [
            (layer, self.optimizer.pending_updates_for(layer), self.optimizer.waiting_for(layer))
            for layer in self._open_layers
            if layer not in done
        ]

    # ---------------------------------------------------------------- membership

    def register(
        self,
        name: str,
        now: float,
        *,
        replace: bool = False,
        client_nonce: str = "",
        gossip_address: str = "",
    ) -> Registration:
        """Register a worker under a fresh incarnation id.

        Args:
            name: Stable worker name; non-empty.
            now: Registration time, seconds (monotonic); starts the lease.
            replace: Fence a live registration of the same name (it leaves every quorum).
            client_nonce: A retried register with the same name and nonce returns the live
                registration (idempotent).
            gossip_address: ``host:port`` of the worker's push-sum endpoint; required by the
                gossip strategy, ignored by the others.

        Returns:
            The registration.

        Raises:
            InvalidArgument: (INVALID_ARGUMENT) an empty name, or no gossip address under the
                gossip strategy.
            AlreadyExists: (ALREADY_EXISTS) the name is live and ``replace`` is False.
        """
        if not name:
            raise InvalidArgument("worker_name must be non-empty")
        gossip = isinstance(self.strategy, GossipAverage)
        if gossip and not gossip_address:
            raise InvalidArgument(
                f"worker {name!r}: the gossip strategy needs the worker's push-sum endpoint "
                "address (gossip_address)"
            )
        live_id = self._by_name.get(name)
        if live_id is not None:
            live = self._registrations[live_id]
            if client_nonce and live.client_nonce == client_nonce:
                self.optimizer.touch(live_id, now)
                return live
            if not replace:
                raise AlreadyExists(  # the facts: clients word the remedy (replace)
                    f"worker name {name!r} is already registered as {live_id!r}"
                )
            self._remove(live_id, "fenced")
        self._incarnations += 1
        worker_id = f"{name}#{self._incarnations}"
        self.optimizer.register_worker(worker_id, now)
        reg = Registration(worker_id, name, gossip_address if gossip else "", client_nonce)
        self._registrations[worker_id] = reg
        self._by_name[name] = worker_id
        logger.info("worker %s registered at step %d", worker_id, self.current_step)
        return reg

    def heartbeat(self, worker_id: str, now: float) -> None:
        """Renew a lease at ``now`` (seconds).

        Raises:
            WorkerNotFound: (FAILED_PRECONDITION) unknown, evicted or departed worker.
        """
        self._require(worker_id)
        self.optimizer.touch(worker_id, now)

    def leave(self, worker_id: str) -> None:
        """Leave at once: the worker's pending updates are dropped and it leaves every quorum.

        Raises:
            WorkerNotFound: (FAILED_PRECONDITION) unknown, evicted or departed worker.
        """
        self._require(worker_id)
        self._remove(worker_id, "left")

    def expire(self, now: float) -> list[str]:
        """Evict every worker whose lease lapsed (not seen for more than ``lease_s``).

        Args:
            now: Current time, seconds (monotonic).

        Returns:
            Evicted worker ids, sorted.
        """
        before = set(self.optimizer.active_workers())
        if not self.optimizer.evict_stale_workers(self.lease_s * 1000.0, now):
            return []
        evicted = sorted(before - set(self.optimizer.active_workers()))
        for worker_id in evicted:
            self._forget(worker_id)
            logger.warning(
                "worker %s evicted at step %d: lease of %.3f s lapsed",
                worker_id,
                self.current_step,
                self.lease_s,
            )
        self.evicted_workers += len(evicted)
        self._reevaluate()
        return evicted

    def peers(self, worker_id: str, now: float) -> list[Registration]:
        """Peer directory (gossip): the other live workers, sorted by id; renews the lease.

        Raises:
            WorkerNotFound: (FAILED_PRECONDITION) the asking worker is not live.
            FailedPrecondition: (FAILED_PRECONDITION) the strategy is not gossip.
        """
        if not isinstance(self.strategy, GossipAverage):
            raise FailedPrecondition(
                "the peer directory is served only under the gossip strategy "
                "(--reduce-strategy gossip)"
            )
        self.heartbeat(worker_id, now)
        return [self._registrations[w] for w in self.optimizer.peers_of(worker_id)]

    # ---------------------------------------------------------------- reduce

    def submit(
        self,
        worker_id: str,
        step: int,
        request_id: int,
        gradients: Mapping[str, npt.NDArray[np.generic]],
        num_samples: int,
        now: float,
    ) -> Ticket:
        """Accept a worker's gradients for one step (all layers or none) and aggregate.

        A repeat of the worker's last accepted ``(step, request_id)`` (a retry after a lost
        answer or a deadline) is not submitted again: it waits for the same aggregate.

        Under partial quorums (``Synchronous(replicas_to_aggregate=N)`` backup workers,
        ``FederatedAverage``), a worker late for a step that closed without it is answered with
        that step's aggregate while it is retained; its gradients are dropped (counted in
        ``dropped_updates``), as TensorFlow's ``SyncReplicasOptimizer`` drops stale gradients
        while every replica still applies the step's update.

        Args:
            worker_id: Live worker id.
            step: Step the gradients were computed at.
            request_id: Unique per worker; a retry reuses it.
            gradients: Layer -> gradient (any shape; float16, bfloat16, float32, float64,
                int32 or int64); at least one layer.
            num_samples: Examples behind the gradients; ``>= 1``.
            now: Arrival time, seconds (monotonic); renews the lease.

        Returns:
            The ticket to wait on (:meth:`outcome`).

        Raises:
            InvalidArgument: (INVALID_ARGUMENT) no layers, the gossip strategy, or bad values.
            DimensionMismatch: (INVALID_ARGUMENT) a layer's shape differs from its first
                update's; the message names the layer.
            NonFiniteGradient: (INVALID_ARGUMENT) NaN/Inf under the default policy.
            WorkerNotFound: (FAILED_PRECONDITION) unknown, evicted or departed worker.
            StaleUpdate: (FAILED_PRECONDITION) a stale, future or duplicate step.
        """
        self._require(worker_id)
        previous = self._accepted.get(worker_id)
        if (
            previous is not None
            and previous.step_sent == step
            and previous.request_id == request_id
        ):
            self.optimizer.touch(worker_id, now)
            if previous.target_step < self.current_step and previous.target_step not in (
                self._results
            ):
                raise StaleUpdate(
                    f"reduce {request_id} of worker {worker_id!r} for step {step}: the "
                    f"aggregate of step {previous.target_step} is no longer kept"
                )
            return self._open_ticket(
                Ticket(worker_id, previous.target_step, previous.layers, request_id)
            )
        if not gradients:
            raise InvalidArgument(f"reduce from worker {worker_id!r} carries no gradients")
        late = self._late(worker_id, step, request_id, gradients)
        if late is not None:
            self.optimizer.touch(worker_id, now)
            return late
        updates = [
            GradientUpdate(worker_id, layer, gradient, step, now, num_samples)
            for layer, gradient in gradients.items()
        ]
        target = self.current_step
        self.optimizer.submit_updates(updates, now)
        layers = tuple(gradients)
        self._accepted[worker_id] = _Accepted(step, request_id, target, layers)
        for layer in layers:
            self._open_layers.setdefault(layer, None)
        ticket = self._open_ticket(Ticket(worker_id, target, layers, request_id))
        self._aggregate(layers)
        return ticket

    def outcome(self, ticket: Ticket) -> ReduceOutcome | None:
        """The ticket's aggregates once every one of its layers has been aggregated, else None."""
        results = self._results.get(ticket.step)
        if results is None or any(layer not in results for layer in ticket.layers):
            return None
        return ReduceOutcome(
            step=ticket.step,
            next_step=self.current_step,
            aggregates={layer: results[layer] for layer in ticket.layers},
        )

    def waiting_for(self, ticket: Ticket) -> list[str]:
        """Active workers whose update for one of the ticket's open layers is still missing."""
        if ticket.step != self.current_step:
            return []
        done = self._results.get(ticket.step, {})
        missing: dict[str, None] = {}
        for layer in ticket.layers:
            if layer not in done:
                missing.update(dict.fromkeys(self.optimizer.waiting_for(layer)))
        return sorted(missing)

    def release(self, ticket: Ticket) -> None:
        """The ticket's waiter is done (answered, timed out or cancelled)."""
        count = self._tickets_per_step.get(ticket.step, 0) - 1
        if count > 0:
            self._tickets_per_step[ticket.step] = count
        else:
            self._tickets_per_step.pop(ticket.step, None)
        self._prune()

    # ---------------------------------------------------------------- internals

    def _late(
        self,
        worker_id: str,
        step: int,
        request_id: int,
        gradients: Mapping[str, npt.NDArray[np.generic]],
    ) -> Ticket | None:
        """A ticket answered with a closed step's aggregate for a late worker, or None."""
        strategy = self.strategy
        partial = isinstance(strategy, FederatedAverage) or (
            isinstance(strategy, Synchronous) and strategy.replicas_to_aggregate is not None
        )
        results = self._results.get(step)
        if not partial or step >= self.current_step or results is None:
            return None
        if any(layer not in results for layer in gradients):
            return None  # the optimizer refuses it as stale
        for layer, gradient in gradients.items():
            shape = results[layer].gradient.shape
            if gradient.shape != shape:
                raise DimensionMismatch(
                    f"late update from worker {worker_id!r} for layer {layer!r} at step {step} "
                    f"has shape {gradient.shape}, but the layer's shape is {shape}"
                )
        self.optimizer.dropped_updates += len(gradients)
        logger.debug("worker %s late for step %d: answered with its aggregate", worker_id, step)
        layers = tuple(gradients)
        self._accepted[worker_id] = _Accepted(step, request_id, step, layers)
        return self._open_ticket(Ticket(worker_id, step, layers, request_id))

    def _require(self, worker_id: str) -> Registration:
        reg = self._registrations.get(worker_id)
        if reg is None:
            raise WorkerNotFound(
                f"worker {worker_id!r} is not registered (unknown, evicted or departed)"
            )
        return reg

    def _open_ticket(self, ticket: Ticket) -> Ticket:
        self._tickets_per_step[ticket.step] = self._tickets_per_step.get(ticket.step, 0) + 1
        return ticket

    def _forget(self, worker_id: str) -> None:
        reg = self._registrations.pop(worker_id, None)
        if reg is not None and self._by_name.get(reg.name) == worker_id:
            del self._by_name[reg.name]
        self._accepted.pop(worker_id, None)

    def _remove(self, worker_id: str, why: str) -> None:
        self.optimizer.evict_worker(worker_id)
        self._forget(worker_id)
        logger.info("worker %s %s at step %d", worker_id, why, self.current_step)
        self._reevaluate()

    def _reevaluate(self) -> None:
        """After a membership change: quorums may now be met; drop layers nobody waits on."""
        done = self._results.get(self.current_step, {})
        for layer in [
            layer
            for layer in self._open_layers
            if layer not in done and not self.optimizer.pending_updates_for(layer)
        ]:
            del self._open_layers[layer]
        self._aggregate(list(self._open_layers))

    def _aggregate(self, layers: Iterable[str]) -> None:
        """Aggregate the given layers where the quorum is met; close the step when all are."""
        for layer in layers:
            result = self.optimizer.try_aggregate(layer)
            if result is not None:
                self._results.setdefault(result.step, {})[layer] = result
        done = self._results.get(self.current_step, {})
        if self._open_layers and all(layer in done for layer in self._open_layers):
            logger.debug("step %d closed (%d layers)", self.current_step, len(self._open_layers))
            self._open_layers = {}
            self.optimizer.advance_step()
            self._prune()

    def _prune(self) -> None:
        keep_from = self.current_step - self.retain_steps
        for step in [s for s in self._results if s < keep_from]:
            if step not in self._tickets_per_step:
                del self._results[step]
