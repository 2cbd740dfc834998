"""Gradient aggregation: the seeds' ``DistributedOptimizer``, with the literature's semantics.

A :class:`DistributedOptimizer` collects per-layer :class:`GradientUpdate` s from registered
workers and, when the strategy's quorum for a layer is met, reduces them element-wise into one
:class:`AggregatedGradient`. It is pure synchronous logic: time is passed in (``now``, seconds on
a monotonic clock), nothing waits and nothing speaks gRPC (docs/architecture.md;
docs/semantics.md "Aggregation").

Strategies:

* :class:`Synchronous` -- bulk-synchronous data parallelism: exactly one update per active worker
  per (layer, step); duplicates and other steps are refused; the quorum is every active worker,
  or the first ``replicas_to_aggregate`` of them (backup workers, as TensorFlow's
  ``SyncReplicasOptimizer``; Chen et al., "Revisiting Distributed Synchronous SGD", 2016).
* :class:`Asynchronous` -- each update is aggregated on arrival; an update whose staleness
  ``current_step - update.step`` exceeds the threshold is refused and counted; optionally each
  gradient is scaled by ``1 / (1 + staleness)`` (Zhang et al., "Staleness-aware Async-SGD for
  Distributed Deep Learning", IJCAI 2016).
* :class:`FederatedAverage` -- one update per worker per round, weighted by ``num_samples``:
  ``w = sum_k n_k w_k / sum_k n_k`` (McMahan et al., "Communication-Efficient Learning of Deep
  Networks from Decentralized Data", AISTATS 2017).
* :class:`GossipAverage` -- decentralised push-sum averaging among the workers (Kempe et al.,
  "Gossip-Based Computation of Aggregate Information", FOCS 2003); the server only keeps the
  membership that serves as the peer directory (:meth:`DistributedOptimizer.peers_of`). The
  averaging itself lives in :mod:`paramserver.core.push_sum`.

Numerics (:mod:`paramserver.core.gradient_updates`, beside the update and aggregate types):
gradients are accumulated in float64 (float32 when every input is float16 or bfloat16), the
division happens once, and the aggregate keeps the accumulation dtype; the caller casts to the
key's dtype when it applies the aggregate (tests/core/test_aggregation.py checks the
denominator against an independent model).

Counting: ``dropped_updates`` counts gradients that were accepted or offered but never reached an
aggregate because they were too old -- refused as stale (an earlier step, a step whose layer was
already aggregated, or staleness above the threshold), discarded by :meth:`advance_step`, or
removed with an evicted or departed worker. Duplicates and future steps are protocol errors: they
are refused but not counted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Final, Literal, TypeAlias, cast

import numpy as np

from paramserver.core.gradient_updates import (
    FLOAT_DTYPES,
    AggregatedGradient,
    Array,
    GradientUpdate,
    accumulation_dtype,
    reduce_gradients,
)
from paramserver.errors import (
    DimensionMismatch,
    InvalidArgument,
    NonFiniteGradient,
    StaleUpdate,
    WorkerNotFound,
)

__all__ = [
    "AggregatedGradient",
    "AggregationMethod",
    "Asynchronous",
    "DistributedOptimizer",
    "FederatedAverage",
    "GossipAverage",
    "GradientUpdate",
    "OptimizerStats",
    "Strategy",
    "Synchronous",
    "accumulation_dtype",
]

logger = logging.getLogger(__name__)

AggregationMethod: TypeAlias = Literal["mean", "sum", "weighted_mean"]

_METHODS: Final[frozenset[str]] = frozenset({"mean", "sum", "weighted_mean"})


# --------------------------------------------------------------------------------------------
# Data


@dataclass(frozen=True)
class OptimizerStats:
    """Snapshot of a :class:`DistributedOptimizer`.

    Attributes:
        total_workers: Registered workers, active or departed (evicted ones are gone).
        active_workers: Registered workers that have not deregistered.
        current_step: The open step (round).
        total_aggregations: Aggregates produced since creation.
        dropped_updates: Gradients that never reached an aggregate (see the module docstring).
        pending_layers: Layers with at least one pending update.
    """

    total_workers: int
    active_workers: int
    current_step: int
    total_aggregations: int
    dropped_updates: int
    pending_layers: int


# --------------------------------------------------------------------------------------------
# Strategies


@dataclass(frozen=True)
class Synchronous:
    """Bulk-synchronous aggregation: one update per active worker per (layer, step).

    Source: synchronous data-parallel SGD; backup workers as TensorFlow's
    ``tf.compat.v1.train.SyncReplicasOptimizer(replicas_to_aggregate=N)`` (Chen et al.,
    "Revisiting Distributed Synchronous SGD", 2016).

    Attributes:
        replicas_to_aggregate: ``None``: the quorum is every active worker. ``N``: aggregate
            once the first ``N`` active workers have sent their update (at most the number of
            active workers, so the quorum shrinks with membership); the late ones are refused as
            stale for that step.

    Raises:
        InvalidArgument: (INVALID_ARGUMENT) ``replicas_to_aggregate < 1``.
    """

    replicas_to_aggregate: int | None = None

    def __post_init__(self) -> None:
        if self.replicas_to_aggregate is not None and self.replicas_to_aggregate < 1:
            raise InvalidArgument(
                f"replicas_to_aggregate must be >= 1 or None, got {self.replicas_to_aggregate}"
            )


@dataclass(frozen=True)
class Asynchronous:
    """Asynchronous aggregation with bounded staleness.

    Staleness of an update is ``current_step - update.step``. An update with staleness above
    ``staleness_threshold`` is refused and counted in ``dropped_updates``; exactly at the
    threshold it is accepted; a step in the future is refused. A single pending update forms a
    quorum.

    Source: Zhang et al., "Staleness-aware Async-SGD for Distributed Deep Learning", IJCAI 2016
    (gradient scaled by ``1 / (1 + staleness)`` when ``scale_by_staleness``).

    Attributes:
        staleness_threshold: Largest accepted staleness, in steps; ``>= 0``.
        scale_by_staleness: Scale each gradient by ``1 / (1 + staleness)`` before reducing.

    Raises:
        InvalidArgument: (INVALID_ARGUMENT) a negative threshold.
    """

    staleness_threshold: int
    scale_by_staleness: bool = False

    def __post_init__(self) -> None:
        _check_at_least("staleness_threshold", self.staleness_threshold, 0)


@dataclass(frozen=True)
class FederatedAverage:
    """Federated averaging: one update per worker per round, weighted by ``num_samples``.

    ``w = sum_k n_k w_k / sum_k n_k`` over the round's updates; the quorum is ``min_updates``
    distinct active workers. The method is always ``weighted_mean``.

    Source: McMahan et al., "Communication-Efficient Learning of Deep Networks from
    Decentralized Data", AISTATS 2017 (FedAvg).

    Attributes:
        min_updates: Distinct workers needed before a round's layer is aggregated; ``>= 1``.

    Raises:
        InvalidArgument: (INVALID_ARGUMENT) ``min_updates < 1``.
    """

    min_updates: int

    def __post_init__(self) -> None:
        _check_at_least("min_updates", self.min_updates, 1)


@dataclass(frozen=True)
class GossipAverage:
    """Decentralised push-sum averaging; the server keeps only the peer directory.

    Workers average among themselves with :class:`paramserver.core.push_sum.PushSumNode`,
    exchanging with ``fanout`` random peers per round, and find their peers through
    :meth:`DistributedOptimizer.peers_of`. Gradients are never submitted to the server.

    Source: Kempe, Dobra and Gehrke, "Gossip-Based Computation of Aggregate Information",
    FOCS 2003 (push-sum).

    Attributes:
        fanout: Peers each node pushes to per round; ``>= 1``.

    Raises:
        InvalidArgument: (INVALID_ARGUMENT) ``fanout < 1``.
    """

    fanout: int

    def __post_init__(self) -> None:
        _check_at_least("fanout", self.fanout, 1)


Strategy: TypeAlias = Synchronous | Asynchronous | FederatedAverage | GossipAverage


def _check_at_least(name: str, value: int, minimum: int) -> None:
    """Raise InvalidArgument (INVALID_ARGUMENT) naming a strategy's ``name`` unless
    ``value >= minimum``."""
    if value < minimum:
        raise InvalidArgument(f"{name} must be >= {minimum}, got {value}")


# --------------------------------------------------------------------------------------------
# The optimizer


@dataclass
class _Worker:
    active: bool
    last_seen_s: float


@dataclass
class _Layer:
    shape: tuple[int, ...] | None = None
    pending: list[GradientUpdate] = field(default_factory=list)
    # Workers whose update for ``current_step`` was accepted (synchronous / federated).
    contributors: set[str] = field(default_factory=set)
    # Step for which this layer was last aggregated (late updates for it are refused).
    aggregated_step: int | None = None
    last: AggregatedGradient | None = None


class DistributedOptimizer:
    """Per-layer gradient aggregation under a :data:`Strategy` (docs/semantics.md "Aggregation").

    The server's BSP and federated paths call :meth:`submit_update`, then :meth:`try_aggregate`
    (quorum met) or :meth:`close_step` (every live worker clocked past the step). Membership
    (register, deregister, evict, heartbeats) re-evaluates every quorum: quorums are computed
    from the live membership whenever they are asked for.

    Attributes:
        strategy: The aggregation strategy.
        method: ``"mean"``, ``"sum"`` or ``"weighted_mean"`` (by ``num_samples``);
            :class:`FederatedAverage` always uses ``"weighted_mean"``.
        reject_non_finite: Refuse gradients holding NaN or Inf (the default policy,
            docs/semantics.md).
        current_step: The open step (round).
        dropped_updates: Gradients that never reached an aggregate (see the module docstring).

    Args:
        strategy: Aggregation strategy.
        method: Element-wise reduction; ignored (forced to ``"weighted_mean"``) for
            :class:`FederatedAverage`.
        reject_non_finite: Refuse NaN/Inf gradients with
            :class:`~paramserver.errors.NonFiniteGradient`.

    Raises:
        InvalidArgument: (INVALID_ARGUMENT) an unknown method.
    """

    def __init__(
        self,
        strategy: Strategy,
        method: str = "mean",
        *,
        reject_non_finite: bool = True,
    ) -> None:
        if method not in _METHODS:
            raise InvalidArgument(
                f"unknown aggregation method {method!r}; expected one of {sorted(_METHODS)}"
            )
        if not isinstance(strategy, Synchronous | Asynchronous | FederatedAverage | GossipAverage):
            raise InvalidArgument(f"unknown aggregation strategy {strategy!r}")
        self.strategy: Strategy = strategy
        self.method: AggregationMethod = cast(
            AggregationMethod, "weighted_mean" if isinstance(strategy, FederatedAverage) else method
        )
        self.reject_non_finite = reject_non_finite
        self.current_step: int = 0
        self.dropped_updates: int = 0
        self._total_aggregations = 0
        self._workers: dict[str, _Worker] = {}
        self._layers: dict[str, _Layer] = {}

    # ---------------------------------------------------------------- membership

    def register_worker(self, worker_id: str, now: float = 0.0) -> bool:
        """Register (or re-activate) a worker, seen at ``now``.

        Args:
            worker_id: Worker id; non-empty.
            now: Registration time in seconds (monotonic); the worker's last-seen time.

        Returns:
            True if the worker was added or re-activated; False if it is already active
            (nothing changes).

        Raises:
            InvalidArgument: (INVALID_ARGUMENT) an empty id.
        """
        if not worker_id:
            raise InvalidArgument("worker id must be non-empty")
        worker = self._workers.get(worker_id)
        if worker is not None and worker.active:
            return False
        if worker is None:
            self._workers[worker_id] = _Worker(active=True, last_seen_s=now)
        else:
            worker.active = True
            worker.last_seen_s = max(worker.last_seen_s, now)
        return True

    def deregister_worker(self, worker_id: str) -> bool:
        """Soft leave: mark a worker inactive.

        Its pending updates stay queued but are excluded from aggregates and quorums (and are
        counted as dropped when the queue is cleared) unless it re-registers first.

        Returns:
            True if the worker was active; False if it is unknown or already inactive.
        """
        worker = self._workers.get(worker_id)
        if worker is None or not worker.active:
            return False
        worker.active = False
        return True

    def evict_worker(self, worker_id: str, why: str = "removed") -> bool:
        """Hard removal: forget the worker and drop its pending updates of the open step.

        The dropped updates are counted in ``dropped_updates``; the worker leaves every
        quorum's denominator (quorums are re-evaluated on the next :meth:`try_aggregate`).

        Args:
            worker_id: The worker.
            why: How it went, for the log line (``left``, ``evicted``, ``fenced``; default
                ``removed``: the caller did not say).

        Returns:
            True if the worker was known (active or not); False otherwise.
        """
        if self._workers.pop(worker_id, None) is None:
            return False
        dropped = 0
        for layer in self._layers.values():
            kept = [u for u in layer.pending if u.worker_id != worker_id]
            dropped += len(layer.pending) - len(kept)
            layer.pending = kept
            layer.contributors.discard(worker_id)
        self.dropped_updates += dropped
        logger.info(
            "worker %r %s at step %d (%d pending updates dropped)",
            worker_id,
            why,
            self.current_step,
            dropped,
        )
        return True

    def transfer_worker(self, old_worker_id: str, new_worker_id: str) -> int:
        """``new_worker_id`` (registered) takes over ``old_worker_id``'s updates of the open
        step, as if it had submitted them, and ``old_worker_id`` is forgotten: a successor that
        continues its predecessor's clock and request ids continues its step contribution
        too (its re-push of that batch is a duplicate, so the step holds the batch once).

        Returns:
            Updates taken over.

        Raises:
            WorkerNotFound: (FAILED_PRECONDITION) ``new_worker_id`` is not registered.
        """
        self._active_worker(new_worker_id)
        if self._workers.pop(old_worker_id, None) is None:
            return 0
        moved = 0
        for layer in self._layers.values():
            for i, update in enumerate(layer.pending):
                if update.worker_id == old_worker_id:
                    layer.pending[i] = replace(update, worker_id=new_worker_id)
                    moved += 1
            if old_worker_id in layer.contributors:
                layer.contributors.discard(old_worker_id)
                layer.contributors.add(new_worker_id)
        return moved

    def touch(self, worker_id: str, now: float) -> None:
        """Heartbeat: record that the worker was seen at ``now`` (seconds).

        Raises:
            WorkerNotFound: (FAILED_PRECONDITION) unknown, evicted or departed worker.
        """
        worker = self._active_worker(worker_id)
        worker.last_seen_s = max(worker.last_seen_s, now)

    def credit_stall(self, stall_s: float) -> None:
        """Move every worker's last sighting ``stall_s`` seconds later: the caller could not
        hear anyone for that long (a stalled server), so it does not count as silence."""
        for worker in self._workers.values():
            worker.last_seen_s += stall_s

    def evict_stale_workers(self, max_age_ms: float, now: float) -> int:
        """Evict every worker (active or departed) not seen for more than ``max_age_ms``.

        A worker seen exactly ``max_age_ms`` ago stays.

        Args:
            max_age_ms: Largest tolerated age of the last sighting, in milliseconds.
            now: Current time in seconds (same clock as ``register_worker``/``touch``).

        Returns:
            Number of workers evicted.
        """
        stale = [
            worker_id
            for worker_id, worker in self._workers.items()
            if (now - worker.last_seen_s) * 1000.0 > max_age_ms
        ]
        for worker_id in stale:
            self.evict_worker(worker_id, "evicted (not seen within max_age_ms)")
        return len(stale)

    def active_workers(self) -> list[str]:
        """Active worker ids, sorted."""
        return sorted(w for w, s in self._workers.items() if s.active)

    def worker_count(self) -> int:
        """Registered workers, active or departed."""
        return len(self._workers)

    def active_worker_count(self) -> int:
        """Active workers."""
        return sum(1 for s in self._workers.values() if s.active)

    def peers_of(self, worker_id: str) -> list[str]:
        """Peer directory for decentralised averaging: the other active workers, sorted.

        Raises:
            WorkerNotFound: (FAILED_PRECONDITION) the asking worker is not active.
        """
        self._active_worker(worker_id)
        return [w for w in self.active_workers() if w != worker_id]

    # ---------------------------------------------------------------- layers and updates

    def declare_layer(self, layer_id: str, shape: tuple[int, ...]) -> None:
        """Fix a layer's shape up front (otherwise the first accepted update fixes it).

        Re-declaring the same shape is a no-op.

        Raises:
            DimensionMismatch: (INVALID_ARGUMENT) the layer already has another shape.
            InvalidArgument: (INVALID_ARGUMENT) an empty layer id or a negative dimension.
        """
        if not layer_id:
            raise InvalidArgument("layer id must be non-empty")
        shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in shape):
            raise InvalidArgument(f"layer {layer_id!r}: negative dimension in shape {shape}")
        layer = self._layers.setdefault(layer_id, _Layer())
        if layer.shape is None:
            layer.shape = shape
        elif layer.shape != shape:
            raise DimensionMismatch(
                f"layer {layer_id!r} has shape {layer.shape}; cannot re-declare it as {shape}"
            )

    def submit_update(self, update: GradientUpdate, now: float) -> None:
        """Validate and enqueue one update; the worker is seen at ``now``.

        Checks, in this order: the worker, the step, the shape, the values.

        Args:
            update: The gradient update.
            now: Arrival time in seconds.

        Raises:
            InvalidArgument: (INVALID_ARGUMENT) the strategy is :class:`GossipAverage`, which
                takes no updates.
            WorkerNotFound: (FAILED_PRECONDITION) unknown, evicted or departed worker.
            StaleUpdate: (FAILED_PRECONDITION) wrong, stale, future or duplicate step.
            DimensionMismatch: (INVALID_ARGUMENT) a shape other than the layer's.
            NonFiniteGradient: (INVALID_ARGUMENT) NaN/Inf values under ``reject_non_finite``.
        """
        self.submit_updates([update], now)

    def submit_updates(
        self,
        updates: Sequence[GradientUpdate],
        now: float,
        *,
        on_valid: Callable[[], None] | None = None,
    ) -> None:
        """Validate every update (against the state and each other), then enqueue them all.

        All or nothing: if any update is refused, none is enqueued and the error of the first
        refused update is raised. Duplicates within the batch are refused like duplicates
        across calls.

        Args:
            updates: Updates to enqueue.
            now: Arrival time in seconds.
            on_valid: Called once every update is valid, before any is enqueued (the
                write-ahead log); if it raises, nothing is enqueued.

        Raises:
            Same as :meth:`submit_update`.
        """
        if isinstance(self.strategy, GossipAverage):
            raise InvalidArgument(
                "the GossipAverage strategy averages among the workers by push-sum; the server "
                "keeps only the peer directory and takes no gradient updates"
            )
        staged_shapes: dict[str, tuple[int, ...]] = {}
        staged_contributions: set[tuple[str, str]] = set()
        for update in updates:
            self._validate(update, staged_shapes, staged_contributions)
        if on_valid is not None:
            on_valid()
        for update in updates:
            layer = self._layers.setdefault(update.layer_id, _Layer())
            if layer.shape is None:
                layer.shape = update.gradient.shape
            layer.pending.append(update)
            if not isinstance(self.strategy, Asynchronous):
                layer.contributors.add(update.worker_id)
            worker = self._workers[update.worker_id]
            worker.last_seen_s = max(worker.last_seen_s, now)

    def pending_updates_for(self, layer_id: str) -> int:
        """Updates queued for a layer (0 for an unknown layer)."""
        layer = self._layers.get(layer_id)
        return 0 if layer is None else len(layer.pending)

    def pending_updates(self) -> list[GradientUpdate]:
        """Every queued update, layer by layer in arrival order (checkpoints save them, and
        :meth:`submit_updates` of this list re-queues them in the same order)."""
        return [u for layer in self._layers.values() for u in layer.pending]

    def waiting_for(self, layer_id: str) -> list[str]:
        """Active workers whose update for the layer at ``current_step`` is still missing.

        Empty for :class:`Asynchronous` and :class:`GossipAverage`, and for a layer already
        aggregated in this step. Used to name whom a wait waits for.
        """
        if isinstance(self.strategy, Asynchronous | GossipAverage):
            return []
        layer = self._layers.get(layer_id)
        if layer is None:
            return self.active_workers()
        if layer.aggregated_step == self.current_step:
            return []
        return [w for w in self.active_workers() if w not in layer.contributors]

    # ---------------------------------------------------------------- aggregation

    def try_aggregate(self, layer_id: str) -> AggregatedGradient | None:
        """Aggregate a layer if the strategy's quorum is met.

        Quorums: :class:`Synchronous` -- every active worker, or ``min(replicas_to_aggregate,
        active workers)`` of them (the first to arrive are used, any others are dropped);
        :class:`Asynchronous` -- any pending update; :class:`FederatedAverage` --
        ``min_updates`` distinct active workers. Only updates of active workers are reduced.
        On success the layer's queue is cleared (leftovers counted as dropped) and the result is
        kept for :meth:`last_aggregated`.

        Returns:
            The aggregate, or None if the quorum is not met (or nothing is pending).
        """
        layer = self._layers.get(layer_id)
        if layer is None or not layer.pending:
            return None
        eligible = self._eligible(layer)
        if not eligible:
            return None
        contributors = len({u.worker_id for u in eligible})
        strategy = self.strategy
        if isinstance(strategy, Synchronous):
            active = self.active_worker_count()
            quorum = (
                active
                if strategy.replicas_to_aggregate is None
                else min(strategy.replicas_to_aggregate, active)
            )
            if contributors < quorum:
                return None
        elif isinstance(strategy, FederatedAverage):
            if contributors < strategy.min_updates:
                return None
        elif isinstance(strategy, GossipAverage):  # pragma: no cover - never has pending
            return None
        return self._aggregate_layer(layer_id, layer, eligible)

    def close_step(self) -> dict[str, AggregatedGradient]:
        """Aggregate every layer's eligible pending updates regardless of quorum, then advance.

        Meant for the parameter server's BSP path once every live worker has clocked past the
        step: the denominator is whoever contributed among the active workers. Layers with no
        eligible update are omitted. Then :meth:`advance_step` runs (counting leftovers).

        Returns:
            Layer id -> aggregate for the closed step.
        """
        results: dict[str, AggregatedGradient] = {}
        for layer_id, layer in self._layers.items():
            eligible = self._eligible(layer)
            if eligible:
                results[layer_id] = self._aggregate_layer(layer_id, layer, eligible)
        self.advance_step()
        return results

    def advance_step(self) -> None:
        """Open the next step: discard leftover pending updates (counted) and increment."""
        for layer in self._layers.values():
            self.dropped_updates += len(layer.pending)
            layer.pending = []
            layer.contributors = set()
        self.current_step += 1

    def last_aggregated(self, layer_id: str) -> AggregatedGradient | None:
        """The layer's most recent aggregate, or None."""
        layer = self._layers.get(layer_id)
        return None if layer is None else layer.last

    def aggregate_gradients(self, updates: Sequence[GradientUpdate]) -> Array:
        """Element-wise reduction of updates per ``method``, as :meth:`try_aggregate` does it.

        ``mean``: ``sum g_k / K``; ``sum``: ``sum g_k``; ``weighted_mean``:
        ``sum n_k g_k / sum n_k`` (McMahan et al. 2017). Under ``Asynchronous(...,
        scale_by_staleness=True)`` each ``g_k`` is first scaled by ``1 / (1 + staleness_k)``
        relative to ``current_step`` (Zhang et al. 2016). Accumulated in float64 (float32 when
        every input is half precision), divided once.

        Args:
            updates: Updates of one layer, all the same shape.

        Returns:
            The aggregate in the accumulation dtype; an empty float64 array of shape ``(0,)``
            for no updates (no warnings).

        Raises:
            DimensionMismatch: (INVALID_ARGUMENT) updates of different shapes.
        """
        if not updates:
            return np.zeros((0,), dtype=np.float64)
        return self._reduce_updates(updates[0].layer_id, updates, self.current_step)

    def stats(self) -> OptimizerStats:
        """A snapshot of membership, step and counters."""
        return OptimizerStats(
            total_workers=self.worker_count(),
            active_workers=self.active_worker_count(),
            current_step=self.current_step,
            total_aggregations=self._total_aggregations,
            dropped_updates=self.dropped_updates,
            pending_layers=sum(1 for layer in self._layers.values() if layer.pending),
        )

    # ---------------------------------------------------------------- internals

    def _active_worker(self, worker_id: str) -> _Worker:
        worker = self._workers.get(worker_id)
        if worker is None:
            raise WorkerNotFound(f"worker {worker_id!r} is not registered (unknown or evicted)")
        if not worker.active:
            raise WorkerNotFound(f"worker {worker_id!r} has deregistered; register it again")
        return worker

    def _validate(
        self,
        update: GradientUpdate,
        staged_shapes: dict[str, tuple[int, ...]],
        staged_contributions: set[tuple[str, str]],
    ) -> None:
        """Check one update against the state and the batch staged so far; stage it."""
        worker_id, layer_id, step = update.worker_id, update.layer_id, update.step
        self._active_worker(worker_id)
        layer = self._layers.get(layer_id)
        current = self.current_step
        strategy = self.strategy
        where = f"update from worker {worker_id!r} for layer {layer_id!r}"
        if isinstance(strategy, Asynchronous):
            staleness = current - step
            if staleness < 0:
                raise StaleUpdate(
                    f"{where} is for future step {step}; the current step is {current}"
                )
            if staleness > strategy.staleness_threshold:
                self.dropped_updates += 1
                raise StaleUpdate(
                    f"{where} is for step {step}, {staleness} steps behind the current step "
                    f"{current}; the staleness threshold is {strategy.staleness_threshold}"
                )
        else:
            kind = "round" if isinstance(strategy, FederatedAverage) else "step"
            if step > current:
                raise StaleUpdate(
                    f"{where} is for future {kind} {step}; the current {kind} is {current}"
                )
            if step < current:
                self.dropped_updates += 1
                raise StaleUpdate(
                    f"{where} is for stale {kind} {step}; the current {kind} is {current}"
                )
            if (layer is not None and worker_id in layer.contributors) or (
                layer_id,
                worker_id,
            ) in staged_contributions:
                raise StaleUpdate(
                    f"duplicate {where} at {kind} {step}: the worker already contributed to "
                    f"this {kind}"
                )
            if layer is not None and layer.aggregated_step == current:
                self.dropped_updates += 1
                raise StaleUpdate(
                    f"late {where} at {kind} {step}: the layer was already aggregated for this "
                    f"{kind}"
                )
            staged_contributions.add((layer_id, worker_id))
        shape = layer.shape if layer is not None and layer.shape is not None else None
        if shape is None:
            shape = staged_shapes.setdefault(layer_id, update.gradient.shape)
        if update.gradient.shape != shape:
            raise DimensionMismatch(
                f"{where} at step {step} has shape {update.gradient.shape}, but the layer's "
                f"shape is {shape}"
            )
        if self.reject_non_finite and update.gradient.dtype in FLOAT_DTYPES:
            finite = np.isfinite(update.gradient)
            if not finite.all():
                bad = int(finite.size - np.count_nonzero(finite))
                raise NonFiniteGradient(
                    f"{where} at step {step} holds {bad} non-finite value(s) (NaN or Inf)"
                )

    def _eligible(self, layer: _Layer) -> list[GradientUpdate]:
        """Pending updates of active workers (of the current step, by construction)."""
        return [
            u
            for u in layer.pending
            if (w := self._workers.get(u.worker_id)) is not None
            and w.active
            and u.step <= self.current_step
        ]

    def _aggregate_layer(
        self, layer_id: str, layer: _Layer, eligible: list[GradientUpdate]
    ) -> AggregatedGradient:
        strategy = self.strategy
        if isinstance(strategy, Synchronous) and strategy.replicas_to_aggregate is not None:
            eligible = eligible[: strategy.replicas_to_aggregate]
        gradient = self._reduce_updates(layer_id, eligible, self.current_step)
        gradient.flags.writeable = False
        worker_ids = tuple(dict.fromkeys(u.worker_id for u in eligible))
        result = AggregatedGradient(
            layer_id=layer_id,
            gradient=gradient,
            step=self.current_step,
            contributing_workers=len(worker_ids),
            total_samples=sum(u.num_samples for u in eligible),
            worker_ids=worker_ids,
        )
        self.dropped_updates += len(layer.pending) - len(eligible)
        layer.pending = []
        if not isinstance(strategy, Asynchronous):
            layer.aggregated_step = self.current_step
        layer.last = result
        self._total_aggregations += 1
        return result

    def _reduce_updates(
        self, layer_id: str, updates: Sequence[GradientUpdate], current_step: int
    ) -> Array:
        gradients = [u.gradient for u in updates]
        scale: list[float] | None = None
        strategy = self.strategy
        if isinstance(strategy, Asynchronous) and strategy.scale_by_staleness:
            scale = [1.0 / (1.0 + max(current_step - u.step, 0)) for u in updates]
        if self.method == "weighted_mean":
            weights = [float(u.num_samples) for u in updates]
            factors = (
                weights if scale is None else [w * s for w, s in zip(weights, scale, strict=True)]
            )
            return reduce_gradients(layer_id, gradients, factors, float(sum(weights)))
        denominator = float(len(updates)) if self.method == "mean" else 1.0
        return reduce_gradients(layer_id, gradients, scale, denominator)
