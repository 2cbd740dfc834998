"""What the server shard observes about itself, without any metrics library
(docs/semantics.md, docs/architecture.md).

Two hook objects, both cheap no-ops until something listens:

* :class:`CoreObserver` — the pure :class:`~paramserver.core.shard.ServerCore` calls it where
  updates are applied, dropped and where clocks and BSP steps advance. :class:`ShardObservations`
  is the one the engine installs: plain counters and bucket arrays (no locks, no prometheus),
  read by ``paramserver status`` and by the Prometheus collector at scrape time.
* :class:`ServingHooks` — the servicer's shared push/pull seams (``apply_push``, ``admit_pull``,
  ``pull_frame_bytes``, ``pull_snapshots_bytes``, used by every transport: the Push/Pull streams
  and the Session RPC) report bytes and latencies through :func:`observed_push` /
  :func:`observed_admit` / :func:`observed_snapshot` / :func:`observed_snapshots`. The
  metrics module installs a Prometheus implementation; without
  ``--metrics-port`` the no-op base stays.

Definitions (docs/observability.md "Definitions"):

* **Staleness of an applied gradient, in clocks** (Ho et al., "More Effective Distributed ML via a
  Stale Synchronous Parallel Parameter Server", NIPS 2013: the clock difference): when a gradient
  computed at clock ``c_g`` (the clock sent with the push) is applied, ``max(0, c_hi - c_g)``,
  where ``c_hi`` is the highest clock of any gradient applied to this shard before it. It counts
  the iterations the parameters have moved past the ones the gradient was computed from. Under
  BSP it is 0 (each step's aggregate is applied once, in step order); under SSP(s) it is at most
  s (a worker at clock ``c_hi`` was admitted only when every live worker had clock
  ``>= c_hi - s``); under ASP it is unbounded.
* **Staleness in versions**: ``applied_updates - base_version`` at application, where
  ``base_version`` is the parameter version the worker last pulled (sent with each push; the
  quantity ASP ``max_staleness`` bounds). Only for pushes that carry a base version.
* **BSP barrier wait** of worker w in step t: ``close_t - clock_{w,t}``, the seconds between w
  ending iteration t (its ``clock()`` call) and step t closing (the last live worker's
  ``clock()``, or the lease sweep that removed it). Fast workers wait long; the straggler ~0.
* **BSP barrier lag** of w in step t: ``clock_{w,t} - min_v clock_{v,t}``, how long after the
  step's first finisher w ended it — the time the fastest worker waited on w. Per step,
  ``wait + lag`` is the same for every worker, so ranking by total lag (descending) is the
  straggler ranking.
"""

from __future__ import annotations

import bisect
import functools
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Concatenate, ParamSpec, Protocol, TypeVar

import numpy as np

from paramserver.core.shard import CoreObserver, ObserverState
from paramserver.serving.metrics import CURRENT_RPC

__all__ = [
    "CURRENT_RPC",
    "STALENESS_CLOCK_BOUNDS",
    "STALENESS_VERSION_BOUNDS",
    "BarrierTotals",
    "BucketCounts",
    "CoreObserver",
    "ServingHooks",
    "ShardObservations",
    "observed_admit",
    "observed_push",
    "observed_snapshot",
]

#: Upper bounds (inclusive, clocks) of the staleness-in-clocks histogram buckets.
STALENESS_CLOCK_BOUNDS: tuple[float, ...] = (0, 1, 2, 3, 4, 5, 6, 8, 10, 16, 32, 64, 128)
#: Upper bounds (inclusive, versions) of the staleness-in-versions histogram buckets.
STALENESS_VERSION_BOUNDS: tuple[float, ...] = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096)
#: Upper bounds (seconds) of the checkpoint-duration histogram buckets.
CHECKPOINT_SECONDS_BOUNDS: tuple[float, ...] = (0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300)


#: Reasons a push or a queued gradient is not applied.
DROP_REASONS = (
    "duplicate",  # a retried request id: answered, not applied again
    "stale",  # ASP max_staleness: the gradient's base version is too old
    "stale_step",  # BSP/SSP push for a clock or step that is not the worker's / not open
    "non_finite",  # NaN/Inf gradient refused
    "invalid",  # wrong dtype/shape or another malformed gradient
    "unknown_key",  # a key never declared
    "aborted_step",  # BSP step aborted by fail_fast: its queued gradients dropped
    "out_of_range",  # an update (or BSP aggregate) whose result overflows the key's dtype
    "rejected",  # any other refusal
)


@dataclass
class BucketCounts:
    """A fixed-bucket histogram in plain Python (what Prometheus exposes, built at scrape).

    Attributes:
        bounds: Inclusive upper bounds, ascending; a value above the last one counts in +Inf.
        counts: Observations per bucket (not cumulative); one more entry than ``bounds``.
        total: Sum of the observed values.
    """

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, cumulative count)`` pairs ending with ``("+Inf", count)``."""
        out: list[tuple[str, int]] = []
        running = 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += n
            out.append(("+Inf" if bound == float("inf") else repr(float(bound)), running))
        return out


@dataclass
class BarrierTotals:
    """One worker's BSP barrier accounting, summed over the steps it ended (seconds)."""

    wait_s: float = 0.0
    lag_s: float = 0.0
    steps: int = 0


class ShardObservations(CoreObserver):
    """The engine's observer: counters, staleness histograms, barrier waits, checkpoints.

    The per-worker barrier totals (and the clock times of the steps still open) are part of a
    checkpoint (:meth:`state` / :meth:`restore`), and WAL replay rebuilds those of the steps it
    replays at the times its records were written (:meth:`replaying_at`), so they survive a
    restart as the clocks do. Applied gradients per registration are counted by the core
    (:attr:`~paramserver.core.shard.ServerCore.applied_by_registration`).

    Args:
        now: Clock of barrier times in seconds: wall-clock (Unix) time, so that the times a
            checkpoint or the write-ahead log keeps compare with those of the restarted
            server (injectable for tests).
        bsp: Whether BSP barrier waits are recorded (clock times are kept until a step closes).
        max_workers: Worker names tracked for barrier waits; later names are not tracked
            (bounds memory and Prometheus label cardinality).
    """

    def __init__(
        self, now: Callable[[], float] = time.time, *, bsp: bool, max_workers: int = 1024
    ) -> None:
        self.now = now
        self.bsp = bsp
        self.max_workers = max_workers
        self.staleness_clocks = BucketCounts(STALENESS_CLOCK_BOUNDS)
        self.staleness_versions = BucketCounts(STALENESS_VERSION_BOUNDS)
        self.dropped_by_reason: dict[str, int] = dict.fromkeys(DROP_REASONS, 0)
        self.barrier: dict[str, BarrierTotals] = {}
        self._clocked_at: dict[int, dict[str, float]] = {}
        #: During WAL replay: the wall-clock time of the record being replayed.
        self._replay_at: float | None = None
        self.checkpoint_seconds = BucketCounts(CHECKPOINT_SECONDS_BOUNDS)
        #: Wall-clock time (Unix seconds) the newest checkpoint committed; None before one.
        self.last_checkpoint_unix_s: float | None = None
        #: Name of the newest checkpoint written or restored ("" before one).
        self.last_checkpoint_name = ""
        #: The newest checkpoint is the one restored at start (none written since).
        self.last_checkpoint_restored = False

    # ------------------------------------------------------------------ CoreObserver
    def applied(
        self,
        worker_name: str,
        staleness_clocks: int,
        staleness_versions: int | None,
        *,
        worker_id: str = "",
    ) -> None:
        self.staleness_clocks.observe(staleness_clocks)
        if staleness_versions is not None:
            self.staleness_versions.observe(staleness_versions)

    def dropped(self, reason: str, count: int = 1) -> None:
        self.dropped_by_reason[reason] = self.dropped_by_reason.get(reason, 0) + count

    def _time(self) -> float:
        return self.now() if self._replay_at is None else self._replay_at

    def clocked(self, worker_name: str, clock: int) -> None:
        if self.bsp:
            self._clocked_at.setdefault(clock, {})[worker_name] = self._time()

    def step_closed(self, step: int) -> None:
        close = self._time()
        for old in [s for s in self._clocked_at if s < step]:  # steps skipped (aborted, restored)
            del self._clocked_at[old]
        times = self._clocked_at.pop(step, {})
        if not times:
            return
        first = min(times.values())
        for name, at in times.items():
            totals = self.barrier.get(name)
            if totals is None:
                if len(self.barrier) >= self.max_workers:
                    continue
                totals = self.barrier[name] = BarrierTotals()
            totals.wait_s += max(0.0, close - at)
            totals.lag_s += at - first
            totals.steps += 1

    def replaying_at(self, unix_s: float | None) -> None:
        self._replay_at = unix_s

    # ------------------------------------------------------------------ durable part
    def state(self) -> ObserverState:
        """The barrier totals per worker name and the clock times of the BSP steps still
        open (JSON-able; a checkpoint's ``"observations"``)."""
        return {
            "barrier": {n: [b.wait_s, b.lag_s, b.steps] for n, b in self.barrier.items()},
            "clocked_at": {
                str(step): dict(times) for step, times in self._clocked_at.items() if times
            },
        }

    def restore(self, state: ObserverState) -> None:
        self.barrier = {
            str(n): BarrierTotals(float(wait), float(lag), int(steps))
            for n, (wait, lag, steps) in state.get("barrier", {}).items()
        }
        self._clocked_at = {
            int(step): {str(n): float(at) for n, at in times.items()}
            for step, times in state.get("clocked_at", {}).items()
        }

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_written(self, duration_s: float, name: str = "") -> None:
        """A checkpoint committed after ``duration_s`` seconds (snapshot + write + commit)."""
        self.checkpoint_seconds.observe(duration_s)
        self.last_checkpoint_unix_s = time.time()
        self.last_checkpoint_name = name
        self.last_checkpoint_restored = False

    def checkpoint_restored(self, name: str, committed_unix_s: float) -> None:
        """The server started from checkpoint ``name``, committed at ``committed_unix_s``."""
        self.last_checkpoint_unix_s = committed_unix_s
        self.last_checkpoint_name = name
        self.last_checkpoint_restored = True

    # ------------------------------------------------------------------ reads
    def straggler_ranking(self) -> list[tuple[str, BarrierTotals]]:
        """Workers by total barrier lag, the worst straggler first."""
        return sorted(self.barrier.items(), key=lambda kv: (-kv[1].lag_s, kv[0]))


class ServingHooks:
    """What the push/pull seams report; no-ops here (installed when metrics are off)."""

    enabled = False

    def pushed(self, rpc: str, grads: Mapping[str, np.ndarray], seconds: float, ok: bool) -> None:
        """A push was applied (or queued, or refused: ``ok`` False) after ``seconds``."""

    def pull_admitted(self, rpc: str, keys: Sequence[str], seconds: float, ok: bool) -> None:
        """A pull's consistency wait ended (admitted: ``ok`` True) after ``seconds``."""

    def pulled(self, rpc: str, key: str, nbytes: int) -> None:
        """``nbytes`` of key ``key`` were snapshotted for a reader."""


class _Served(Protocol):
    """What a decorated seam's owner has: the engine whose ``hooks`` it reports to."""

    @property
    def engine(self) -> object: ...


P = ParamSpec("P")
T = TypeVar("T")
S = TypeVar("S", bound=_Served)


def _hooks(owner: _Served) -> ServingHooks:
    hooks = getattr(owner.engine, "hooks", None)
    return hooks if isinstance(hooks, ServingHooks) else _NOOP


_NOOP = ServingHooks()


def _timed(
    fn: Callable[Concatenate[S, P], Awaitable[T]],
    report: Callable[[ServingHooks, T | None, Mapping[str, object], float, bool], None],
) -> Callable[Concatenate[S, P], Awaitable[T]]:
    """``fn`` timed: ``report(hooks, result or None, kwargs, seconds, ok)`` after every call
    (failed ones too) while the owner's hooks are enabled; nothing is timed otherwise."""

    @functools.wraps(fn)
    async def wrapper(self: S, *args: P.args, **kwargs: P.kwargs) -> T:
        hooks = _hooks(self)
        if not hooks.enabled:
            return await fn(self, *args, **kwargs)
        t0 = time.perf_counter()
        result: T | None = None
        ok = False
        try:
            result = await fn(self, *args, **kwargs)
            ok = True
            return result
        finally:
            report(hooks, result, kwargs, time.perf_counter() - t0, ok)

    return wrapper  # type: ignore[return-value]


def _report_push(
    hooks: ServingHooks, _result: object, kwargs: Mapping[str, object], seconds: float, ok: bool
) -> None:
    grads = kwargs.get("grads")
    hooks.pushed(CURRENT_RPC.get(), grads if isinstance(grads, Mapping) else {}, seconds, ok)


def _report_admit(
    hooks: ServingHooks, keys: list[str] | None, _kwargs: object, seconds: float, ok: bool
) -> None:
    hooks.pull_admitted(CURRENT_RPC.get(), keys or [], seconds, ok)


def observed_push(
    fn: Callable[Concatenate[S, P], Awaitable[T]],
) -> Callable[Concatenate[S, P], Awaitable[T]]:
    """Decorate the servicer's ``apply_push`` seam: bytes and latency of every push."""
    return _timed(fn, _report_push)


def observed_admit(
    fn: Callable[Concatenate[S, P], Awaitable[list[str]]],
) -> Callable[Concatenate[S, P], Awaitable[list[str]]]:
    """Decorate the servicer's ``admit_pull`` seam: one pull, and its consistency wait."""
    return _timed(fn, _report_admit)


def observed_snapshot(
    fn: Callable[Concatenate[S, P], Awaitable[T]],
) -> Callable[Concatenate[S, P], Awaitable[T]]:
    """Decorate the servicer's one-key pull seams (``pull_frame_bytes``): bytes pulled per key
    (the result's ``nbytes``, or its length when it is raw bytes)."""

    @functools.wraps(fn)
    async def wrapper(self: S, *args: P.args, **kwargs: P.kwargs) -> T:
        hooks = _hooks(self)
        result = await fn(self, *args, **kwargs)
        if hooks.enabled:
            key = args[0] if args else kwargs.get("key", "")
            nbytes = len(result) if isinstance(result, bytes) else getattr(result, "nbytes", 0)
            hooks.pulled(CURRENT_RPC.get(), str(key), int(nbytes))
        return result

    return wrapper  # type: ignore[return-value]


def observed_snapshots(
    fn: Callable[Concatenate[S, P], Awaitable[list[bytes]]],
) -> Callable[Concatenate[S, P], Awaitable[list[bytes]]]:
    """Decorate a servicer seam that pulls several keys' raw bytes at once (its first
    argument the keys, its result their bytes in order): bytes pulled per key, as
    :func:`observed_snapshot` reports each."""

    @functools.wraps(fn)
    async def wrapper(self: S, *args: P.args, **kwargs: P.kwargs) -> list[bytes]:
        hooks = _hooks(self)
        result = await fn(self, *args, **kwargs)
        if hooks.enabled:
            keys = args[0] if args else kwargs.get("keys", ())
            rpc = CURRENT_RPC.get()
            for key, data in zip(keys, result, strict=True):  # type: ignore[call-overload]
                hooks.pulled(rpc, str(key), len(data))
        return result

    return wrapper  # type: ignore[return-value]
