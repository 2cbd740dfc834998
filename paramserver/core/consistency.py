"""Membership, clocks and the BSP / SSP / ASP admission rules, as pure synchronous logic.

Source: Ho et al., "More Effective Distributed ML via a Stale Synchronous Parallel Parameter
Server", NIPS 2013; Li et al., "Scaling Distributed Machine Learning with the Parameter Server",
OSDI 2014. docs/semantics.md states the rules implemented here:

* Each worker p has a clock ``c_p`` = iterations it has completed; a worker that joins starts at
  the current minimum clock of the live workers (never 0 for a late joiner).
* **SSP(s)**: a pull by p is admitted when ``min_q c_q >= c_p - s`` over live workers q, so it
  reflects every update from iterations ``<= c_p - s - 1``.
* **BSP** is SSP with s = 0; in addition step t closes (its aggregate is applied once) when
  every live worker has clocked past t, i.e. when ``min_q c_q > t``.
* **ASP**: pulls never wait.

Time is passed in (``now``, seconds on a monotonic clock), so every rule is testable without a
network or an event loop. Decisions carry the names of the workers they wait for.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TypedDict

from paramserver.errors import AlreadyExists, InvalidArgument, StaleUpdate, WorkerNotFound
from paramserver.protocol.limits import check_worker_id, check_worker_name, shown

#: Departed (left, evicted, fenced) registrations remembered for clearer refusals.
DEPARTED_KEPT = 1024


class Consistency(enum.Enum):
    """Consistency model of a server shard."""

    BSP = "bsp"
    SSP = "ssp"
    ASP = "asp"


class DeathPolicy(enum.Enum):
    """What a BSP worker whose lease lapses does to the open step (docs/semantics.md "Membership").

    ``SHRINK``: the dead worker leaves the denominator; the step completes with the rest.
    ``FAIL_FAST``: the open step is aborted; waiting pulls get ABORTED naming the dead worker.
    ``WAIT``: the step keeps waiting for the worker to re-register under the same name.
    """

    SHRINK = "shrink"
    FAIL_FAST = "fail_fast"
    WAIT = "wait"


@dataclass
class WorkerRecord:
    """One registration (incarnation) of a worker.

    Attributes:
        worker_id: Opaque id ``"{name}#{incarnation}"`` used in every call.
        name: Stable human name; at most one live registration per name.
        incarnation: Cluster-wide registration counter; fences older incarnations.
        clock: Iterations completed.
        lease_expiry_s: Monotonic time (seconds) at which the lease lapses.
        live: False once the worker left, was evicted or was fenced.
        lost: True for a worker whose lease lapsed under the ``wait`` policy: not live, but
            its clock still holds BSP/SSP back until it re-registers.
        client_nonce: Random per client session, makes Register retries idempotent.
    """

    worker_id: str
    name: str
    incarnation: int
    clock: int
    lease_expiry_s: float
    live: bool = True
    lost: bool = False
    client_nonce: str = ""


@dataclass(frozen=True)
class Admission:
    """Decision on a pull: admitted, waiting (naming whom for) or aborted."""

    admitted: bool
    waiting_for: tuple[str, ...] = ()
    reason: str = ""
    aborted: bool = False


@dataclass(frozen=True)
class MembershipChange:
    """A worker that left the live set, and why (``left``, ``evicted`` or ``fenced``)."""

    worker: WorkerRecord
    why: str


class RegisterOptions(TypedDict, total=False):
    """The keywords of :meth:`ClusterState.register` (documented there), which
    :meth:`~paramserver.core.shard.ServerCore.register` passes on as they are."""

    replace: bool
    client_nonce: str
    log: Callable[[str], None] | None


@dataclass
class ClusterState:
    """Membership, leases and clocks of one server shard.

    Args:
        consistency: BSP, SSP or ASP.
        staleness: SSP bound s in clocks (forced to 0 under BSP; unused under ASP).
        lease_s: Lease length in seconds; heartbeats renew it.
        death_policy: What a lapsed lease does to an open BSP/SSP wait.

    Raises:
        InvalidArgument: negative staleness or non-positive lease (INVALID_ARGUMENT).
    """

    consistency: Consistency
    staleness: int = 0
    lease_s: float = 10.0
    death_policy: DeathPolicy = DeathPolicy.SHRINK
    workers: dict[str, WorkerRecord] = field(default_factory=dict)
    epoch: int = 0
    incarnations: int = 0
    floor: int = 0
    aborted_steps: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.staleness < 0:
            raise InvalidArgument(f"staleness must be >= 0, got {self.staleness}")
        if not self.lease_s > 0:
            raise InvalidArgument(f"lease must be > 0 s, got {self.lease_s}")
        if self.consistency is Consistency.BSP:
            self.staleness = 0

    # ------------------------------------------------------------------ membership
    def live_workers(self) -> list[WorkerRecord]:
        """Live registrations, in registration order."""
        return [w for w in self.workers.values() if w.live]

    def holding_workers(self) -> list[WorkerRecord]:
        """Workers whose clocks bound the minimum: live ones, plus lost ones under ``wait``."""
        return [w for w in self.workers.values() if w.live or w.lost]

    def restore_floor(self, clock: int) -> None:
        """Restore the minimum clock from a checkpoint (late joiners start there)."""
        self.floor = max(self.floor, clock)

    def min_clock(self) -> int:
        """Minimum clock over live (and, under ``wait``, lost) workers.

        With nobody live it is the last minimum seen, so a late joiner never starts at 0.
        """
        holding = self.holding_workers()
        if holding:
            lowest = min(w.clock for w in holding)
            self.floor = max(self.floor, lowest)
            return lowest
        return self.floor

    def register(
        self,
        name: str,
        now: float,
        *,
        replace: bool = False,
        client_nonce: str = "",
        log: Callable[[str], None] | None = None,
    ) -> tuple[WorkerRecord, list[MembershipChange]]:
        """Register a worker by name; it starts at the current minimum clock.

        A successor of its name's registration (a live one it fences with ``replace``, or one
        lost under the ``wait`` policy that it takes over) inherits that registration's clock
        instead: it continues its predecessor's iterations, so under BSP it redoes the step
        its predecessor died in, in that step, and the steps pair the same batches as if
        nobody had died. A retry with the same ``client_nonce`` returns the existing live
        registration.

        Args:
            log: Called with the new worker id once the registration is decided and before
                anything changes (the write-ahead log); if it raises, nothing changes. Not
                called for a retry answered with the existing registration.

        Returns:
            The new (or existing) record, and the registrations it fenced.

        Raises:
            InvalidArgument: empty name, or one over the length limit (INVALID_ARGUMENT).
            AlreadyExists: the name is live and ``replace`` is False (ALREADY_EXISTS).
        """
        check_worker_name(name)
        same_name = [rec for rec in self.workers.values() if rec.name == name]
        for rec in same_name:
            if rec.live:
                if client_nonce and rec.client_nonce == client_nonce:
                    rec.lease_expiry_s = now + self.lease_s
                    return rec, []
                if not replace:
                    # The facts only: each client words what to do about it (replace=True
                    # from Python, --replace on the command line).
                    raise AlreadyExists(
                        f"worker name {name!r} is already registered as {rec.worker_id!r}, "
                        f"whose lease lapses in {max(0.0, rec.lease_expiry_s - now):.1f} s "
                        "unless it is renewed"
                    )
        worker_id = f"{name}#{self.incarnations + 1}"
        if log is not None:
            log(worker_id)
        changes: list[MembershipChange] = []
        start_clock: int | None = None
        base = self.min_clock()  # the predecessor still holds: never above its clock
        for rec in same_name:
            if rec.live:
                rec.live = False
                changes.append(MembershipChange(rec, "fenced"))
                start_clock = rec.clock
            elif rec.lost:
                rec.lost = False
                start_clock = rec.clock if start_clock is None else start_clock
        self.incarnations += 1
        rec = WorkerRecord(
            worker_id=worker_id,
            name=name,
            incarnation=self.incarnations,
            clock=base if start_clock is None else max(start_clock, base),
            lease_expiry_s=now + self.lease_s,
            client_nonce=client_nonce,
        )
        self.workers[rec.worker_id] = rec
        self._prune_departed()
        self.epoch += 1
        return rec, changes

    def _prune_departed(self) -> None:
        """Forget the oldest departed registrations beyond :data:`DEPARTED_KEPT` (their ids
        then answer "unknown worker" instead of "no longer a member"; both are refusals)."""
        departed = [wid for wid, w in self.workers.items() if not w.live and not w.lost]
        for wid in departed[: max(0, len(departed) - DEPARTED_KEPT)]:
            del self.workers[wid]

    def require_live(self, worker_id: str) -> WorkerRecord:
        """The live record of ``worker_id``.

        Raises:
            InvalidArgument: an empty worker id, or one longer than any the server makes
                (INVALID_ARGUMENT).
            WorkerNotFound: unknown, departed, evicted or fenced (FAILED_PRECONDITION).
        """
        rec = self.workers.get(worker_id)
        if rec is None:
            check_worker_id(worker_id)  # empty or over-long: a malformed request
            raise WorkerNotFound(f"unknown worker {shown(worker_id)!r}: register first")
        if not rec.live:
            raise WorkerNotFound(
                f"worker {worker_id!r} is no longer a member (left, evicted or fenced by a "
                "newer registration): register again"
            )
        return rec

    def heartbeat(self, worker_id: str, now: float) -> WorkerRecord:
        """Renew a lease. Raises WorkerNotFound (FAILED_PRECONDITION) if not live."""
        rec = self.require_live(worker_id)
        rec.lease_expiry_s = now + self.lease_s
        return rec

    def leave(self, worker_id: str, *, log: Callable[[], None] | None = None) -> MembershipChange:
        """Clean leave: the worker stops holding any step back at once, whatever the policy.

        ``log`` is called once the leave is valid and before anything changes (the
        write-ahead log); if it raises, nothing changes."""
        rec = self.require_live(worker_id)
        if log is not None:
            log()
        self.min_clock()  # remember the minimum the leaver held: a late joiner starts there
        rec.live = False
        self.epoch += 1
        return MembershipChange(rec, "left")

    def credit_leases(self, stall_s: float) -> None:
        """Extend every live lease by ``stall_s`` seconds (the server was stalled that long, so
        no worker could be heard; a lease measures the worker's silence, not the server's)."""
        for rec in self.workers.values():
            if rec.live:
                rec.lease_expiry_s += stall_s

    def expire(self, now: float) -> list[MembershipChange]:
        """Evict every live worker whose lease lapsed at or before ``now``.

        Under ``fail_fast`` an eviction aborts the step the worker had not finished (its
        clock): :attr:`aborted_steps` records the reason, named after the worker.
        """
        lapsed = [w.worker_id for w in self.workers.values() if w.live and w.lease_expiry_s <= now]
        self.min_clock()  # remember the minimum the lapsed workers held (see leave)
        return [self.evict(wid) for wid in lapsed]

    def evict(self, worker_id: str) -> MembershipChange:
        """Evict one live worker (lease lapsed), applying the death policy.

        Raises:
            WorkerNotFound: not live (FAILED_PRECONDITION).
        """
        rec = self.require_live(worker_id)
        rec.live = False
        if self.death_policy is DeathPolicy.WAIT and self.consistency is not Consistency.ASP:
            rec.lost = True
        change = MembershipChange(rec, "evicted")
        self.epoch += 1
        if self.death_policy is DeathPolicy.FAIL_FAST:
            self._abort_for([change])
        return change

    def _abort_for(self, changes: list[MembershipChange]) -> None:
        if self.consistency is Consistency.ASP:
            return
        for ch in changes:
            dead = ch.worker
            # The dead worker never finished step `dead.clock`: every pull that needs that
            # step (need - 1 == dead.clock) is refused with ABORTED instead of shrinking.
            self.aborted_steps.setdefault(
                dead.clock,
                f"step {dead.clock} aborted: worker {dead.name!r} ({dead.worker_id}) lost its "
                "lease under the fail_fast policy",
            )

    # ------------------------------------------------------------------ clocks
    def clock(self, worker_id: str, clock: int, *, log: Callable[[], None] | None = None) -> int:
        """End iteration ``clock`` of a worker; returns the new clock.

        Idempotent: ending an iteration that already ended returns the current clock.

        Args:
            log: Called before the clock advances (the write-ahead log; not for a repeat that
                changes nothing); if it raises, nothing changes.

        Raises:
            WorkerNotFound: not live (FAILED_PRECONDITION).
            StaleUpdate: ``clock`` is ahead of the worker's clock (FAILED_PRECONDITION).
        """
        rec = self.require_live(worker_id)
        if clock > rec.clock:
            raise StaleUpdate(
                f"worker {worker_id!r} ends clock {clock} but is at clock {rec.clock}"
            )
        if clock == rec.clock:
            if log is not None:
                log()
            rec.clock += 1
        return rec.clock

    def check_pull(self, worker_id: str) -> Admission:
        """Whether a pull by ``worker_id`` may read now (docs/semantics.md).

        SSP(s): admitted iff ``min_q c_q >= c_p - s`` over live workers; BSP: s = 0;
        ASP: always admitted. An empty ``worker_id`` is an observer read (always admitted).

        Raises:
            WorkerNotFound: the worker is not live (FAILED_PRECONDITION).
        """
        return self.admit_read(
            worker_id,
            asynchronous=self.consistency is Consistency.ASP,
            staleness=self.staleness,
            describe=lambda rec, need: (
                f"worker {rec.name!r} at clock {rec.clock} (staleness {self.staleness}) waits "
                f"for clock >= {need}"
            ),
            aborted=self.aborted_steps,
        )

    def admit_read(
        self,
        worker_id: str,
        *,
        asynchronous: bool,
        staleness: int,
        describe: Callable[[WorkerRecord, int], str],
        aborted: Mapping[int, str] | None = None,
    ) -> Admission:
        """The bounded-staleness read rule every pull shares (dense keys and table rows).

        A read by a worker at clock ``c`` is admitted iff every live worker that holds the
        cluster back has clock ``>= c - staleness`` (Ho et al. 2013); ``asynchronous`` (ASP)
        and an observer read (empty ``worker_id``) are always admitted.

        Args:
            worker_id: The reading worker ("" for an observer).
            asynchronous: No bound (ASP).
            staleness: The bound ``s`` in clocks (0: BSP).
            describe: ``(reader, needed clock) -> text`` of a wait, for its reason.
            aborted: Aborted BSP steps by step, with their reason (a read waiting on one fails).

        Raises:
            WorkerNotFound: the worker is not live (FAILED_PRECONDITION).
        """
        if not worker_id or asynchronous:
            if worker_id:
                self.require_live(worker_id)
            return Admission(True, reason="no wait")
        rec = self.require_live(worker_id)
        need = rec.clock - staleness
        if aborted and need - 1 in aborted:
            return Admission(False, reason=aborted[need - 1], aborted=True)
        behind = tuple(sorted(w.name for w in self.holding_workers() if w.clock < need))
        if not behind:
            return Admission(True, reason=f"min clock >= {need}")
        return Admission(
            False,
            waiting_for=behind,
            reason=f"{describe(rec, need)} from {', '.join(behind)}",
        )
