"""Many sparse features in one module: :class:`RemoteEmbeddingBagCollection` (after TorchRec's
``EmbeddingBagCollection``), whose tables live on the parameter server.

Needs the optional extra ``pip install 'paramserver[torch]'``. The input is keyed jagged ids:
TorchRec's ``KeyedJaggedTensor`` when torchrec is installed, or the plain
:class:`KeyedJaggedIds` here (the same ``keys()`` / ``values()`` / ``lengths()`` /
``weights_or_none()``), or a numpy :class:`~paramserver.worker_client.KeyedIds`. Each table
(:class:`RemoteBagTable`) serves one or more features; forward pools every feature's bags
(``sum`` or ``mean``, per-id weights with ``sum``) and returns ``{feature: (B, dim)}``.

One batch costs one request per shard each way, whatever the number of features: forward pulls
every table's distinct rows with ``pull_rows_many``; backward delivers every table's row
gradient (summed per id) at once and pushes them with ``push_rows_many``, all or nothing.
With the blocking client both happen inside ``forward`` / ``backward``; with the async client
``await m.prefetch(features)`` before forward and ``await m.push_pending()`` after backward::

    tables = [RemoteBagTable("users", 16, ["user"]), RemoteBagTable("items", 16, ["item", "seen"])]
    ebc = RemoteEmbeddingBagCollection(client, tables)
    features = {"user": [[3], [7]], "item": [[1], [2]], "seen": [[1, 9], []]}
    pooled = ebc(KeyedJaggedIds.from_lists(features))
    pooled["seen"]  # (2, 16): the sum of items 1 and 9's rows, then zeros

A table whose pooled features take no part in the loss still gets (zero) gradients for the
rows its features read.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeGuard, runtime_checkable

import numpy as np

from paramserver.errors import InvalidArgument
from paramserver.worker_client.embedding import RowPushAck
from paramserver.worker_client.keyed import KeyedIds

try:
    import torch
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ModuleNotFoundError(
        "paramserver.integrations.torch_collection needs PyTorch: pip install 'paramserver[torch]'",
        name="torch",
    ) from exc

__all__ = ["KeyedJaggedIds", "RemoteBagTable", "RemoteEmbeddingBagCollection"]

#: One several-table row request: ``{table: ids}``, and ``{table: rows}`` for a push.
_Tables = dict[str, np.ndarray]


class _BlockingRowsMany(Protocol):
    """The several-table row calls of a blocking client (``connect_sync``)."""

    def pull_rows_many(self, ids: _Tables, /) -> _Tables: ...

    def push_rows_many(self, ids: _Tables, grads: _Tables, /) -> dict[str, RowPushAck] | None: ...


class _AsyncRowsMany(Protocol):
    """The several-table row calls of the async client (``connect``), or of a row cache."""

    async def pull_rows_many(self, ids: _Tables, /) -> _Tables: ...

    async def push_rows_many(
        self, ids: _Tables, grads: _Tables, /
    ) -> dict[str, RowPushAck] | None: ...


#: A blocking client, or the async client (or a row cache over it).
RowsManyClient = _BlockingRowsMany | _AsyncRowsMany


def _is_async(client: RowsManyClient) -> TypeGuard[_AsyncRowsMany]:
    """The async client (its ``pull_rows_many`` is a coroutine function)."""
    return inspect.iscoroutinefunction(getattr(client, "pull_rows_many", None))


def _is_blocking(client: RowsManyClient) -> TypeGuard[_BlockingRowsMany]:
    return not _is_async(client)


@runtime_checkable
class KeyedJagged(Protocol):
    """A TorchRec ``KeyedJaggedTensor`` (or a :class:`KeyedJaggedIds`), as read here."""

    def keys(self) -> list[str]: ...

    def values(self) -> torch.Tensor: ...

    def lengths(self) -> torch.Tensor: ...

    def weights_or_none(self) -> torch.Tensor | None: ...


#: A batch's keyed jagged ids: a ``KeyedJaggedTensor``, a :class:`KeyedJaggedIds` or a
#: :class:`~paramserver.worker_client.keyed.KeyedIds`.
Features = KeyedJagged | KeyedIds


@dataclass(frozen=True)
class KeyedJaggedIds:
    """A plain stand-in for TorchRec's ``KeyedJaggedTensor`` (the calls this module uses).

    Attributes:
        keys_: Feature names, K.
        values_: int64 (n,) ids, feature-major then sample-major.
        lengths_: int64 (K * B,) ids per (feature, sample).
        weights_: float (n,) per-id weights or None.
    """

    keys_: tuple[str, ...]
    values_: torch.Tensor
    lengths_: torch.Tensor
    weights_: torch.Tensor | None = None

    @classmethod
    def from_lengths_sync(
        cls,
        keys: Sequence[str],
        values: torch.Tensor,
        lengths: torch.Tensor,
        weights: torch.Tensor | None = None,
    ) -> KeyedJaggedIds:
        """As ``KeyedJaggedTensor.from_lengths_sync``."""
        return cls(tuple(keys), values, lengths, weights)

    @classmethod
    def from_lists(
        cls,
        features: Mapping[str, Sequence[Sequence[int]]],
        weights: Mapping[str, Sequence[Sequence[float]]] | None = None,
    ) -> KeyedJaggedIds:
        """From ``{feature: [ids of sample 0, ids of sample 1, ...]}`` (and the same shape of
        weights when given)."""
        kj = KeyedIds.from_lists(features)
        w = None
        if weights is not None:
            w = torch.tensor(
                [x for k in kj.keys for sample in weights[k] for x in sample], dtype=torch.float32
            )
        return cls(kj.keys, torch.from_numpy(kj.values), torch.from_numpy(kj.lengths), w)

    def keys(self) -> list[str]:
        return list(self.keys_)

    def values(self) -> torch.Tensor:
        return self.values_

    def lengths(self) -> torch.Tensor:
        return self.lengths_

    def weights_or_none(self) -> torch.Tensor | None:
        return self.weights_


@dataclass(frozen=True)
class RemoteBagTable:
    """One server table of a :class:`RemoteEmbeddingBagCollection` (TorchRec's
    ``EmbeddingBagConfig``).

    Attributes:
        name: Table name on the server (declared with ``init_table``, same ``dim``).
        dim: Row width.
        features: The features whose ids look up this table (each feature in one table).
        mode: Pooling of each bag: ``"sum"`` or ``"mean"``.

    Raises:
        InvalidArgument: no features, or a mode other than sum/mean (INVALID_ARGUMENT).
    """

    name: str
    dim: int
    features: Sequence[str] = field(default_factory=tuple)
    mode: str = "sum"

    def __post_init__(self) -> None:
        if self.mode not in ("sum", "mean"):
            raise InvalidArgument(f"table {self.name!r}: mode must be 'sum' or 'mean'")
        if not self.features:
            raise InvalidArgument(f"table {self.name!r}: no features")
        object.__setattr__(self, "features", tuple(self.features))


def _keyed_parts(
    features: Features,
) -> tuple[list[str], torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(keys, values, lengths, weights or None) of a KJT, a KeyedJaggedIds or a KeyedIds."""
    if isinstance(features, KeyedIds):
        w = None if features.weights is None else torch.from_numpy(features.weights)
        return (
            list(features.keys),
            torch.from_numpy(features.values),
            torch.from_numpy(features.lengths),
            w,
        )
    return (
        list(features.keys()),
        features.values(),
        features.lengths(),
        features.weights_or_none(),
    )


#: One backward's row gradients, to push: (``{table: ids}``, ``{table: rows}``).
Pending = tuple[dict[str, np.ndarray], dict[str, np.ndarray]]


@dataclass
class _Plan:
    """One forward's lookups: each table's distinct ids, and each feature's positions among
    them, offsets (B,) and weights."""

    uniq: dict[str, np.ndarray]
    local: dict[str, torch.Tensor]
    offsets: dict[str, torch.Tensor]
    weights: dict[str, torch.Tensor | None]
    stride: int


#: A training pipeline's batch, pulled ahead: its features, their plan, their rows.
Staged = tuple[Features, _Plan, dict[str, np.ndarray]]


class RemoteEmbeddingBagCollection(torch.nn.Module):
    """Pooled embeddings of many sparse features whose tables live on the parameter server.

    Args:
        client: A blocking client (``connect_sync``) or the async client (then use
            :meth:`prefetch` / :meth:`push_pending`); anything with ``pull_rows_many`` and
            ``push_rows_many`` (e.g. a worker-side row cache).
        tables: The tables and the features each serves.
        dtype: dtype of the rows handed to the model.

    Forward ``(features)``: keyed jagged ids (see the module docstring) holding every
    configured feature (others are ignored) -> ``{feature: (B, dim) pooled}`` in the tables'
    feature order. Semantics per feature: ``torch.nn.functional.embedding_bag`` with the
    feature's bags (empty bags give zeros; per-id weights scale entries, ``sum`` only).

    Raises:
        InvalidArgument: a feature in two tables, a feature missing from the input, weights
            with a ``mean`` table, an async client without :meth:`prefetch` of the same input
            (INVALID_ARGUMENT).
    """

    def __init__(
        self,
        client: RowsManyClient,
        tables: Sequence[RemoteBagTable],
        *,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.client = client
        self.tables = list(tables)
        self.dtype = dtype
        self._table_of: dict[str, RemoteBagTable] = {}
        for t in self.tables:
            for f in t.features:
                if f in self._table_of:
                    raise InvalidArgument(
                        f"feature {f!r} is in tables {self._table_of[f].name!r} and {t.name!r}"
                    )
                self._table_of[f] = t
        self._async = _is_async(client)
        self._prefetched: dict[str, tuple[np.ndarray, np.ndarray]] | None = None
        self._pending: list[Pending] = []
        #: A training pipeline's batch in compute: (its features, their plan, their rows).
        self._staged: Staged | None = None

    @property
    def feature_names(self) -> list[str]:
        return [f for t in self.tables for f in t.features]

    # ------------------------------------------------------------------ planning
    def _plan(self, features: Features) -> _Plan:
        keys, values, lengths, weights = _keyed_parts(features)
        k = len(keys)
        if k == 0 or lengths.shape[0] % k:
            raise InvalidArgument("keyed ids: lengths are not a whole number of samples per key")
        stride = int(lengths.shape[0]) // k
        values = values.reshape(-1).to(torch.int64).cpu()
        lengths = lengths.reshape(-1).to(torch.int64).cpu()
        per_key = lengths.reshape(k, stride).sum(dim=1)
        bounds = [0, *torch.cumsum(per_key, 0).tolist()]
        index = {key: i for i, key in enumerate(keys)}
        ids_of: dict[str, torch.Tensor] = {}
        offsets: dict[str, torch.Tensor] = {}
        w_of: dict[str, torch.Tensor | None] = {}
        for f, t in self._table_of.items():
            if f not in index:
                raise InvalidArgument(f"feature {f!r} (table {t.name!r}) is not in the input")
            i = index[f]
            ids_of[f] = values[bounds[i] : bounds[i + 1]]
            lens = lengths[i * stride : (i + 1) * stride]
            offsets[f] = torch.cumsum(lens, 0) - lens
            if weights is None:
                w_of[f] = None
            else:
                if t.mode != "sum":
                    raise InvalidArgument(
                        f"feature {f!r}: per-id weights need a 'sum' table, {t.name!r} is "
                        f"{t.mode!r}"
                    )
                w_of[f] = weights.reshape(-1)[bounds[i] : bounds[i + 1]].to(self.dtype)
        uniq: dict[str, np.ndarray] = {}
        local: dict[str, torch.Tensor] = {}
        for t in self.tables:
            cat = torch.cat([ids_of[f] for f in t.features])
            u, inverse = torch.unique(cat, sorted=True, return_inverse=True)
            uniq[t.name] = u.numpy()
            start = 0
            for f in t.features:
                n = int(ids_of[f].shape[0])
                local[f] = inverse[start : start + n]
                start += n
        return _Plan(uniq, local, offsets, w_of, stride)

    # ------------------------------------------------------------------ async client
    async def prefetch(self, features: Features) -> None:
        """Pull every table's distinct rows of ``features`` in one request per shard (async
        client), for the next forward."""
        plan = self._plan(features)
        rows = await self._async_client().pull_rows_many(plan.uniq)
        self._prefetched = {t: (plan.uniq[t], np.asarray(rows[t])) for t in plan.uniq}

    async def push_pending(self) -> list[dict[str, RowPushAck] | None]:
        """Push the row gradients the last backward passes produced (async client), one
        several-table request per shard each."""
        pending, self._pending = self._pending, []
        client = self._async_client()
        return [await client.push_rows_many(ids, grads) for ids, grads in pending]

    def _async_client(self) -> _AsyncRowsMany:
        client = self.client
        if not _is_async(client):
            raise TypeError("prefetch and push_pending need the async client (connect(...))")
        return client

    def _blocking_client(self) -> _BlockingRowsMany:
        client = self.client
        if not _is_blocking(client):
            raise TypeError("with the async client, rows are pulled by prefetch")
        return client

    # ------------------------------------------------------------------ training pipeline
    def _stage(self, features: Features, plan: _Plan, rows: dict[str, np.ndarray]) -> None:
        """Hand the next forward a batch's plan and rows, pulled ahead by
        :class:`~paramserver.integrations.torch_pipeline.TrainPipeline`."""
        self._staged = (features, plan, rows)
        self._prefetched = {t: (plan.uniq[t], rows[t]) for t in plan.uniq}

    def _unstage(self) -> None:
        self._staged = None
        self._prefetched = None

    def _take_pending(self) -> list[Pending]:
        """The row gradients of the backward passes since the last call (async client)."""
        pending, self._pending = self._pending, []
        return pending

    # ------------------------------------------------------------------ forward
    def _pull(self, plan: _Plan) -> dict[str, np.ndarray]:
        if not self._async:
            return self._blocking_client().pull_rows_many(plan.uniq)
        cached = self._prefetched
        out = {}
        for name, u in plan.uniq.items():
            have = None if cached is None else cached.get(name)
            if have is None or not np.isin(u, have[0], assume_unique=True).all():
                raise InvalidArgument(
                    f"table {name!r}: with an async client, await prefetch(features) before "
                    "forward (the forward's ids were not prefetched)"
                )
            out[name] = have[1][np.searchsorted(have[0], u)]
        return out

    def forward(self, features: Features) -> dict[str, torch.Tensor]:
        staged = self._staged
        if staged is not None and staged[0] is features:  # planned when it was pulled
            plan, rows = staged[1], staged[2]
        else:
            plan = self._plan(features)
            rows = self._pull(plan)
        sizes = [(t.name, plan.uniq[t.name].shape[0], t.dim) for t in self.tables]
        flat = np.concatenate(
            [np.asarray(rows[name], dtype=np.float32).reshape(-1) for name, _, _ in sizes]
        )
        # One leaf for every table's rows: backward delivers all their gradients in one hook,
        # pushed as one several-table request.
        leaf = torch.from_numpy(flat).to(self.dtype)
        if torch.is_grad_enabled():
            leaf.requires_grad_(True)
            leaf.register_hook(lambda g: self._on_grad(plan.uniq, sizes, g))  # type: ignore[no-untyped-call]
        weights: dict[str, torch.Tensor] = {}
        start = 0
        for name, m, dim in sizes:
            weights[name] = leaf[start : start + m * dim].view(m, dim)
            start += m * dim
        out: dict[str, torch.Tensor] = {}
        for t in self.tables:
            for f in t.features:
                out[f] = torch.nn.functional.embedding_bag(
                    plan.local[f],
                    weights[t.name],
                    plan.offsets[f],
                    mode=t.mode,
                    per_sample_weights=plan.weights[f],
                )
        return out

    def _on_grad(
        self, uniq: dict[str, np.ndarray], sizes: list[tuple[str, int, int]], grad: torch.Tensor
    ) -> None:
        g = grad.detach().to(torch.float32).cpu().numpy()
        grads: dict[str, np.ndarray] = {}
        start = 0
        for name, m, dim in sizes:
            grads[name] = np.ascontiguousarray(g[start : start + m * dim].reshape(m, dim))
            start += m * dim
        if self._async:
            self._pending.append((uniq, grads))
        else:
            self._blocking_client().push_rows_many(uniq, grads)
