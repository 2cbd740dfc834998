"""PullBuffers: a key's last result is reused only once nothing outside it refers to it."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import numpy as np
import pytest

from paramserver.errors import InvalidArgument, ResourceExhausted
from paramserver.protocol import tensor
from paramserver.worker_client.pull_buffers import MIN_BYTES, PullBuffers, refcounts_exact

pytestmark = [
    pytest.mark.timeout(30),
    pytest.mark.skipif(not refcounts_exact(), reason="needs exact reference counts"),
]

F32 = np.dtype(np.float32)
N = MIN_BYTES // 4  # float32 elements of one kept-size array


def _address(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


def _result(buffers: PullBuffers, key: str = "w", n: int = N, fill: float = 1.0) -> np.ndarray:
    """As a pull does: take an array, fill it, keep it, hand it over."""
    out = buffers.empty(key, F32, (n,))
    out.fill(fill)
    buffers.keep(key, out)
    return out


def test_a_dropped_result_is_reused_and_a_held_one_never_is() -> None:
    b = PullBuffers()
    first = _result(b, fill=1.0)
    where = _address(first)
    del first
    second = _result(b, fill=2.0)
    assert _address(second) == where and b.reused == 1
    # held by the caller: the next result is new memory and the held values stay as they were
    third = _result(b, fill=3.0)
    assert _address(third) != _address(second)
    np.testing.assert_array_equal(second, np.full(N, 2.0, np.float32))
    np.testing.assert_array_equal(third, np.full(N, 3.0, np.float32))
    assert b.reused == 1


HOLDERS = {
    "slice": (lambda a: a[1:], lambda h: h[0]),
    "reshape": (lambda a: a.reshape(2, -1), lambda h: h[0, 1]),
    "memoryview": (memoryview, lambda h: h[1]),
    "list": (lambda a: [a], lambda h: h[0][1]),
    "frombuffer": (lambda a: np.frombuffer(a, dtype=np.float32), lambda h: h[1]),
}


@pytest.mark.parametrize("how", list(HOLDERS))
def test_anything_still_reaching_the_array_blocks_reuse(how: str) -> None:
    hold, read = HOLDERS[how]
    b = PullBuffers()
    first = _result(b, fill=1.0)
    where = _address(first)
    holder = hold(first)
    del first
    second = _result(b, fill=2.0)
    assert _address(second) != where and b.reused == 0
    assert read(holder) == 1.0  # the caller still reads the first round's values


@pytest.mark.parametrize("how", ["weakref", "finalize", "weak-value-dict"])
def test_a_weak_reference_blocks_reuse(how: str) -> None:
    b = PullBuffers()
    first = _result(b, fill=1.0)
    where = _address(first)
    finalized: list[bool] = []
    if how == "weakref":
        ref: Any = weakref.ref(first)
    elif how == "finalize":
        ref = weakref.finalize(first, finalized.append, True)
    else:
        ref = weakref.WeakValueDictionary({"round-0": first})
    del first
    second = _result(b, fill=2.0)
    assert _address(second) != where and b.reused == 0
    if how == "weakref":
        assert ref() is not second and float(ref()[0]) == 1.0
    elif how == "weak-value-dict":
        assert float(ref["round-0"][0]) == 1.0
    else:
        assert not finalized  # still alive (kept); it runs once the client lets go
        b.clear()
        assert finalized == [True]


def test_the_only_reference_count_is_measured_not_assumed(monkeypatch: pytest.MonkeyPatch) -> None:
    from paramserver.worker_client import pull_buffers

    probe = [np.empty(4)]
    assert pull_buffers._slot_refcount(probe, 0) == pull_buffers._ONLY_OURS
    held = probe[0]
    assert pull_buffers._slot_refcount(probe, 0) == pull_buffers._ONLY_OURS + 1
    del held
    monkeypatch.setattr(pull_buffers, "_ONLY_OURS", None)  # counts found untrustworthy
    assert not pull_buffers.refcounts_exact()
    b = PullBuffers()
    assert not b.enabled
    first = _result(b)
    del first
    _result(b)
    assert b.reused == 0 and b.kept_bytes() == 0


def test_kept_bytes_stay_exact_when_the_caller_resizes_a_result() -> None:
    b = PullBuffers()
    first = _result(b)
    with pytest.raises(ValueError, match="cannot resize"):
        first.resize(4 * N)  # the client's reference trips numpy's check (documented)
    first.resize(4 * N, refcheck=False)
    del first
    assert b.kept_bytes() == N * 4  # as kept, not as resized
    b.empty("w", F32, (N,))  # dropped (shape changed): let go, not reused
    assert b.kept_bytes() == 0 and b.reused == 0


def test_a_reference_cycle_not_yet_collected_blocks_reuse_until_it_is() -> None:
    b = PullBuffers()
    first = _result(b)
    cycle: list[Any] = [first]
    cycle.append(cycle)
    del first, cycle
    gc.disable()
    try:
        _result(b)
        assert b.reused == 0  # the uncollected cycle still refers to it
    finally:
        gc.enable()
    gc.collect()


def test_reshaped_or_retyped_in_place_is_not_reused() -> None:
    b = PullBuffers()
    first = _result(b)
    first.shape = (2, N // 2)  # changed in place by its caller, then dropped
    del first
    out = b.empty("w", F32, (N,))
    assert out.shape == (N,) and b.reused == 0


def test_read_only_results_come_back_writeable() -> None:
    b = PullBuffers()
    first = _result(b)
    first.flags.writeable = False
    del first
    second = b.empty("w", F32, (N,))
    assert b.reused == 1 and second.flags.writeable


def test_small_results_disabled_buffers_and_clear_keep_nothing() -> None:
    small = PullBuffers()
    first = _result(small, n=N // 2)  # below MIN_BYTES
    assert small.kept_bytes() == 0
    del first
    off = PullBuffers(enabled=False)
    second = _result(off)
    assert off.kept_bytes() == 0
    del second
    _result(off)
    assert off.reused == 0
    cleared = PullBuffers()
    third = _result(cleared)
    assert cleared.kept_bytes() == third.nbytes
    del third
    cleared.clear()
    assert cleared.kept_bytes() == 0
    cleared.empty("w", F32, (N,))
    assert cleared.reused == 0


def test_the_usual_loop_alternates_between_two_buffers() -> None:
    """``params = await pull()`` still holds the previous result while the next pull runs: the
    one from two pulls ago is free, and the loop settles on two buffers."""
    b = PullBuffers()
    params = _result(b, fill=0.0)
    seen = {_address(params)}
    for round_ in range(1, 7):
        params = _result(b, fill=float(round_))
        seen.add(_address(params))
        np.testing.assert_array_equal(params, np.full(N, round_, np.float32))
    assert len(seen) == 2 and b.reused == 5


def test_max_bytes_bounds_what_is_kept() -> None:
    b = PullBuffers(max_bytes=MIN_BYTES)  # room for one result
    params = _result(b)
    params = _result(b)
    assert b.kept_bytes() == MIN_BYTES  # only the newest
    params = _result(b)  # the older one was let go, the newest is still held: a new array
    assert b.reused == 0
    del params
    tiny = PullBuffers(max_bytes=MIN_BYTES - 1)
    _result(tiny)
    assert tiny.kept_bytes() == 0


@pytest.mark.parametrize("bad", [-1, 2.5, "1GiB", None, True])
def test_a_bad_byte_bound_is_refused_when_built(bad: Any) -> None:
    with pytest.raises(InvalidArgument, match="max_bytes must be an int >= 0"):
        PullBuffers(max_bytes=bad)
    with pytest.raises(InvalidArgument, match="min_bytes must be an int >= 0"):
        PullBuffers(min_bytes=bad)


def test_keys_are_kept_apart() -> None:
    b = PullBuffers()
    a = _result(b, "a")
    where = _address(a)
    del a
    other = b.empty("b", F32, (N,))
    assert _address(other) != where and b.reused == 0
    assert _address(b.empty("a", F32, (N,))) == where


def test_assembler_receives_into_the_given_arrays_bit_exactly() -> None:
    b = PullBuffers()
    rng = np.random.default_rng(7)
    for round_ in range(3):
        value = rng.standard_normal((N // 64, 64)).astype(np.float32)
        value.reshape(-1)[::97] = np.float32(-0.0)
        assembler = tensor.TensorAssembler(allocate=b.empty)
        done = None
        for frame in tensor.encode_frames("w", value, 100_000):
            done = assembler.feed(frame)
        assembler.finish()
        assert done is not None
        key, got = done
        assert key == "w" and got.dtype == value.dtype and got.shape == value.shape
        assert got.tobytes() == value.tobytes()
        b.keep(key, got)
        del got, done
        assert b.reused == round_  # each round after the first reuses the last one's memory


def test_assembler_refuses_an_allocator_that_breaks_its_contract() -> None:
    def strided(key: str, dtype: np.dtype[Any], shape: tuple[int, ...]) -> np.ndarray:
        return np.empty((shape[0] * 2,), dtype)[::2]

    def failing(key: str, dtype: np.dtype[Any], shape: tuple[int, ...]) -> np.ndarray:
        raise MemoryError("no room")

    value = np.arange(10, dtype=np.float32)
    with pytest.raises(TypeError, match="C-contiguous float32 array of shape"):
        tensor.TensorAssembler(allocate=strided).feed(next(iter(tensor.encode_frames("w", value))))
    with pytest.raises(ResourceExhausted, match="cannot allocate 40 bytes"):
        tensor.TensorAssembler(allocate=failing).feed(next(iter(tensor.encode_frames("w", value))))
