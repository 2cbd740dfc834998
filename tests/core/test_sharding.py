"""Placement and slicing of keys over shards (pure; paramserver.core.sharding)."""

from __future__ import annotations

import hashlib
import itertools
from collections import Counter

import ml_dtypes
import numpy as np
import pytest

from paramserver.core.sharding import (
    DEFAULT_SLICE_BYTES,
    PLACEMENT,
    ShardMap,
    TensorLayout,
    assemble,
    check_user_key,
    decode_layout,
    encode_layout,
    home_shard,
    key_hash,
    layout_key,
    parse_addresses,
    parse_name,
    plan_layout,
    shard_map_from_proto,
    shard_map_to_proto,
    slice_key,
    split,
)
from paramserver.errors import DimensionMismatch, InvalidArgument, MalformedStream

pytestmark = pytest.mark.timeout(30)

DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64, np.int32, np.int64]


def _independent_home(key: str, shards: int) -> int:
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % shards


@pytest.mark.parametrize("key", ["w", "layer0/weight", "ключ", "a" * 300, "x@y"])
@pytest.mark.parametrize("shards", [1, 2, 3, 4, 7, 64])
def test_home_shard_is_blake2b_of_utf8_key(key: str, shards: int) -> None:
    assert home_shard(key, shards) == _independent_home(key, shards)
    assert key_hash(key) == int.from_bytes(
        hashlib.blake2b(key.encode(), digest_size=8).digest(), "big"
    )


def test_placement_is_stable_across_processes() -> None:
    """Pinned values: a change of the rule would silently misplace every stored key."""
    assert PLACEMENT == "blake2b-64/v1"
    assert [home_shard(f"k{i}", 3) for i in range(8)] == [
        _independent_home(f"k{i}", 3) for i in range(8)
    ]
    assert key_hash("w") == int.from_bytes(hashlib.blake2b(b"w", digest_size=8).digest(), "big")


@pytest.mark.parametrize("shards", [2, 3, 4, 8])
def test_keys_spread_evenly(shards: int) -> None:
    counts = Counter(home_shard(f"layer{i}/weight", shards) for i in range(4000))
    assert set(counts) == set(range(shards))
    expected = 4000 / shards
    assert all(abs(c - expected) < 0.15 * expected for c in counts.values())


def test_home_shard_refuses_no_shards() -> None:
    with pytest.raises(InvalidArgument):
        home_shard("w", 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("shape", "slice_bytes", "sliced"),
    [
        ((), 8, False),
        ((0,), 8, False),
        ((3, 0, 5), 8, False),
        ((4,), 64, False),
        ((1000,), 64, True),
        ((33, 17), 100, True),
        ((2, 3, 5, 7), 16, True),
    ],
)
def test_split_and_assemble_round_trip_bit_exact(
    dtype: type, shape: tuple[int, ...], slice_bytes: int, sliced: bool
) -> None:
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * np.dtype(dtype).itemsize, dtype=np.uint8)
    array = raw.view(dtype).reshape(shape)
    layout = plan_layout("k", array.dtype, array.shape, slice_bytes)
    assert layout.sliced is (sliced and array.nbytes > slice_bytes)
    parts = split(array, layout)
    assert list(parts) == layout.names()
    back = assemble(layout, {n: p.copy() for n, p in parts.items()})
    assert back.dtype == array.dtype and back.shape == array.shape
    assert back.tobytes() == array.tobytes()


@pytest.mark.parametrize(
    ("nbytes", "slice_bytes", "count"),
    [(4096, 4096, 1), (4100, 4096, 2), (8192, 4096, 2), (8196, 4096, 3), (100 << 20, 4 << 20, 25)],
)
def test_slice_count_and_bounds(nbytes: int, slice_bytes: int, count: int) -> None:
    layout = plan_layout("w", np.float32, (nbytes // 4,), slice_bytes)
    assert layout.count == count
    bounds = [layout.bounds(j) for j in range(count)]
    assert bounds[0][0] == 0 and bounds[-1][1] == nbytes // 4
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    if count > 1:
        assert all(stop - start == slice_bytes // 4 for start, stop in bounds[:-1])
        assert 0 < bounds[-1][1] - bounds[-1][0] <= slice_bytes // 4


def test_split_returns_views_without_copies() -> None:
    array = np.arange(1000, dtype=np.float64)
    parts = split(array, plan_layout("w", array.dtype, array.shape, 800))
    assert all(np.shares_memory(p, array) for p in parts.values())
    assert sum(p.size for p in parts.values()) == 1000


@pytest.mark.parametrize("shards", [1, 2, 3, 4, 5])
def test_slices_start_at_home_and_go_round_robin(shards: int) -> None:
    layout = plan_layout("big", np.float32, (10_000,), 4096)
    where = layout.placement(shards)
    home = _independent_home("big", shards)
    assert where[layout_key("big")] == home
    for j, name in enumerate(layout.names()):
        assert where[name] == (home + j) % shards
    if layout.count >= shards:
        assert {where[n] for n in layout.names()} == set(range(shards))


def test_small_key_is_whole_on_its_home() -> None:
    layout = plan_layout("b", np.float32, (3,))
    assert not layout.sliced and layout.names() == ["b"]
    assert layout.placement(4) == {"b": _independent_home("b", 4)}


def test_names_parse_back() -> None:
    assert parse_name(slice_key("a/b@c", 3, 16)) == ("slice", "a/b@c", 3, 16)
    assert parse_name(layout_key("a/b")) == ("layout", "a/b", 0, 0)
    assert parse_name("plain/key") == ("plain", "plain/key", 0, 1)
    assert parse_name("@layout") == ("plain", "@layout", 0, 1)


@pytest.mark.parametrize("key", ["w@slice0/2", "w@layout", "", "x@slice"])
def test_reserved_keys_refused(key: str) -> None:
    with pytest.raises(InvalidArgument):
        check_user_key(key)
    with pytest.raises(InvalidArgument):
        plan_layout(key, np.float32, (3,))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5000,), (100, 70), (2, 3, 4, 100)])
def test_layout_tensor_round_trip(dtype: type, shape: tuple[int, ...]) -> None:
    layout = plan_layout("w", dtype, shape, 256)
    encoded = encode_layout(layout)
    assert encoded.dtype == np.int64 and encoded.ndim == 1
    assert decode_layout("w", encoded) == layout


@pytest.mark.parametrize(
    "values", [[], [2, 2, 4, 1, 10], [1, 99, 4, 1, 10], [1, 2, 0, 1, 10], [1, 2, 4, 2, 10]]
)
def test_malformed_layout_tensor_refused(values: list[int]) -> None:
    with pytest.raises(MalformedStream):
        decode_layout("w", np.array(values, dtype=np.int64))


def test_split_refuses_wrong_shape_or_dtype() -> None:
    layout = plan_layout("w", np.float32, (100,), 64)
    with pytest.raises(DimensionMismatch):
        split(np.zeros(99, np.float32), layout)
    with pytest.raises(DimensionMismatch):
        split(np.zeros(100, np.float64), layout)


def test_assemble_refuses_missing_or_short_slice() -> None:
    layout = plan_layout("w", np.float32, (100,), 64)
    parts = split(np.zeros(100, np.float32), layout)
    first = layout.names()[0]
    with pytest.raises(MalformedStream, match="missing"):
        assemble(layout, {n: p for n, p in parts.items() if n != first})
    with pytest.raises(MalformedStream):
        assemble(layout, {**parts, first: parts[first][:-1]})


def test_shard_map_validation_and_proto_round_trip() -> None:
    m = ShardMap(("a:1", "b:2", "c:3"), slice_bytes=1 << 20, epoch=4)
    assert m.num_shards == 3
    assert shard_map_from_proto(shard_map_to_proto(m, 1)) == m
    assert ShardMap(("a:1",)).slice_bytes == DEFAULT_SLICE_BYTES
    for bad in (
        {"addresses": ()},
        {"addresses": ("a:1",), "slice_bytes": 4},
        {"addresses": ("a:1",), "placement": "crc32"},
        {"addresses": ("a:1",), "epoch": -1},
    ):
        with pytest.raises(InvalidArgument):
            ShardMap(**bad)  # type: ignore[arg-type]


def test_route_groups_parts_by_shard() -> None:
    m = ShardMap(("a:1", "b:2", "c:3"), slice_bytes=64)
    arrays = {"big": np.arange(100, dtype=np.float32), "small": np.ones(2, np.float32)}
    layouts = {k: m.layout(k, a.dtype, a.shape) for k, a in arrays.items()}
    per_shard = m.route(layouts, arrays)
    names = {n: i for i, part in enumerate(per_shard) for n in part}
    assert names == {
        n: s
        for k in arrays
        for n, s in layouts[k].placement(3).items()
        if n != layout_key(k) or not layouts[k].sliced
    }
    assert sum(p.size for part in per_shard for p in part.values()) == 102


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("a:1", ("a:1",)),
        (" a:1 , b:22,", ("a:1", "b:22")),
        (["h:0", "x:65535"], ("h:0", "x:65535")),
    ],
)
def test_parse_addresses(text: str | list[str], expected: tuple[str, ...]) -> None:
    assert parse_addresses(text) == expected


@pytest.mark.parametrize("text", ["", ",", "a", "a:", ":1", "a:x", "a:70000"])
def test_parse_addresses_refuses(text: str) -> None:
    with pytest.raises(InvalidArgument):
        parse_addresses(text)


def test_layout_properties() -> None:
    layout = TensorLayout("w", np.dtype(np.float32), (10, 10), 30)
    assert (layout.size, layout.nbytes, layout.count) == (100, 400, 4)
    assert layout.bounds(3) == (90, 100)
    with pytest.raises(InvalidArgument):
        layout.bounds(4)
