"""Row calls on several shards: each call split by the ids' home shards, sent to every shard
at once and merged back in the caller's order (what
:class:`~paramserver.worker_client.sharded.ShardedWorkerClient` runs its row calls through)."""

from __future__ import annotations

from collections.abc import Awaitable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, TypeVar, Unpack

import numpy as np
import numpy.typing as npt
from numpy.typing import ArrayLike

from paramserver.core.tables import TableSpec, shard_of_ids
from paramserver.worker_client.embedding import (
    RowPushAck,
    ValidatedRows,
    _sum_acks,
    check_ids,
    check_ids_many,
    check_rows,
    check_rows_many,
)
from paramserver.worker_client.keyed import TableIds
from paramserver.worker_client.options import PullRowsManyOptions, ValidatedPullOptions

if TYPE_CHECKING:
    from paramserver.worker_client.client import WorkerClient

T = TypeVar("T")


class FanOut(Protocol):
    """Runs {shard: awaitable} concurrently, collecting every outcome before raising (the
    sharded client's ``_fan_out``)."""

    def __call__(self, calls: Mapping[int, Awaitable[T]], /) -> Awaitable[dict[int, T]]: ...


def _in_order(
    n: int, parts: Sequence[npt.NDArray[np.int64]], got: Mapping[int, np.ndarray]
) -> np.ndarray:
    """The (n, dim) rows of the caller's n ids from the shards' answers: ``got[i]`` holds the
    rows of the ids at positions ``parts[i]`` (at least one shard answered)."""
    first = next(iter(got.values()))
    out = np.empty((n, first.shape[1]), first.dtype)
    for i, rows in got.items():
        out[parts[i]] = rows
    return out


async def _rows_of(call: Awaitable[tuple[RowPushAck, np.ndarray]]) -> np.ndarray:
    return (await call)[1]


async def _no_rows(call: Awaitable[RowPushAck]) -> None:
    await call


class ShardedTables:
    """Row calls over S shard clients: split by ``hash64(table, id) mod S``, call concurrently,
    reassemble in the caller's order.

    Args:
        shards: One table-capable client per shard, in shard-map order.
        fan_out: Runs {shard: awaitable} concurrently, collecting every outcome before raising
            (the cluster client's).
    """

    def __init__(self, shards: list[WorkerClient], fan_out: FanOut) -> None:
        self.shards = shards
        self.fan_out = fan_out

    def split(self, table: str, ids: npt.NDArray[np.int64]) -> list[npt.NDArray[np.int64]]:
        """Positions of ``ids`` per shard (int64 arrays; empty for a shard with none)."""
        shard = shard_of_ids(table, ids, len(self.shards))
        order = np.argsort(shard, kind="stable")
        counts = np.bincount(shard, minlength=len(self.shards))
        return np.split(order, np.cumsum(counts)[:-1])

    async def init_table(self, spec: TableSpec) -> tuple[bool, TableSpec]:
        got = await self.fan_out({i: c.init_table(spec) for i, c in enumerate(self.shards)})
        return any(g[0] for g in got.values()), got[0][1]

    async def pull_rows(
        self, table: str, ids: ArrayLike, *, timeout_s: float | None, observer: bool
    ) -> np.ndarray:
        arr = check_ids(ids)
        parts = self.split(table, arr)

        def pull(shard: int, part: npt.NDArray[np.int64]) -> Awaitable[np.ndarray]:
            return self.shards[shard].pull_rows(table, part, timeout_s=timeout_s, observer=observer)

        got = await self.fan_out(
            {i: pull(i, arr[pos]) for i, pos in enumerate(parts) if pos.shape[0]}
        )
        if not got:  # no ids: ask one shard for the table's dim and dtype
            return np.asarray(await pull(0, arr))
        return _in_order(arr.shape[0], parts, got)

    async def push_rows(
        self, table: str, ids: ArrayLike, grads: ArrayLike, request_id: int
    ) -> RowPushAck:
        arr = check_ids(ids)
        rows = check_rows(grads, arr.shape[0])
        parts = self.split(table, arr)
        calls = {
            i: self.shards[i]._push_rows_as(table, arr[pos], rows[pos], request_id, None)
            for i, pos in enumerate(parts)
            if pos.shape[0]
        }
        if not calls:
            return _sum_acks(())
        return _sum_acks((await self.fan_out(calls)).values())

    async def push_pull_rows(
        self,
        table: str,
        push_ids: ArrayLike,
        grads: ArrayLike,
        pull_ids: ArrayLike,
        request_id: int,
        timeout_s: float | None = None,
    ) -> np.ndarray:
        """Push ids and pull ids split by shard; one call per shard, all concurrently: a
        push-then-pull on a shard with both, a push or a pull on one with either (so each
        shard sees exactly what push_rows then pull_rows would send it); the rows in
        ``pull_ids``' order. Every shard's push carries ``request_id``."""
        arr = check_ids(push_ids)
        rows = check_rows(grads, arr.shape[0])
        pull = check_ids(pull_ids)
        pushes = self.split(table, arr)
        pulls = self.split(table, pull)
        calls: dict[int, Awaitable[np.ndarray | None]] = {}
        for i, shard in enumerate(self.shards):
            p, q = pushes[i], pulls[i]
            if p.shape[0] and q.shape[0]:
                calls[i] = _rows_of(
                    shard._push_pull_rows_as(table, arr[p], rows[p], pull[q], request_id, timeout_s)
                )
            elif p.shape[0]:
                calls[i] = _no_rows(shard._push_rows_as(table, arr[p], rows[p], request_id, None))
            elif q.shape[0]:
                calls[i] = shard.pull_rows(table, pull[q], timeout_s=timeout_s)
        got = {i: r for i, r in (await self.fan_out(calls)).items() if r is not None}
        if not got:  # no ids to pull: ask one shard for the table's dim and dtype
            return np.asarray(await self.shards[0].pull_rows(table, pull, timeout_s=timeout_s))
        return _in_order(pull.shape[0], pulls, got)

    async def pull_rows_many(
        self, ids: TableIds, **options: Unpack[PullRowsManyOptions]
    ) -> dict[str, np.ndarray]:
        """Every table's ids split by shard; one several-table request per shard, all
        concurrently; rows reassembled per table in the caller's order."""
        arrays = check_ids_many(ids)
        parts = {t: self.split(t, a) for t, a in arrays.items()}
        calls: dict[int, Awaitable[dict[str, np.ndarray]]] = {}
        # The row cache's counts are reported to one shard only (no double count).
        rest: PullRowsManyOptions = {**options, "cache_counts": None}
        for i, shard in enumerate(self.shards):
            if any(parts[t][i].shape[0] for t in arrays):
                calls[i] = shard.pull_rows_many(
                    {t: a[parts[t][i]] for t, a in arrays.items()}, **(rest if calls else options)
                )
        if not calls:  # no ids at all: ask one shard for every table's dim and dtype
            return await self.shards[0].pull_rows_many(arrays, **rest)
        got = await self.fan_out(calls)
        return {
            t: _in_order(a.shape[0], parts[t], {i: rows[t] for i, rows in got.items()})
            for t, a in arrays.items()
        }

    async def pull_rows_validated(
        self,
        ids: Mapping[str, npt.NDArray[np.int64]],
        held: Mapping[str, npt.NDArray[np.int64]],
        **options: Unpack[ValidatedPullOptions],
    ) -> dict[str, ValidatedRows]:
        """Every table's ids and held versions split by shard; one version-validated
        request per shard, all concurrently; each table's answers merged in the caller's
        order (``epoch_changed`` if any shard's changed)."""
        arrays = check_ids_many(ids)
        parts = {t: self.split(t, a) for t, a in arrays.items()}
        # The row cache's counts are reported to one shard only (no double count).
        rest: ValidatedPullOptions = {**options, "cache_counts": None}
        calls: dict[int, Awaitable[dict[str, ValidatedRows]]] = {}
        for i, shard in enumerate(self.shards):
            if any(parts[t][i].shape[0] for t in arrays):
                calls[i] = shard.pull_rows_validated(
                    {t: a[parts[t][i]] for t, a in arrays.items()},
                    {t: np.asarray(held[t], np.int64)[parts[t][i]] for t in arrays},
                    **(rest if calls else options),
                )
        if not calls:  # no ids at all: ask one shard for every table's dim and dtype
            return await self.shards[0].pull_rows_validated(arrays, held, **options)
        got = await self.fan_out(calls)
        out: dict[str, ValidatedRows] = {}
        for t, a in arrays.items():
            mask = np.zeros(a.shape[0], bool)
            where, rows, versions = [], [], []
            for i, answer in got.items():
                one = answer[t]
                pos = parts[t][i]
                mask[pos] = one.resent
                where.append(pos[one.resent])
                rows.append(one.rows)
                versions.append(one.versions)
            at = np.concatenate(where)
            order = np.argsort(at, kind="stable")
            out[t] = ValidatedRows(
                mask,
                np.concatenate(rows)[order],
                np.concatenate(versions)[order],
                any(answer[t].epoch_changed for answer in got.values()),
            )
        return out

    async def push_rows_many(
        self, ids: TableIds, grads: Mapping[str, ArrayLike], request_id: int
    ) -> dict[str, RowPushAck]:
        """Every table's ids and rows split by shard; one several-table push per shard, all
        concurrently, every table in every shard's request (possibly with no ids) so that a
        table carries request id ``request_id`` + its position on every shard."""
        arrays = check_ids_many(ids)
        rows = check_rows_many(arrays, grads)
        parts = {t: self.split(t, a) for t, a in arrays.items()}
        calls = {}
        for i, shard in enumerate(self.shards):
            if any(parts[t][i].shape[0] for t in arrays):
                calls[i] = shard._push_rows_many_as(
                    {t: a[parts[t][i]] for t, a in arrays.items()},
                    {t: rows[t][parts[t][i]] for t in arrays},
                    request_id,
                    None,
                )
        got = await self.fan_out(calls) if calls else {}
        return {
            t: _sum_acks([g[t] for i, g in got.items() if parts[t][i].shape[0]]) for t in arrays
        }
