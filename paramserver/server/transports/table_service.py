"""Embedding-table RPCs of a shard (InitTable, PullRows, PushRows): decode, call, encode.

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
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from paramserver.api.v1 import tables_pb2 as tpb
from paramserver.api.v1 import tensor_pb2
from paramserver.core.table_set import RowPushOutcome
from paramserver.core.tables import EmbeddingTable
from paramserver.errors import (
    DimensionMismatch,
    InvalidArgument,
    MalformedStream,
    StorageError,
    StorageFull,
)
from paramserver.protocol import rows_wire, tensor
from paramserver.protocol.table_spec import check_owned
from paramserver.security.tokens import check_worker_identity
from paramserver.server import wal_records
from paramserver.server.engine import LogFn, ServerEngine

logger = logging.getLogger(__name__)

__all__ = ["TableRpcs", "table_infos"]

#: Expiry sweeps of a table run at most this often (seconds), after a push.
EXPIRY_SWEEP_INTERVAL_S = 1.0


class TableRpcs:
    """The table handlers over one :class:`ServerEngine` (the servicer delegates to them)."""

    def __init__(self, engine: ServerEngine) -> None:
        self.engine = engine
        self._last_sweep: dict[str, tuple[float, int]] = {}
        #: This shard's index and the cluster's shard count (which ids it owns).
        self.shard_index = int(engine.config.shard_index)
        self.num_shards = int(engine.config.num_shards)

    @property
    def tables(self) -> Any:
        return self.engine.core.tables

    # ------------------------------------------------------------------ InitTable
    async def init_table(self, request: Any) -> Any:
        spec = rows_wire.spec_from_proto(request.spec)
        tables = self.tables

        def decide(log: LogFn) -> tuple[bool, Any]:
            # built and checked, then logged, then installed (a no-op logs nothing)
            return tables.init(spec, log=lambda: log(wal_records.init_table(spec)))  # type: ignore[no-any-return]

        created, stored = await self.engine.mutate(decide)
        if created:
            logger.info("table %r declared: %s", spec.name, spec.to_dict())
        return tpb.InitTableResponse(created=created, spec=rows_wire.spec_to_proto(stored))

    # ------------------------------------------------------------------ helpers
    def _check_header(self, header: Any, *, push: bool, n: int | None = None) -> EmbeddingTable:
        table: EmbeddingTable = self.tables.get(header.table)
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
        request_iterator: AsyncIterator[Any],
    ) -> tuple[Any, AsyncIterator[Any]]:
        it = request_iterator.__aiter__()
        try:
            first = await it.__anext__()
        except StopAsyncIteration:
            raise MalformedStream("empty row stream: no header") from None
        if first.WhichOneof("body") != "header":
            raise MalformedStream("a row stream must start with a RowsHeader")
        return first.header, it

    @staticmethod
    async def _chunks(it: AsyncIterator[Any], receiver: rows_wire.RowsReceiver) -> None:
        async for msg in it:
            if msg.WhichOneof("body") != "chunk":
                raise MalformedStream(f"{receiver.what}: a second header in one stream")
            receiver.feed(msg.chunk)

    async def _wait_rows(self, worker_id: str, table: str, timeout_ms: int) -> None:
        engine = self.engine
        wait_ms = timeout_ms or engine.config.wait_timeout_ms
        await engine.wait_admitted(
            lambda: self.tables.check_pull(engine.core.cluster, worker_id, table),
            f"row pull by {worker_id!r}",
            wait_ms / 1000.0,
        )

    # ------------------------------------------------------------------ PullRows
    async def pull_rows(self, request_iterator: AsyncIterator[Any]) -> AsyncIterator[Any]:
        header, it = await self._read(request_iterator)
        table = self._check_header(header, push=False)
        receiver = rows_wire.RowsReceiver(
            f"table {table.spec.name!r}", int(header.num_ids), 0, np.dtype(np.float32)
        )
        await self._chunks(it, receiver)
        ids, _ = receiver.finish()
        info, rows = await self.pull_decoded(header, ids)
        yield tpb.PullRowsResponse(info=info)
        for chunk in rows_wire.chunk_rows(None, rows):
            yield tpb.PullRowsResponse(chunk=chunk)

    async def pull_decoded(self, header: Any, ids: np.ndarray) -> tuple[Any, np.ndarray]:
        """A row pull of decoded ``ids`` (every transport shares it): checks, the table's
        consistency wait, then the rows. Returns (PullRowsInfo, rows (n, dim))."""
        check_worker_identity(header.worker_id)
        table = self._check_header(header, push=False, n=int(ids.shape[0]))
        checked = self._check_ids(table, ids)
        await self._wait_rows(header.worker_id, table.spec.name, int(header.timeout_ms))
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
    async def push_rows(self, request_iterator: AsyncIterator[Any]) -> Any:
        header, it = await self._read(request_iterator)
        table = self._check_header(header, push=True)
        where = f"table {table.spec.name!r}"
        if header.dtype == tensor_pb2.DTYPE_UNSPECIFIED:
            raise InvalidArgument(
                f"{where}: a PushRows header needs the gradient rows' dtype (FLOAT32 or the "
                "table's dtype), got DTYPE_UNSPECIFIED"
            )
        dtype = tensor.dtype_from_wire(header.dtype, where)
        table.check_grad_dtype(dtype)
        receiver = rows_wire.RowsReceiver(where, int(header.num_ids), table.spec.dim, dtype)
        await self._chunks(it, receiver)
        ids, grads = receiver.finish()
        return await self.push_decoded(header, ids, grads)

    async def push_decoded(self, header: Any, ids: np.ndarray, grads: np.ndarray) -> Any:
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
            return self.tables.commit(prepared, now_s=now)  # type: ignore[no-any-return]

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


def table_infos(tables: Any) -> list[Any]:
    """``TableInfo`` of every table of a :class:`~paramserver.core.table_set.TableSet`."""
    out = []
    for name, table in tables.tables.items():
        stats = tables.stats[name]
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
                size_bytes=table.stored_bytes(),
                state_size_bytes=table.state_bytes(),
            )
        )
    return out
