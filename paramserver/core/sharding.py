"""Placement of keys on server shards, and slicing of large tensors (pure, synchronous).

A cluster of S shard processes shares the keys (docs/architecture.md: one process per shard,
since the GIL caps one process). The rule, named :data:`PLACEMENT` in every shard map, is:

* **Small tensors** (``nbytes <= slice_bytes``) live whole on their *home shard*
  ``blake2b_64(key) mod S`` — a stable hash of the key's UTF-8 bytes (BLAKE2b, RFC 7693, 8-byte
  digest read big-endian), never Python's per-process salted ``hash()``.
* **Large tensors** are flattened (C order) and split into contiguous slices of
  ``slice_bytes // itemsize`` elements (the last one shorter), as BytePS partitions tensors
  (Jiang et al., OSDI 2020; default 4 MiB). Slice ``j`` of ``m`` is stored under the name
  ``"{key}@slice{j}/{m}"`` on shard ``(home + j) mod S``, so consecutive slices land on
  consecutive shards and a tensor of ``m >= S`` slices spreads over every shard. A small
  *layout* tensor ``"{key}@layout"`` (int64: format, dtype code, slice elements, ndim, shape)
  lives on the home shard: it tells any client (and the resharding tool) how to reassemble the
  tensor, and its creation is the first-writer-wins point of a sliced ``init``.

Update rules are element-wise (assign, add, sgd, adam, adamw, adagrad; adam's ``step`` counter is
per slice and advances in lockstep), so a sliced key is updated bit-for-bit as the whole key
would be. Names containing ``@slice`` or ``@layout`` are reserved.

Nothing here does I/O; the routing client (:mod:`paramserver.worker_client.cluster`), the shard
daemon and the resharding tool (:mod:`paramserver.server.reshard`) all use these functions.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

from paramserver.api.v1 import parameter_server_pb2 as pb
from paramserver.core.store import SUPPORTED_DTYPES
from paramserver.errors import DimensionMismatch, InvalidArgument, MalformedStream

# Address parsing lives in the protocol layer (a command checks an address without loading the
# core); these names stay importable from here.
from paramserver.protocol.addresses import parse_address, parse_addresses

__all__ = [
    "DEFAULT_SLICE_BYTES",
    "LAYOUT_SUFFIX",
    "PLACEMENT",
    "ShardMap",
    "TensorLayout",
    "assemble",
    "check_user_key",
    "decode_layout",
    "encode_layout",
    "home_shard",
    "key_hash",
    "layout_key",
    "parse_address",
    "parse_addresses",
    "parse_name",
    "plan_layout",
    "shard_map_from_proto",
    "shard_map_to_proto",
    "slice_key",
    "split",
]

PLACEMENT: Final = "blake2b-64/v1"
"""Name of the placement rule above (shard maps and checkpoints carry it)."""

DEFAULT_SLICE_BYTES: Final = 4 << 20
"""Tensors above this many bytes are sliced (4 MiB, BytePS's default partition size)."""

LAYOUT_SUFFIX: Final = "@layout"
_SLICE_MARK: Final = "@slice"
_SLICE_RE: Final = re.compile(r"^(?P<key>.+)@slice(?P<index>\d+)/(?P<count>\d+)$")
_LAYOUT_FORMAT: Final = 1

# Stable dtype codes of the layout tensor (never renumber).
_DTYPE_CODES: Final[tuple[np.dtype[np.generic], ...]] = SUPPORTED_DTYPES  # append only


def key_hash(key: str) -> int:
    """64-bit stable hash of a key: BLAKE2b (8-byte digest) of its UTF-8 bytes, big-endian."""
    return int.from_bytes(hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest(), "big")


def home_shard(key: str, num_shards: int) -> int:
    """Shard that holds ``key`` whole (or its layout and slice 0): ``key_hash mod S``.

    Raises:
        InvalidArgument: ``num_shards < 1`` (INVALID_ARGUMENT).
    """
    if num_shards < 1:
        raise InvalidArgument(f"num_shards must be >= 1, got {num_shards}")
    return key_hash(key) % num_shards


def slice_key(key: str, index: int, count: int) -> str:
    """Stored name of slice ``index`` of ``count`` of ``key``."""
    return f"{key}{_SLICE_MARK}{index}/{count}"


def layout_key(key: str) -> str:
    """Stored name of the layout tensor of a sliced ``key``."""
    return f"{key}{LAYOUT_SUFFIX}"


def parse_name(name: str) -> tuple[str, str, int, int]:
    """Classify a stored name.

    Returns:
        ``(kind, key, index, count)``: kind ``"plain"`` (``index 0, count 1``), ``"slice"`` or
        ``"layout"`` (``index 0, count 0``); ``key`` is the user's key.
    """
    match = _SLICE_RE.match(name)
    if match is not None:
        return "slice", match["key"], int(match["index"]), int(match["count"])
    if name.endswith(LAYOUT_SUFFIX) and len(name) > len(LAYOUT_SUFFIX):
        return "layout", name[: -len(LAYOUT_SUFFIX)], 0, 0
    return "plain", name, 0, 1


def check_user_key(key: str) -> None:
    """Refuse keys that use the reserved ``@slice`` / ``@layout`` markers.

    Raises:
        InvalidArgument: a reserved or empty key (INVALID_ARGUMENT).
    """
    if not isinstance(key, str) or not key:
        raise InvalidArgument(f"key must be a non-empty string, got {key!r}")
    if _SLICE_MARK in key or LAYOUT_SUFFIX in key:
        raise InvalidArgument(
            f"key {key!r} uses a reserved marker ({_SLICE_MARK!r} or {LAYOUT_SUFFIX!r}): "
            "a sharded cluster stores slices and layouts under such names"
        )


@dataclass(frozen=True)
class TensorLayout:
    """How one key is stored: whole, or as contiguous slices of its flattened elements.

    Attributes:
        key: The user's key.
        dtype: Element dtype.
        shape: The tensor's shape.
        slice_elems: Elements per slice (the last slice may be shorter); 0 = stored whole.
    """

    key: str
    dtype: np.dtype[np.generic]
    shape: tuple[int, ...]
    slice_elems: int = 0

    @property
    def size(self) -> int:
        """Number of elements (1 for shape ``()``)."""
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def sliced(self) -> bool:
        return self.slice_elems > 0

    @property
    def count(self) -> int:
        """Number of slices (1 for a whole tensor)."""
        if not self.sliced:
            return 1
        return -(-self.size // self.slice_elems)

    def bounds(self, index: int) -> tuple[int, int]:
        """Element range ``[start, stop)`` of slice ``index`` in the flattened tensor."""
        if not 0 <= index < self.count:
            raise InvalidArgument(f"slice {index} of {self.key!r} out of range [0, {self.count})")
        if not self.sliced:
            return 0, self.size
        start = index * self.slice_elems
        return start, min(start + self.slice_elems, self.size)

    def names(self) -> list[str]:
        """Stored names of the data: ``[key]``, or every slice name in order."""
        if not self.sliced:
            return [self.key]
        return [slice_key(self.key, j, self.count) for j in range(self.count)]

    def placement(self, num_shards: int) -> dict[str, int]:
        """Stored name -> shard, data and (for a sliced key) the layout tensor."""
        home = home_shard(self.key, num_shards)
        if not self.sliced:
            return {self.key: home}
        out = {layout_key(self.key): home}
        for j, name in enumerate(self.names()):
            out[name] = (home + j) % num_shards
        return out


def plan_layout(
    key: str, dtype: npt.DTypeLike, shape: Iterable[int], slice_bytes: int = DEFAULT_SLICE_BYTES
) -> TensorLayout:
    """The layout of a tensor: sliced iff its byte size exceeds ``slice_bytes``.

    Raises:
        InvalidArgument: ``slice_bytes < 1`` or a reserved key (INVALID_ARGUMENT).
    """
    check_user_key(key)
    if slice_bytes < 1:
        raise InvalidArgument(f"slice_bytes must be >= 1, got {slice_bytes}")
    dt = np.dtype(dtype)
    shp = tuple(int(n) for n in shape)
    whole = TensorLayout(key, dt, shp)
    if whole.nbytes <= slice_bytes:
        return whole
    return TensorLayout(key, dt, shp, max(1, slice_bytes // dt.itemsize))


def split(array: np.ndarray, layout: TensorLayout) -> dict[str, np.ndarray]:
    """Stored name -> data: the array itself, or 1-D views of its slices (no copies for a
    C-contiguous array).

    Raises:
        DimensionMismatch: the array's dtype or shape is not the layout's (INVALID_ARGUMENT).
    """
    if array.dtype != layout.dtype and tuple(array.shape) == layout.shape:
        raise DimensionMismatch(
            f"dtype mismatch for key {layout.key!r}: expected {layout.dtype}, got {array.dtype} "
            "(cast it, or push with cast=True)"
        )
    if array.dtype != layout.dtype or tuple(array.shape) != layout.shape:
        raise DimensionMismatch(
            f"key {layout.key!r}: array is {array.dtype}{list(array.shape)}, layout is "
            f"{layout.dtype}{list(layout.shape)}"
        )
    if not layout.sliced:
        return {layout.key: array}
    flat = np.ascontiguousarray(array).reshape(-1)
    out = {}
    for j, name in enumerate(layout.names()):
        start, stop = layout.bounds(j)
        out[name] = flat[start:stop]
    return out


def assemble(layout: TensorLayout, parts: Mapping[str, np.ndarray]) -> np.ndarray:
    """Rebuild the tensor from its stored parts (bit-exact: bytes are only copied).

    Raises:
        MalformedStream: a part missing or of the wrong dtype/length (INVALID_ARGUMENT).
    """
    if not layout.sliced:
        try:
            whole = parts[layout.key]
        except KeyError:
            raise MalformedStream(f"key {layout.key!r} missing from the pulled parts") from None
        return whole
    out = np.empty(layout.size, dtype=layout.dtype)
    for j, name in enumerate(layout.names()):
        part = parts.get(name)
        start, stop = layout.bounds(j)
        if part is None:
            raise MalformedStream(f"slice {name!r} of key {layout.key!r} missing")
        if part.dtype != layout.dtype or part.size != stop - start:
            raise MalformedStream(
                f"slice {name!r} is {part.dtype}[{part.size}], expected "
                f"{layout.dtype}[{stop - start}]"
            )
        out[start:stop] = part.reshape(-1)
    return out.reshape(layout.shape)


def encode_layout(layout: TensorLayout) -> np.ndarray:
    """The layout tensor: int64 ``[format, dtype code, slice_elems, ndim, *shape]``."""
    code = _DTYPE_CODES.index(layout.dtype)
    header = [_LAYOUT_FORMAT, code, layout.slice_elems, len(layout.shape)]
    return np.array([*header, *layout.shape], dtype=np.int64)


def decode_layout(key: str, array: np.ndarray) -> TensorLayout:
    """Inverse of :func:`encode_layout`.

    Raises:
        MalformedStream: not a layout tensor this version understands (INVALID_ARGUMENT).
    """
    values = [int(v) for v in np.asarray(array).reshape(-1)]
    if (
        len(values) < 4
        or values[0] != _LAYOUT_FORMAT
        or not 0 <= values[1] < len(_DTYPE_CODES)
        or values[2] < 1
        or len(values) != 4 + values[3]
        or any(n < 0 for n in values[4:])
    ):
        raise MalformedStream(f"layout tensor of key {key!r} is malformed: {values}")
    return TensorLayout(key, _DTYPE_CODES[values[1]], tuple(values[4:]), values[2])


@dataclass(frozen=True)
class ShardMap:
    """The cluster's shard map, served by every shard (``GetShardMap``).

    Attributes:
        addresses: ``host:port`` of shard i at index i, as workers reach it.
        slice_bytes: Tensors above this many bytes are sliced.
        epoch: Bumps whenever the map changes (e.g. after resharding).
        placement: Placement rule name (:data:`PLACEMENT`).
    """

    addresses: tuple[str, ...]
    slice_bytes: int = DEFAULT_SLICE_BYTES
    epoch: int = 0
    placement: str = PLACEMENT

    def __post_init__(self) -> None:
        if not self.addresses:
            raise InvalidArgument("a shard map needs at least one address")
        if self.slice_bytes < 8:
            raise InvalidArgument(f"slice_bytes must be >= 8, got {self.slice_bytes}")
        if self.placement != PLACEMENT:
            raise InvalidArgument(
                f"placement rule {self.placement!r} is not supported (this build: {PLACEMENT!r})"
            )
        if self.epoch < 0:
            raise InvalidArgument(f"epoch must be >= 0, got {self.epoch}")

    @property
    def num_shards(self) -> int:
        return len(self.addresses)

    def layout(self, key: str, dtype: npt.DTypeLike, shape: Iterable[int]) -> TensorLayout:
        """Layout of a new key under this map's slice size."""
        return plan_layout(key, dtype, shape, self.slice_bytes)

    def route(
        self, layouts: Mapping[str, TensorLayout], arrays: Mapping[str, np.ndarray]
    ) -> list[dict[str, np.ndarray]]:
        """Split ``arrays`` (key -> tensor) and group the parts by shard.

        Returns:
            One ``{stored name: array}`` per shard (empty for shards with no part).
        """
        out: list[dict[str, np.ndarray]] = [{} for _ in self.addresses]
        for key, array in arrays.items():
            layout = layouts[key]
            where = layout.placement(self.num_shards)
            for name, part in split(array, layout).items():
                out[where[name]][name] = part
        return out


def shard_map_to_proto(shard_map: ShardMap, shard_index: int) -> pb.GetShardMapResponse:
    """The ``GetShardMap`` answer of shard ``shard_index``."""
    return pb.GetShardMapResponse(
        addresses=list(shard_map.addresses),
        shard_index=shard_index,
        slice_bytes=shard_map.slice_bytes,
        placement=shard_map.placement,
        epoch=shard_map.epoch,
    )


def shard_map_from_proto(resp: pb.GetShardMapResponse) -> ShardMap:
    """Decode a ``GetShardMap`` answer.

    Raises:
        InvalidArgument: an empty or unsupported map (INVALID_ARGUMENT).
    """
    return ShardMap(
        addresses=tuple(resp.addresses),
        slice_bytes=int(resp.slice_bytes),
        epoch=int(resp.epoch),
        placement=resp.placement,
    )
