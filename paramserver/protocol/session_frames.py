"""The ``Session`` stream's tensor encoding that both ends share: sizes, slot layout, decoding.

A pushed or pulled tensor goes inline in a ``SessionRequest``/``SessionResponse`` up to these
sizes; a larger one travels in a shared-memory slot (:mod:`paramserver.protocol.shm`) or in
the frames of the Push and Pull streams. Slots are laid out from offset 0 of a region, each at
an :func:`~paramserver.protocol.shm.align_up` boundary, and described either by one
``SlotBatch`` (packed arrays: keys, wire dtypes, ranks, dims, offsets) or by one
``SessionTensor`` per key. :func:`place_slot_batch` / :func:`place_slot_tensors` write the
descriptions and return the destination views; :func:`slot_batch_entries` reads a batch back
(checked), as the pushing client's server and the pulling client both do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from paramserver.api.v1 import parameter_server_pb2 as pb
from paramserver.errors import MalformedStream
from paramserver.protocol import shm, tensor

__all__ = [
    "MAX_INLINE_BYTES",
    "SMALL_INLINE_BYTES",
    "RegionView",
    "SlotEntry",
    "inline_array",
    "place_slot_batch",
    "place_slot_tensors",
    "slot_batch_entries",
]

#: Pulled values up to this many bytes in total go inline even when a segment is mapped.
SMALL_INLINE_BYTES = 64 << 10
#: Largest inline payload (bytes) of one message: well under a 4 MiB receive limit and under
#: the ~1 MiB frame size of the streams (docs/semantics.md).
MAX_INLINE_BYTES = (1 << 20) - (32 << 10)

#: ``region.view(offset_bytes, size_bytes, dtype, shape)`` of a mapped shared-memory region.
RegionView = Callable[[int, int, Any, tuple[int, ...]], np.ndarray]

#: One slot of a ``SlotBatch``: (key, dtype, shape, offset_bytes, size_bytes).
SlotEntry = tuple[str, np.dtype[Any], tuple[int, ...], int, int]


def place_slot_batch(
    batch: pb.SlotBatch, view: RegionView, keys: Iterable[str], values: Sequence[Any]
) -> list[np.ndarray]:
    """Lay ``values`` (arrays, or anything with ``dtype``, ``shape`` and ``nbytes``) out in a
    region and describe them in ``batch``.

    Args:
        batch: The message's ``SlotBatch`` field (filled in place: no per-key messages).
        view: The region's ``view``.
        keys: One key per value, in order.
        values: What goes in the slots (only its dtype, shape and size are read).

    Returns:
        The slots' views, in order: the caller copies the bytes into them.

    Raises:
        InvalidArgument: a slot beyond the region (INVALID_ARGUMENT), from ``view``.
    """
    dsts: list[np.ndarray] = []
    dtypes: list[int] = []
    ndims: list[int] = []
    dims: list[int] = []
    offsets: list[int] = []
    to_wire = tensor.dtype_to_wire
    offset = 0
    for value in values:
        size = value.nbytes
        shape = value.shape
        dsts.append(view(offset, size, value.dtype, shape))
        dtypes.append(to_wire(value.dtype))
        ndims.append(len(shape))
        dims.extend(shape)
        offsets.append(offset)
        offset = shm.align_up(offset + size)
    batch.keys.extend(keys)
    batch.dtypes.extend(dtypes)
    batch.ndims.extend(ndims)
    batch.dims.extend(dims)
    batch.offsets.extend(offsets)
    return dsts


def place_slot_tensors(
    tensors: Any, view: RegionView, keys: Iterable[str], values: Sequence[Any]
) -> list[np.ndarray]:
    """:func:`place_slot_batch` for a peer that reads one ``SessionTensor`` per key:
    ``tensors`` is the message's repeated ``SessionTensor`` field."""
    dsts: list[np.ndarray] = []
    add = tensors.add  # (fields set in place: no per-key message objects)
    to_wire = tensor.dtype_to_wire
    offset = 0
    for key, value in zip(keys, values, strict=True):
        size = value.nbytes
        dsts.append(view(offset, size, value.dtype, value.shape))
        add(
            key=key,
            dtype=to_wire(value.dtype),
            shape=value.shape,
            slot={"offset_bytes": offset, "size_bytes": size},
        )
        offset = shm.align_up(offset + size)
    return dsts


def slot_batch_entries(batch: pb.SlotBatch) -> list[SlotEntry]:
    """The slots a ``SlotBatch`` describes, in order (dtypes decoded, sizes computed).

    Raises:
        MalformedStream: its arrays disagree in length (naming each length).
        InvalidArgument: a dtype the wire does not carry (INVALID_ARGUMENT).
    """
    keys = list(batch.keys)
    dtypes = list(batch.dtypes)
    ndims = list(batch.ndims)
    dims = list(batch.dims)
    offsets = list(batch.offsets)
    n = len(keys)
    if not (len(dtypes) == len(ndims) == len(offsets) == n) or sum(ndims) != len(dims):
        raise MalformedStream(
            f"SlotBatch arrays disagree: {n} keys, {len(dtypes)} dtypes, {len(ndims)} ndims, "
            f"{len(offsets)} offsets, {len(dims)} dims for ranks summing to {sum(ndims)}"
        )
    from_wire = tensor.dtype_from_wire
    nbytes_of = tensor.tensor_nbytes
    out: list[SlotEntry] = []
    pos = 0
    for key, wire_dtype, nd, offset in zip(keys, dtypes, ndims, offsets, strict=True):
        dtype = from_wire(wire_dtype, key)
        shape = tuple(dims[pos : pos + nd])
        pos += nd
        out.append((key, dtype, shape, offset, nbytes_of(shape, dtype)))
    return out


def inline_array(t: pb.SessionTensor) -> np.ndarray:
    """A writeable copy of an inline ``SessionTensor``'s value.

    Raises:
        MalformedStream: the bytes do not match the shape and dtype.
        InvalidArgument: a dtype the wire does not carry (INVALID_ARGUMENT).
    """
    key = t.key
    dtype = tensor.dtype_from_wire(t.dtype, key)
    shape = tuple(t.shape)  # (int64 field: already Python ints)
    nbytes = tensor.tensor_nbytes(shape, dtype)
    data = t.data
    if len(data) != nbytes:
        raise MalformedStream(
            f"tensor {key!r}: {len(data)} inline bytes != prod(shape {shape}) * "
            f"itemsize {dtype.itemsize} = {nbytes}"
        )
    return np.frombuffer(data, dtype=dtype).reshape(shape).copy()
