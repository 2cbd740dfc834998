"""Per-key reservations of :mod:`paramserver.server.apply_threads`, with a deliberately slow apply.

The apply is replaced by one that writes the update in four parts with pauses in a worker
thread, so any read or write that overlapped it would see (or make) a torn value.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterable

import numpy as np
import pytest

from paramserver.core.optimizers import UpdateRule
from paramserver.core.store import Checked, ParameterStore
from paramserver.errors import WaitTimeout
from paramserver.server.apply_threads import KeyGate, Offload

pytestmark = pytest.mark.timeout(30)

N = 1 << 12
PARTS = 4
PAUSE_S = 0.02


class SlowApply:
    """Stand-in for ``ParameterStore.apply_checked``: ``value = grad`` written in parts."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.intervals: list[tuple[float, float]] = []
        self._lock = threading.Lock()

    def __call__(self, checked: Iterable[Checked]) -> None:
        t0 = time.monotonic()
        for entry, grad in checked:
            flat, g = entry.value.reshape(-1), grad.reshape(-1)
            q = flat.size // PARTS
            for i in range(PARTS):
                flat[i * q : (i + 1) * q] = g[i * q : (i + 1) * q]
                self.started.set()
                time.sleep(PAUSE_S)
        with self._lock:
            self.intervals.append((t0, time.monotonic()))


@pytest.fixture
def slow(monkeypatch: pytest.MonkeyPatch) -> SlowApply:
    fake = SlowApply()
    monkeypatch.setattr(ParameterStore, "apply_checked", staticmethod(fake))
    return fake


def _setup() -> tuple[ParameterStore, Offload]:
    store = ParameterStore()
    store.init("k", np.zeros(N, np.float32), UpdateRule("assign"))
    store.init("j", np.zeros(N, np.float32), UpdateRule("assign"))
    return store, Offload(lambda: store, min_bytes=0)


def _push(store: ParameterStore, fill: float, keys: tuple[str, ...] = ("k",)) -> list[Checked]:
    return store.check_many({k: np.full(N, fill, np.float32) for k in keys})


async def test_snapshot_waits_for_an_apply_in_progress(slow: SlowApply) -> None:
    store, offload = _setup()
    done = offload.apply(_push(store, 1.0))
    await asyncio.to_thread(slow.started.wait, 5)  # the thread has written part of it
    snap = await offload.snapshot("k", timeout_s=5)
    np.testing.assert_array_equal(snap, np.ones(N, np.float32))
    await done
    assert offload.gate.busy_keys() == []


async def test_applies_of_one_key_run_in_decision_order_and_never_overlap(
    slow: SlowApply,
) -> None:
    store, offload = _setup()
    first = offload.apply(_push(store, 1.0, ("k", "j")))
    reads = [asyncio.ensure_future(offload.snapshot("j", timeout_s=5))]
    second = offload.apply(_push(store, 2.0))
    reads.append(asyncio.ensure_future(offload.snapshot("k", timeout_s=5)))
    await asyncio.gather(first, second)
    after_first, after_second = await asyncio.gather(*reads)
    np.testing.assert_array_equal(after_first, np.ones(N, np.float32))
    np.testing.assert_array_equal(after_second, np.full(N, 2.0, np.float32))
    (_, a1), (b0, _) = sorted(slow.intervals)
    assert a1 <= b0  # the second apply started after the first finished


async def test_cancelled_reader_does_not_let_a_later_writer_overlap(slow: SlowApply) -> None:
    store, offload = _setup()
    first = offload.apply(_push(store, 1.0))
    reader = asyncio.ensure_future(offload.snapshot("k", timeout_s=5))
    await asyncio.sleep(0)
    reader.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reader
    second = offload.apply(_push(store, 2.0))
    await asyncio.gather(first, second)
    (_, a1), (b0, _) = sorted(slow.intervals)
    assert a1 <= b0


async def test_reader_deadline(slow: SlowApply) -> None:
    store, offload = _setup()
    done = offload.apply(_push(store, 1.0))
    with pytest.raises(WaitTimeout, match="'k'"):
        await offload.snapshot("k", timeout_s=0.01)
    await done


async def test_quiesced_waits_for_applies_and_holds_new_pushes(slow: SlowApply) -> None:
    store, offload = _setup()
    done = offload.apply(_push(store, 1.0))
    async with offload.quiesced():
        assert done.done()
        np.testing.assert_array_equal(store.get("k").value, np.ones(N, np.float32))
        admitted = asyncio.ensure_future(offload.admit_writer(timeout_s=5))
        await asyncio.sleep(0.01)
        assert not admitted.done()  # held back while the snapshot is taken
    await asyncio.wait_for(admitted, 5)


async def test_small_free_apply_runs_inline() -> None:
    store = ParameterStore()
    store.init("k", np.zeros(4, np.float32), UpdateRule("add"))
    offload = Offload(lambda: store)
    done = offload.apply(store.check_many({"k": np.ones(4, np.float32)}))
    assert done.done()  # applied before apply() returned, no thread
    np.testing.assert_array_equal(store.get("k").value, np.ones(4, np.float32))
    assert offload.offloaded == 0


async def test_a_push_of_many_small_keys_runs_in_a_thread_not_on_the_loop() -> None:
    """Issue 19 item 1 (docs/robustness.md): per-key work of a many-key push would hold the
    event loop; from OFFLOAD_MIN_KEYS keys it is applied in a worker thread."""
    from paramserver.server.apply_threads import OFFLOAD_MIN_KEYS

    store = ParameterStore()
    keys = [f"k{i}" for i in range(OFFLOAD_MIN_KEYS)]
    for key in keys:
        store.init(key, np.zeros(2, np.float32), UpdateRule("add"))
    offload = Offload(lambda: store)
    grads = {key: np.ones(2, np.float32) for key in keys}
    assert offload.worth_a_thread(grads) and await offload.all_finite(grads)
    done = offload.apply(store.check_many(grads))
    assert not done.done()  # scheduled, not run inline
    await asyncio.wait_for(asyncio.shield(done), 30)
    assert offload.offloaded == 1
    assert all(store.get(key).value.tolist() == [1.0, 1.0] for key in keys)
    offload.close()


async def test_gate_fifo_and_release_before_prev_defers() -> None:
    gate = KeyGate()
    r1 = gate.reserve(["a"])
    r2 = gate.reserve(["a", "b"])
    r3 = gate.reserve(["b"])
    assert r1.prevs == () and r2.prevs == (r1.done,) and r3.prevs == (r2.done,)
    gate.release(r2)  # early (cancelled holder): hands over only after r1
    await asyncio.sleep(0)
    assert not r2.done.done()
    gate.release(r1)
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert r2.done.done()
    await asyncio.wait_for(r3.ready(), 1)
    gate.release(r3)
    assert gate.busy_keys() == []


async def test_snapshot_many_waits_for_an_apply_in_progress_and_hops_once(
    slow: SlowApply,
) -> None:
    # One request's keys: a consistent copy of each, after the apply decided before, in one
    # worker-thread call for the request (not one per key).
    store, offload = _setup()
    done = offload.apply(_push(store, 2.0, ("k", "j")))
    await asyncio.to_thread(slow.started.wait, 5)
    before = offload.offloaded
    outs = [np.empty(N, np.float32), np.empty(N, np.float32)]
    await offload.snapshot_many(["k", "j"], outs, timeout_s=5)
    for out in outs:
        np.testing.assert_array_equal(out, np.full(N, 2.0, np.float32))
    assert offload.offloaded == before + 1
    await done
    assert offload.gate.busy_keys() == []


async def test_snapshot_many_small_and_idle_copies_inline() -> None:
    store = ParameterStore()
    store.init("a", np.arange(6, dtype=np.float32).reshape(2, 3), UpdateRule("assign"))
    store.init("b", np.arange(4, dtype=np.int64), UpdateRule("assign"))
    offload = Offload(lambda: store)  # default min_bytes: both keys are small
    outs = [np.empty((2, 3), np.float32), np.empty(4, np.int64)]
    await offload.snapshot_many(["a", "b"], outs)
    np.testing.assert_array_equal(outs[0], np.arange(6, dtype=np.float32).reshape(2, 3))
    np.testing.assert_array_equal(outs[1], np.arange(4, dtype=np.int64))
    assert offload.offloaded == 0
    assert offload.gate.busy_keys() == []


async def test_snapshot_many_unknown_key_copies_nothing() -> None:
    from paramserver.errors import KeyNotFound

    store = ParameterStore()
    store.init("a", np.ones(3, np.float32), UpdateRule("assign"))
    offload = Offload(lambda: store)
    out = np.zeros(3, np.float32)
    with pytest.raises(KeyNotFound):
        await offload.snapshot_many(["a", "missing"], [out, np.zeros(3, np.float32)])
    np.testing.assert_array_equal(out, np.zeros(3, np.float32))


async def test_read_with_waits_for_an_apply_in_progress_and_runs_in_a_thread(
    slow: SlowApply,
) -> None:
    # What read_with hands its reader is the value after the apply decided before it (never
    # a torn one), read in a worker thread for a big key; nothing is reserved afterwards.
    store, offload = _setup()
    done = offload.apply(_push(store, 3.0))
    await asyncio.to_thread(slow.started.wait, 5)
    before = offload.offloaded
    threads: list[int] = []

    def read(value: np.ndarray) -> bytes:
        threads.append(threading.get_ident())
        return value.tobytes()

    got = await offload.read_with("k", read, timeout_s=5)
    assert got == np.full(N, 3.0, np.float32).tobytes()
    assert threads and threads[0] != threading.get_ident()
    assert offload.offloaded == before + 1
    await done
    assert offload.gate.busy_keys() == []


async def test_read_with_small_and_idle_reads_inline() -> None:
    store = ParameterStore()
    store.init("a", np.arange(5, dtype=np.float32), UpdateRule("assign"))
    offload = Offload(lambda: store)  # default min_bytes: a small key
    got = await offload.read_with("a", lambda v: v.sum())
    assert got == 10.0 and offload.offloaded == 0 and offload.gate.busy_keys() == []
