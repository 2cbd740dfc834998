"""A worker-side hot-row cache with a staleness bound (HET: Miao et al., "HET: Scaling out Huge
Embedding Model Training via Cache-enabled Distributed Framework", VLDB 2022).

With Zipf-distributed ids most rows a batch pulls are the same hot rows as the batch before.
:class:`RowCache` wraps a worker client (the async one: ``connect``, or a sharded cluster
client) and keeps the rows it pulled, each with its **version**: the server counts, per
stored row, the pushes applied to it (HET's per-embedding clock; 0 for a row never pushed),
and sends a row's version with the row. With a bound s >= 1:

* **Read staleness.** Every read is one version-validated pull (``PullRowsMany`` with
  ``row_versions``, one request per shard): each id goes with the version the cache holds
  (16 bytes an id instead of 8), and the server, at the moment it reads the rows and after
  the table's consistency wait, sends back only the rows the cache must replace: not held,
  or held at a version ``h`` with ``V - h > s`` (or ``< 0``) for the server's version ``V``,
  or of another version epoch (a shard restart or an expiry sweep that dropped rows). Every
  other row is served from the cache: it is at most s pushes behind the server's row *at the
  time of the read*.
* **Write staleness.** Gradients of clock p are summed locally per (table, id) and pushed
  (one several-table request per shard) at the latest by the :meth:`RowCache.clock` that ends
  clock ``p + s``. Of an ``sgd`` table (asp or ssp, no frequency filter) the pushed sum is
  then applied to the cached copies (``w -= lr * g`` in float32, as the server's rule: HET's
  local updates of cached embeddings) and their versions advanced by one, so the worker reads
  its own flushed updates and they do not count against the bound; of another rule the copy
  is left as it was, and the worker's own pushes count as pushes the copy lacks.

**Guarantee.** For s >= 1 a row read at any moment is, for the server's row of version V at
that moment: the server's row of some version ``h`` with ``V - s <= h <= V``; or, of an sgd
table, such a row plus this worker's own later pushes applied locally, where ``V - h`` minus
those own pushes is at most s (the copy lacks at most s pushes of other workers; the same
additions in another order, so equal up to float rounding). Not yet in it: this worker's own
gradients not yet flushed (at most s clocks of them). Deferred gradients are summed before
they are pushed, so the table's rule sees one push of their sum per flush instead of one
push per batch (the same update for ``sgd`` up to float rounding; a different trajectory for
adaptive rules). **s = 0 is exact:** the cache keeps nothing and defers nothing; every read
is a plain pull and every push is sent at once, so training is bit for bit that of the client
it wraps.

Usage::

    async with connect(address, worker_name="w0") as ps:
        cache = RowCache(ps, staleness=2)
        rows = await cache.pull_rows("items", ids)        # unchanged hot rows not re-sent
        await cache.push_rows("items", ids, grads)        # summed locally
        await cache.clock()                               # flushes what reached the bound
        cache.stats.hit_rate

Only this worker's reads are cached; a table's server-side consistency (asp, ssp, bsp) applies
to every pull the cache makes. The server's ``Status`` shows per table the rows the cache
requested and hit (``cache_rows_*``: counted by the server from each validated pull; at s = 0
each pull reports its rows, none hit).
With a bsp table use s = 0 (a deferred push would miss its step). The cache keeps every row it
has read (its memory grows with the distinct ids this worker reads).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, Unpack

import numpy as np
import numpy.typing as npt
from numpy.typing import ArrayLike

from paramserver.api.v1 import parameter_server_pb2 as pb
from paramserver.errors import InvalidArgument
from paramserver.protocol import rows_wire
from paramserver.worker_client.embedding import (
    RowPushAck,
    ValidatedRows,
    check_ids,
    check_ids_many,
    check_rows,
)
from paramserver.worker_client.keyed import TableIds
from paramserver.worker_client.options import PullRowsManyOptions, ValidatedPullOptions

__all__ = ["CacheStats", "RowCache", "RowClient"]


class RowClient(Protocol):
    """What a :class:`RowCache` uses of the client it wraps (an async client: ``connect``)."""

    @property
    def clock_value(self) -> int: ...

    async def pull_rows_many(
        self, ids: TableIds, **options: Unpack[PullRowsManyOptions]
    ) -> dict[str, np.ndarray]: ...

    async def pull_rows_validated(
        self,
        ids: Mapping[str, npt.NDArray[np.int64]],
        held: Mapping[str, npt.NDArray[np.int64]],
        **options: Unpack[ValidatedPullOptions],
    ) -> dict[str, ValidatedRows]: ...

    async def push_rows_many(
        self, ids: TableIds, grads: Mapping[str, ArrayLike], *, timeout_s: float | None = None
    ) -> dict[str, RowPushAck]: ...

    async def status(self) -> pb.StatusResponse: ...

    async def clock(self) -> int: ...


@dataclass
class CacheStats:
    """Counters of a :class:`RowCache` (rows are counted per distinct id of a read).

    Attributes:
        rows_requested: Distinct rows the caller read.
        rows_hit: Of those, rows served from the cache.
        rows_pulled: Rows pulled over the wire.
        rows_pushed: Gradient rows pushed over the wire (after summing per id).
        flushes: Pushes of deferred gradients.
        rows_validated: Cached rows whose version went to the server for validation (each
            costs 8 bytes of version beside its id, instead of a row coming back).
    """

    rows_requested: int = 0
    rows_hit: int = 0
    rows_pulled: int = 0
    rows_pushed: int = 0
    flushes: int = 0
    rows_validated: int = 0

    @property
    def hit_rate(self) -> float:
        """Share of distinct rows read that the cache served (0 when nothing was read)."""
        return self.rows_hit / self.rows_requested if self.rows_requested else 0.0


@dataclass
class _TableCache:
    """One table's cached rows, sorted by id, with the version of each; and its deferred
    gradients (per clock, not yet summed)."""

    ids: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, np.int64))
    rows: np.ndarray | None = None
    versions: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, np.int64))
    pending: list[tuple[npt.NDArray[np.int64], np.ndarray]] = field(default_factory=list)
    oldest_pending: int | None = None

    def lookup(self, uniq: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Positions of ``uniq`` (sorted, distinct) among the cached ids; -1 where absent."""
        n = self.ids.shape[0]
        if n == 0:
            return np.full(uniq.shape[0], -1, np.int64)
        pos = np.searchsorted(self.ids, uniq)
        pos_c = np.minimum(pos, n - 1)
        ok = (pos < n) & (self.ids[pos_c] == uniq)
        return np.where(ok, pos_c, -1)

    def store(
        self, new_ids: npt.NDArray[np.int64], new_rows: np.ndarray, versions: npt.NDArray[np.int64]
    ) -> None:
        """Insert or replace rows (``new_ids`` sorted, distinct) with their versions; rows of
        an unknown version (-1) are not kept."""
        known = versions >= 0
        new_ids, new_rows, versions = new_ids[known], new_rows[known], versions[known]
        if self.rows is None or self.ids.shape[0] == 0:
            self.ids = new_ids.copy()
            self.rows = np.array(new_rows)
            self.versions = versions.copy()
            return
        keep = ~np.isin(self.ids, new_ids, assume_unique=True)
        ids = np.concatenate([self.ids[keep], new_ids])
        rows = np.concatenate([self.rows[keep], new_rows])
        vers = np.concatenate([self.versions[keep], versions])
        order = np.argsort(ids, kind="stable")
        self.ids, self.rows, self.versions = ids[order], rows[order], vers[order]

    def clear(self) -> None:
        """Drop every cached row (deferred gradients stay)."""
        self.ids = np.zeros(0, np.int64)
        self.rows = None
        self.versions = np.zeros(0, np.int64)

    def apply_sgd(self, ids: npt.NDArray[np.int64], grads: np.ndarray, lr: float) -> None:
        """``w -= lr * g`` on the cached copies of ``ids`` (sorted, distinct) that are held,
        in float32, rounded once to the rows' dtype (as the server's sgd rule), and their
        versions advanced by one (the push the server applied)."""
        assert self.rows is not None
        n = self.ids.shape[0]
        pos = np.minimum(np.searchsorted(self.ids, ids), n - 1)
        held = self.ids[pos] == ids
        at = pos[held]
        w = self.rows[at].astype(np.float32)
        w -= np.float32(lr) * np.asarray(grads, np.float32)[held]
        self.rows[at] = w.astype(self.rows.dtype)
        self.versions[at] += 1


def _coalesce(
    parts: list[tuple[npt.NDArray[np.int64], np.ndarray]],
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]:
    """Distinct ids (sorted) and their float32 gradient rows summed in arrival order."""
    ids = np.concatenate([p[0] for p in parts])
    grads = np.concatenate([np.asarray(p[1], dtype=np.float32) for p in parts])
    uniq, inverse = np.unique(ids, return_inverse=True)
    out = np.zeros((uniq.shape[0], grads.shape[1]), np.float32)
    np.add.at(out, inverse, grads)
    return uniq, out


class RowCache:
    """Worker-side row cache with staleness bound ``s`` over an async worker client.

    Args:
        client: The async client (``connect``): ``pull_rows_many``, ``push_rows_many``,
            ``clock`` and ``clock_value``.
        staleness: The bound s in clocks (0: exact, nothing cached or deferred).

    Raises:
        InvalidArgument: a negative staleness (INVALID_ARGUMENT).
    """

    def __init__(self, client: RowClient, staleness: int) -> None:
        if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0:
            raise InvalidArgument(f"RowCache staleness must be an int >= 0, got {staleness!r}")
        self.client = client
        self.staleness = staleness
        self.stats = CacheStats()
        self._tables: dict[str, _TableCache] = {}
        #: table -> lr of an sgd table (asp or ssp, no frequency filter: flushed sums are
        #: applied to the cached copies), None otherwise; learned from the server's Status at
        #: the first flush of a table.
        self._sgd_lr: dict[str, float | None] = {}
        #: table -> [rows requested, rows hit] not yet reported to the server (the counts
        #: travel with the cache's next pull of the table: Status' cache hit rate).
        self._unreported: dict[str, list[int]] = {}

    @property
    def clock_value(self) -> int:
        """The worker's clock (the wrapped client's)."""
        return int(self.client.clock_value)

    # ------------------------------------------------------------------ reads
    async def pull_rows(
        self, table: str, ids: ArrayLike, *, timeout_s: float | None = None
    ) -> np.ndarray:
        """As the client's ``pull_rows``, served from the cache within the bound."""
        return (await self.pull_rows_many({table: ids}, timeout_s=timeout_s))[table]

    async def pull_rows_many(
        self, ids: TableIds, *, timeout_s: float | None = None
    ) -> dict[str, np.ndarray]:
        """As the client's ``pull_rows_many``: one version-validated request per shard; rows
        within the bound served from the cache, the others sent by the server and cached."""
        arrays = check_ids_many(ids)
        s = self.staleness
        if s == 0:  # exact: every distinct row pulled now, nothing kept
            split = {t: np.unique(a, return_inverse=True) for t, a in arrays.items()}
            for t, (u, _) in split.items():
                self._count(t, int(u.shape[0]), 0)
            got = await self._pull({t: u for t, (u, _) in split.items()}, timeout_s)
            for u, _ in split.values():
                self.stats.rows_requested += int(u.shape[0])
                self.stats.rows_pulled += int(u.shape[0])
            return {t: np.asarray(got[t])[inv.reshape(-1)] for t, (_, inv) in split.items()}
        held: dict[str, npt.NDArray[np.int64]] = {}
        plans = {}
        for t, a in arrays.items():
            uniq, inverse = np.unique(a, return_inverse=True)
            cache = self._tables.setdefault(t, _TableCache())
            pos = cache.lookup(uniq)
            held[t] = np.full(uniq.shape[0], -1, np.int64)
            held[t][pos >= 0] = cache.versions[pos[pos >= 0]]
            plans[t] = (uniq, inverse, pos)
        # (the server counts a validated read's requested and hit rows itself: no report)
        answers = await self.client.pull_rows_validated(
            {t: plan[0] for t, plan in plans.items()}, held, max_version_lag=s, timeout_s=timeout_s
        )
        out: dict[str, np.ndarray] = {}
        for t, (uniq, inverse, pos) in plans.items():
            cache = self._tables[t]
            answer = answers[t]
            sent = answer.resent
            fresh = np.asarray(answer.rows)
            rows = np.empty((uniq.shape[0], fresh.shape[1]), fresh.dtype)
            kept = ~sent
            if kept.any():
                assert cache.rows is not None and bool((pos[kept] >= 0).all())
                rows[kept] = cache.rows[pos[kept]]
            rows[sent] = fresh
            if answer.epoch_changed:  # held rows of another epoch: keep none of them
                cache.clear()
            cache.store(uniq[sent], fresh, answer.versions)
            n, hit = int(uniq.shape[0]), int(kept.sum())
            self.stats.rows_requested += n
            self.stats.rows_hit += hit
            self.stats.rows_pulled += n - hit
            self.stats.rows_validated += int((pos >= 0).sum())
            out[t] = rows[inverse.reshape(-1)]
        return out

    def _count(self, table: str, requested: int, hit: int) -> None:
        counts = self._unreported.setdefault(table, [0, 0])
        counts[0] += requested
        counts[1] += hit

    async def _pull(
        self, ids: dict[str, npt.NDArray[np.int64]], timeout_s: float | None
    ) -> dict[str, np.ndarray]:
        """The client's ``pull_rows_many`` carrying the unreported counts of its tables."""
        report = {t: (c[0], c[1]) for t, c in self._unreported.items() if t in ids and c[0]}
        got = await self.client.pull_rows_many(ids, cache_counts=report, timeout_s=timeout_s)
        for t in report:
            del self._unreported[t]
        return got

    # ------------------------------------------------------------------ writes
    async def push_rows(
        self, table: str, ids: ArrayLike, grads: ArrayLike, *, timeout_s: float | None = None
    ) -> RowPushAck | None:
        """As the client's ``push_rows``; deferred (summed locally) when s >= 1, then None
        (``timeout_s`` is taken as the client's signature has it, and not used)."""
        arr = check_ids(ids)
        got = await self.push_rows_many({table: arr}, {table: check_rows(grads, arr.shape[0])})
        return None if got is None else got[table]

    async def push_rows_many(
        self, ids: TableIds, grads: Mapping[str, ArrayLike], *, timeout_s: float | None = None
    ) -> dict[str, RowPushAck] | None:
        """As the client's ``push_rows_many`` at s = 0; for s >= 1 the gradients are kept,
        summed per id at the flush, and pushed by :meth:`clock` within the bound (returns
        None)."""
        if self.staleness == 0:
            arrays = check_ids_many(ids)
            acks = await self.client.push_rows_many(arrays, grads, timeout_s=timeout_s)
            self.stats.rows_pushed += sum(int(np.unique(a).shape[0]) for a in arrays.values())
            return acks
        arrays = check_ids_many(ids)
        if set(grads) != set(arrays):
            raise InvalidArgument(
                f"gradients for tables {sorted(grads)}, ids for tables {sorted(arrays)}"
            )
        clock = self.clock_value
        for t, a in arrays.items():
            g = check_rows(grads[t], a.shape[0])
            if not np.isfinite(g).all():  # refused now, as the server would, not at the flush
                raise InvalidArgument(f"table {t!r}: NaN or Inf in a gradient row")
            cache = self._tables.setdefault(t, _TableCache())
            cache.pending.append((a.copy(), np.array(g, dtype=np.float32)))
            if cache.oldest_pending is None:
                cache.oldest_pending = clock
        return None

    async def _learn_rules(self, tables: list[str]) -> None:
        """Which of ``tables`` are sgd tables, and their lr (one Status call when any is new)."""
        if all(t in self._sgd_lr for t in tables):
            return
        status = await self.client.status()
        for info in status.tables:
            spec = rows_wire.spec_from_proto(info.spec)
            local = spec.rule.kind == "sgd" and spec.consistency != "bsp" and spec.min_pushes <= 1
            self._sgd_lr[spec.name] = float(spec.rule.lr) if local else None
        for t in tables:
            self._sgd_lr.setdefault(t, None)

    async def flush(self) -> dict[str, RowPushAck]:
        """Push every deferred gradient now (one several-table request per shard); the cached
        rows of the pushed ids stay, an sgd table's with the pushed sum applied and their
        versions advanced by one (only when the server applied it: not queued, nothing
        filtered)."""
        ids: dict[str, npt.NDArray[np.int64]] = {}
        grads: dict[str, np.ndarray] = {}
        for t, cache in self._tables.items():
            if cache.pending:
                ids[t], grads[t] = _coalesce(cache.pending)
        if not ids:
            return {}
        await self._learn_rules(list(ids))
        acks = await self.client.push_rows_many(ids, grads)
        self.stats.flushes += 1
        for t, u in ids.items():
            cache = self._tables[t]
            cache.pending = []
            cache.oldest_pending = None
            self.stats.rows_pushed += int(u.shape[0])
            lr = self._sgd_lr.get(t)
            ack = acks[t]
            applied_once = not ack.queued and ack.filtered == 0
            if lr is not None and applied_once and cache.rows is not None and cache.ids.shape[0]:
                cache.apply_sgd(u, grads[t], lr)
        return acks

    # ------------------------------------------------------------------ clock
    async def clock(self) -> int:
        """End the iteration: push deferred gradients that reached the bound (those of clock
        p at the clock ending p + s), then the client's ``clock``."""
        ending = self.clock_value
        s = self.staleness
        # Every deferred gradient goes in one flush (the oldest decides), so none waits past
        # its bound and one request per shard carries them all.
        if s and any(
            c.oldest_pending is not None and ending >= c.oldest_pending + s
            for c in self._tables.values()
        ):
            await self.flush()
        return await self.client.clock()
