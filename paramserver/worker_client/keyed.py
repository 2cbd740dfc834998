"""Keyed jagged ids: several sparse features of one batch in one object (TorchRec's
``KeyedJaggedTensor`` layout, numpy only).

A batch of B samples with K features is ``keys`` (K names), ``values`` (every id, feature-major:
all of feature 0's ids for samples 0..B-1, then feature 1's, ...), and ``lengths`` (K * B counts,
the same order: how many ids sample b has in feature k), with optional per-id ``weights``.
The several-table row calls (``pull_rows_many`` / ``push_rows_many``) take it, or a plain
``{table: ids}`` mapping.

Usage::

    kj = KeyedIds.from_lists({"user": [[3], [7]], "genres": [[1, 2], []]})
    kj.stride          # 2 samples
    kj.ids_of("genres")  # array([1, 2])
    kj.offsets_of("genres")  # array([0, 2, 2])
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeAlias

import numpy as np
import numpy.typing as npt

from paramserver.errors import InvalidArgument

__all__ = ["KeyedIds", "TableIds"]


class _Tensor(Protocol):
    """What :meth:`KeyedIds.from_torchrec` reads of a tensor: a CPU numpy copy."""

    def detach(self) -> _Tensor: ...
    def cpu(self) -> _Tensor: ...
    def numpy(self) -> np.ndarray: ...


class _KeyedJagged(Protocol):
    """A ``torchrec.KeyedJaggedTensor``, as :meth:`KeyedIds.from_torchrec` reads it."""

    def keys(self) -> Sequence[str]: ...
    def values(self) -> _Tensor: ...
    def lengths(self) -> _Tensor: ...
    def weights_or_none(self) -> _Tensor | None: ...


@dataclass(frozen=True)
class KeyedIds:
    """Keyed jagged ids (TorchRec ``KeyedJaggedTensor``'s layout).

    Attributes:
        keys: Feature names, K.
        values: int64 (n,) ids, feature-major then sample-major.
        lengths: int64 (K * B,) ids per (feature, sample), feature-major.
        weights: float32 (n,) per-id weights, or None.

    Raises:
        InvalidArgument: lengths not a multiple of K, negative, or not adding up to
            ``len(values)``; weights of another length (INVALID_ARGUMENT).
    """

    keys: tuple[str, ...]
    values: npt.NDArray[np.int64]
    lengths: npt.NDArray[np.int64]
    weights: npt.NDArray[np.float32] | None = None

    def __post_init__(self) -> None:
        k = len(self.keys)
        if len(set(self.keys)) != k:
            raise InvalidArgument(f"keyed ids: a key appears twice in {list(self.keys)}")
        n_len = int(self.lengths.shape[0])
        if self.values.ndim != 1 or self.lengths.ndim != 1:
            raise InvalidArgument("keyed ids: values and lengths must be 1-D")
        if (k == 0 and n_len) or (k and n_len % k):
            raise InvalidArgument(
                f"keyed ids: {n_len} lengths are not a whole number of samples for {k} keys"
            )
        if n_len and int(self.lengths.min()) < 0:
            raise InvalidArgument("keyed ids: a negative length")
        if int(self.lengths.sum()) != int(self.values.shape[0]):
            raise InvalidArgument(
                f"keyed ids: lengths add up to {int(self.lengths.sum())}, "
                f"there are {self.values.shape[0]} values"
            )
        if self.weights is not None and self.weights.shape != self.values.shape:
            raise InvalidArgument(
                f"keyed ids: {self.weights.shape[0]} weights for {self.values.shape[0]} values"
            )

    # ------------------------------------------------------------------ construction
    @classmethod
    def of(
        cls,
        keys: Sequence[str],
        values: npt.ArrayLike,
        lengths: npt.ArrayLike,
        weights: npt.ArrayLike | None = None,
    ) -> KeyedIds:
        """From array-likes (values as int64, lengths as int64, weights as float32)."""
        return cls(
            tuple(keys),
            np.ascontiguousarray(np.asarray(values), dtype=np.int64).reshape(-1),
            np.ascontiguousarray(np.asarray(lengths), dtype=np.int64).reshape(-1),
            None if weights is None else np.ascontiguousarray(weights, dtype=np.float32),
        )

    @classmethod
    def from_offsets(
        cls,
        keys: Sequence[str],
        values: npt.ArrayLike,
        offsets: npt.ArrayLike,
        weights: npt.ArrayLike | None = None,
    ) -> KeyedIds:
        """From K * B + 1 offsets into ``values`` (starting at 0)."""
        off = np.asarray(offsets, dtype=np.int64).reshape(-1)
        if off.shape[0] == 0 or off[0] != 0:
            raise InvalidArgument("keyed ids: offsets must start at 0")
        return cls.of(keys, values, np.diff(off), weights)

    @classmethod
    def from_lists(cls, features: Mapping[str, Sequence[Sequence[int]]]) -> KeyedIds:
        """From ``{key: [ids of sample 0, ids of sample 1, ...]}`` (every key B samples)."""
        keys = list(features)
        sizes = {len(v) for v in features.values()}
        if len(sizes) > 1:
            raise InvalidArgument(f"keyed ids: keys have different sample counts {sorted(sizes)}")
        values: list[int] = []
        lengths: list[int] = []
        for key in keys:
            for sample in features[key]:
                values.extend(int(i) for i in sample)
                lengths.append(len(sample))
        return cls.of(keys, values, lengths)

    @classmethod
    def from_torchrec(cls, kjt: _KeyedJagged) -> KeyedIds:
        """From a ``torchrec.KeyedJaggedTensor`` (or anything with ``keys()``, ``values()``,
        ``lengths()`` and ``weights_or_none()`` returning tensors)."""
        w = kjt.weights_or_none()
        return cls.of(
            list(kjt.keys()),
            kjt.values().detach().cpu().numpy(),
            kjt.lengths().detach().cpu().numpy(),
            None if w is None else w.detach().cpu().numpy(),
        )

    # ------------------------------------------------------------------ views
    @property
    def stride(self) -> int:
        """Samples in the batch, B."""
        return int(self.lengths.shape[0] // len(self.keys)) if self.keys else 0

    def _bounds(self) -> npt.NDArray[np.int64]:
        """Offsets of each key's ids in ``values``, (K + 1,)."""
        per_key = self.lengths.reshape(len(self.keys), self.stride).sum(axis=1)
        return np.concatenate([[0], np.cumsum(per_key)]).astype(np.int64)

    def ids_of(self, key: str) -> npt.NDArray[np.int64]:
        """The ids of feature ``key`` (every sample's, in order)."""
        k = self._index(key)
        b = self._bounds()
        return self.values[b[k] : b[k + 1]]

    def weights_of(self, key: str) -> npt.NDArray[np.float32] | None:
        """The per-id weights of feature ``key``, or None."""
        if self.weights is None:
            return None
        k = self._index(key)
        b = self._bounds()
        return self.weights[b[k] : b[k + 1]]

    def lengths_of(self, key: str) -> npt.NDArray[np.int64]:
        """Ids per sample of feature ``key``, (B,)."""
        k = self._index(key)
        return self.lengths[k * self.stride : (k + 1) * self.stride]

    def offsets_of(self, key: str) -> npt.NDArray[np.int64]:
        """Offsets of each sample's ids within :meth:`ids_of`, (B + 1,)."""
        return np.concatenate([[0], np.cumsum(self.lengths_of(key))]).astype(np.int64)

    def to_dict(self) -> dict[str, npt.NDArray[np.int64]]:
        """``{key: ids}`` in key order."""
        b = self._bounds()
        return {key: self.values[b[k] : b[k + 1]] for k, key in enumerate(self.keys)}

    def _index(self, key: str) -> int:
        try:
            return self.keys.index(key)
        except ValueError:
            raise InvalidArgument(f"keyed ids: no key {key!r} (keys {list(self.keys)})") from None


#: The ids of a several-table row call: ``{table: 1-D integer ids}``, or :class:`KeyedIds`
#: whose keys are the table names.
TableIds: TypeAlias = Mapping[str, npt.ArrayLike] | KeyedIds
