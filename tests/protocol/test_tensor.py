"""Unit tests for :mod:`paramserver.protocol.tensor` (docs/semantics.md "Tensors"); no sockets.

Expected bytes are built independently of the codec: arrays are made from explicit unsigned
integer bit patterns, and the expected wire payload is those patterns converted to
little-endian unsigned integers.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from paramserver import errors
from paramserver.api.v1 import tensor_pb2
from paramserver.protocol import tensor
from paramserver.protocol.tensor import (
    DEFAULT_CHUNK_BYTES,
    SUPPORTED_DTYPES,
    TensorAssembler,
    decode_frames,
    dtype_from_wire,
    dtype_to_wire,
    encode_frames,
    normalize,
    tensor_nbytes,
)

BF16 = np.dtype(ml_dtypes.bfloat16)

# (dtype, wire value) written out by hand, not taken from the module's table.
WIRE_TABLE: list[tuple[np.dtype[Any], int]] = [
    (np.dtype(np.float16), tensor_pb2.DTYPE_FLOAT16),
    (BF16, tensor_pb2.DTYPE_BFLOAT16),
    (np.dtype(np.float32), tensor_pb2.DTYPE_FLOAT32),
    (np.dtype(np.float64), tensor_pb2.DTYPE_FLOAT64),
    (np.dtype(np.int32), tensor_pb2.DTYPE_INT32),
    (np.dtype(np.int64), tensor_pb2.DTYPE_INT64),
]
DTYPES = [dt for dt, _ in WIRE_TABLE]
DTYPE_IDS = [str(dt) for dt in DTYPES]
SHAPES: list[tuple[int, ...]] = [(), (0,), (1,), (7,), (3, 0, 5), (2, 3), (4, 1, 3), (33,)]
UNSUPPORTED = [
    np.complex64,
    np.complex128,
    np.bool_,
    np.uint8,
    np.uint16,
    np.int8,
    np.int16,
    np.float128 if hasattr(np, "float128") else np.longdouble,
    object,
    "U3",
    "V4",
]

# Interesting bit patterns per dtype: NaN payloads (quiet and signalling, both signs), -0.0,
# smallest/largest subnormals, infinities, extremes.
SPECIAL_BITS: dict[str, list[int]] = {
    "float16": [0x7E01, 0x7C01, 0xFE00, 0x8000, 0x0001, 0x03FF, 0x7C00, 0xFC00, 0x7BFF],
    "bfloat16": [0x7FC1, 0x7F81, 0xFFC0, 0x8000, 0x0001, 0x007F, 0x7F80, 0xFF80, 0x7F7F],
    "float32": [
        0x7FC00001,
        0x7F800001,
        0xFFC00000,
        0x80000000,
        0x00000001,
        0x007FFFFF,
        0x7F800000,
        0xFF800000,
    ],
    "float64": [
        0x7FF8000000000001,
        0x7FF0000000000001,
        0xFFF8000000000000,
        0x8000000000000000,
        0x0000000000000001,
        0x000FFFFFFFFFFFFF,
        0x7FF0000000000000,
    ],
    "int32": [0x80000000, 0x7FFFFFFF, 0xFFFFFFFF, 0, 1],
    "int64": [0x8000000000000000, 0x7FFFFFFFFFFFFFFF, 0xFFFFFFFFFFFFFFFF, 0, 1],
}


def _uint(itemsize: int, order: str = "=") -> np.dtype[Any]:
    return np.dtype(f"{order}u{itemsize}")


def from_bits(bits: np.ndarray, dtype: np.dtype[Any]) -> np.ndarray:
    """Array of ``dtype`` whose elements have exactly the given unsigned bit patterns."""
    return bits.astype(_uint(dtype.itemsize)).view(dtype)


def random_array(
    dtype: np.dtype[Any], shape: tuple[int, ...], seed: int = 0
) -> tuple[np.ndarray, bytes]:
    """Random bit patterns (NaN payloads included) and their little-endian wire bytes."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape, dtype=np.int64))
    raw = rng.integers(0, 256, size=n * dtype.itemsize, dtype=np.uint8)
    bits = raw.view(_uint(dtype.itemsize)).reshape(shape)
    expected = bits.astype(_uint(dtype.itemsize, "<")).tobytes()
    return from_bits(bits, dtype), expected


def assert_bit_exact(
    got: np.ndarray, dtype: np.dtype[Any], shape: tuple[int, ...], wire: bytes
) -> None:
    assert got.dtype == dtype
    assert got.dtype.byteorder in "=<|"  # native is little-endian on every supported host
    assert got.shape == shape
    assert got.tobytes() == wire


def _flags(array: np.ndarray) -> dict[str, bool]:
    f = array.flags
    return {
        "c_contiguous": f.c_contiguous,
        "f_contiguous": f.f_contiguous,
        "owndata": f.owndata,
        "writeable": f.writeable,
        "aligned": f.aligned,
    }


def roundtrip(key: str, array: Any, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> np.ndarray:
    out = decode_frames(encode_frames(key, array, chunk_bytes))
    assert list(out) == [key]
    return out[key]


def frames_of(key: str, array: Any, chunk_bytes: int) -> list[tensor_pb2.TensorFrame]:
    return list(encode_frames(key, array, chunk_bytes))


def feed_all(assembler: TensorAssembler, frames: list[tensor_pb2.TensorFrame]) -> list[Any]:
    return [assembler.feed(f) for f in frames]


def copy_frame(frame: tensor_pb2.TensorFrame) -> tensor_pb2.TensorFrame:
    out = tensor_pb2.TensorFrame()
    out.CopyFrom(frame)
    return out


# --------------------------------------------------------------------------- dtypes


def test_malformed_stream_is_invalid_argument() -> None:
    assert errors.MalformedStream.code == grpc.StatusCode.INVALID_ARGUMENT
    assert issubclass(errors.MalformedStream, errors.InvalidArgument)


def test_supported_dtypes_and_chunk_size() -> None:
    assert list(SUPPORTED_DTYPES) == DTYPES
    assert DEFAULT_CHUNK_BYTES == 1 << 20


@pytest.mark.parametrize(("dtype", "wire"), WIRE_TABLE, ids=DTYPE_IDS)
def test_dtype_wire_mapping(dtype: np.dtype[Any], wire: int) -> None:
    assert dtype_to_wire(dtype) == wire
    assert dtype_from_wire(wire, "w") == dtype
    if dtype != BF16:
        assert dtype_to_wire(dtype.newbyteorder(">")) == wire
        assert dtype_to_wire(dtype.newbyteorder("<")) == wire
        assert dtype_to_wire(dtype.type) == wire


@pytest.mark.parametrize("dtype", UNSUPPORTED, ids=str)
def test_dtype_to_wire_unsupported(dtype: Any) -> None:
    with pytest.raises(errors.InvalidArgument, match="unsupported dtype"):
        dtype_to_wire(np.dtype(dtype))


@pytest.mark.parametrize("dtype", [None, "not-a-dtype"])
def test_dtype_to_wire_rejects_non_dtypes(dtype: Any) -> None:
    with pytest.raises(errors.InvalidArgument):
        dtype_to_wire(dtype)


@pytest.mark.parametrize("value", [tensor_pb2.DTYPE_UNSPECIFIED, 7, 99, -1])
def test_dtype_from_wire_unknown_names_key(value: int) -> None:
    with pytest.raises(errors.InvalidArgument, match=r"layer3\.w") as info:
        dtype_from_wire(value, "layer3.w")
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_tensor_nbytes() -> None:
    assert tensor_nbytes((), np.float32) == 4
    assert tensor_nbytes((3, 0, 5), np.float64) == 0
    assert tensor_nbytes((2, 3), BF16) == 12
    # No int64 overflow: 2**62 float64 elements.
    assert tensor_nbytes((1 << 31, 1 << 31), np.float64) == 1 << 65
    with pytest.raises(errors.InvalidArgument, match="negative"):
        tensor_nbytes((2, -1), np.float32)


# --------------------------------------------------------------------------- normalize


def test_normalize_python_scalars() -> None:
    f = normalize(1.5)
    assert f.dtype == np.float64 and f.shape == () and f.item() == 1.5
    i = normalize(-7)
    assert i.dtype == np.int64 and i.shape == () and i.item() == -7
    n = normalize(np.float32(2.0))
    assert n.dtype == np.float32 and n.shape == ()
    b = normalize(np.asarray(3, dtype=BF16))
    assert b.dtype == BF16 and b.shape == ()


@pytest.mark.parametrize(
    "value",
    [True, np.bool_(True), 1 << 70, np.complex64(1j), np.uint8(3), "abc", None],
    ids=repr,
)
def test_normalize_rejects_unsupported_scalars(value: Any) -> None:
    with pytest.raises(errors.InvalidArgument, match="emb"):
        normalize(value, "emb")


@pytest.mark.parametrize("dtype", UNSUPPORTED, ids=str)
def test_normalize_rejects_unsupported_arrays_naming_key_and_dtype(dtype: Any) -> None:
    array = np.zeros(3, dtype=dtype)
    with pytest.raises(errors.InvalidArgument) as info:
        normalize(array, "layer0.bias")
    assert "layer0.bias" in info.value.message
    assert str(array.dtype) in info.value.message
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_normalize_returns_same_object_when_already_normal(dtype: np.dtype[Any]) -> None:
    array, _ = random_array(dtype, (4, 5))
    assert normalize(array) is array


@pytest.mark.parametrize("dtype", [dt for dt in DTYPES if dt != BF16], ids=str)
@pytest.mark.parametrize("shape", [(), (5,), (3, 4), (2, 0, 3)], ids=str)
def test_normalize_big_endian_copies_and_leaves_input_alone(
    dtype: np.dtype[Any], shape: tuple[int, ...]
) -> None:
    bits = np.arange(int(np.prod(shape)), dtype=_uint(dtype.itemsize)).reshape(shape)
    bits *= 0x0101  # in place, so shape () stays a 0-d array rather than a numpy scalar
    big = bits.astype(_uint(dtype.itemsize, ">")).view(dtype.newbyteorder(">"))
    before = big.tobytes()
    flags = _flags(big)
    out = normalize(big, "k")
    assert out is not big
    assert not np.shares_memory(out, big)
    assert out.dtype == dtype and out.dtype.byteorder in "=<|"
    assert out.flags.c_contiguous
    assert out.shape == shape
    assert out.tobytes() == bits.astype(_uint(dtype.itemsize, "<")).tobytes()
    assert big.tobytes() == before
    assert _flags(big) == flags
    assert big.dtype.byteorder == ">"


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_normalize_non_contiguous_copies_and_leaves_input_alone(dtype: np.dtype[Any]) -> None:
    base, _ = random_array(dtype, (6, 8), seed=3)
    base_before = base.tobytes()
    for view in (base.T, base[:, ::2], base[::-1], base[1:5:2, 3]):
        flags = _flags(view)
        expected = view.copy(order="C").tobytes()
        out = normalize(view, "k")
        assert out.flags.c_contiguous
        assert not np.shares_memory(out, base)
        assert out.tobytes() == expected
        assert _flags(view) == flags
    assert base.tobytes() == base_before


def test_normalize_read_only_input() -> None:
    array = np.arange(10, dtype=np.float32)
    array.flags.writeable = False
    assert normalize(array) is array
    assert roundtrip("ro", array).tobytes() == array.tobytes()
    assert not array.flags.writeable


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("chunk_bytes", [1, 7, 8, 64, DEFAULT_CHUNK_BYTES])
def test_roundtrip_grid(dtype: np.dtype[Any], shape: tuple[int, ...], chunk_bytes: int) -> None:
    array, wire = random_array(dtype, shape, seed=len(shape) * 31 + chunk_bytes)
    got = roundtrip("grid", array, chunk_bytes)
    assert_bit_exact(got, dtype, shape, wire)
    assert got.flags.writeable
    assert got.flags.c_contiguous
    assert not np.shares_memory(got, array)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("chunk_bytes", [1, 3, DEFAULT_CHUNK_BYTES])
def test_roundtrip_special_values_bit_exact(dtype: np.dtype[Any], chunk_bytes: int) -> None:
    bits = np.array(SPECIAL_BITS[str(dtype)], dtype=np.uint64).astype(_uint(dtype.itemsize))
    array = from_bits(bits, dtype)
    got = roundtrip("special", array, chunk_bytes)
    assert got.view(_uint(dtype.itemsize)).tolist() == bits.tolist()
    # Each pattern alone, as shape () too.
    for b in bits:
        scalar = from_bits(np.asarray(b), dtype)
        assert roundtrip("s", scalar, chunk_bytes).view(_uint(dtype.itemsize)) == b


def test_roundtrip_specific_float32_nan_payload_and_negative_zero() -> None:
    array = np.array([0x7FC00001, 0x80000000, 0x00000001], dtype=np.uint32).view(np.float32)
    got = roundtrip("f", array)
    assert got.view(np.uint32).tolist() == [0x7FC00001, 0x80000000, 0x00000001]
    assert np.signbit(got[1]) and got[1] == 0.0


def test_roundtrip_python_scalars() -> None:
    f = roundtrip("f", -0.0)
    assert f.dtype == np.float64 and f.shape == () and np.signbit(f)
    i = roundtrip("i", -(1 << 63))
    assert i.dtype == np.int64 and i.shape == () and int(i) == -(1 << 63)


@pytest.mark.parametrize("dtype", [dt for dt in DTYPES if dt != BF16], ids=str)
def test_wire_bytes_are_little_endian(dtype: np.dtype[Any]) -> None:
    native = np.arange(1, 4, dtype=dtype)
    expected = native.astype(dtype.newbyteorder("<")).tobytes()
    for array in (native, native.astype(dtype.newbyteorder(">"))):
        data = b"".join(f.data for f in encode_frames("le", array))
        assert data == expected
    one = b"".join(f.data for f in encode_frames("one", np.float32(1.0)))
    assert one == b"\x00\x00\x80\x3f"


def test_caller_array_not_modified_by_encode_or_by_writing_result() -> None:
    base = np.arange(48, dtype=">f4").reshape(6, 8)
    view = base[:, 1::3]
    before_base, before_view = base.tobytes(), view.tobytes()
    flags_base, flags_view = _flags(base), _flags(view)
    got = roundtrip("k", view, chunk_bytes=5)
    got[...] = -1.0
    assert base.tobytes() == before_base and view.tobytes() == before_view
    assert _flags(base) == flags_base and _flags(view) == flags_view
    assert base.dtype == np.dtype(">f4") and view.dtype == np.dtype(">f4")


def test_frames_are_snapshots_of_bytes() -> None:
    array = np.arange(8, dtype=np.int32)
    frames = frames_of("k", array, 8)
    array[:] = 0
    assert decode_frames(frames)["k"].tolist() == list(range(8))


# --------------------------------------------------------------------------- frame layout


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("chunk_bytes", [1, 7, 16, DEFAULT_CHUNK_BYTES])
def test_frame_layout(dtype: np.dtype[Any], shape: tuple[int, ...], chunk_bytes: int) -> None:
    array, wire = random_array(dtype, shape)
    frames = frames_of("layout", array, chunk_bytes)
    size = len(wire)
    n_expected = max(1, -(-size // chunk_bytes))
    assert len(frames) == n_expected
    header = frames[0].header
    assert frames[0].HasField("header")
    assert header.key == "layout"
    assert header.dtype == dict((str(d), w) for d, w in WIRE_TABLE)[str(dtype)]
    assert tuple(header.shape) == shape
    assert header.size_bytes == size
    offset = 0
    for index, frame in enumerate(frames):
        assert frame.chunk_index == index
        assert frame.offset_bytes == offset
        assert len(frame.data) <= chunk_bytes
        assert frame.last == (index == len(frames) - 1)
        if index > 0:
            assert not frame.HasField("header")
            assert len(frame.data) > 0
        offset += len(frame.data)
    assert b"".join(f.data for f in frames) == wire


@pytest.mark.parametrize("shape", [(0,), (3, 0, 5), (0, 0)], ids=str)
def test_zero_size_is_exactly_one_frame(shape: tuple[int, ...]) -> None:
    frames = frames_of("empty", np.zeros(shape, np.float32), 7)
    assert len(frames) == 1
    (frame,) = frames
    assert frame.HasField("header") and frame.last and frame.data == b""
    assert frame.header.size_bytes == 0 and tuple(frame.header.shape) == shape
    assert decode_frames(frames)["empty"].shape == shape


@pytest.mark.parametrize(
    ("dtype", "nbytes", "chunk_bytes", "sizes"),
    [
        (np.float64, 64, 64, [64]),  # exactly chunk_bytes
        (np.float16, 66, 64, [64, 2]),  # chunk_bytes + one element
        (np.float16, 64, 63, [63, 1]),  # chunk_bytes + 1 byte
        (np.float16, 62, 64, [62]),  # just under
        (np.float32, 128, 64, [64, 64]),  # two exact chunks
        (np.int64, 72, 7, [7] * 10 + [2]),  # many frames, chunk not a multiple of itemsize
        (BF16, 14, 7, [7, 7]),
        (np.float32, DEFAULT_CHUNK_BYTES, DEFAULT_CHUNK_BYTES, [DEFAULT_CHUNK_BYTES]),
        (np.int32, DEFAULT_CHUNK_BYTES + 4, DEFAULT_CHUNK_BYTES, [DEFAULT_CHUNK_BYTES, 4]),
        (
            np.float16,
            DEFAULT_CHUNK_BYTES + 2,
            DEFAULT_CHUNK_BYTES + 1,
            [DEFAULT_CHUNK_BYTES + 1, 1],
        ),
    ],
)
def test_chunk_boundaries(dtype: Any, nbytes: int, chunk_bytes: int, sizes: list[int]) -> None:
    dt = np.dtype(dtype)
    array, wire = random_array(dt, (nbytes // dt.itemsize,))
    assert len(wire) == nbytes
    frames = frames_of("b", array, chunk_bytes)
    assert [len(f.data) for f in frames] == sizes
    assert [f.offset_bytes for f in frames] == [sum(sizes[:i]) for i in range(len(sizes))]
    assert [f.last for f in frames] == [False] * (len(sizes) - 1) + [True]
    assert decode_frames(frames)["b"].tobytes() == wire


def test_default_chunking_of_a_multi_mib_tensor() -> None:
    array, wire = random_array(np.dtype(np.float32), (3 * (1 << 18) + 5,))  # 3 MiB + 20 B
    frames = frames_of("big", array, DEFAULT_CHUNK_BYTES)
    assert [len(f.data) for f in frames] == [DEFAULT_CHUNK_BYTES] * 3 + [20]
    assert decode_frames(frames)["big"].tobytes() == wire


def test_encode_is_lazy_but_validates_eagerly() -> None:
    array = np.arange(1000, dtype=np.float64)
    frames = encode_frames("lazy", array, chunk_bytes=8)
    assert isinstance(frames, Iterator)
    first = next(frames)
    assert first.chunk_index == 0 and first.HasField("header")
    assert sum(1 for _ in frames) == 999
    with pytest.raises(errors.InvalidArgument, match="non-empty"):
        encode_frames("", array)
    with pytest.raises(errors.InvalidArgument, match="chunk_bytes"):
        encode_frames("k", array, chunk_bytes=0)
    with pytest.raises(errors.InvalidArgument, match="'bad'"):
        encode_frames("bad", np.zeros(3, np.complex64))


# --------------------------------------------------------------------------- multi-tensor


def test_multi_tensor_stream_with_assembler() -> None:
    tensors = {
        "a": random_array(np.dtype(np.float32), (5, 3), 1)[0],
        "b": np.zeros((0,), np.int64),
        "c": random_array(BF16, (), 2)[0],
        "d": random_array(np.dtype(np.float64), (17,), 3)[0],
    }
    assembler = TensorAssembler()
    completed: dict[str, np.ndarray] = {}
    assert assembler.in_progress is None
    for key, array in tensors.items():
        frames = frames_of(key, array, 9)
        for frame in frames[:-1]:
            assert assembler.feed(frame) is None
            assert assembler.in_progress == key
        result = assembler.feed(frames[-1])
        assert result is not None
        assert result[0] == key
        completed[key] = result[1]
        assert assembler.in_progress is None
    assembler.finish()
    for key, array in tensors.items():
        assert completed[key].dtype == array.dtype
        assert completed[key].shape == array.shape
        assert completed[key].tobytes() == array.tobytes()
    assert not np.shares_memory(completed["a"], completed["d"])


def test_decode_frames_multi_tensor_order_preserved() -> None:
    items: list[tuple[str, np.ndarray | np.generic]] = [
        ("z", np.arange(3.0)),
        ("a", np.int32(4)),
        ("m", np.ones((2, 2))),
    ]
    stream = [f for key, arr in items for f in encode_frames(key, arr, 8)]
    out = decode_frames(stream)
    assert list(out) == ["z", "a", "m"]
    assert out["a"].shape == () and int(out["a"]) == 4


def test_decode_frames_empty_stream() -> None:
    assert decode_frames([]) == {}


# --------------------------------------------------------------------------- malformed streams


def _three_frames(key: str = "w.layer1") -> list[tensor_pb2.TensorFrame]:
    frames = frames_of(key, np.arange(6, dtype=np.float32), 8)  # 24 bytes -> 3 frames
    assert len(frames) == 3
    return frames


def _expect_malformed(frames: list[tensor_pb2.TensorFrame], key: str, match: str) -> None:
    with pytest.raises(errors.MalformedStream, match=match) as info:
        decode_frames(frames)
    assert key in info.value.message
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_malformed_first_frame_without_header() -> None:
    frames = _three_frames()
    frames[0].ClearField("header")
    with pytest.raises(errors.MalformedStream, match="chunk_index 0 has no header"):
        decode_frames(frames)


def test_malformed_headerless_frame_after_a_tensor_names_previous_key() -> None:
    frames = _three_frames("first") + _three_frames("second")
    frames[3].ClearField("header")
    _expect_malformed(frames, "first", "no header")


def test_malformed_stray_frame_without_tensor() -> None:
    frames = _three_frames()
    with pytest.raises(errors.MalformedStream, match="no tensor in progress"):
        decode_frames(frames[1:])


def test_malformed_header_on_non_first_frame() -> None:
    frames = _three_frames()
    frames[1].header.CopyFrom(frames[0].header)
    _expect_malformed(frames, "w.layer1", "non-first frame")


def test_malformed_missing_frame() -> None:
    frames = _three_frames()
    _expect_malformed([frames[0], frames[2]], "w.layer1", "expected chunk_index 1, got 2")


def test_malformed_duplicate_frame() -> None:
    frames = _three_frames()
    _expect_malformed(
        [frames[0], frames[1], frames[1], frames[2]], "w.layer1", "expected chunk_index 2, got 1"
    )


def test_malformed_out_of_order_frames() -> None:
    frames = _three_frames()
    _expect_malformed([frames[0], frames[2], frames[1]], "w.layer1", "expected chunk_index 1")


def test_malformed_offset_mismatch() -> None:
    frames = _three_frames()
    frames[1].offset_bytes = 4
    _expect_malformed(frames, "w.layer1", "expected offset_bytes 8, got 4")


def test_malformed_offset_uint64() -> None:
    frames = _three_frames()
    frames[1].offset_bytes = (1 << 64) - 1
    _expect_malformed(frames, "w.layer1", str((1 << 64) - 1))


def test_malformed_data_past_size_bytes() -> None:
    frames = _three_frames()
    frames[2].data += b"\x00"
    _expect_malformed(frames, "w.layer1", "past size_bytes 24")


def test_malformed_size_bytes_mismatch() -> None:
    frames = _three_frames()
    frames[0].header.size_bytes = 20
    _expect_malformed(frames, "w.layer1", "size_bytes 20")


def test_malformed_negative_dimension() -> None:
    frames = _three_frames()
    del frames[0].header.shape[:]
    frames[0].header.shape.extend([-2, -3])
    _expect_malformed(frames, "w.layer1", "negative dimension")


def test_malformed_last_before_complete() -> None:
    frames = _three_frames()
    frames[1].last = True
    _expect_malformed(frames, "w.layer1", "last set on chunk 1 after 16 of 24 bytes")


def test_malformed_new_header_while_incomplete() -> None:
    stream = _three_frames("alpha")[:2] + _three_frames("beta")
    with pytest.raises(errors.MalformedStream, match="incomplete") as info:
        decode_frames(stream)
    assert "alpha" in info.value.message and "beta" in info.value.message


@pytest.mark.parametrize("dtype_value", [tensor_pb2.DTYPE_UNSPECIFIED, 42])
def test_malformed_unknown_dtype(dtype_value: int) -> None:
    frames = _three_frames()
    frames[0].header.dtype = dtype_value  # type: ignore[assignment]
    _expect_malformed(frames, "w.layer1", "dtype")


def test_malformed_empty_key() -> None:
    frames = _three_frames()
    frames[0].header.key = ""
    with pytest.raises(errors.MalformedStream, match="empty key"):
        decode_frames(frames)


def test_malformed_truncated_stream_on_finish() -> None:
    frames = _three_frames()
    assembler = TensorAssembler()
    feed_all(assembler, frames[:2])
    assert assembler.in_progress == "w.layer1"
    with pytest.raises(errors.MalformedStream, match="16 of 24 bytes") as info:
        assembler.finish()
    assert "w.layer1" in info.value.message
    _expect_malformed(frames[:2], "w.layer1", "stream ended")


def test_malformed_duplicate_key_in_stream() -> None:
    _expect_malformed(_three_frames("dup") + _three_frames("dup"), "dup", "twice")


def test_max_tensor_bytes() -> None:
    frames = _three_frames()
    assert decode_frames(frames, max_tensor_bytes=24)["w.layer1"].nbytes == 24
    with pytest.raises(errors.InvalidArgument, match="max_tensor_bytes") as info:
        decode_frames(frames, max_tensor_bytes=23)
    assert "w.layer1" in info.value.message
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    # A huge declared size is refused at the header, before any allocation.
    header = tensor_pb2.TensorHeader(
        key="huge", dtype=tensor_pb2.DTYPE_FLOAT64, shape=[1 << 40], size_bytes=8 << 40
    )
    frame = tensor_pb2.TensorFrame(header=header, chunk_index=0)
    with pytest.raises(errors.InvalidArgument, match="huge"):
        TensorAssembler(max_tensor_bytes=1 << 30).feed(frame)


@pytest.mark.parametrize(
    ("shape", "words"),
    [
        ([1 << 62, 1 << 62, 0], "larger than any array"),  # zero-size, yet numpy refuses it
        ([1 << 61, 0], "larger than any array"),  # 2**61 * 8 bytes overflows a signed size
        ([1] * 65, "65 dimensions"),
    ],
)
def test_header_shape_numpy_cannot_hold_is_malformed(shape: list[int], words: str) -> None:
    size = 0 if 0 in shape else 8
    header = tensor_pb2.TensorHeader(
        key="k", dtype=tensor_pb2.DTYPE_FLOAT64, shape=shape, size_bytes=size
    )
    frame = tensor_pb2.TensorFrame(header=header, chunk_index=0, last=True)
    with pytest.raises(errors.MalformedStream, match=words) as info:
        TensorAssembler().feed(frame)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_assembler_after_error_drops_tensor() -> None:
    frames = _three_frames()
    assembler = TensorAssembler()
    assembler.feed(frames[0])
    with pytest.raises(errors.MalformedStream):
        assembler.feed(frames[2])
    assert assembler.in_progress is None


# --------------------------------------------------------------------------- property test

_BITS_DTYPES = DTYPES + [dt.newbyteorder(">") for dt in DTYPES if dt != BF16]


@st.composite
def bit_pattern_arrays(draw: st.DrawFn) -> tuple[np.ndarray, bytes]:
    """Arrays with arbitrary bit patterns, any byte order, sometimes non-contiguous."""
    dtype = draw(st.sampled_from(_BITS_DTYPES))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5))
    bits = draw(hnp.arrays(_uint(dtype.itemsize), shape))
    expected = bits.astype(_uint(dtype.itemsize, "<")).tobytes()
    if dtype.byteorder == ">":
        array = bits.astype(_uint(dtype.itemsize, ">")).view(dtype)
    else:
        array = bits.view(dtype)
    if array.ndim >= 2 and draw(st.booleans()):
        # Same elements, non-contiguous Fortran-ordered storage.
        array = np.asfortranarray(array)
    if array.ndim >= 1 and draw(st.booleans()):
        # Interleave with junk and slice it back out: a strided view of the same values.
        wide = np.empty((*array.shape[:-1], array.shape[-1] * 2), dtype=array.dtype)
        wide[..., ::2] = array
        array = wide[..., ::2]
    return array, expected


@settings(max_examples=200, deadline=None)
@given(case=bit_pattern_arrays(), chunk_bytes=st.integers(1, 40), key=st.text(min_size=1))
def test_roundtrip_property_bit_exact(
    case: tuple[np.ndarray, bytes], chunk_bytes: int, key: str
) -> None:
    array, expected = case
    before = array.tobytes()
    flags = _flags(array)
    frames = frames_of(key, array, chunk_bytes)
    assert all(len(f.data) <= chunk_bytes for f in frames)
    got = decode_frames(frames)[key]
    assert got.shape == array.shape
    assert got.dtype == (array.dtype if array.dtype == BF16 else array.dtype.newbyteorder("<"))
    assert got.tobytes() == expected
    assert array.tobytes() == before
    assert _flags(array) == flags


@settings(max_examples=50, deadline=None)
@given(
    tensors=st.lists(
        st.tuples(st.sampled_from(DTYPES), hnp.array_shapes(min_dims=0, max_dims=3, min_side=0)),
        min_size=1,
        max_size=5,
    ),
    chunk_bytes=st.integers(1, 32),
)
def test_multi_tensor_stream_property(
    tensors: list[tuple[np.dtype[Any], tuple[int, ...]]], chunk_bytes: int
) -> None:
    sent = {f"t{i}": random_array(dtype, shape, seed=i) for i, (dtype, shape) in enumerate(tensors)}
    stream = [f for key, (arr, _) in sent.items() for f in encode_frames(key, arr, chunk_bytes)]
    out = decode_frames(iter(stream))
    assert list(out) == list(sent)
    for key, (arr, wire) in sent.items():
        assert out[key].dtype == arr.dtype and out[key].shape == arr.shape
        assert out[key].tobytes() == wire


def test_module_exports() -> None:
    assert set(tensor.__all__) >= {
        "DEFAULT_CHUNK_BYTES",
        "SUPPORTED_DTYPES",
        "TensorAssembler",
        "decode_frames",
        "dtype_from_wire",
        "dtype_to_wire",
        "encode_frames",
        "normalize",
        "tensor_nbytes",
    }
