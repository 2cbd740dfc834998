"""``torch.nn.Embedding`` and ``EmbeddingBag`` whose rows live in a server table.

Re-exported by :mod:`paramserver.integrations.torch` (the user-facing reference; tables in
``docs/embedding-tables.md``). Forward pulls the batch's unique rows, backward pushes their
sparse gradients (summed per id) for the table's server-side rule to apply.
"""

from __future__ import annotations

import inspect
from typing import Protocol, TypeGuard

import numpy as np
import numpy.typing as npt
import torch

from paramserver.errors import InvalidArgument
from paramserver.worker_client.embedding import RowPushAck

__all__ = ["RemoteEmbedding", "RemoteEmbeddingBag"]


class _BlockingRows(Protocol):
    """The row calls of a blocking client (``connect_sync``)."""

    def pull_rows(self, table: str, ids: npt.NDArray[np.int64], /) -> np.ndarray: ...

    def push_rows(
        self, table: str, ids: npt.NDArray[np.int64], grads: np.ndarray, /
    ) -> RowPushAck | None: ...


class _AsyncRows(Protocol):
    """The row calls of the async client (``connect``), or of a row cache over it."""

    async def pull_rows(self, table: str, ids: npt.NDArray[np.int64], /) -> np.ndarray: ...

    async def push_rows(
        self, table: str, ids: npt.NDArray[np.int64], grads: np.ndarray, /
    ) -> RowPushAck | None: ...


#: A blocking client, or the async client (or a row cache over it).
RowsClient = _BlockingRows | _AsyncRows


def _is_async(client: RowsClient) -> TypeGuard[_AsyncRows]:
    return inspect.iscoroutinefunction(getattr(client, "pull_rows", None))


def _is_blocking(client: RowsClient) -> TypeGuard[_BlockingRows]:
    return not _is_async(client)


class _RemoteRows(torch.nn.Module):
    """Shared machinery of :class:`RemoteEmbedding` and :class:`RemoteEmbeddingBag`.

    Forward pulls the batch's unique rows (``torch.unique``) as a leaf tensor of shape
    (n_unique, dim); backward delivers that leaf's gradient, the sparse gradient of the table
    already summed per id, and pushes it with ``push_rows``. With a blocking client
    (:class:`~paramserver.worker_client.SyncWorkerClient`) both happen inside ``forward`` /
    ``backward``. With the async client, ``await module.prefetch(ids)`` before forward and
    ``await module.push_pending()`` after backward (forward then reads the prefetched rows).
    """

    def __init__(
        self, client: RowsClient, table: str, dim: int, *, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        self.client = client
        self.table = table
        self.dim = dim
        self.dtype = dtype
        #: An id whose row is never pulled, read or pushed (the bag's ``padding_idx``).
        self._skip_id: int | None = None
        self._async = _is_async(client)
        self._prefetched: tuple[np.ndarray, np.ndarray] | None = None
        self._pending: list[tuple[np.ndarray, np.ndarray]] = []

    async def prefetch(self, ids: torch.Tensor | np.ndarray) -> None:
        """Pull the unique rows of ``ids`` (async client) for the next forward."""
        uniq = np.unique(np.asarray(ids, dtype=np.int64).reshape(-1))
        if self._skip_id is not None:
            uniq = uniq[uniq != self._skip_id]
        rows = await self._async_client().pull_rows(self.table, uniq)
        self._prefetched = (uniq, np.asarray(rows))

    async def push_pending(self) -> list[RowPushAck | None]:
        """Push the row gradients the last backward passes produced (async client)."""
        pending, self._pending = self._pending, []
        client = self._async_client()
        return [await client.push_rows(self.table, u, g) for u, g in pending]

    def _async_client(self) -> _AsyncRows:
        client = self.client
        if not _is_async(client):
            raise TypeError(
                f"table {self.table!r}: prefetch and push_pending need the async client"
            )
        return client

    def _blocking_client(self) -> _BlockingRows:
        client = self.client
        if not _is_blocking(client):
            raise TypeError(f"table {self.table!r}: the async client pulls in prefetch")
        return client

    def _local(self, ids: torch.Tensor) -> tuple[np.ndarray, torch.Tensor, int | None]:
        """The batch's distinct ids (int64 (m,), ascending), ``ids`` as positions among them
        (``ids``' shape), and the position of the skipped id (None when absent)."""
        flat = ids.reshape(-1).to(torch.int64).cpu()
        uniq_t, inverse = torch.unique(flat, sorted=True, return_inverse=True)
        uniq = uniq_t.numpy()
        skip = None
        if self._skip_id is not None:
            at = int(np.searchsorted(uniq, self._skip_id))
            if at < uniq.shape[0] and int(uniq[at]) == self._skip_id:
                skip = at
        return uniq, inverse.reshape(ids.shape), skip

    def _weight(self, uniq: np.ndarray, skip: int | None) -> torch.Tensor:
        """The rows of ``uniq`` as a leaf tensor (m, dim) whose gradient is pushed; the row at
        position ``skip`` is zeros, neither pulled nor pushed."""
        fetch = uniq if skip is None else np.delete(uniq, skip)
        if self._async:
            cached = self._prefetched
            if cached is None or not np.isin(fetch, cached[0], assume_unique=True).all():
                raise InvalidArgument(
                    f"table {self.table!r}: with an async client, await prefetch(ids) before "
                    "forward (the forward's ids were not prefetched)"
                )
            rows = cached[1][np.searchsorted(cached[0], fetch)]
        else:
            rows = np.asarray(self._blocking_client().pull_rows(self.table, fetch))
        rows = rows.astype(np.float32)
        if skip is not None:
            rows = np.insert(rows, skip, 0.0, axis=0)
        weight = torch.from_numpy(np.ascontiguousarray(rows)).to(self.dtype)
        if torch.is_grad_enabled():
            weight.requires_grad_(True)
            weight.register_hook(lambda g: self._on_grad(fetch, skip, g))  # type: ignore[no-untyped-call]
        return weight

    def _rows(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        uniq, local, skip = self._local(ids)
        return self._weight(uniq, skip), local

    def _on_grad(self, fetch: np.ndarray, skip: int | None, grad: torch.Tensor) -> None:
        g = grad.detach().to(torch.float32).cpu().numpy()
        if skip is not None:
            g = np.delete(g, skip, axis=0)
            if fetch.shape[0] == 0:  # only the skipped id: nothing to push
                return
        g = np.ascontiguousarray(g)
        if self._async:
            self._pending.append((fetch, g))
        else:
            self._blocking_client().push_rows(self.table, fetch, g)


class RemoteEmbedding(_RemoteRows):
    """``torch.nn.Embedding`` whose table lives on the parameter server.

    Args:
        client: A blocking client (``connect_sync``) or the async client (then use
            :meth:`prefetch` / :meth:`push_pending`).
        table: Table name (declared with ``init_table``; its rule updates the rows).
        dim: Row width.
        dtype: dtype of the rows handed to the model (the table's storage dtype is its own).

    Forward: ``ids`` int64 tensor of any shape -> ``ids.shape + (dim,)``.
    """

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        weight, local = self._rows(ids)
        return torch.nn.functional.embedding(local, weight)


class RemoteEmbeddingBag(_RemoteRows):
    """``torch.nn.EmbeddingBag`` (``sum`` / ``mean``) whose table lives on the parameter server.

    Args:
        client, table, dim, dtype: As :class:`RemoteEmbedding`.
        mode: ``"sum"`` or ``"mean"``.
        include_last_offset: As ``torch.nn.EmbeddingBag``: ``offsets`` has one more element,
            the end of the last bag (the CSR format).
        padding_idx: An id (>= 0) whose entries do not contribute to their bag (a ``mean``
            bag does not count them; a bag of padding only gives zeros) and whose row gets no
            gradient, as ``torch.nn.EmbeddingBag``'s ``padding_idx``. Its row is never pulled
            or pushed, so the server neither stores it nor advances its optimizer state.
            Negative values (counted from ``num_embeddings`` in torch) are refused: the module
            does not know the table's size.

    Forward ``(input, offsets=None, per_sample_weights=None)`` as ``torch.nn.EmbeddingBag``:
    ``input`` 1-D int64 ids with ``offsets`` (bag starts, 1-D, ``offsets[0] == 0``) ->
    (bags, dim); or ``input`` 2-D (bags of equal length) with ``offsets=None``.
    ``per_sample_weights`` (``input``'s shape, the module's ``dtype``) scales each entry before
    the sum (``mode="sum"`` only). Semantics of ``torch.nn.functional.embedding_bag``; empty
    bags give zeros. Torch checks the arguments (on a one-column stand-in of the rows) before
    any row is pulled, so a call torch refuses raises torch's own error (NotImplementedError
    for ``per_sample_weights`` with ``mode="mean"``, ValueError for a wrong shape) and touches
    no server.

    Raises:
        InvalidArgument: a mode other than ``sum``/``mean``, or a negative or non-integer
            ``padding_idx`` (INVALID_ARGUMENT).
    """

    def __init__(
        self,
        client: RowsClient,
        table: str,
        dim: int,
        *,
        mode: str = "mean",
        dtype: torch.dtype = torch.float32,
        include_last_offset: bool = False,
        padding_idx: int | None = None,
    ) -> None:
        if mode not in ("sum", "mean"):
            raise InvalidArgument(f"RemoteEmbeddingBag mode must be 'sum' or 'mean', got {mode!r}")
        if padding_idx is not None and (
            isinstance(padding_idx, bool) or not isinstance(padding_idx, int) or padding_idx < 0
        ):
            raise InvalidArgument(
                f"RemoteEmbeddingBag padding_idx must be an id >= 0 or None, got {padding_idx!r}"
            )
        super().__init__(client, table, dim, dtype=dtype)
        self.mode = mode
        self.include_last_offset = include_last_offset
        self.padding_idx = padding_idx
        self._skip_id = padding_idx

    def forward(
        self,
        input: torch.Tensor,  # torch.nn.EmbeddingBag.forward's name
        offsets: torch.Tensor | None = None,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        uniq, local, skip = self._local(input)

        def bag(weight: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.embedding_bag(
                local,
                weight,
                offsets,
                mode=self.mode,
                per_sample_weights=per_sample_weights,
                include_last_offset=self.include_last_offset,
                padding_idx=skip,
            )

        with torch.no_grad():  # torch's own argument checks, before any row is pulled
            bag(torch.zeros((uniq.shape[0], 1), dtype=self.dtype))
        return bag(self._weight(uniq, skip))
