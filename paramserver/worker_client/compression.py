"""Opt-in wire compression of pushed gradients, per key.

* :class:`Cast` sends a float gradient as float16 or bfloat16 (half the bytes of float32); the
  server casts it back to the key's dtype before aggregation (wire role ``TENSOR_ROLE_CAST``).
* :class:`TopK` sends only the ``ratio`` largest-magnitude entries as (int64 flat index, value)
  pairs (roles ``TENSOR_ROLE_SPARSE_INDICES`` / ``_VALUES``); the server scatters them into a
  dense zero gradient. With error feedback (default) the entries not sent are kept on the worker
  as a residual and added to the next gradient, so nothing is lost, only delayed — Stich et al.,
  "Sparsified SGD with Memory", NeurIPS 2018; Karimireddy et al., "Error Feedback Fixes SignSGD
  and other Gradient Compression Schemes", ICML 2019.

Usage::

    async with connect(addr, worker_name="w0", compression={"emb": TopK(0.01), "w": Cast()}):
        ...
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from paramserver.api.v1 import tensor_pb2
from paramserver.errors import InvalidArgument

_CAST_DTYPES = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
_FLOAT = (np.float16, np.float32, np.float64, ml_dtypes.bfloat16)


@dataclass(frozen=True)
class Cast:
    """Send the gradient in a narrower float dtype ("float16" or "bfloat16")."""

    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if self.dtype not in _CAST_DTYPES:
            raise InvalidArgument(f"Cast dtype must be float16 or bfloat16, got {self.dtype!r}")


@dataclass(frozen=True)
class TopK:
    """Send the ``ratio`` (0 < ratio <= 1) largest-magnitude entries, at least one.

    Attributes:
        ratio: Fraction of entries sent per push.
        error_feedback: Keep what was not sent as a residual added to the next gradient.
        value_dtype: Optionally send the values as "float16"/"bfloat16" too.
    """

    ratio: float = 0.01
    error_feedback: bool = True
    value_dtype: str | None = None

    def __post_init__(self) -> None:
        if not 0.0 < self.ratio <= 1.0:
            raise InvalidArgument(f"TopK ratio must be in (0, 1], got {self.ratio}")
        if self.value_dtype is not None and self.value_dtype not in _CAST_DTYPES:
            raise InvalidArgument(
                f"TopK value_dtype must be float16, bfloat16 or None, got {self.value_dtype!r}"
            )


Compression = Cast | TopK


@dataclass(frozen=True)
class WirePart:
    """One tensor to send: its array, wire role and (sparse) dense shape."""

    array: np.ndarray
    role: tensor_pb2.TensorRole.ValueType = tensor_pb2.TENSOR_ROLE_UNSPECIFIED
    dense_shape: tuple[int, ...] = ()


class DenseParts(Mapping[str, list[WirePart]]):
    """``parts`` of a push of uncompressed gradients: key -> one dense part, made only when
    a transport asks (the session carries ``dense`` itself and never does)."""

    __slots__ = ("arrays",)

    def __init__(self, arrays: Mapping[str, np.ndarray]) -> None:
        self.arrays = arrays

    def __getitem__(self, key: str) -> list[WirePart]:
        return [WirePart(self.arrays[key])]

    def __iter__(self) -> Iterator[str]:
        return iter(self.arrays)

    def __len__(self) -> int:
        return len(self.arrays)


class GradientCompressor:
    """Encodes gradients per key and keeps the error-feedback residuals (worker side).

    Args:
        schemes: key -> :class:`Cast` or :class:`TopK`; keys not listed are sent dense.
    """

    def __init__(self, schemes: dict[str, Compression] | None = None) -> None:
        self.schemes = dict(schemes or {})
        self.residuals: dict[str, np.ndarray] = {}
        self.sent_bytes = 0
        self.dense_bytes = 0

    def encode_all(self, grads: Mapping[str, np.ndarray]) -> Mapping[str, list[WirePart]]:
        """:meth:`encode` of every key: key -> its wire parts. With no scheme at all, the
        parts are the gradients themselves, dense (no per-key work beyond the byte count).

        Raises:
            InvalidArgument: as :meth:`encode`.
        """
        if not self.schemes:
            nbytes = sum(g.nbytes for g in grads.values())
            self.dense_bytes += nbytes
            self.sent_bytes += nbytes
            return DenseParts(grads)
        return {k: self.encode(k, v) for k, v in grads.items()}

    def encode(self, key: str, grad: np.ndarray) -> list[WirePart]:
        """The wire parts of one key's gradient (1 part dense/cast, 2 parts sparse).

        Raises:
            InvalidArgument: compression asked for a non-float gradient (INVALID_ARGUMENT).
        """
        scheme = self.schemes.get(key)
        if scheme is None and "@slice" in key:  # a slice of a sharded cluster's large key
            scheme = self.schemes.get(key.split("@slice", 1)[0])
        self.dense_bytes += grad.nbytes
        if scheme is None:
            self.sent_bytes += grad.nbytes
            return [WirePart(grad)]
        if grad.dtype.type not in _FLOAT:
            raise InvalidArgument(
                f"key {key!r}: compression needs a float gradient, got {grad.dtype}"
            )
        if isinstance(scheme, Cast):
            out = grad.astype(_CAST_DTYPES[scheme.dtype])
            self.sent_bytes += out.nbytes
            return [WirePart(out, tensor_pb2.TENSOR_ROLE_CAST)]
        return self._top_k(key, grad, scheme)

    def _top_k(self, key: str, grad: np.ndarray, scheme: TopK) -> list[WirePart]:
        work = np.asarray(grad, dtype=np.float32 if grad.dtype != np.float64 else np.float64)
        flat = work.reshape(-1)
        if scheme.error_feedback:
            residual = self.residuals.get(key)
            if residual is not None and residual.shape == flat.shape:
                flat = flat + residual
        n = flat.size
        k = min(n, max(1, math.ceil(scheme.ratio * n))) if n else 0
        if k == n:
            idx = np.arange(n, dtype=np.int64)
        else:
            idx = np.argpartition(np.abs(flat), n - k)[n - k :].astype(np.int64)
            idx.sort()
        values = flat[idx]
        if scheme.error_feedback:
            residual = flat.copy()  # `flat` may alias the caller's gradient: never write it
            residual[idx] = 0
            self.residuals[key] = residual
        value_dtype = _CAST_DTYPES[scheme.value_dtype] if scheme.value_dtype else grad.dtype
        values = values.astype(value_dtype)
        self.sent_bytes += idx.nbytes + values.nbytes
        return [
            WirePart(idx, tensor_pb2.TENSOR_ROLE_SPARSE_INDICES, tuple(grad.shape)),
            WirePart(values, tensor_pb2.TENSOR_ROLE_SPARSE_VALUES),
        ]

    @property
    def ratio(self) -> float:
        """Bytes sent / dense bytes so far (1.0 without compression)."""
        return self.sent_bytes / self.dense_bytes if self.dense_bytes else 1.0
