"""Server side of opt-in wire compression: compressed gradients back to dense ones.

The worker side (:mod:`paramserver.worker_client.compression`) sends a gradient either cast to
a narrower float dtype (``TENSOR_ROLE_CAST``) or as top-k (index, value) pairs
(``TENSOR_ROLE_SPARSE_INDICES`` then ``_VALUES``). Both become dense gradients of the key's own
dtype and shape here, before validation, aggregation and the update rule, so every consistency
model and update rule works unchanged. Transports hand the compressed gradients on as received
(:class:`Encoded`); the shard's push path decodes them
(``paramserver.server.shard_service.ShardService.apply_push_header``), one place for all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from paramserver.core.store import ParameterStore
from paramserver.errors import DimensionMismatch, InvalidArgument, MalformedStream

_FLOATS = (np.float16, np.float32, np.float64, ml_dtypes.bfloat16)


@dataclass(frozen=True)
class Encoded:
    """A compressed gradient as received.

    Attributes:
        values: CAST: the dense gradient in a narrower dtype. SPARSE: values, shape (k,).
        indices: SPARSE only: int64 flat C-order indices, shape (k,).
        dense_shape: SPARSE only: the shape the sender declared for the dense gradient.
    """

    values: np.ndarray
    indices: np.ndarray | None = None
    dense_shape: tuple[int, ...] = ()


def decode(store: ParameterStore, key: str, enc: Encoded) -> np.ndarray:
    """The dense gradient (key's dtype and shape) of one compressed gradient.

    Raises:
        KeyNotFound: unknown key (NOT_FOUND).
        InvalidArgument / DimensionMismatch / MalformedStream: a non-float key or values, a
            dense shape that is not the key's, indices out of range or of the wrong count
            (INVALID_ARGUMENT), each naming the key.
    """
    value = store.get(key).value
    if value.dtype.type not in _FLOATS or enc.values.dtype.type not in _FLOATS:
        raise InvalidArgument(
            f"key {key!r}: compressed gradients need float keys and values "
            f"(key {value.dtype}, sent {enc.values.dtype})"
        )
    if enc.indices is None:
        if enc.values.shape != value.shape:
            raise DimensionMismatch(
                f"gradient for key {key!r} has shape {enc.values.shape} (expected {value.shape})"
            )
        return enc.values.astype(value.dtype)
    if enc.dense_shape != value.shape:
        raise DimensionMismatch(
            f"sparse gradient for key {key!r} has dense shape {enc.dense_shape} "
            f"(expected {value.shape})"
        )
    idx, vals = enc.indices, enc.values
    if idx.dtype != np.int64 or idx.ndim != 1 or vals.ndim != 1 or idx.shape != vals.shape:
        raise MalformedStream(
            f"sparse gradient for key {key!r}: {idx.shape[0] if idx.ndim == 1 else idx.shape} "
            f"int64 indices need as many 1-D values, got {vals.shape} ({idx.dtype} indices)"
        )
    size = math.prod(value.shape)
    if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= size):
        raise InvalidArgument(
            f"sparse gradient for key {key!r}: indices must lie in [0, {size}), got "
            f"[{int(idx.min())}, {int(idx.max())}]"
        )
    dense = np.zeros(value.shape, dtype=value.dtype)
    dense.reshape(-1)[idx] = vals.astype(value.dtype)
    return dense
