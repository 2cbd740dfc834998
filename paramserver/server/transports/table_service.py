"""Embedding-table RPCs of a shard (InitTable, PullRows, PushRows, PushPullRows, and
PullRowsMany / PushRowsMany over several tables): decode, call, encode.

Kept apart from the dense push path. A shard serves only the ids it owns: a pull or push with
an id of another shard (``hash64(table, id) mod S``, :func:`check_owned`) is refused
(FAILED_PRECONDITION, WrongShard) before anything else happens. A row push follows the durable
order: validate fully (:meth:`TableSet.prepare`, changes nothing), append its WAL record (none
for a push of no ids, which changes nothing), apply it
(:meth:`TableSet.commit`, no await in between, so the log order is the apply order), wait
until the record is durable, then acknowledge. A refused request changes nothing, in memory or
on disk. The servicer's error decorator turns refusals into status codes.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from paramserver.api.v1 import tables_pb2 as tpb
from paramserver.api.v1 import tensor_pb2
from paramserver.core.table_set import RowPushOutcome, TableSet
from paramserver.core.tables import EmbeddingTable
from paramserver.errors import (
    DimensionMismatch,
    InvalidArgument,
    MalformedStream,
    StorageError,
    StorageFull,
)
from paramserver.protocol import rows_wire, tensor
from paramserver.protocol.table_spec import TableSpec, check_owned
from paramserver.security.tokens import check_worker_identity
from paramserver.server import wal_records
from paramserver.server.engine import LogFn, ServerEngine

logger = logging.getLogger(__name__)

__all__ = ["RATE_WINDOW_S", "PullChecked", "TableRates", "TableRpcs", "table_infos"]

#: Expiry sweeps of a table run at most this often (seconds), after a push.
EXPIRY_SWEEP_INTERVAL_S = 1.0

_Header = TypeVar("_Header", covariant=True)


class _RowStreamMessage(Protocol[_Header]):
    """One message of a row request stream (``PullRowsRequest``, ``PushRowsRequest``,
    ``PushPullRowsRequest``, ``PullRowsManyRequest``, ``PushRowsManyRequest``): its header
    first, then its chunks."""

    @property
    def header(self) -> _Header: ...

    @property
    def chunk(self) -> rows_wire.RowsChunkLike: ...

    def WhichOneof(self, oneof_group: Literal["body"]) -> str | None: ...


@dataclass(frozen=True, slots=True)
class PullChecked:
    """A row pull that passed its checks (:meth:`TableRpcs.check_pull`): its header, table
    and validated int64 ids."""

    header: tpb.RowsHeader
    table: EmbeddingTable
    ids: np.ndarray


class TableRpcs:
    """The table handlers over one :class:`ServerEngine` (the servicer delegates to them)."""

    def __init__(self, engine: ServerEngine) -> None:
        self.engine = engine
        self._last_sweep: dict[str, tuple[float, int]] = {}
        #: Row rates per table (rows pulled and pushed per second, for Status).
        self.rates = TableRates()
        #: table -> [rows requested, rows hit] reported by workers' row caches.
        self.cache_counts: dict[str, list[int]] = {}
        #: This shard's index and the cluster's shard count (which ids it owns).
        self.shard_index = int(engine.config.shard_index)
        self.num_shards = int(engine.config.num_shards)

    @property
    def tables(self) -> TableSet:
        return self.engine.core.tables

    # ------------------------------------------------------------------ InitTable
    async def init_table(self, request: tpb.InitTableRequest) -> tpb.InitTableResponse:
        spec = rows_wire.spec_from_proto(request.spec)
        tables = self.tables

        def decide(log: LogFn) -> tuple[bool, TableSpec]:
            # built and checked, then logged, then installed (a no-op logs nothing)
            return tables.init(spec, log=lambda: log(wal_records.init_table(spec)))

        created, stored = await self.engine.mutate(decide)
        if created:
            logger.info("table %r declared: %s", spec.name, spec.to_dict())
        return tpb.InitTableResponse(created=created, spec=rows_wire.spec_to_proto(stored))

    # ------------------------------------------------------------------ helpers
    def _check_header(
        self, header: tpb.RowsHeader, *, push: bool, n: int | None = None
    ) -> EmbeddingTable:
        table = self.tables.get(header.table)
        spec = table.spec
        where = f"table {spec.name!r}"
        n = int(header.num_ids) if n is None else n
        limits = table.limits
        if n > limits.max_ids:
            raise InvalidArgument(
                f"{where}: {n} ids in one request exceed the server's limit of {limits.max_ids}"
            )
        row_bytes = spec.dim * spec.np_dtype.itemsize
        if n * row_bytes > limits.max_bytes:
            raise InvalidArgument(
                f"{where}: {n} rows ({n * row_bytes} bytes) exceed the server's limit of "
                f"{limits.max_bytes} bytes per request"
            )
        if push:
            if not header.worker_id:
                raise InvalidArgument(f"{where}: a row push needs a worker_id")
            if header.dim != spec.dim:
                raise DimensionMismatch(
                    f"{where}: gradient rows of dim {header.dim}, the table's dim is {spec.dim}"
                )
        return table

    def _check_ids(self, table: EmbeddingTable, ids: np.ndarray) -> np.ndarray:
        """Validated int64 ids that this shard owns (changes nothing).

        Raises:
            InvalidArgument: bad ids (INVALID_ARGUMENT). WrongShard: an id another shard owns
                (FAILED_PRECONDITION).
        """
        checked = table.check_ids(ids)
        check_owned(table.spec.name, checked, self.shard_index, self.num_shards)
        return checked

    @staticmethod
    async def _read(
        request_iterator: AsyncIterator[_RowStreamMessage[_Header]],
    ) -> tuple[_Header, AsyncIterator[_RowStreamMessage[_Header]]]:
        it = request_iterator.__aiter__()
        try:
            first = await it.__anext__()
        except StopAsyncIteration:
            raise MalformedStream("empty row stream: no header") from None
        if first.WhichOneof("body") != "header":
            raise MalformedStream("a row stream must start with a RowsHeader")
        return first.header, it

    @staticmethod
    async def _chunks(
        it: AsyncIterator[_RowStreamMessage[_Header]],
        receiver: rows_wire.RowsReceiver | rows_wire.SegmentsReceiver,
        second_header: str,
    ) -> None:
        """Feeds every chunk after the header to ``receiver``; another header is refused
        (MalformedStream ``second_header``)."""
        async for msg in it:
            if msg.WhichOneof("body") != "chunk":
                raise MalformedStream(second_header)
            receiver.feed(msg.chunk)

    @staticmethod
    def _grad_dtype(
        table: EmbeddingTable, wire: tensor_pb2.DType.ValueType, what: str
    ) -> np.dtype[np.generic]:
        """The gradient rows' dtype of a push (``what``: its header or segment), which must
        name one the table takes.

        Raises:
            InvalidArgument: DTYPE_UNSPECIFIED or an unknown dtype. DTypeMismatch: a dtype
                the table does not take (:meth:`EmbeddingTable.check_grad_dtype`).
        """
        where = f"table {table.spec.name!r}"
        if wire == tensor_pb2.DTYPE_UNSPECIFIED:
            raise InvalidArgument(
                f"{where}: {what} needs the gradient rows' dtype (FLOAT32 or the table's "
                "dtype), got DTYPE_UNSPECIFIED"
            )
        dtype = tensor.dtype_from_wire(wire, where)
        table.check_grad_dtype(dtype)
        return dtype

    async def _wait_rows(self, worker_id: str, table: str, timeout_ms: int) -> None:
        engine = self.engine
        wait_ms = timeout_ms or engine.config.wait_timeout_ms
        await engine.wait_admitted(
            lambda: self.tables.check_pull(engine.core.cluster, worker_id, table),
            f"row pull by {worker_id!r}",
            wait_ms / 1000.0,
        )

    # ------------------------------------------------------------------ PullRows
    async def pull_rows(
        self, request_iterator: AsyncIterator[tpb.PullRowsRequest]
    ) -> AsyncIterator[tpb.PullRowsResponse | bytes]:
        header, it = await self._read(request_iterator)
        table = self._check_header(header, push=False)
        receiver = rows_wire.RowsReceiver(
            f"table {table.spec.name!r}", int(header.num_ids), 0, np.dtype(np.float32)
        )
        await self._chunks(it, receiver, f"{receiver.what}: a second header in one stream")
        ids, _ = receiver.finish()
        info, rows = await self.pull_decoded(header, ids)
        yield tpb.PullRowsResponse(info=info)
        for message in rows_wire.chunk_messages(None, rows):
            yield message  # a PullRowsResponse(chunk=...)'s wire bytes

    async def pull_decoded(
        self, header: tpb.RowsHeader, ids: np.ndarray
    ) -> tuple[tpb.PullRowsInfo, np.ndarray]:
        """A row pull of decoded ``ids`` (every transport shares it): checks, the table's
        consistency wait, then the rows. Returns (PullRowsInfo, rows (n, dim))."""
        return await self.pull_checked(self.check_pull(header, ids))

    def check_pull(self, header: tpb.RowsHeader, ids: np.ndarray) -> PullChecked:
        """A row pull's checks alone (identity, limits, ids, ownership; changes nothing).

        Raises:
            The pull's refusals, as :meth:`pull_decoded` raises them.
        """
        check_worker_identity(header.worker_id)
        table = self._check_header(header, push=False, n=int(ids.shape[0]))
        return PullChecked(header, table, self._check_ids(table, ids))

    async def pull_checked(self, pull: PullChecked) -> tuple[tpb.PullRowsInfo, np.ndarray]:
        """A checked row pull (:meth:`check_pull`): the table's consistency wait, then the
        rows. Returns (PullRowsInfo, rows (n, dim))."""
        header, table, checked = pull.header, pull.table, pull.ids
        await self._wait_rows(header.worker_id, table.spec.name, int(header.timeout_ms))
        self.rates.note(self.engine.now(), table)
        rows = table.pull(checked)
        spec = table.spec
        info = tpb.PullRowsInfo(
            dtype=tensor.dtype_to_wire(spec.np_dtype),
            dim=spec.dim,
            num_ids=int(checked.shape[0]),
            min_clock=self.engine.core.cluster.min_clock(),
        )
        return info, rows

    # ------------------------------------------------------------------ PushRows
    async def push_rows(
        self, request_iterator: AsyncIterator[tpb.PushRowsRequest]
    ) -> tpb.PushRowsResponse:
        header, it = await self._read(request_iterator)
        table = self._check_header(header, push=True)
        where = f"table {table.spec.name!r}"
        dtype = self._grad_dtype(table, header.dtype, "a PushRows header")
        receiver = rows_wire.RowsReceiver(where, int(header.num_ids), table.spec.dim, dtype)
        await self._chunks(it, receiver, f"{where}: a second header in one stream")
        ids, grads = receiver.finish()
        return await self.push_decoded(header, ids, grads)

    async def push_decoded(
        self, header: tpb.RowsHeader, ids: np.ndarray, grads: np.ndarray
    ) -> tpb.PushRowsResponse:
        """A row push of decoded arrays (every transport shares it): validate fully, log,
        apply, make durable, acknowledge. Returns the PushRowsResponse."""
        check_worker_identity(header.worker_id)
        table = self._check_header(header, push=True, n=int(ids.shape[0]))
        self._check_ids(table, ids)
        engine = self.engine
        logging_on = engine.wal is not None

        def decide(log: LogFn) -> RowPushOutcome:
            prepared = self.tables.prepare(
                engine.core.cluster,
                header.worker_id,
                int(header.request_id),
                int(header.clock),
                table.spec.name,
                ids,
                grads,
            )
            now = engine.now()
            if logging_on and prepared.duplicate is None and ids.shape[0]:
                # Refused (disk full, I/O error): nothing applied, the request id not recorded.
                log(wal_records.push_rows(prepared, header.worker_id, now))
            return self.tables.commit(prepared, now_s=now)

        self.rates.note(engine.now(), table)
        outcome = await engine.mutate(decide, duplicate=lambda o: bool(o.duplicate))
        await self._maybe_expire(table)
        r = outcome.result
        return tpb.PushRowsResponse(
            duplicate=outcome.duplicate,
            queued=outcome.queued,
            distinct=r.distinct,
            applied=r.applied,
            filtered=r.filtered,
            staleness=outcome.staleness,
        )

    # ------------------------------------------------------------------ PushPullRows
    async def push_pull_rows(
        self, request_iterator: AsyncIterator[tpb.PushPullRowsRequest]
    ) -> AsyncIterator[tpb.PushPullRowsResponse | bytes]:
        """PushPullRows: the push's ids and rows, then the pull's ids; one info (the push's
        result and the pull's) and the pulled rows."""
        fused, it = await self._read(request_iterator)
        header = fused.push
        table = self._check_header(header, push=True)
        where = f"table {table.spec.name!r}"
        dtype = self._grad_dtype(table, header.dtype, "a PushPullRows header")
        pull_n = int(fused.pull_num_ids)
        self._check_header(header, push=False, n=pull_n)  # the pull's limits, before its ids
        both = rows_wire.SegmentsReceiver(
            [
                rows_wire.RowsReceiver(where, int(header.num_ids), table.spec.dim, dtype),
                rows_wire.RowsReceiver(where, pull_n, 0, np.dtype(np.float32)),
            ]
        )
        await self._chunks(it, both, f"{where}: a second header in one PushPullRows stream")
        (ids, grads), (pull_ids, _) = both.finish()
        pushed, info, rows = await self.push_pull_decoded(header, ids, grads, pull_ids)
        yield tpb.PushPullRowsResponse(info=tpb.PushPullRowsInfo(pushed=pushed, pulled=info))
        for message in rows_wire.chunk_messages(None, rows):
            yield message  # a PushPullRowsResponse(chunk=...)'s wire bytes

    async def push_pull_decoded(
        self, header: tpb.RowsHeader, ids: np.ndarray, grads: np.ndarray, pull_ids: np.ndarray
    ) -> tuple[tpb.PushRowsResponse, tpb.PullRowsInfo, np.ndarray]:
        """A row push, then a row pull of the same table (every transport shares it): the
        pull's checks first (a refusal changes nothing), then the push exactly as
        :meth:`push_decoded` (refused: nothing applied, nothing pulled), then the pull
        exactly as :meth:`pull_decoded` (its wait from ``header.timeout_ms``), reading the
        rows after the push. Returns (PushRowsResponse, PullRowsInfo, rows (m, dim))."""
        pull = self.check_pull(self.pull_header(header), pull_ids)
        pushed = await self.push_decoded(header, ids, grads)
        info, rows = await self.pull_checked(pull)
        return pushed, info, rows

    @staticmethod
    def pull_header(push: tpb.RowsHeader) -> tpb.RowsHeader:
        """The pull's ``RowsHeader`` of a push-then-pull whose push header is ``push``: the
        same table and worker, the wait of ``push.timeout_ms``."""
        return tpb.RowsHeader(
            table=push.table, worker_id=push.worker_id, timeout_ms=push.timeout_ms
        )

    # ------------------------------------------------------------------ several tables
    def _segment_tables(self, header: tpb.RowsManyHeader, *, push: bool) -> list[EmbeddingTable]:
        """Every segment's table, checked as a single-table header (limits per table, a
        push's dim and worker id); a table named twice is refused (changes nothing)."""
        seen: set[str] = set()
        tables = []
        for seg in header.segments:
            if seg.table in seen:
                raise InvalidArgument(
                    f"table {seg.table!r} appears twice in one request; send its ids in one segment"
                )
            seen.add(seg.table)
            one = tpb.RowsHeader(
                table=seg.table, worker_id=header.worker_id, num_ids=seg.num_ids, dim=seg.dim
            )
            tables.append(self._check_header(one, push=push))
        return tables

    async def _read_many(
        self,
        request_iterator: AsyncIterator[_RowStreamMessage[tpb.RowsManyHeader]],
        *,
        push: bool,
    ) -> tuple[
        tpb.RowsManyHeader,
        list[EmbeddingTable],
        list[tuple[np.ndarray, np.ndarray]],
        list[np.ndarray | None],
    ]:
        """The header, every segment's table and (ids, rows), and each segment's held row
        versions (pulls with ``row_versions``; None otherwise)."""
        header, it = await self._read(request_iterator)
        tables = self._segment_tables(header, push=push)
        receivers = []
        for seg, table in zip(header.segments, tables, strict=True):
            where = f"table {table.spec.name!r}"
            if push:
                dtype = self._grad_dtype(table, seg.dtype, "a PushRowsMany segment")
                receivers.append(
                    rows_wire.RowsReceiver(where, int(seg.num_ids), table.spec.dim, dtype)
                )
            else:
                receivers.append(
                    rows_wire.RowsReceiver(
                        where,
                        int(seg.num_ids),
                        0,
                        np.dtype(np.float32),
                        with_versions=seg.row_versions,
                    )
                )
        many = rows_wire.SegmentsReceiver(receivers)
        await self._chunks(it, many, "a second header in one several-table stream")
        parts = many.finish()
        held = [r.versions if r.with_versions else None for r in receivers]
        return header, tables, parts, held

    async def pull_rows_many(
        self, request_iterator: AsyncIterator[tpb.PullRowsManyRequest]
    ) -> AsyncIterator[tpb.PullRowsManyResponse | bytes]:
        """PullRowsMany: every segment's ids, then one info and every segment's rows."""
        header, _, parts, held = await self._read_many(request_iterator, push=False)
        infos, rows, versions = await self.pull_many_decoded(
            header, [ids for ids, _ in parts], held
        )
        yield tpb.PullRowsManyResponse(info=tpb.PullRowsManyInfo(tables=infos))
        for block, vers in zip(rows, versions, strict=True):
            for message in rows_wire.chunk_messages(None, block, versions=vers):
                yield message  # a PullRowsManyResponse(chunk=...)'s wire bytes

    async def pull_many_decoded(
        self,
        header: tpb.RowsManyHeader,
        ids: list[np.ndarray],
        held: list[np.ndarray | None] | None = None,
    ) -> tuple[list[tpb.PullRowsInfo], list[np.ndarray], list[np.ndarray | None]]:
        """Rows of several tables: every id checked, every table's consistency wait, then
        every table read with no await in between (one moment of the shard). A segment
        with ``row_versions`` (``held``: the worker's versions, -1 none) gets only the rows
        whose held version is absent, of another epoch, ahead of the server's or more than
        ``max_version_lag`` behind it (:func:`resend_mask`), with their versions. Returns
        the ``PullRowsInfo``, rows and versions (None: a segment without versions) of each
        segment, in segment order."""
        check_worker_identity(header.worker_id)
        tables = self._segment_tables(header, push=False)
        checked = [self._check_ids(t, i) for t, i in zip(tables, ids, strict=True)]
        cluster = self.engine.core.cluster
        while True:  # until every table admits at one moment (no await between the checks)
            waiting = [
                t
                for t in tables
                if not self.tables.check_pull(cluster, header.worker_id, t.spec.name).admitted
            ]
            if not waiting:
                break
            await self._wait_rows(header.worker_id, waiting[0].spec.name, int(header.timeout_ms))
        self.engine.check_serving()
        now = self.engine.now()
        for t in tables:
            self.rates.note(now, t)
        held = held if held is not None else [None] * len(tables)
        resent: list[np.ndarray | None] = []
        versions: list[np.ndarray | None] = []
        for t, c, seg, h in zip(tables, checked, header.segments, held, strict=True):
            if h is None:
                resent.append(None)
                versions.append(None)
                continue
            current = t.versions(c)
            mask = resend_mask(
                h, current, int(seg.version_epoch) == t.version_epoch, int(seg.max_version_lag)
            )
            resent.append(mask)
            versions.append(current[mask])
        rows = [
            t.pull(c if m is None else c[m])
            for t, c, m in zip(tables, checked, resent, strict=True)
        ]
        for t, c, m in zip(tables, checked, resent, strict=True):
            if m is not None:  # a cache's validated read: its hits are the rows not re-sent
                counts = self.cache_counts.setdefault(t.spec.name, [0, 0])
                counts[0] += int(c.shape[0])
                counts[1] += int(c.shape[0] - np.count_nonzero(m))
        for t, seg in zip(tables, header.segments, strict=True):
            if seg.cache_rows_requested:
                counts = self.cache_counts.setdefault(t.spec.name, [0, 0])
                counts[0] += int(seg.cache_rows_requested)
                counts[1] += int(min(seg.cache_rows_hit, seg.cache_rows_requested))
        min_clock = self.engine.core.cluster.min_clock()
        infos = []
        for t, r, m in zip(tables, rows, resent, strict=True):
            info = tpb.PullRowsInfo(
                dtype=tensor.dtype_to_wire(t.spec.np_dtype),
                dim=t.spec.dim,
                num_ids=int(r.shape[0]),
                min_clock=min_clock,
            )
            if m is not None:
                info.row_versions = True
                info.resent = np.packbits(m, bitorder="little").tobytes()
                info.version_epoch = t.version_epoch
            infos.append(info)
        return infos, rows, versions

    async def push_rows_many(
        self, request_iterator: AsyncIterator[tpb.PushRowsManyRequest]
    ) -> tpb.PushRowsManyResponse:
        """PushRowsMany: every segment's ids and gradient rows, all or nothing."""
        header, _, parts, _ = await self._read_many(request_iterator, push=True)
        return await self.push_many_decoded(header, parts)

    async def push_many_decoded(
        self, header: tpb.RowsManyHeader, parts: list[tuple[np.ndarray, np.ndarray]]
    ) -> tpb.PushRowsManyResponse:
        """A push to several tables through the one funnel, all or nothing: every segment
        validated (:meth:`TableSet.prepare`; any refusal refuses the request with nothing
        logged or applied), then one ``push_rows`` record per segment written as one write,
        then every segment applied, made durable and acknowledged. Segment i carries request
        id ``header.request_id + i``. Returns the PushRowsManyResponse."""
        check_worker_identity(header.worker_id)
        if not header.worker_id:
            raise InvalidArgument("a several-table row push needs a worker_id")
        tables = self._segment_tables(header, push=True)
        for table, (ids, _) in zip(tables, parts, strict=True):
            self._check_ids(table, ids)
        engine = self.engine
        logging_on = engine.wal is not None
        base = int(header.request_id)

        def decide(log: LogFn) -> list[RowPushOutcome]:
            prepared = [
                self.tables.prepare(
                    engine.core.cluster,
                    header.worker_id,
                    base + i,
                    int(header.clock),
                    table.spec.name,
                    ids,
                    grads,
                )
                for i, (table, (ids, grads)) in enumerate(zip(tables, parts, strict=True))
            ]
            now = engine.now()
            if logging_on:
                records = [
                    wal_records.push_rows(p, header.worker_id, now)
                    for p in prepared
                    if p.duplicate is None and p.ids.shape[0]
                ]
                log(records)  # all or none (a refused write: nothing applied)
            return [self.tables.commit(p, now_s=now) for p in prepared]

        now = engine.now()
        for table in tables:
            self.rates.note(now, table)
        outcomes = await engine.mutate(decide, duplicate=lambda got: any(o.duplicate for o in got))
        for table in tables:
            await self._maybe_expire(table)
        return tpb.PushRowsManyResponse(
            tables=[
                tpb.PushRowsResponse(
                    duplicate=o.duplicate,
                    queued=o.queued,
                    distinct=o.result.distinct,
                    applied=o.result.applied,
                    filtered=o.result.filtered,
                    staleness=o.staleness,
                )
                for o in outcomes
            ]
        )

    async def _maybe_expire(self, table: EmbeddingTable) -> None:
        """An expiry sweep of ``table`` when its interval passed or the minimum clock moved,
        through the funnel (logged before it runs) when it drops rows. A sweep the log
        cannot take is skipped (maintenance: the push it follows stands)."""
        spec = table.spec
        if not (spec.expiry_clocks or spec.expiry_s):
            return
        engine = self.engine
        now = engine.now()
        clock = engine.core.cluster.min_clock()
        last = self._last_sweep.get(spec.name)
        if last is not None and now - last[0] < EXPIRY_SWEEP_INTERVAL_S and clock == last[1]:
            return
        self._last_sweep[spec.name] = (now, clock)
        logging_on = engine.wal is not None

        def decide(log: LogFn) -> int:
            if not table.would_expire(now_s=now, clock=clock):
                return 0
            if logging_on:
                log(wal_records.expire_rows(spec.name, now, clock))
            return int(table.expire(now_s=now, clock=clock))

        try:
            dropped = await engine.mutate(decide)
        except (StorageFull, StorageError) as exc:  # (a failed fsync also stops the server)
            logger.warning("table %r: expiry sweep skipped: %s", spec.name, exc)
            return
        logger.debug("table %r: %d rows expired", spec.name, dropped)

    def infos(self) -> list[tpb.TableInfo]:
        """``TableInfo`` of every table of the shard, with its row rates and the row-cache
        counts workers reported."""
        now = self.engine.now()
        out = table_infos(self.tables)
        for info in out:
            name = info.spec.name
            table = self.tables.tables[name]
            pulled, pushed = self.rates.per_s(now, table)
            info.rows_pulled_per_s = pulled
            info.rows_pushed_per_s = pushed
            requested, hit = self.cache_counts.get(name, (0, 0))
            info.cache_rows_requested = requested
            info.cache_rows_hit = hit
        return out


def resend_mask(
    held: np.ndarray, current: np.ndarray, same_epoch: bool, max_lag: int
) -> npt.NDArray[np.bool_]:
    """Which rows a version-validated pull sends (bool (n,)): every row when the held
    versions belong to another epoch; else each row held at no version (-1), at a version
    ahead of the server's (``current - held < 0``) or more than ``max_lag`` pushes behind.

    Args:
        held: int64 (n,) versions the worker holds (-1: none).
        current: int64 (n,) the server's versions of the same ids, read with the rows.
        same_epoch: Whether the held versions are of the table's current version epoch.
        max_lag: Pushes a held row may lag the server's row.
    """
    if not same_epoch:
        return np.ones(held.shape[0], bool)
    lag = current - held
    out: npt.NDArray[np.bool_] = (held < 0) | (lag < 0) | (lag > max_lag)
    return out


#: Seconds of history the row rates of Status cover.
RATE_WINDOW_S = 10.0


class TableRates:
    """Rows pulled and pushed per second per table over the last :data:`RATE_WINDOW_S`:
    the tables' counters sampled at most once a second, just before rows move (time passed
    in)."""

    def __init__(self, window_s: float = RATE_WINDOW_S) -> None:
        self.window_s = window_s
        self._samples: dict[str, deque[tuple[float, int, int]]] = {}

    def note(self, now_s: float, table: EmbeddingTable) -> None:
        """Sample ``table``'s counters if its newest sample is a second old or more."""
        got = self._samples.setdefault(table.spec.name, deque())
        if got and now_s - got[-1][0] < 1.0:
            return
        got.append((now_s, int(table.rows_pulled), int(table.rows_pushed)))
        while len(got) > 1 and now_s - got[1][0] >= self.window_s:
            got.popleft()

    def per_s(self, now_s: float, table: EmbeddingTable) -> tuple[float, float]:
        """(rows pulled / s, rows pushed / s) from the oldest sample within the window to the
        counters now (0, 0 when nothing moved within it)."""
        got = self._samples.get(table.spec.name)
        if not got:
            return 0.0, 0.0
        inside = [x for x in got if now_s - x[0] <= self.window_s]
        if not inside:
            return 0.0, 0.0
        t0, pulled0, pushed0 = inside[0]
        dt = max(now_s - t0, 1.0)
        return (int(table.rows_pulled) - pulled0) / dt, (int(table.rows_pushed) - pushed0) / dt


def table_infos(tables: TableSet) -> list[tpb.TableInfo]:
    """``TableInfo`` of every table of a :class:`~paramserver.core.table_set.TableSet`."""
    out = []
    for name, table in tables.tables.items():
        stats = tables.stats[name]
        stored = int(table.stored_bytes())
        out.append(
            tpb.TableInfo(
                spec=rows_wire.spec_to_proto(table.spec),
                rows=table.n,
                pushes=table.pushes,
                rows_pushed=table.rows_pushed,
                pulls=table.pulls,
                rows_pulled=table.rows_pulled,
                filtered=table.filtered,
                expired=table.expired,
                queued_pushes=stats.queued_pushes(),
                staleness_max=stats.staleness_max,
                staleness_mean=(
                    stats.staleness_sum / stats.applied_pushes if stats.applied_pushes else 0.0
                ),
                size_bytes=stored,
                state_size_bytes=table.state_bytes(),
                bytes_per_row=stored / table.n if table.n else 0.0,
            )
        )
    return out
