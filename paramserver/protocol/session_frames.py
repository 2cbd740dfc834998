"""The ``Session`` stream's one tensor encoding, which both ends share: sizes, layout, decoding.

Every request or answer of the Session stream carries its tensors (one or many) as one
``SlotBatch``: packed arrays (keys, wire dtypes, ranks, dims, offsets) describing slots laid
out from offset 0 of a region, each at an :func:`~paramserver.protocol.shm.align_up` boundary.
The region is one of two carriers, with this one encoding each:

- **inline**: the batch's own ``data`` field (set, even when empty) holds the bytes, zero-padded
  between slots (:func:`pack_slot_batch`; read back through :func:`inline_region`), up to
  :data:`MAX_INLINE_BYTES` a message;
- **shared memory**: ``data`` unset, the slots lie in the push or pull region of the session's
  segment (:mod:`paramserver.protocol.shm`; :func:`place_slot_batch` returns the destination
  views).

:func:`slot_batch_views` reads a batch back against its region (checked), as the pushing
client's server and the pulling client both do; :func:`batch_bytes` is a batch's region size.
A tensor too large for either carrier travels in the frames of the Push and Pull streams.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, TypeAlias

import numpy as np

from paramserver.api.v1 import parameter_server_pb2 as pb
from paramserver.errors import InvalidArgument, MalformedStream
from paramserver.protocol import shm, tensor

__all__ = [
    "MAX_INLINE_BYTES",
    "SMALL_INLINE_BYTES",
    "RegionView",
    "SlotEntry",
    "SlotValue",
    "batch_bytes",
    "inline_region",
    "pack_slot_batch",
    "place_slot_batch",
    "slot_batch_entries",
    "slot_batch_views",
    "slot_span",
]

#: Requests and answers up to this many bytes (:func:`batch_bytes`) go inline even when a
#: segment is mapped.
SMALL_INLINE_BYTES = 64 << 10
#: Largest inline ``data`` (bytes, padding included) of one message: well under a 4 MiB receive
#: limit and under the ~1 MiB frame size of the streams (docs/semantics.md).
MAX_INLINE_BYTES = (1 << 20) - (32 << 10)

#: ``region.view(offset_bytes, size_bytes, dtype, shape)`` of a mapped shared-memory region.
RegionView = Callable[[int, int, np.dtype[np.generic], tuple[int, ...]], np.ndarray]

#: One slot of a ``SlotBatch``: (key, dtype, shape, offset_bytes, size_bytes).
SlotEntry = tuple[str, np.dtype[np.generic], tuple[int, ...], int, int]

#: A ``SlotBatch``'s packed arrays as lists: (keys, wire dtypes, ranks, dims, offsets).
_Packed: TypeAlias = tuple[list[str], list[tensor.WireDType], list[int], list[int], list[int]]
#: Each value's (dtype, shape): what a layout depends on.
_Signature: TypeAlias = list[tuple[np.dtype[np.generic], tuple[int, ...]]]


class SlotValue(Protocol):
    """What a slot is laid out for: an array, or anything with its dtype, shape and size."""

    @property
    def dtype(self) -> np.dtype[np.generic]: ...

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def nbytes(self) -> int: ...


def batch_bytes(sizes: Iterable[int]) -> int:
    """Bytes a batch of tensors of these payload sizes (bytes, in order) spans in its region:
    each slot rounded up to the next :func:`~paramserver.protocol.shm.align_up` boundary. For
    the inline carrier this is ``len(data)`` exactly."""
    align = shm.align_up
    return sum(align(n) for n in sizes)


class _Placed:
    """One layout :func:`place_slot_batch` made: what it was for, and what it produced."""

    __slots__ = (
        "dims",
        "dsts",
        "dtypes",
        "keys",
        "ndims",
        "offsets",
        "pads",
        "signature",
        "view",
    )

    def __init__(self, view: RegionView | None, keys: list[str], signature: _Signature) -> None:
        self.view = view
        self.keys = keys
        self.signature = signature
        #: (inline batches) zero bytes after each slot, up to the next one's offset
        self.pads: list[bytes] = []
        self.dsts: list[np.ndarray] = []
        self.dtypes: list[tensor.WireDType] = []
        self.ndims: list[int] = []
        self.dims: list[int] = []
        self.offsets: list[int] = []


class _Read:
    """One batch :func:`slot_batch_views` read: its packed arrays, entries and views."""

    __slots__ = ("entries", "packed", "region", "views")

    def __init__(
        self,
        region: shm.Region,
        packed: _Packed,
        entries: list[SlotEntry],
        views: list[np.ndarray],
    ) -> None:
        self.region = region
        self.packed = packed
        self.entries = entries
        self.views = views


class _Decoded:
    """One batch :func:`slot_batch_entries` decoded: its packed arrays and entries."""

    __slots__ = ("entries", "packed")

    def __init__(self, packed: _Packed, entries: list[SlotEntry]) -> None:
        self.packed = packed
        self.entries = entries


class _Span:
    """One :func:`slot_span` answer and the entries list it was for."""

    __slots__ = ("entries", "span")

    def __init__(
        self, entries: list[SlotEntry], span: tuple[int, int, np.dtype[np.generic]] | None
    ) -> None:
        self.entries = entries
        self.span = span


def place_slot_batch(
    batch: pb.SlotBatch,
    view: RegionView,
    keys: Iterable[str],
    values: Sequence[SlotValue],
    *,
    memo: dict[str, object] | None = None,
) -> list[np.ndarray]:
    """Lay ``values`` (arrays, or anything with ``dtype``, ``shape`` and ``nbytes``) out in a
    region and describe them in ``batch``.

    Args:
        batch: The message's ``SlotBatch`` field (filled in place: no per-key messages).
        view: The region's ``view``.
        keys: One key per value, in order.
        values: What goes in the slots (only its dtype, shape and size are read).
        memo: The mapping's memo (``layouts`` of a :class:`~paramserver.protocol.shm.ClientSegment`
            or :class:`~paramserver.protocol.shm.ServerMapping`): a model's requests repeat one
            layout every round, so when ``keys``, dtypes and shapes are those of the last call
            with this memo and region, its views and packed arrays are reused (same result).

    Returns:
        The slots' views, in order: the caller copies the bytes into them.

    Raises:
        InvalidArgument: a slot beyond the region (INVALID_ARGUMENT), from ``view``.
    """
    key_list = list(keys)
    signature = [(v.dtype, v.shape) for v in values]
    last = memo.get("placed") if memo is not None else None
    if (
        not isinstance(last, _Placed)
        or last.view != view
        or last.keys != key_list
        or last.signature != signature
    ):
        last = _Placed(view, key_list, signature)
        to_wire = tensor.dtype_to_wire
        offset = 0
        for value in values:
            size = value.nbytes
            shape = value.shape
            last.dsts.append(view(offset, size, value.dtype, shape))
            last.dtypes.append(to_wire(value.dtype))
            last.ndims.append(len(shape))
            last.dims.extend(shape)
            last.offsets.append(offset)
            offset = shm.align_up(offset + size)
        if memo is not None:
            memo["placed"] = last
    batch.keys.extend(key_list)
    batch.dtypes.extend(last.dtypes)
    batch.ndims.extend(last.ndims)
    batch.dims.extend(last.dims)
    batch.offsets.extend(last.offsets)
    return last.dsts


def pack_slot_batch(
    batch: pb.SlotBatch,
    keys: Iterable[str],
    values: Sequence[np.ndarray],
    *,
    datas: Sequence[bytes] | None = None,
    memo: dict[str, object] | None = None,
) -> int:
    """Describe ``values`` in ``batch`` for the inline carrier: the :func:`place_slot_batch`
    layout (each slot at an :func:`~paramserver.protocol.shm.align_up` boundary from 0) with
    the bytes, zero-padded between slots, in ``batch.data`` (set even when empty), joined in
    one copy.

    Args:
        batch: The message's ``SlotBatch`` field (filled in place).
        keys: One key per value, in order.
        values: The arrays (any dtype the wire carries, any layout or byte order: the bytes
            packed are each value's elements C-ordered and little-endian).
        datas: Each value's raw C-order bytes when the caller has them already (then only
            ``values``' dtypes and shapes are read).
        memo: A dict kept by the caller across requests: when ``keys``, dtypes and shapes
            repeat (a model's every round), the layout is reused instead of recomputed.

    Returns:
        ``len(batch.data)``, bytes.

    Raises:
        ValueError: ``datas`` whose lengths are not the values' sizes (a caller's bug).
    """
    key_list = list(keys)
    signature = [(v.dtype, v.shape) for v in values]
    last = memo.get("packed") if memo is not None else None
    if not isinstance(last, _Placed) or last.keys != key_list or last.signature != signature:
        last = _Placed(None, key_list, signature)
        to_wire = tensor.dtype_to_wire
        offset = 0
        zeros: dict[int, bytes] = {}
        for value in values:
            size = value.nbytes
            shape = value.shape
            last.dtypes.append(to_wire(value.dtype))
            last.ndims.append(len(shape))
            last.dims.extend(shape)
            last.offsets.append(offset)
            end = shm.align_up(offset + size)
            pad = end - offset - size
            last.pads.append(zeros.setdefault(pad, bytes(pad)))
            offset = end
        if memo is not None:
            memo["packed"] = last
    # bytes and arrays (numpy types an ndarray as a buffer for Python 3.12+ only)
    parts: list[Any] = [b""] * (2 * len(values))
    if datas is not None:
        parts[0::2] = datas
    else:
        parts[0::2] = [
            v if v.flags.c_contiguous and v.dtype.byteorder != ">" else _little_contiguous(v)
            for v in values
        ]
    parts[1::2] = last.pads
    if len(values) == 1 and not last.pads[0]:
        del parts[1]  # (one key without padding: the join of its bytes alone is no copy)
    data = b"".join(parts)
    need = last.offsets[-1] + values[-1].nbytes + len(last.pads[-1]) if values else 0
    if len(data) != need:
        raise ValueError(
            f"packed {len(data)} bytes where the layout needs {need}: some value's "
            "bytes are not its size"
        )
    batch.keys.extend(key_list)
    batch.dtypes.extend(last.dtypes)
    batch.ndims.extend(last.ndims)
    batch.dims.extend(last.dims)
    batch.offsets.extend(last.offsets)
    batch.data = data
    return len(data)


def _little_contiguous(value: np.ndarray) -> np.ndarray:
    """``value``'s elements as a C-contiguous little-endian array (the wire's byte order)."""
    dtype = value.dtype.newbyteorder("<") if value.dtype.byteorder == ">" else value.dtype
    return np.ascontiguousarray(value, dtype=dtype)


def inline_region(data: bytes | bytearray, name: str) -> shm.Region:
    """A :class:`~paramserver.protocol.shm.Region` over an inline batch's ``data`` (its views
    are read-only for ``bytes``, writeable for a ``bytearray``), so the batch is read and
    checked exactly as one in a shared-memory region is."""
    return shm.Region(data, 0, len(data), name)


def _packed(batch: pb.SlotBatch) -> _Packed:
    return (
        list(batch.keys),
        list(batch.dtypes),
        list(batch.ndims),
        list(batch.dims),
        list(batch.offsets),
    )


def slot_batch_entries(
    batch: pb.SlotBatch, memo: dict[str, object] | None = None
) -> list[SlotEntry]:
    """The slots a ``SlotBatch`` describes, in order (dtypes decoded, sizes computed).

    Args:
        batch: A received ``SlotBatch``.
        memo: A dict kept across requests: a batch whose packed arrays equal the last one
            decoded with it returns that one's entries (same result, no per-key decoding).

    Raises:
        MalformedStream: its arrays disagree in length (naming each length).
        InvalidArgument: a dtype the wire does not carry (INVALID_ARGUMENT).
    """
    packed = _packed(batch)
    last = memo.get("entries") if memo is not None else None
    if isinstance(last, _Decoded) and last.packed == packed:
        return last.entries
    entries = _entries(packed)
    if memo is not None:
        memo["entries"] = _Decoded(packed, entries)
    return entries


def _entries(packed: _Packed) -> list[SlotEntry]:
    keys, dtypes, ndims, dims, offsets = packed
    n = len(keys)
    if not (len(dtypes) == len(ndims) == len(offsets) == n) or sum(ndims) != len(dims):
        raise MalformedStream(
            f"SlotBatch arrays disagree: {n} keys, {len(dtypes)} dtypes, {len(ndims)} ndims, "
            f"{len(offsets)} offsets, {len(dims)} dims for ranks summing to {sum(ndims)}"
        )
    if dims and min(dims) < 0:  # (checked once for the batch; the key is found only then)
        pos = 0
        for key, nd in zip(keys, ndims, strict=True):
            shape = tuple(dims[pos : pos + nd])
            pos += nd
            if min(shape, default=0) < 0:
                raise InvalidArgument(f"tensor {key!r}: negative dimension in shape {shape}")
    from_wire = tensor.dtype_from_wire
    prod = math.prod
    out: list[SlotEntry] = []
    pos = 0
    for key, wire_dtype, nd, offset in zip(keys, dtypes, ndims, offsets, strict=True):
        dtype = from_wire(wire_dtype, key)
        shape = tuple(dims[pos : pos + nd])
        pos += nd
        nbytes = prod(shape) * dtype.itemsize
        # (a non-empty slot too large for an array lies outside every region: its view says so)
        if nd > tensor.MAX_NDIM or (nbytes == 0 and nd > 1):
            problem = tensor.array_limit_problem(shape, dtype.itemsize)
            if problem is not None:
                raise InvalidArgument(f"tensor {key!r}: {problem}")
        out.append((key, dtype, shape, offset, nbytes))
    return out


def slot_batch_views(
    batch: pb.SlotBatch, region: shm.Region, memo: dict[str, object] | None = None
) -> tuple[list[SlotEntry], list[np.ndarray]]:
    """:func:`slot_batch_entries` of ``batch`` and each slot's view of ``region``.

    Args:
        batch: A received ``SlotBatch``.
        region: The mapped region its offsets refer to.
        memo: The mapping's memo (as in :func:`place_slot_batch`): a batch whose packed
            arrays equal the last one read with this memo and region reuses its entries and
            views (same result, no per-key decoding).

    Returns:
        ``(entries, views)``, in the batch's order.

    Raises:
        MalformedStream, InvalidArgument: as :func:`slot_batch_entries`, and a slot outside
            the region or of the wrong size (INVALID_ARGUMENT, naming the key).
    """
    packed = _packed(batch)
    last = memo.get("read") if memo is not None else None
    if isinstance(last, _Read) and last.region is region and last.packed == packed:
        return last.entries, last.views
    entries = _entries(packed)
    views: list[np.ndarray] = []
    for key, dtype, shape, offset, nbytes in entries:
        try:
            views.append(region.view(offset, nbytes, dtype, shape))
        except InvalidArgument as exc:
            raise InvalidArgument(f"tensor {key!r}: {exc.message}") from None
    if memo is not None:
        memo["read"] = _Read(region, packed, entries, views)
    return entries, views


#: Floating dtypes whose slots :func:`slot_span` may cover with one view.
_SPAN_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def slot_span(
    entries: list[SlotEntry], memo: dict[str, object] | None = None
) -> tuple[int, int, np.dtype[np.generic]] | None:
    """``(start, end, dtype)``: the bytes ``[start, end)`` of the region that every slot of
    ``entries`` lies in, when all share one float32 or float64 dtype, start at a multiple of
    its size, and the span is at most twice their payload (little padding); else None.

    A value check over the span then covers every slot at once (with the padding between
    them, so a clean span means clean slots, not the converse). Memoized per ``entries``
    list in ``memo`` (a mapping's ``layouts``).
    """
    last = memo.get("span") if memo is not None else None
    if isinstance(last, _Span) and last.entries is entries:
        return last.span
    result: tuple[int, int, np.dtype[np.generic]] | None = None
    dtype = entries[0][1] if entries else None
    if dtype in _SPAN_DTYPES and all(e[1] == dtype for e in entries):
        assert dtype is not None
        start = min(e[3] for e in entries)
        end = max(e[3] + e[4] for e in entries)
        payload = sum(e[4] for e in entries)
        size = dtype.itemsize
        if (
            start % size == 0
            and (end - start) % size == 0
            and end - start <= 2 * payload
            and all(e[3] % size == 0 for e in entries)
        ):
            result = (start, end, dtype)
    if memo is not None:
        memo["span"] = _Span(entries, result)
    return result
