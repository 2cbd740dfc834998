"""Fast paths for small tensors (issue 7, small-tensor rounds/s) keep their guarantees.

- :class:`Offload` applies and copies small keys inline with no reservation only when no
  earlier holder of the key is unfinished; otherwise they queue in FIFO order as before.
- :func:`count_non_finite` counts small gradients directly: same counts as numpy's.
- :func:`tensor.dtype_to_wire`'s dict lookup agrees with the full path for every dtype.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterable

import ml_dtypes
import numpy as np
import pytest

from paramserver.core.optimizers import BLOCK_ELEMENTS, UpdateRule
from paramserver.core.store import Checked, ParameterStore, count_non_finite
from paramserver.protocol import tensor
from paramserver.server.apply_threads import Offload

pytestmark = pytest.mark.timeout(30)

BIG = 4096  # float32 elements: 16 KiB, offloaded with MIN_BYTES below
SMALL = 16  # 64 bytes: inline when the key is free
MIN_BYTES = 8 << 10
PAUSE_S = 0.02


class SlowAssign:
    """Stand-in for ``ParameterStore.apply_checked``: ``value = grad`` in four paused parts,
    recording each call's keys and (start, end) times."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.calls: list[tuple[tuple[str, ...], float, float]] = []
        self._lock = threading.Lock()

    def __call__(self, checked: Iterable[Checked]) -> None:
        t0 = time.monotonic()
        items = list(checked)
        for entry, grad in items:
            flat, g = entry.value.reshape(-1), grad.reshape(-1)
            q = flat.size // 4
            for i in range(4):
                flat[i * q : (i + 1) * q] = g[i * q : (i + 1) * q]
                self.started.set()
                time.sleep(PAUSE_S)
        with self._lock:
            self.calls.append((tuple(e.key for e, _ in items), t0, time.monotonic()))


@pytest.fixture
def slow(monkeypatch: pytest.MonkeyPatch) -> SlowAssign:
    fake = SlowAssign()
    monkeypatch.setattr(ParameterStore, "apply_checked", staticmethod(fake))
    return fake


def _setup() -> tuple[ParameterStore, Offload]:
    store = ParameterStore()
    store.init("big", np.zeros(BIG, np.float32), UpdateRule("assign"))
    store.init("small", np.zeros(SMALL, np.float32), UpdateRule("assign"))
    return store, Offload(lambda: store, min_bytes=MIN_BYTES)


async def test_small_push_queues_behind_an_unfinished_big_push_of_its_key(
    slow: SlowAssign,
) -> None:
    store, offload = _setup()
    first = offload.apply(
        store.check_many({"big": np.ones(BIG, np.float32), "small": np.ones(SMALL, np.float32)})
    )
    await asyncio.to_thread(slow.started.wait, 5)  # the thread is writing
    assert not offload.gate.idle(["small"])
    assert offload.read_now("small") is None  # no unguarded read while it is written
    second = offload.apply(store.check_many({"small": np.full(SMALL, 2.0, np.float32)}))
    assert not second.done()  # not inline: it waits for the first
    snap = asyncio.ensure_future(offload.snapshot("small", timeout_s=5))
    await asyncio.wait_for(asyncio.gather(first, second), 5)
    np.testing.assert_array_equal(await snap, np.full(SMALL, 2.0, np.float32))
    (keys1, _, end1), (keys2, start2, _) = sorted(slow.calls, key=lambda c: c[1])
    assert keys1 == ("big", "small") and keys2 == ("small",)
    assert end1 <= start2  # never overlapped, decision order kept
    assert offload.gate.busy_keys() == []


async def test_small_push_on_a_free_key_is_applied_before_apply_returns() -> None:
    store, offload = _setup()
    offload.apply(store.check_many({"big": np.ones(BIG, np.float32)}))  # another key busy
    grad = np.arange(SMALL, dtype=np.float32)
    done = offload.apply(store.check_many({"small": grad}))
    assert done.done()
    np.testing.assert_array_equal(store.get("small").value, grad)  # assign: value = grad
    assert offload.gate.idle(["small"])  # no reservation was taken
    await offload.drain()


async def test_small_snapshot_on_a_free_key_is_a_private_copy() -> None:
    store, offload = _setup()
    store.get("small").value[:] = 3.0
    snap = await offload.snapshot("small", timeout_s=5)
    live = offload.read_now("small")
    assert live is store.get("small").value  # readable in place: nothing pending
    snap[:] = -1.0
    np.testing.assert_array_equal(store.get("small").value, np.full(SMALL, 3.0, np.float32))
    assert offload.read_now("big") is None  # big keys always take a snapshot


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32, np.float64])
@pytest.mark.parametrize("size", [1, 7, 1000, BLOCK_ELEMENTS, BLOCK_ELEMENTS + 3])
def test_count_non_finite_matches_numpy(dtype: type, size: int) -> None:
    rng = np.random.default_rng(size)
    values = rng.standard_normal(size).astype(dtype)
    bad = rng.choice(size, size=min(size, 5), replace=False)
    specials = np.array([np.nan, np.inf, -np.inf, np.nan, np.inf], dtype=np.float64)
    values[bad] = specials[: bad.size].astype(dtype)
    expected = int(np.sum(~np.isfinite(values.astype(np.float64))))
    assert expected == bad.size
    assert count_non_finite(values) == expected
    assert count_non_finite(np.ones(size, dtype)) == 0


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_count_non_finite_large_finite_squares_overflow_strided_and_swapped(dtype: type) -> None:
    # Above one block the fast check is a sum of squares (contiguous float32/float64): squares
    # that overflow are finite values and must still count 0; strided and byte-swapped arrays
    # take the plain sum. Expected counts from numpy on float64 copies.
    size = 3 * BLOCK_ELEMENTS + 5
    huge = np.full(size, np.finfo(dtype).max / 2, dtype)
    assert count_non_finite(huge) == 0
    rng = np.random.default_rng(7)
    values = rng.standard_normal(2 * size).astype(dtype)
    values[[0, size, 2 * size - 1]] = [np.nan, -np.inf, np.inf]
    for array in (values, values[::2], values[1::2], values.astype(np.dtype(dtype).newbyteorder())):
        expected = int(np.sum(~np.isfinite(array.astype(np.float64))))
        assert count_non_finite(array) == expected


@pytest.mark.parametrize("dtype", tensor.SUPPORTED_DTYPES)
@pytest.mark.parametrize("order", ["<", ">", "="])
def test_dtype_to_wire_lookup_agrees_with_the_full_path(dtype: np.dtype, order: str) -> None:
    dt = dtype.newbyteorder(order)
    wire = tensor.dtype_to_wire(dt)  # an np.dtype: the dict lookup (or its fallback)
    assert wire == tensor.dtype_to_wire(dtype.type)  # a scalar type: the full path
    assert tensor.dtype_from_wire(wire, "k") == dtype  # either byte order: the same dtype
    others = [d for d in tensor.SUPPORTED_DTYPES if d != dtype]
    assert wire not in {tensor.dtype_to_wire(d) for d in others}
