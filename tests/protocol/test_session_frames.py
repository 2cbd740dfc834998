"""Packed inline batches (``session_frames.pack_slot_batch``) read back through the same checked
reader as a shared-memory batch; values compared with the numpy arrays packed."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paramserver.api.v1 import parameter_server_pb2 as pb
from paramserver.errors import InvalidArgument
from paramserver.protocol import shm, tensor
from paramserver.protocol.session_frames import (
    inline_region,
    pack_slot_batch,
    slot_batch_entries,
    slot_batch_views,
)

pytestmark = pytest.mark.timeout(60)

#: Every dtype the wire carries.
DTYPES = list(tensor.SUPPORTED_DTYPES)


def _read(batch: pb.SlotBatch) -> dict[str, np.ndarray]:
    entries, views = slot_batch_views(batch, inline_region(batch.data, "test"))
    return {e[0]: v for e, v in zip(entries, views, strict=True)}


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(DTYPES),
            st.lists(st.integers(0, 5), min_size=0, max_size=3),
            st.booleans(),
        ),
        min_size=1,
        max_size=8,
    ),
    st.integers(0, 2**32 - 1),
)
def test_packed_batches_read_back_exactly(layout: list[Any], seed: int) -> None:
    rng = np.random.default_rng(seed)
    keys, values = [], []
    for i, (dtype, dims, transpose) in enumerate(layout):
        arr = rng.standard_normal(size=tuple(dims)).astype(np.float32).astype(dtype)
        if transpose and arr.ndim > 1:
            arr = arr.T  # (not C-contiguous: packed as its values)
        keys.append(f"k{i}")
        values.append(arr)
    memo: dict[str, Any] = {}
    for _ in range(2):  # the second pass reuses the memoized layout: same bytes
        batch = pb.SlotBatch()
        size = pack_slot_batch(batch, keys, values, memo=memo)
        assert size == len(batch.data)
        offsets = list(batch.offsets)
        assert offsets == sorted(offsets) and all(o % shm.ALIGN_BYTES == 0 for o in offsets)
        got = _read(batch)
        for key, want in zip(keys, values, strict=True):
            assert got[key].dtype == want.dtype and got[key].shape == want.shape
            np.testing.assert_array_equal(got[key], want)
        # the padding after each slot is zero bytes
        data = batch.data
        for offset, want in zip(offsets, values, strict=True):
            end = offset + want.nbytes
            assert data[end : shm.align_up(end)] == bytes(shm.align_up(end) - end)


def test_given_bytes_are_packed_as_the_values_would_be() -> None:
    values = [np.arange(3, dtype=np.float32), np.arange(5, dtype=np.int64)]
    by_values, by_bytes = pb.SlotBatch(), pb.SlotBatch()
    pack_slot_batch(by_values, ["a", "b"], values)
    pack_slot_batch(by_bytes, ["a", "b"], values, datas=[v.tobytes() for v in values])
    assert by_values.SerializeToString() == by_bytes.SerializeToString()


def test_a_slot_past_the_bytes_is_refused_naming_the_key() -> None:
    batch = pb.SlotBatch()
    pack_slot_batch(batch, ["a", "b"], [np.zeros(4, np.float32), np.zeros(3, np.float32)])
    batch.data = batch.data[: 64 + 8]  # b needs 12 bytes at offset 64
    with pytest.raises(InvalidArgument, match="'b'"):
        _read(batch)


def test_entries_memo_returns_the_same_decoding() -> None:
    batch = pb.SlotBatch()
    pack_slot_batch(batch, ["a"], [np.zeros((2, 3), np.float16)])
    memo: dict[str, Any] = {}
    first = slot_batch_entries(batch, memo)
    assert slot_batch_entries(batch, memo) is first
    assert first == [("a", np.dtype(np.float16), (2, 3), 0, 12)]
    other = pb.SlotBatch()
    pack_slot_batch(other, ["a"], [np.zeros((3, 2), np.float16)])
    assert slot_batch_entries(other, memo) == [("a", np.dtype(np.float16), (3, 2), 0, 12)]


def test_big_endian_values_are_packed_little_endian() -> None:
    batch = pb.SlotBatch()
    want = np.arange(5, dtype=np.float32)
    pack_slot_batch(batch, ["a"], [want.astype(">f4")])
    got = _read(batch)["a"]
    assert got.dtype == np.dtype("<f4")
    np.testing.assert_array_equal(got, want)


def test_given_bytes_of_the_wrong_size_are_a_caller_bug() -> None:
    with pytest.raises(ValueError, match="packed 55 bytes where the layout needs 64"):
        pack_slot_batch(pb.SlotBatch(), ["a"], [np.zeros(3, np.float32)], datas=[b"123"])


@pytest.mark.parametrize(
    ("shape", "words"), [((1,) * 70, "70 dimensions"), ((0, 2**62, 2**62), "larger than")]
)
def test_shapes_no_array_can_have_are_refused_by_name(shape: tuple[int, ...], words: str) -> None:
    f32 = tensor.dtype_to_wire(np.float32)
    batch = pb.SlotBatch(keys=["k"], dtypes=[f32], ndims=[len(shape)], dims=shape, offsets=[0])
    with pytest.raises(InvalidArgument, match=f"'k'.*{words}"):
        slot_batch_entries(batch)
