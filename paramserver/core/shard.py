"""The server shard's state machine: store + membership/clocks + BSP aggregation, pure and sync.

Every method takes ``now`` (monotonic seconds) where time matters and returns a decision; the
asyncio layer (:mod:`paramserver.server.engine`) only waits and wakes waiters. Nothing here
half-applies: each push is validated completely before any of it is applied or queued.

BSP steps aggregate through :class:`paramserver.core.aggregation.DistributedOptimizer` with the
``Synchronous`` strategy (one aggregation pipeline in the product): pushes for step t queue there
and are aggregated and applied once, when every live worker has clocked past t (docs/semantics.md).
SSP and ASP apply each push on arrival (updates commute).
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Final, Protocol, TypedDict, Unpack

import numpy as np

from paramserver.core.aggregation import DistributedOptimizer, GradientUpdate, Synchronous
from paramserver.core.consistency import (
    Admission,
    ClusterState,
    Consistency,
    DeathPolicy,
    MembershipChange,
    RegisterOptions,
    WorkerRecord,
)
from paramserver.core.dedup import DedupKind, DedupWindows
from paramserver.core.optimizers import UpdateRule
from paramserver.core.store import Checked, ParameterStore, out_of_range
from paramserver.core.table_set import ROW_PUSH, TableSet
from paramserver.core.tables import TableLimits
from paramserver.errors import (
    InvalidArgument,
    KeyNotFound,
    NonFiniteGradient,
    StaleUpdate,
    ValueOutOfRange,
)
from paramserver.protocol.limits import check_key, shown

logger = logging.getLogger(__name__)


class ShardSettings(Protocol):
    """What the shard's core reads of its configuration (the server builds a
    :class:`~paramserver.server.config.ServerConfig`, which has all of it; units and meaning
    are the config's)."""

    @property
    def consistency_model(self) -> Consistency: ...
    @property
    def staleness(self) -> int: ...
    @property
    def lease_ms(self) -> int: ...
    @property
    def policy(self) -> DeathPolicy: ...
    @property
    def aggregation(self) -> str: ...
    @property
    def allow_non_finite(self) -> bool: ...
    @property
    def max_staleness(self) -> int | None: ...
    @property
    def table_max_ids(self) -> int: ...
    @property
    def table_max_request_bytes(self) -> int: ...
    @property
    def table_max_tables(self) -> int: ...
    @property
    def table_memory_bytes(self) -> int: ...


class ObserverState(TypedDict, total=False):
    """What a checkpoint keeps of an observer (its ``"observations"``, JSON).

    Attributes:
        barrier: Per worker name, ``[wait_s, lag_s, steps]``: its BSP barrier totals.
        clocked_at: Per open BSP step (as a string), worker name -> unix seconds it clocked.
    """

    barrier: dict[str, list[float]]
    clocked_at: dict[str, dict[str, float]]


class CoreObserver:
    """Hooks the pure core calls; every method is a no-op here (the default observer)."""

    def applied(
        self,
        worker_name: str,
        staleness_clocks: int,
        staleness_versions: int | None,
        *,
        worker_id: str = "",
    ) -> None:
        """One worker's gradient entered the parameters (a BSP step calls it per contributor);
        ``worker_id`` names the registration (a worker that registers again gets a new one)."""

    def dropped(self, reason: str, count: int = 1) -> None:
        """Pushes (or queued gradients) not applied, by reason (see :data:`DROP_REASONS`)."""

    def clocked(self, worker_name: str, clock: int) -> None:
        """A worker ended iteration ``clock`` (its clock became ``clock + 1``)."""

    def step_closed(self, step: int) -> None:
        """BSP step ``step`` closed (its aggregate was applied, or it was aborted)."""

    def replaying_at(self, unix_s: float | None) -> None:
        """Write-ahead-log replay: what follows happened at wall-clock time ``unix_s`` (the
        record's); None ends the replay (time is the observer's own clock again)."""

    def state(self) -> ObserverState:
        """What a checkpoint keeps of the observations (JSON-able); nothing here."""
        return {}

    def restore(self, state: ObserverState) -> None:
        """Take back :meth:`state` from a checkpoint (an empty mapping: nothing saved)."""


@dataclass
class NameProgress:
    """What the registrations of one worker name completed (kept across re-registration and
    replacement, so a restarted worker can resume its data where its name left off).

    Attributes:
        steps: Iterations completed: ``clock()`` calls of this name that advanced a clock.
        clock: The clock its newest registration reached (a registration that joins late
            starts at the live minimum, so ``clock`` may exceed ``steps``).
    """

    steps: int = 0
    clock: int = 0


#: Worker names whose progress a shard keeps (the oldest updated is forgotten first).
PROGRESS_NAMES_KEPT = 65536

#: Applies validated gradients of one push (see :meth:`ServerCore.push`).
Applier = Callable[[list[Checked]], None]

#: The dedup kind of dense pushes (:class:`~paramserver.core.dedup.DedupWindows`).
DENSE_PUSH: Final[DedupKind[PushResult]] = DedupKind("push")


@dataclass(frozen=True)
class PushResult:
    """Outcome of one push.

    Attributes:
        duplicate: The request id was seen before; nothing was applied again.
        applied_updates: Server-wide count of applied pushes after this call.
        dropped_stale: ASP ``max_staleness`` refused the gradient as too old (counted).
        queued: BSP: the gradient waits in the open step's aggregation.
    """

    duplicate: bool
    applied_updates: int
    dropped_stale: bool = False
    queued: bool = False


#: The observer's drop reason of a refused push, by error class (most specific first).
_DROP_REASONS: tuple[tuple[type[Exception], str], ...] = (
    (NonFiniteGradient, "non_finite"),
    (ValueOutOfRange, "out_of_range"),
    (InvalidArgument, "invalid"),
    (StaleUpdate, "stale_step"),
    (KeyNotFound, "unknown_key"),
)


def _drop_reason(exc: Exception) -> str:
    return next((why for cls, why in _DROP_REASONS if isinstance(exc, cls)), "rejected")


def default_table_memory_bytes() -> int:
    """90% of the machine's physical memory (0 where it cannot be read: no budget)."""
    try:
        return int(0.9 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (OSError, ValueError):  # pragma: no cover - not POSIX
        return 0


class ServerCore:
    """One shard's parameters, membership, clocks and BSP aggregation.

    Args:
        config: The shard's configuration (consistency, staleness, aggregation, lease, policy).
    """

    def __init__(self, config: ShardSettings) -> None:
        self.config = config
        self.consistency = config.consistency_model
        self.cluster = ClusterState(
            consistency=self.consistency,
            staleness=config.staleness,
            lease_s=config.lease_ms / 1000.0,
            death_policy=config.policy,
        )
        self.store = ParameterStore()
        #: Sparse embedding tables, each with its own consistency (docs/embedding-tables.md).
        #: Request ids remembered per registration, dense and row pushes alike.
        self.dedup = DedupWindows((DENSE_PUSH, ROW_PUSH))
        self.tables = TableSet(
            TableLimits(
                max_ids=config.table_max_ids,
                max_bytes=config.table_max_request_bytes,
                max_tables=config.table_max_tables,
                memory_bytes=config.table_memory_bytes or default_table_memory_bytes(),
            ),
            self.dedup,
        )
        self.aggregator: DistributedOptimizer | None = (
            DistributedOptimizer(Synchronous(), method=config.aggregation)
            if self.consistency is Consistency.BSP
            else None
        )
        self.applied_updates = 0
        #: Applied gradients per registration (worker id; a BSP step counts each contributor
        #: once), summing to :attr:`applied_updates` over the registrations remembered: what
        #: ``paramserver status`` lists per worker. Counted where :attr:`applied_updates` is
        #: (:meth:`_count_applied`), so WAL replay rebuilds it; checkpoints keep it.
        self.applied_by_registration: dict[str, int] = {}
        #: Per worker name: the iterations its registrations completed and the clock reached
        #: (:class:`NameProgress`). Counted in :meth:`clock`, so WAL replay rebuilds it;
        #: checkpoints keep it.
        self.progress: dict[str, NameProgress] = {}
        self.duplicate_pushes = 0
        self.rejected_pushes = 0
        #: BSP aggregates not applied because their result would overflow the key's dtype.
        self.rejected_aggregates = 0
        self.dropped_stale = 0
        self._release_after_step: dict[str, int] = {}
        self._progress = 0
        #: Called with the new progress mark (closed BSP steps, or the live minimum clock
        #: under SSP/ASP) whenever it advances; the daemon hangs periodic checkpoints here.
        self.on_progress: Callable[[int], None] | None = None
        #: Applies a closed BSP step's validated aggregates; None applies them at once. The
        #: engine installs one that reserves the keys and may run the numeric work in a worker
        #: thread (:mod:`paramserver.server.apply_threads`).
        self.step_applier: Applier | None = None
        #: Told of applied / dropped updates, clocks and closed BSP steps (metrics, status);
        #: a no-op unless the engine installs one (see
        # :mod:`paramserver.server.observability.hooks`).
        self.observer: CoreObserver = CoreObserver()
        #: Highest clock of any gradient applied so far (staleness reference; -1: none yet).
        self._newest_applied_clock = -1

    # ------------------------------------------------------------------ membership
    @property
    def bsp_step(self) -> int:
        """The open BSP step (the next one to close); 0 outside BSP."""
        return self.aggregator.current_step if self.aggregator is not None else 0

    def register(
        self,
        name: str,
        now: float,
        *,
        resume_worker_id: str = "",
        resume: bool = False,
        **options: Unpack[RegisterOptions],
    ) -> WorkerRecord:
        """Register a worker; ``options`` (``replace``, ``client_nonce``, ``log``) and the errors
        are those of :meth:`ClusterState.register`.

        Push deduplication is scoped to a registration (its worker id): a new registration
        starts with no request ids seen, so a restarted worker may number its pushes afresh.
        With ``resume``, a successor that continues its predecessor's clock (``replace``, or a
        lost registration taken over) continues its applied push request ids as well.
        ``resume_worker_id`` names the registration this one continues (a client that lost
        its registration and retries its last push under the new one): when it is a departed
        registration of the same name, its request ids carry over, so that retry is still
        applied once. ``log`` is called with the new worker id before anything changes.
        """
        lost = [w for w in self.cluster.workers.values() if w.name == name and w.lost]
        rec, fenced = self.cluster.register(name, now, **options)
        if resume_worker_id and rec.worker_id != resume_worker_id:
            prior = self.cluster.workers.get(resume_worker_id)
            if prior is not None and prior.name == name and not prior.live:
                self.dedup.carry_over(resume_worker_id, rec.worker_id)  # every kind
        if self.aggregator is not None:
            self.aggregator.register_worker(rec.worker_id, now)
        # The predecessors whose clock it took: fenced with ``replace``, or lost under the
        # ``wait`` policy and taken over.
        taken_lost = [w for w in lost if not w.lost]
        taken = [c.worker for c in fenced] + taken_lost
        taken = [old for old in taken if old.worker_id != rec.worker_id]
        if resume:
            # It continues them: their request ids (every outcome, queued ones included) and
            # their unfinished contribution to the open BSP step, so its re-push of a batch a
            # predecessor pushed but never clocked is a duplicate and the step holds that batch
            # once. (A worker that died between its clocks of two shards is clocked forward on
            # the shard that missed the clock: that shard's step must keep the pushed batch.)
            for old in taken:
                self.dedup.carry_over(old.worker_id, rec.worker_id)
                self._take_over_step(old, rec.worker_id)
        self._forget_departed()
        self._departed(fenced)
        for old in taken_lost:
            # `wait` policy takeover without ``resume``: a successor that redoes the open step
            # replaces the old incarnation's queued gradient and row pushes (no double count);
            # one that starts past the step leaves that gradient in it.
            self.tables.reassign_unclocked(old.worker_id, old.clock, None)
            if self.aggregator is None:
                continue
            if rec.clock > self.aggregator.current_step:
                self._release_after_step[old.worker_id] = rec.clock
            else:
                self.aggregator.evict_worker(old.worker_id)
        self._advance()
        return rec

    def _take_over_step(self, old: WorkerRecord, successor_id: str) -> None:
        """``successor_id`` takes over what ``old`` pushed and never clocked: its queued
        gradients of the open BSP step (dense, when ``old`` had not clocked past it) and its
        queued bsp row pushes."""
        if self.aggregator is not None and old.clock <= self.aggregator.current_step:
            self.aggregator.transfer_worker(old.worker_id, successor_id)
        self.tables.reassign_unclocked(old.worker_id, old.clock, successor_id)

    def heartbeat(self, worker_id: str, now: float) -> WorkerRecord:
        rec = self.cluster.heartbeat(worker_id, now)
        if self.aggregator is not None:
            self.aggregator.touch(worker_id, now)
        return rec

    def _forget_departed(self) -> None:
        """Drop the request ids and applied counts of registrations the cluster no longer
        remembers."""
        known = self.cluster.workers
        self.dedup.forget_except(known)
        applied = self.applied_by_registration
        if len(applied) > len(known):
            for wid in [w for w in applied if w not in known]:
                del applied[wid]

    def leave(self, worker_id: str, *, log: Callable[[], None] | None = None) -> MembershipChange:
        change = self.cluster.leave(worker_id, log=log)
        self._departed([change])
        self._advance()
        return change

    def lapsed(self, now: float) -> list[str]:
        """Ids of the live workers whose lease lapsed at or before ``now`` (changes nothing;
        :meth:`evict` them together, as one sweep)."""
        return [
            w.worker_id for w in self.cluster.workers.values() if w.live and w.lease_expiry_s <= now
        ]

    def expire(self, now: float) -> list[MembershipChange]:
        """Evict workers whose lease lapsed; closes BSP steps they no longer hold back."""
        changes = self.cluster.expire(now)
        if changes:
            for ch in changes:
                logger.warning(
                    "evicted worker %s (clock %d): lease of %d ms lapsed",
                    ch.worker.worker_id,
                    ch.worker.clock,
                    self.config.lease_ms,
                )
            self._departed(changes)
            self._advance()
        return changes

    def evict(self, worker_ids: Iterable[str]) -> list[MembershipChange]:
        """Evict workers together, as one lease sweep does; used by WAL replay."""
        self.cluster.min_clock()  # remember the minimum they held, as expire() does
        changes = [self.cluster.evict(wid) for wid in worker_ids]
        self._departed(changes)
        self._advance()
        return changes

    def _departed(self, changes: Iterable[MembershipChange]) -> None:
        """A worker left the live set: its unfinished step contribution leaves the aggregate.

        A worker that already clocked past the open step finished it: its queued gradient
        stays in that step and it is released from the aggregator when the step closes. Its
        bsp row pushes of steps it never clocked leave their steps too.
        """
        for ch in changes:
            wid = ch.worker.worker_id
            if ch.worker.lost:
                continue  # `wait` policy: the step keeps waiting for a re-registration
            self.tables.reassign_unclocked(wid, ch.worker.clock, None)
            if self.aggregator is None:
                continue
            if ch.worker.clock > self.aggregator.current_step:
                self._release_after_step[wid] = ch.worker.clock
            else:
                self.aggregator.evict_worker(wid, ch.why)

    # ------------------------------------------------------------------ keys
    def init(
        self,
        tensors: Mapping[str, np.ndarray],
        rule: UpdateRule,
        *,
        take: bool = False,
        log: Callable[[dict[str, bool]], None] | None = None,
    ) -> dict[str, bool]:
        """Declare keys (first writer wins); returns key -> created. All-or-nothing.

        ``take``: the caller hands the arrays over (receive buffers), stored without a copy
        (see :meth:`ParameterStore.init`). ``log`` is called with key -> "will be created"
        once the init is valid and before anything is stored (the write-ahead log).

        Raises:
            InvalidArgument: a bad key, value or rule (INVALID_ARGUMENT).
            KeyConflict: an existing key declared with another dtype or shape
                (ALREADY_EXISTS)."""
        created = self.store.init_many(dict(tensors), rule, take=take, before_create=log)
        if self.aggregator is not None:
            for key, was_created in created.items():
                if was_created:
                    self.aggregator.declare_layer(key, tuple(self.store.get(key).value.shape))
        return created

    def require_keys(self, keys: Iterable[str]) -> list[str]:
        """The keys to read (all when empty), each checked.

        Raises:
            KeyNotFound: (NOT_FOUND) a key never declared.
            InvalidArgument: (INVALID_ARGUMENT) an empty key or one over the key length limit.
        """
        wanted = list(keys) or list(self.store.keys())
        for key in wanted:
            if key not in self.store:
                check_key(key)  # an over-long key is refused as such, not as NOT_FOUND
                raise KeyNotFound(f"unknown key {shown(key)!r}: declare it with init first")
        return wanted

    # ------------------------------------------------------------------ push / clock / pull
    def push(
        self,
        worker_id: str,
        request_id: int,
        clock: int,
        grads: Mapping[str, np.ndarray],
        now: float,
        *,
        num_samples: int = 1,
        base_version: int | None = None,
        applier: Applier | None = None,
        finite_checked: bool = False,
        log: Callable[[], None] | None = None,
    ) -> PushResult:
        """Apply (SSP/ASP) or queue (BSP) one push of gradients, at most once per request id.

        Everything is decided here, synchronously: validation, deduplication, staleness, BSP
        queueing, counters. Only the numeric apply of an SSP/ASP push may be handed to
        ``applier``, which must apply it exactly once before any later reader or writer of
        those keys runs (the engine reserves the keys at once and may run it in a thread).

        Args:
            worker_id: A live worker's id.
            request_id: Unique per worker; a retry with the same id is answered as duplicate.
            clock: The worker's clock when it computed the gradients.
            grads: key -> gradient, each of the key's dtype and shape.
            now: Monotonic seconds.
            num_samples: Examples behind the gradients (weighted_mean); 0 is taken as 1.
            base_version: :attr:`applied_updates` the gradient was computed from (ASP
                ``max_staleness``).
            applier: Takes the validated gradients of an SSP/ASP push to apply them; None
                applies them here, before returning.
            finite_checked: The caller already found every gradient free of NaN/Inf (e.g. in a
                worker thread); the scan is not repeated.
            log: Called once the push is decided (to be applied or queued) and before any
                state changes: the write-ahead log writes its record here. If it raises, the
                push is refused with nothing changed and its request id not recorded. Not
                called for a duplicate or an ASP push dropped as too stale.

        Raises:
            WorkerNotFound: unknown or evicted worker (FAILED_PRECONDITION).
            KeyNotFound: an undeclared key (NOT_FOUND).
            DimensionMismatch / NonFiniteGradient: bad gradient (INVALID_ARGUMENT).
            StaleUpdate: BSP push for a step that is not open, or a second push of a key in
                one step (FAILED_PRECONDITION).
        """
        rec = self.cluster.require_live(worker_id)
        prior = self.dedup.get(DENSE_PUSH, rec.worker_id, request_id)
        if prior is not None:
            self.duplicate_pushes += 1
            self.observer.dropped("duplicate")
            return PushResult(True, self.applied_updates, prior.dropped_stale, prior.queued)
        try:
            checked = self.store.check_many(
                grads,
                allow_non_finite=self.config.allow_non_finite or finite_checked,
                allow_aggregate=False,
            )
            result = self._apply_or_queue(
                rec, clock, grads, checked, now, max(num_samples, 1), base_version, applier, log
            )
        except Exception as exc:
            self.rejected_pushes += 1
            self.observer.dropped(_drop_reason(exc))
            if isinstance(exc, InvalidArgument):  # name the pushing worker too, same class
                raise type(exc)(f"push from worker {rec.worker_id!r}: {exc.message}") from exc
            raise
        self.dedup.remember(DENSE_PUSH, rec.worker_id, request_id, result)
        return result

    def _apply_or_queue(
        self,
        rec: WorkerRecord,
        clock: int,
        grads: Mapping[str, np.ndarray],
        checked: list[Checked],
        now: float,
        num_samples: int,
        base_version: int | None,
        applier: Applier | None,
        log: Callable[[], None] | None,
    ) -> PushResult:
        if self.aggregator is not None:
            step = self.aggregator.current_step
            if clock != rec.clock:
                raise StaleUpdate(
                    f"worker {rec.worker_id!r} pushes for clock {clock} but is at clock {rec.clock}"
                )
            if rec.clock != step:
                waiting = self.cluster.check_pull(rec.worker_id).waiting_for
                raise StaleUpdate(
                    f"worker {rec.worker_id!r} pushes for step {rec.clock} but BSP step {step} "
                    f"is open (waiting for {', '.join(waiting) or 'nobody'}): pull before pushing"
                )
            self.aggregator.submit_updates(
                [
                    GradientUpdate(rec.worker_id, key, grad, step, now, num_samples)
                    for key, grad in grads.items()
                ],
                now,
                on_valid=log,
            )
            return PushResult(False, self.applied_updates, queued=True)
        max_stale = self.config.max_staleness
        if (
            self.consistency is Consistency.ASP
            and max_stale is not None
            and base_version is not None
            and self.applied_updates - base_version > max_stale
        ):
            self.dropped_stale += 1
            self.observer.dropped("stale")
            return PushResult(False, self.applied_updates, dropped_stale=True)
        if clock > rec.clock:
            raise StaleUpdate(
                f"worker {rec.worker_id!r} pushes for clock {clock} but is at clock {rec.clock}"
            )
        # Decided: logged first, then the numeric apply runs now, or wherever the applier
        # schedules it (the engine runs big ones in a worker thread with the keys reserved).
        self.store.check_range(checked)  # on the final values (the engine waits for them)
        if log is not None:
            log()
        if applier is None:
            self.store.apply_checked(checked)
        else:
            applier(checked)
        self._count_applied(rec.name, clock, base_version, rec.worker_id)
        return PushResult(False, self.applied_updates)

    def _count_applied(
        self, name: str, clock: int, base_version: int | None, worker_id: str
    ) -> None:
        """Count one applied gradient, server-wide and for its registration, and report its
        staleness (definitions: :mod:`paramserver.server.observability.hooks`). The one place
        applied gradients are counted, live and in WAL replay alike."""
        self.observer.applied(
            name,
            max(0, self._newest_applied_clock - clock),
            None if base_version is None else max(0, self.applied_updates - base_version),
            worker_id=worker_id,
        )
        self._newest_applied_clock = max(self._newest_applied_clock, clock)
        self.applied_updates += 1
        by_reg = self.applied_by_registration
        by_reg[worker_id] = by_reg.get(worker_id, 0) + 1

    def clock(self, worker_id: str, clock: int, *, log: Callable[[], None] | None = None) -> int:
        """End iteration ``clock``; closes BSP steps every live worker finished. ``log`` is
        called before the clock advances (see :meth:`ClusterState.clock`)."""
        before = self.cluster.workers[worker_id].clock if worker_id in self.cluster.workers else -1
        new = self.cluster.clock(worker_id, clock, log=log)
        if new == clock + 1 and before == clock:  # advanced (a repeated clock changes nothing)
            name = self.cluster.workers[worker_id].name
            self.observer.clocked(name, clock)
            self._count_progress(name, new)
        self._advance()
        return new

    def _count_progress(self, name: str, clock: int) -> None:
        """One more completed iteration of ``name``, which reached ``clock``."""
        record = self.progress.pop(name, None) or NameProgress()
        record.steps += 1
        record.clock = clock
        self.progress[name] = record  # (re)inserted last: the dict is oldest-updated first
        while len(self.progress) > PROGRESS_NAMES_KEPT:
            del self.progress[next(iter(self.progress))]

    def _report_progress(self) -> None:
        mark = self.bsp_step if self.aggregator is not None else self.cluster.min_clock()
        if mark > self._progress:
            self._progress = mark
            if self.on_progress is not None:
                self.on_progress(mark)

    def dedup_state(self) -> dict[str, OrderedDict[int, PushResult]]:
        """Dense-push request ids seen per registration (worker id), for checkpoints."""
        return self.dedup.of(DENSE_PUSH)

    def restore_dedup(self, dedup: dict[str, OrderedDict[int, PushResult]]) -> None:
        self.dedup.restore(DENSE_PUSH, dedup)

    def bsp_queue_state(self) -> tuple[list[GradientUpdate], dict[str, int]]:
        """BSP gradients queued in the open step (acknowledged, not applied yet) and the
        departed workers whose queued gradient stays in it, for checkpoints (empty outside
        BSP). A checkpoint without them would lose acknowledged pushes."""
        if self.aggregator is None:
            return [], {}
        return self.aggregator.pending_updates(), dict(self._release_after_step)

    def restore_bsp_queue(
        self, updates: list[GradientUpdate], release_after_step: Mapping[str, int], now: float
    ) -> None:
        """Re-queue checkpointed gradients of the open step, in their original order (call
        after the live workers are restored)."""
        if self.aggregator is None:
            return
        for wid in dict.fromkeys([u.worker_id for u in updates] + list(release_after_step)):
            self.aggregator.register_worker(wid, now)
        self.aggregator.submit_updates(updates, now)
        self._release_after_step.update(release_after_step)

    def check_pull(self, worker_id: str) -> Admission:
        return self.cluster.check_pull(worker_id)

    def _advance(self) -> None:
        """Close every BSP step below the live minimum clock, applying each aggregate once."""
        self._close_steps()
        self.tables.close_steps(self.cluster.min_clock(), len(self.cluster.live_workers()))
        self._report_progress()

    def _close_steps(self) -> None:
        if self.aggregator is None:
            return
        target = self.cluster.min_clock()
        if not self.cluster.holding_workers() and not self._release_after_step:
            return
        while self.aggregator.current_step < target:
            step = self.aggregator.current_step
            if step in self.cluster.aborted_steps:
                queued = len(self.aggregator.pending_updates())
                if queued:
                    self.observer.dropped("aborted_step", queued)
                self.aggregator.advance_step()
                logger.warning(
                    "%s: its queued gradients were dropped", self.cluster.aborted_steps[step]
                )
            else:
                aggregates = self.aggregator.close_step()
                checked = self.store.check_many(
                    {key: agg.gradient for key, agg in aggregates.items()},
                    allow_non_finite=self.config.allow_non_finite,
                )
                checked = self._drop_out_of_range(step, checked)
                if self.step_applier is None:
                    self.store.apply_checked(checked)
                else:
                    self.step_applier(checked)
                if aggregates:
                    contributors = {w for agg in aggregates.values() for w in agg.worker_ids}
                    for wid in sorted(contributors):
                        rec = self.cluster.workers.get(wid)
                        self._count_applied(rec.name if rec else wid, step, None, wid)
            closed = step
            self.observer.step_closed(step)
            for wid, wclock in list(self._release_after_step.items()):
                if wclock <= closed + 1:
                    self.aggregator.evict_worker(wid)
                    del self._release_after_step[wid]

    def _drop_out_of_range(self, step: int, checked: list[Checked]) -> list[Checked]:
        """A closing BSP step's aggregates less those whose result would overflow their key's
        dtype (:func:`~paramserver.core.store.out_of_range`): each such key keeps its value
        for this step, is counted (``rejected_aggregates``, dropped reason ``out_of_range``)
        and logged; the other keys, the clocks and the workers' state go on as usual (the
        pushes were acknowledged when queued, so there is no caller to refuse)."""
        kept: list[Checked] = []
        for entry, grad in checked:
            refusal = out_of_range(entry, grad)
            if refusal is None:
                kept.append((entry, grad))
                continue
            self.rejected_aggregates += 1
            self.observer.dropped("out_of_range")
            logger.warning("BSP step %d: %s", step, refusal.message)
        return kept

    # ------------------------------------------------------------------ reads
    @property
    def version(self) -> int:
        """Parameter version: pushes applied so far (a BSP step counts its contributors)."""
        return self.applied_updates

    def min_clock(self) -> int:
        return self.cluster.min_clock()
