"""Big numeric work off the event-loop thread, with per-key reservations (docs/architecture.md).

The pure core decides every push synchronously on the event loop (validation, deduplication,
staleness, BSP queueing, counters; :meth:`ServerCore.push`). What is left, the numeric apply of an
SSP/ASP push (the update rule's kernel on the key's arrays), is handed to :meth:`Offload.apply`;
gradients of at least :data:`OFFLOAD_MIN_BYTES` run in a worker thread (numpy releases the GIL),
so the loop keeps serving other streams. Pull snapshots of big keys are copied in a thread too.

Safety rests on a per-key FIFO of reservations (:class:`KeyGate`):

1. **Reserve at decision time.** A push's keys are reserved in the same synchronous step that
   decides it (no ``await`` between), and a pull reserves its key before it copies. So the
   reservation order of a key is the order of decisions and reads on the event loop.
2. **Run in order.** A reservation runs only after every earlier reservation of any of its keys
   has finished, and it is released only after they have (also when its holder is cancelled),
   so a key's arrays are never touched by two threads at once: no lost update, and a pull never
   observes a half-applied update (it sees the value before or after, never a mix).
   Small work (under :data:`OFFLOAD_MIN_BYTES`) on keys no unfinished reservation holds runs
   inline at once and takes no reservation: it is already after every earlier holder, and
   nothing else runs on the loop until it returns (:meth:`KeyGate.idle`).
3. **Exactly once.** Deduplication and counters are decided on the loop before the apply is
   scheduled; the apply task is never cancelled (callers wait for it through
   :func:`asyncio.shield`), so each decided push is applied exactly once.
4. **Checkpoints.** :meth:`Offload.quiesced` stops new push decisions (:meth:`admit_writer`),
   waits for every scheduled apply and then lets the caller snapshot synchronously: the
   snapshot's values, counters and deduplication state describe the same set of pushes.
5. **BSP.** Under BSP pushes are only queued; a clock that closes a step validates the
   aggregates inside the core and hands them to :meth:`Offload.apply_detached` (the core's
   ``step_applier``), which reserves their keys in that same synchronous step. Pulls admitted
   by the step's closing queue behind it and see the whole step applied. Cores without an
   engine (unit tests, tools) apply inline.

Only the event loop mutates the reservation tables; worker threads touch only the arrays of the
keys their reservation holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar, TypeVarTuple

import numpy as np

from paramserver.core.store import Checked, ParameterStore, count_non_finite
from paramserver.errors import Unavailable, ValueOutOfRange, WaitTimeout

__all__ = ["OFFLOAD_MIN_BYTES", "OFFLOAD_MIN_KEYS", "KeyGate", "Offload", "Reservation"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
_Args = TypeVarTuple("_Args")

OFFLOAD_MIN_BYTES: int = 8 << 20  # ServerConfig.offload_min_bytes's default
"""Gradients (summed over one push) and pull snapshots of at least this many bytes run in a
worker thread; smaller ones run inline on the loop (a thread hop costs more than they do)."""

OFFLOAD_MIN_KEYS: int = 1024
"""Pushes of at least this many keys run their NaN/Inf scan and apply in a worker thread
whatever their size: the per-key work of a 100,000-key push would otherwise hold the event loop
for seconds (heartbeats unread, leases lapsing). The thread shares the GIL with the loop, which
gets it back every switch interval (5 ms by default), so the loop keeps serving."""

#: Longest a push waits for a checkpoint's quiet period before it is refused (UNAVAILABLE).
ADMIT_WAIT_S = 60.0


class Reservation:
    """One holder's place in the queues of its keys (see :class:`KeyGate`)."""

    __slots__ = ("done", "keys", "prevs")

    def __init__(
        self, keys: tuple[str, ...], prevs: tuple[asyncio.Future[None], ...], done: Any
    ) -> None:
        self.keys = keys
        #: Reservations of the same keys taken earlier and not finished then.
        self.prevs = prevs
        #: Resolved when this reservation and every earlier one of its keys have finished.
        self.done: asyncio.Future[None] = done

    async def ready(self, timeout_s: float | None = None) -> None:
        """Wait until every earlier reservation of these keys has finished.

        Raises:
            WaitTimeout: ``timeout_s`` passed first (DEADLINE_EXCEEDED); names the keys.
        """
        if not self.prevs:
            return
        _, pending = await asyncio.wait(self.prevs, timeout=timeout_s)
        if pending:
            raise WaitTimeout(
                f"waited {timeout_s:.3f} s for earlier updates of key(s) "
                f"{', '.join(repr(k) for k in self.keys)} to finish"
            )


class KeyGate:
    """Per-key FIFO queues of reservations: taken synchronously, waited for asynchronously.

    Use from the event-loop thread only.
    """

    def __init__(self) -> None:
        self._tails: dict[str, asyncio.Future[None]] = {}

    def reserve(self, keys: Iterable[str]) -> Reservation:
        """Queue a reservation of ``keys`` behind every unfinished earlier one (no waiting)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        unique = tuple(dict.fromkeys(keys))
        prevs: dict[int, asyncio.Future[None]] = {}
        for key in unique:
            tail = self._tails.get(key)
            if tail is not None and not tail.done():
                prevs[id(tail)] = tail
            self._tails[key] = done
        return Reservation(unique, tuple(prevs.values()), done)

    def reserve_view(self, keys: Iterable[str]) -> Reservation:
        """A reservation that only waits: behind the unfinished holders of ``keys``, taking no
        place in their queues (nothing to release)."""
        prevs: dict[int, asyncio.Future[None]] = {}
        for key in dict.fromkeys(keys):
            tail = self._tails.get(key)
            if tail is not None and not tail.done():
                prevs[id(tail)] = tail
        return Reservation(tuple(keys), tuple(prevs.values()), None)

    def idle(self, keys: Iterable[str]) -> bool:
        """No unfinished reservation holds any of ``keys``: work on them done synchronously,
        right now (no ``await`` in between), is ordered after every earlier holder without
        taking a reservation of its own (the small-key fast path of :class:`Offload`)."""
        tails = self._tails
        for key in keys:
            tail = tails.get(key)
            if tail is not None and not tail.done():
                return False
        return True

    def release(self, res: Reservation) -> None:
        """End ``res``; its keys pass to the next holders once every earlier holder is done.

        Releasing before the earlier holders finished (a cancelled waiter) defers the hand-over
        until they have, so the FIFO order never lets two holders of a key overlap.
        """
        if res.done.done():
            return
        pending = [p for p in res.prevs if not p.done()]
        if pending:
            gathered = asyncio.gather(*pending, return_exceptions=True)
            gathered.add_done_callback(lambda _: self._finish(res))
        else:
            self._finish(res)

    def _finish(self, res: Reservation) -> None:
        if not res.done.done():
            res.done.set_result(None)
        for key in res.keys:
            if self._tails.get(key) is res.done:
                del self._tails[key]

    def busy_keys(self) -> list[str]:
        """Keys with an unfinished reservation (for status and tests)."""
        return [k for k, f in self._tails.items() if not f.done()]


async def _in_thread(pool: ThreadPoolExecutor, fn: Callable[[*_Args], T], *args: *_Args) -> T:
    """Run ``fn(*args)`` in ``pool``; if the caller is cancelled, still wait for the thread
    to finish before propagating (its reservation must outlive the work)."""
    fut = asyncio.get_running_loop().run_in_executor(pool, fn, *args)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await asyncio.wait([fut])
        raise


class Offload:
    """Runs push applies and pull copies of big keys in worker threads, safely (see module).

    Args:
        store: Returns the core's current store (a checkpoint restore replaces it).
        min_bytes: Size from which work goes to a thread (default :data:`OFFLOAD_MIN_BYTES`).
        threads: Worker threads (default: the CPU count, at most 4).
    """

    def __init__(
        self,
        store: Callable[[], ParameterStore],
        *,
        min_bytes: int = OFFLOAD_MIN_BYTES,
        threads: int | None = None,
    ) -> None:
        self._store = store
        self.min_bytes = min_bytes
        self.gate = KeyGate()
        self._threads = threads or max(1, min(4, os.cpu_count() or 1))
        self._pool: ThreadPoolExecutor | None = None
        self._writers: set[asyncio.Future[None]] = set()
        self._closed = 0
        self._reopened: asyncio.Event | None = None
        #: Applies and copies run in a thread so far (for tests and status).
        self.offloaded = 0

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="paramserver-apply")
        return self._pool

    # ------------------------------------------------------------------ pushes
    async def admit_writer(self, timeout_s: float = ADMIT_WAIT_S) -> None:
        """Wait while a checkpoint holds new push decisions back; call right before deciding
        a push (with no ``await`` between the two).

        Raises:
            Unavailable: still held back after ``timeout_s`` (UNAVAILABLE, retryable).
        """
        if not self._closed:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._closed:
            if self._reopened is None:
                self._reopened = asyncio.Event()
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise Unavailable(
                    f"push held back {timeout_s:.0f} s by a checkpoint in progress; retry"
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._reopened.wait(), remaining)

    async def settled(self, keys: Iterable[str], timeout_s: float = ADMIT_WAIT_S) -> None:
        """Wait until no unfinished update holds any of ``keys`` (their values are final):
        what a decision that reads the values (the range check of half-precision keys)
        needs. Call in a loop with :meth:`idle` right before deciding (no ``await`` between).

        Raises:
            WaitTimeout: ``timeout_s`` passed first (DEADLINE_EXCEEDED).
        """
        await self.gate.reserve_view(keys).ready(timeout_s)

    def idle(self, keys: Iterable[str]) -> bool:
        """No unfinished update holds any of ``keys``."""
        return self.gate.idle(keys)

    @property
    def holding_writers(self) -> bool:
        """A checkpoint holds new push decisions back now (:meth:`admit_writer` would wait)."""
        return bool(self._closed)

    def worth_a_thread(self, grads: Mapping[str, np.ndarray]) -> bool:
        """The gradients are big enough (in total) for :meth:`all_finite` to scan them in a
        worker thread; below that it returns False at once."""
        if len(grads) >= OFFLOAD_MIN_KEYS:
            return True
        return sum(int(getattr(a, "nbytes", 0)) for a in grads.values()) >= self.min_bytes

    async def all_finite(self, grads: Mapping[str, np.ndarray]) -> bool:
        """Whether no gradient holds NaN/Inf, scanned in a worker thread when they are big
        (False also for gradients too small to be worth a thread: let the core scan them).

        The arrays are the caller's own (received, not stored), so the scan needs no key.
        """
        arrays = list(grads.values())
        if not all(isinstance(a, np.ndarray) for a in arrays):
            return False
        if len(arrays) < OFFLOAD_MIN_KEYS and sum(int(a.nbytes) for a in arrays) < self.min_bytes:
            return False
        pool = self._executor()
        loop = asyncio.get_running_loop()
        bad = await loop.run_in_executor(pool, _count_all_non_finite, arrays)
        return bad == 0

    def apply(self, checked: list[Checked]) -> asyncio.Future[None]:
        """Apply one decided push: reserve its keys now, run now or later (an applier for
        :meth:`ServerCore.push`; call on the loop).

        Returns:
            A future resolved once the gradients are applied (already resolved when applied
            inline). Never cancel it; wait through :func:`asyncio.shield`.
        """
        loop = asyncio.get_running_loop()
        nbytes = sum(int(grad.nbytes) for _, grad in checked)
        if len(checked) >= OFFLOAD_MIN_KEYS:
            nbytes = max(nbytes, self.min_bytes)  # many keys: a thread, whatever the bytes
        if nbytes < self.min_bytes and self.gate.idle(entry.key for entry, _ in checked):
            # Small, and no earlier holder of these keys is unfinished: apply inline, now.
            # No reservation is needed: nothing else runs on the loop before this returns
            # (a reservation and its hand-over cost more than a small apply).
            ParameterStore.apply_checked(checked)
            done: asyncio.Future[None] = loop.create_future()
            done.set_result(None)
            return done
        res = self.gate.reserve(entry.key for entry, _ in checked)
        task = loop.create_task(self._apply_later(res, checked, nbytes))
        self._writers.add(task)
        task.add_done_callback(self._writers.discard)
        return task

    def apply_detached(self, checked: list[Checked]) -> None:
        """:meth:`apply` for work nobody waits on (a closed BSP step's aggregates, applied at
        a clock); failures are logged. Readers and checkpoints still wait for it."""
        done = self.apply(checked)
        done.add_done_callback(_retrieve)

    async def _apply_later(self, res: Reservation, checked: list[Checked], nbytes: int) -> None:
        try:
            await res.ready()
            if nbytes >= self.min_bytes:
                self.offloaded += 1
                await _in_thread(self._executor(), ParameterStore.apply_checked, checked)
            else:
                ParameterStore.apply_checked(checked)
        except ValueOutOfRange as exc:  # refused whole at apply time: nothing applied
            logger.warning("%s", exc.message)
            raise
        except Exception:
            logger.exception(
                "applying a push to key(s) %s failed", ", ".join(repr(k) for k in res.keys)
            )
            raise
        finally:
            self.gate.release(res)

    # ------------------------------------------------------------------ pulls
    async def snapshot(
        self, key: str, out: np.ndarray | None = None, *, timeout_s: float | None = None
    ) -> np.ndarray:
        """A consistent copy of ``key``'s value (in ``out`` when given), after every update of
        the key decided before this call.

        Args:
            key: A declared key.
            out: Array of the key's dtype and shape to overwrite, or None for a new array.
            timeout_s: Deadline for earlier updates of the key to finish.

        Raises:
            KeyNotFound: (NOT_FOUND) unknown key.
            WaitTimeout: (DEADLINE_EXCEEDED) earlier updates did not finish in time.
        """

        def copy(value: np.ndarray) -> np.ndarray:
            dst = np.empty_like(value) if out is None else out
            _copy_into(dst, value)
            return dst

        return await self.read_with(key, copy, timeout_s=timeout_s)

    async def read_with(
        self, key: str, read: Callable[[np.ndarray], T], *, timeout_s: float | None = None
    ) -> T:
        """``read(value)`` of ``key``'s stored value, run as :meth:`snapshot` copies it: after
        every update of the key decided before this call, with no update of it running
        meanwhile (inline when the key is small and idle, else under a reservation, in a
        worker thread for a big key). ``read`` must not keep ``value``: it returns what it
        made of it (e.g. the wire bytes of the value, copied once straight out of the store
        instead of into a snapshot first and then into the bytes).

        Raises:
            KeyNotFound: (NOT_FOUND) unknown key.
            WaitTimeout: (DEADLINE_EXCEEDED) earlier updates did not finish in time.
        """
        entry = self._store().get(key)
        if entry.value.nbytes < self.min_bytes and self.gate.idle((key,)):
            return read(entry.value)
        res = self.gate.reserve([key])
        try:
            await res.ready(timeout_s)
            value = entry.value
            if value.nbytes >= self.min_bytes:
                self.offloaded += 1
                return await _in_thread(self._executor(), read, value)
            return read(value)
        finally:
            self.gate.release(res)

    async def snapshot_many(
        self,
        keys: Sequence[str],
        outs: Sequence[np.ndarray],
        *,
        timeout_s: float | None = None,
    ) -> None:
        """:meth:`snapshot` of several keys into ``outs``, with one decision for them all.

        When every key is small and idle the copies run inline, now (no ``await`` before they
        are done, as :meth:`snapshot`'s fast path). Otherwise one reservation of all the keys
        is taken and, once earlier updates of them have finished, the keys of at least
        :attr:`min_bytes` are copied in one worker-thread call (the small ones inline): per
        request, not per key, so a model's many keys cost one hop at most.

        Args:
            keys: Declared keys (distinct).
            outs: One array per key, of the key's dtype and shape, to overwrite.
            timeout_s: Deadline for earlier updates of the keys to finish.

        Raises:
            KeyNotFound: (NOT_FOUND) an unknown key (nothing is copied).
            WaitTimeout: (DEADLINE_EXCEEDED) earlier updates did not finish in time.
        """
        store = self._store()
        entries = [store.get(key) for key in keys]
        small = self.min_bytes
        if all(e.value.nbytes < small for e in entries) and self.gate.idle(keys):
            for entry, dst in zip(entries, outs, strict=True):
                _copy_into(dst, entry.value)
            return
        res = self.gate.reserve(keys)
        try:
            await res.ready(timeout_s)
            big: list[tuple[np.ndarray, np.ndarray]] = []
            for entry, dst in zip(entries, outs, strict=True):
                value = entry.value
                if value.nbytes >= small:
                    big.append((dst, value))
                else:
                    _copy_into(dst, value)
            if big:
                self.offloaded += 1
                await _in_thread(self._executor(), _copy_pairs, big)
        finally:
            self.gate.release(res)

    def read_now(self, key: str) -> np.ndarray | None:
        """``key``'s live value when it may be read right now without a snapshot copy: the
        key is small (under :attr:`min_bytes`) and every earlier update of it has finished.
        The caller must copy what it needs before its next ``await`` (e.g. ``tobytes()``);
        None: take :meth:`snapshot` instead.

        Raises:
            KeyNotFound: (NOT_FOUND) unknown key.
        """
        value = self._store().get(key).value
        if value.nbytes < self.min_bytes and self.gate.idle((key,)):
            return value
        return None

    def read_all_now(self, keys: Sequence[str]) -> list[np.ndarray] | None:
        """:meth:`read_now` of every key at once: their live values when each is small and
        every earlier update of any of them has finished (copy them before the next
        ``await``), else None.

        Raises:
            KeyNotFound: (NOT_FOUND) an unknown key.
        """
        store = self._store()
        values = [store.get(key).value for key in keys]
        limit = self.min_bytes
        if all(v.nbytes < limit for v in values) and self.gate.idle(keys):
            return values
        return None

    # ------------------------------------------------------------------ checkpoints
    @contextlib.asynccontextmanager
    async def quiesced(self) -> AsyncIterator[None]:
        """Hold new push decisions back and wait until every scheduled apply has finished.

        Inside the block (until its first ``await``) the store reflects exactly the decided
        pushes, so a synchronous snapshot there is consistent.
        """
        self._closed += 1
        try:
            while self._writers:
                await asyncio.wait(list(self._writers))
            yield
        finally:
            self._closed -= 1
            if not self._closed and self._reopened is not None:
                self._reopened.set()
                self._reopened = None

    async def drain(self) -> None:
        """Wait for every scheduled apply (e.g. before shutdown)."""
        while self._writers:
            await asyncio.wait(list(self._writers))

    def close(self) -> None:
        """Stop the worker threads (after :meth:`drain`)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _count_all_non_finite(arrays: list[np.ndarray]) -> int:
    return sum(count_non_finite(a) for a in arrays)


def _retrieve(done: asyncio.Future[None]) -> None:
    if not done.cancelled():
        done.exception()  # logged by _apply_later; marked retrieved here


def _copy_into(dst: np.ndarray, src: np.ndarray) -> None:
    np.copyto(dst, src, casting="no")


def _copy_pairs(pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
    for dst, src in pairs:
        np.copyto(dst, src, casting="no")
