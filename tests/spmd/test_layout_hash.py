"""Unit tests of SPMD layouts, tiers and the sequence hash (no sockets, no event loop)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paramserver.api.v1 import spmd_pb2
from paramserver.errors import InvalidArgument
from paramserver.spmd.faults import Faults
from paramserver.spmd.hashing import content_hash, object_key, sequence_hash, sequence_hashes
from paramserver.spmd.layout import DTYPES, Layout, Tier, parse_layout_spec


@pytest.mark.parametrize(
    ("dims", "dtype", "itemsize"),
    [
        ((4, 2, 16, 128), "float16", 2),
        ((32, 2, 16, 128), "bfloat16", 2),
        ((1, 1, 1, 1), "float32", 4),
        ((3, 1, 5, 7), "float64", 8),
        ((2, 2, 8, 64), "uint8", 1),
        ((2, 2, 8, 64), "int8", 1),
        ((2, 2, 8, 64), "int32", 4),
        ((2, 2, 8, 64), "int64", 8),
        ((2, 2, 8, 64), "float8_e4m3fn", 1),
    ],
)
def test_bytes_per_block_closed_form(
    dims: tuple[int, int, int, int], dtype: str, itemsize: int
) -> None:
    layout = Layout(10, *dims, dtype=dtype)
    expected = dims[0] * dims[1] * dims[2] * dims[3] * itemsize
    assert layout.bytes_per_block == expected
    assert layout.total_bytes == 10 * expected
    assert layout.block_offset_bytes(7) == 7 * expected
    assert layout.block_shape == dims
    assert np.zeros(dims, dtype=layout.np_dtype).nbytes == expected


def test_dtypes_match_numpy() -> None:
    assert DTYPES["bfloat16"][0] == np.dtype(ml_dtypes.bfloat16)
    assert DTYPES["float16"][0] == np.dtype("<f2")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_blocks": -1},
        {"num_blocks": 1, "num_layers": 0},
        {"num_blocks": 1, "outer_dim": 0},
        {"num_blocks": 1, "page_size": -3},
        {"num_blocks": 1, "inner_dim": 0},
        {"num_blocks": 1, "dtype": "complex64"},
    ],
)
def test_invalid_layouts(kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidArgument):
        Layout(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("tier", [Tier.G1, Tier.G2, Tier.G3])
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_layout_proto_round_trip(tier: Tier, dtype: str) -> None:
    layout = Layout(12, 3, 2, 8, 16, dtype)
    spec = layout.to_proto(tier, shm_name="seg", path="/p")
    assert spec.tier == int(tier)
    assert spec.bytes_per_block == layout.bytes_per_block
    assert Layout.from_proto(spec) == layout


def test_layout_proto_inconsistent_size_refused() -> None:
    spec = Layout(4).to_proto(Tier.G2)
    spec.bytes_per_block += 1
    with pytest.raises(InvalidArgument, match="bytes_per_block"):
        Layout.from_proto(spec)
    spec = Layout(4).to_proto(Tier.G2)
    spec.dtype = spmd_pb2.BLOCK_D_TYPE_UNSPECIFIED
    with pytest.raises(InvalidArgument):
        Layout.from_proto(spec)


def test_parse_layout_spec() -> None:
    layout = parse_layout_spec("num_layers=2, outer_dim=1,page_size=8,inner_dim=64,dtype=bfloat16")
    assert layout == Layout(0, 2, 1, 8, 64, "bfloat16")
    assert parse_layout_spec("") == Layout(0)
    assert parse_layout_spec("page_size=32").page_size == 32
    for bad in ("pages=3", "num_layers", "num_layers=x", "dtype=bogus"):
        with pytest.raises(InvalidArgument):
            parse_layout_spec(bad)


@pytest.mark.parametrize(
    ("value", "tier"),
    [("G2", Tier.G2), ("g3", Tier.G3), ("host", Tier.G2), ("object", Tier.G4), (1, Tier.G1)],
)
def test_tier_parse(value: str | int, tier: Tier) -> None:
    assert Tier.parse(value) is tier


@pytest.mark.parametrize("value", ["G5", "", 0, 7])
def test_tier_parse_rejects(value: str | int) -> None:
    with pytest.raises(InvalidArgument):
        Tier.parse(value)


def test_tier_values_match_the_wire() -> None:
    assert int(Tier.G1) == spmd_pb2.TIER_G1_DEVICE
    assert int(Tier.G2) == spmd_pb2.TIER_G2_HOST
    assert int(Tier.G3) == spmd_pb2.TIER_G3_DISK
    assert int(Tier.G4) == spmd_pb2.TIER_G4_OBJECT


# --------------------------------------------------------------------------- sequence hash


def _reference(tag: bytes, parent: int | None, body: bytes, length: int) -> int:
    """Independent transcription of the documented definition (module docstring)."""
    prefix = b"\x00" if parent is None else b"\x01" + parent.to_bytes(8, "little")
    digest = hashlib.blake2b(
        tag + prefix + length.to_bytes(8, "little") + body,
        digest_size=8,
        person=b"paramserver-seq1",
    ).digest()
    return int.from_bytes(digest, "little")


def test_sequence_hash_matches_the_documented_definition() -> None:
    tokens = [1, 2, 3, 50256]
    body = b"".join(t.to_bytes(8, "little") for t in tokens)
    assert sequence_hash(tokens) == _reference(b"T", None, body, 4)
    parent = 0xDEADBEEF12345678
    assert sequence_hash(tokens, parent) == _reference(b"T", parent, body, 4)
    assert content_hash(b"abc") == _reference(b"B", None, b"abc", 3)


def test_sequence_hash_accepts_numpy_and_lists_alike() -> None:
    tokens = [5, 6, 7, 8]
    for arr in (np.array(tokens, np.int32), np.array(tokens, np.uint64), tuple(tokens)):
        assert sequence_hash(arr) == sequence_hash(tokens)


def test_sequence_hashes_chain_full_blocks_only() -> None:
    tokens = list(range(10))
    hashes = sequence_hashes(tokens, 4)
    assert len(hashes) == 2
    h0 = sequence_hash(tokens[0:4])
    assert hashes == [h0, sequence_hash(tokens[4:8], h0)]
    assert sequence_hashes(tokens[:3], 4) == []
    # same block tokens, different prefix -> different hash
    assert sequence_hashes([9, 9, 9, 9, 0, 1, 2, 3], 4)[1] != sequence_hash([0, 1, 2, 3])


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 2**64 - 1), max_size=32), st.none() | st.integers(0, 2**64 - 1))
def test_sequence_hash_range_and_determinism(tokens: list[int], parent: int | None) -> None:
    h = sequence_hash(tokens, parent)
    assert 0 <= h < 2**64
    assert h == sequence_hash(list(tokens), parent)
    assert (
        sequence_hash(tokens, parent)
        != content_hash(b"".join(t.to_bytes(8, "little") for t in tokens), parent)
        or not tokens
    )


@pytest.mark.parametrize("bad", [[-1], [2**64], [1.5]])
def test_sequence_hash_rejects_bad_tokens(bad: list[object]) -> None:
    with pytest.raises(InvalidArgument):
        sequence_hash(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        sequence_hash([1], parent_hash=-1)
    with pytest.raises(InvalidArgument):
        sequence_hashes([1, 2], 0)


@pytest.mark.timeout(60)
def test_sequence_hash_is_the_same_in_another_process() -> None:
    code = (
        "from paramserver.spmd.hashing import sequence_hashes;"
        "print(sequence_hashes(list(range(64)), 16))"
    )
    here = str(sequence_hashes(list(range(64)), 16))
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        assert out.stdout.strip() == here


def test_object_key_format() -> None:
    assert object_key(0, 0) == "0/0000000000000000"
    assert object_key(3, 0xABC) == "3/0000000000000abc"
    with pytest.raises(InvalidArgument):
        object_key(-1, 1)
    with pytest.raises(InvalidArgument):
        object_key(0, 2**64)


# --------------------------------------------------------------------------- faults


def test_faults_parse() -> None:
    assert not Faults.from_env({}).any
    f = Faults.from_env(
        {"PARAMSERVER_SPMD_FAULTS": "disk_write_error, hang_commands,io_delay_ms=250"}
    )
    assert f == Faults(True, True, 0.25)
    with pytest.raises(InvalidArgument):
        Faults.parse("explode")
    with pytest.raises(InvalidArgument):
        Faults.parse("io_delay_ms=x")


# ------------------------------------------------- canonical content hashes (issue 19, item 5)


def _array_reference(arr: np.ndarray, parent: int | None = None) -> int:
    """The documented array encoding, transcribed independently (module docstring)."""
    name = {"f": "float", "i": "int", "u": "uint"}[arr.dtype.kind] + str(arr.dtype.itemsize * 8)
    data = b"".join(
        np.array(x, dtype=arr.dtype.newbyteorder("<")).tobytes() for x in arr.ravel(order="C")
    )
    header = len(name).to_bytes(8, "little") + name.encode()
    header += arr.ndim.to_bytes(8, "little")
    header += b"".join(d.to_bytes(8, "little") for d in arr.shape)
    prefix = b"\x00" if parent is None else b"\x01" + parent.to_bytes(8, "little")
    digest = hashlib.blake2b(
        b"A" + prefix + len(data).to_bytes(8, "little") + header + data,
        digest_size=8,
        person=b"paramserver-seq1",
    ).digest()
    return int.from_bytes(digest, "little")


def test_content_hash_of_an_array_matches_the_documented_encoding() -> None:
    arr = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert content_hash(arr) == _array_reference(arr)
    assert content_hash(arr, 7) == _array_reference(arr, 7)


def test_content_hash_ignores_byte_order_and_memory_layout() -> None:
    arr = np.arange(12, dtype=np.float32).reshape(3, 4) * 1.5
    key = content_hash(arr)
    assert content_hash(arr.astype(">f4")) == key
    assert content_hash(np.asfortranarray(arr)) == key
    assert content_hash(np.asfortranarray(arr.astype(">f4"))) == key
    assert content_hash(memoryview(arr)) == key
    strided = np.zeros((3, 8), np.float32)
    strided[:, ::2] = arr
    assert content_hash(strided[:, ::2]) == key
    bf = np.arange(4, dtype=np.float32).astype(ml_dtypes.bfloat16)
    assert content_hash(bf.astype(bf.dtype.newbyteorder(">"))) == content_hash(bf)


def test_content_hash_separates_dtype_and_shape() -> None:
    keys = {
        content_hash(np.zeros(4, np.float32)),
        content_hash(np.zeros(4, np.int32)),
        content_hash(np.zeros((2, 2), np.float32)),
        content_hash(np.zeros(4, np.float32).tobytes()),
        content_hash(np.zeros((), np.float32)),
        content_hash(np.zeros(0, np.float32)),
    }
    assert len(keys) == 6


def test_content_hash_of_bytes_is_unchanged() -> None:
    assert content_hash(b"abc") == _reference(b"B", None, b"abc", 3)
    assert (
        content_hash(bytearray(b"abc")) == content_hash(memoryview(b"abc")) == content_hash(b"abc")
    )


@pytest.mark.parametrize(
    "bad",
    ["text", 12, [1.0, 2.0], np.array(["a"]), np.array([object()]), np.zeros(2, "M8[s]")],
)
def test_content_hash_of_bad_input_is_invalid_argument(bad: object) -> None:
    with pytest.raises(InvalidArgument, match="content_hash"):
        content_hash(bad)  # type: ignore[arg-type]
