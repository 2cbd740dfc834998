"""Embedding-table calls of the worker client: ``init_table``, ``pull_rows``, ``push_rows``,
``push_pull_rows``.

:class:`TableClientMixin` gives :class:`~paramserver.worker_client.client.WorkerClient` the
calls on one shard: over the client's persistent Session when it is free (ids, gradients and
rows inline when small, else through the same-host shared-memory segment; on the local link when
the session moved there), otherwise over the ``PullRows`` / ``PushRows`` streams (chunked as
``tables.proto`` describes): whichever transport carries them. :class:`ShardedTables` splits a
batch by shard
``hash64(table, id) mod S`` (vectorized), calls every shard concurrently and reassembles the
rows in the caller's order; the cluster client uses it. See ``docs/embedding-tables.md``.

Usage::

    async with connect(address, worker_name="w0") as ps:
        await ps.init_table(TableSpec("users", 32, rule=TableRule("adagrad", lr=0.05)))
        rows = await ps.pull_rows("users", ids)          # (len(ids), 32)
        await ps.push_rows("users", ids, grads)          # duplicate ids summed server-side
        rows = await ps.push_pull_rows("users", ids, grads, next_ids)  # both, one round trip
"""

from __future__ import annotations

from collections.abc import (
    AsyncIterable,
    Awaitable,
    Callable,
    Collection,
    Iterable,
    Iterator,
    Mapping,
)
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import grpc
import numpy as np
import numpy.typing as npt

from paramserver.api.v1 import tables_pb2 as tpb
from paramserver.core.tables import TableSpec
from paramserver.errors import InvalidArgument, MalformedStream
from paramserver.protocol import rows_wire, tensor
from paramserver.worker_client.keyed import KeyedIds, TableIds
from paramserver.worker_client.retry import RETRYABLE
from paramserver.worker_client.transport.base import RowPush, Transports

__all__ = [
    "RowPushAck",
    "TableClientMixin",
    "ValidatedRows",
    "check_ids",
    "check_ids_many",
    "check_rows",
    "check_rows_many",
]

if TYPE_CHECKING:
    from paramserver.api.v1 import parameter_server_pb2_grpc as pb_grpc

_PUSH_RETRYABLE = RETRYABLE | {grpc.StatusCode.DEADLINE_EXCEEDED}

T = TypeVar("T")
#: One try of a call (what the retry funnels run).
_Attempt = Callable[[], Awaitable[T]]


@dataclass(frozen=True)
class ValidatedRows:
    """One table's answer to a version-validated pull (:meth:`TableClientMixin.
    pull_rows_validated`).

    Attributes:
        resent: bool (n,) over the requested ids: True where the server sent the row (the
            held copy, if any, is not valid); False where the held row is within the bound.
        rows: (m, dim) the rows sent, in request order (m = resent.sum()).
        versions: int64 (m,) their versions; -1 where unknown (a server that predates row
            versions: every row is sent and none may be cached by version).
        epoch_changed: The table's version epoch on a shard differs from the one the held
            versions of that shard were sent with: held rows of this table that are not in
            this answer may be of the old epoch and must be dropped.
    """

    resent: npt.NDArray[np.bool_]
    rows: np.ndarray
    versions: npt.NDArray[np.int64]
    epoch_changed: bool


@dataclass(frozen=True)
class RowPushAck:
    """The server's answer to a row push (summed over shards for a sharded cluster).

    Attributes:
        duplicate: Every shard had applied this request before (a retry).
        queued: A bsp table: waits for its step to close.
        distinct: Distinct ids pushed.
        applied: Rows the rule was applied to (0 when queued).
        filtered: Distinct ids the frequency filter dropped.
    """

    duplicate: bool
    queued: bool
    distinct: int
    applied: int
    filtered: int


#: Ids travel as int64 (tables.proto); a valid id lies in [0, ID_LIMIT).
ID_LIMIT = 1 << 63


def check_ids(ids: npt.ArrayLike) -> npt.NDArray[np.int64]:
    """The ids as a native int64 (n,) array.

    Ids are int64 on the wire and a valid id is >= 0, so an id of 2**63 or more (a uint64
    array's upper half, or a Python int) cannot be sent: it is refused here, named as the
    caller gave it, instead of wrapping to a negative int64 the server would name.

    Raises:
        InvalidArgument: not a 1-D integer array-like, or an id >= 2**63, named with its
            position (INVALID_ARGUMENT).
    """
    arr = np.asarray(ids)
    if arr.dtype.kind in "fO" and isinstance(ids, (list, tuple)):
        _refuse_large_id(ids)  # Python ints beyond int64 made numpy pick float64 or object
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise InvalidArgument(
            f"ids must be a 1-D integer array, got {arr.dtype} shape {tuple(arr.shape)}"
        )
    if arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and arr.size and arr.max() >= ID_LIMIT:
        position = int(np.argmax(arr >= ID_LIMIT))
        _refuse_large_id([int(arr[position])], position)
    return np.ascontiguousarray(arr, dtype=np.int64)


def _refuse_large_id(ids: Iterable[object], start: int = 0) -> None:
    """Raise InvalidArgument naming the first integer id >= 2**63 (or < -2**63) as the caller
    gave it, at its position counted from ``start``; return when there is none."""
    for position, value in enumerate(ids, start):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            continue
        v = int(value)
        if not -ID_LIMIT <= v < ID_LIMIT:
            raise InvalidArgument(
                f"id {v} (position {position}) does not fit the int64 ids tables take: ids "
                f"lie in [0, 2**63 - 1]"
            )


def check_rows(rows: npt.ArrayLike, n: int) -> np.ndarray:
    """Gradient rows as a C-order (n, dim) float array (float32, float16 or bfloat16).

    Raises:
        InvalidArgument: wrong shape or a dtype the wire does not carry (INVALID_ARGUMENT).
    """
    arr = np.asarray(rows)
    if arr.ndim != 2 or arr.shape[0] != n:
        raise InvalidArgument(
            f"gradient rows must have shape (len(ids)={n}, dim), got {tuple(arr.shape)}"
        )
    tensor.dtype_to_wire(arr.dtype)  # raises InvalidArgument for unsupported dtypes
    return np.ascontiguousarray(arr)


def check_ids_many(ids: TableIds) -> dict[str, npt.NDArray[np.int64]]:
    """``{table: ids}`` of a several-table call, each checked as :func:`check_ids`.

    Raises:
        InvalidArgument: bad ids, naming the table (INVALID_ARGUMENT).
    """
    items = ids.to_dict() if isinstance(ids, KeyedIds) else ids
    out = {}
    for table, value in items.items():
        try:
            out[str(table)] = check_ids(value)
        except InvalidArgument as exc:
            raise InvalidArgument(f"table {table!r}: {exc.message}") from None
    return out


def check_rows_many(
    ids: Mapping[str, npt.NDArray[np.int64]], grads: Mapping[str, npt.ArrayLike]
) -> dict[str, np.ndarray]:
    """The gradient rows of every table of ``ids``, each checked as :func:`check_rows`.

    Raises:
        InvalidArgument: a table without gradients or with others than its ids', bad rows,
            naming the table (INVALID_ARGUMENT).
    """
    if set(grads) != set(ids):
        raise InvalidArgument(
            f"gradients for tables {sorted(grads)}, ids for tables {sorted(ids)}: they must match"
        )
    out = {}
    for table, arr in ids.items():
        try:
            out[table] = check_rows(grads[table], arr.shape[0])
        except InvalidArgument as exc:
            raise InvalidArgument(f"table {table!r}: {exc.message}") from None
    return out


def _ack(resp: tpb.PushRowsResponse) -> RowPushAck:
    return RowPushAck(
        duplicate=resp.duplicate,
        queued=resp.queued,
        distinct=int(resp.distinct),
        applied=int(resp.applied),
        filtered=int(resp.filtered),
    )


def _sum_acks(acks: Collection[RowPushAck]) -> RowPushAck:
    if not acks:
        return RowPushAck(False, False, 0, 0, 0)
    return RowPushAck(
        duplicate=all(a.duplicate for a in acks),
        queued=any(a.queued for a in acks),
        distinct=sum(a.distinct for a in acks),
        applied=sum(a.applied for a in acks),
        filtered=sum(a.filtered for a in acks),
    )


class TableClientMixin:
    """Table calls on one shard (mixed into ``WorkerClient``; uses its retry funnel)."""

    stub: pb_grpc.ParameterServerAsyncStub
    transports: Transports
    worker_id: str
    clock_value: int
    rpc_timeout_s: float
    wait_timeout_s: float | None

    def _row_push_request_id(self, tables: int = 1) -> int:
        """The first of ``tables`` consecutive request ids of the next row push (the
        client numbers them; see ``WorkerClient``)."""
        raise NotImplementedError

    if TYPE_CHECKING:  # WorkerClient's retry funnels and the one deadline rule of every pull

        async def _call(
            self, attempt: _Attempt[T], what: str, retryable: Collection[grpc.StatusCode] = ...
        ) -> T: ...

        async def _member_call(
            self, attempt: _Attempt[T], what: str, retryable: Collection[grpc.StatusCode] = ...
        ) -> T: ...

        def _pull_deadlines(self, timeout_s: float | None) -> tuple[int, float]: ...

    async def init_table(self, spec: TableSpec) -> tuple[bool, TableSpec]:
        """Declare a table (first writer wins; the same declaration again is a no-op).

        Returns:
            (created here, the stored declaration).

        Raises:
            InvalidArgument: a bad declaration (INVALID_ARGUMENT).
            AlreadyExists: the name is declared differently (ALREADY_EXISTS).
        """
        req = tpb.InitTableRequest(spec=rows_wire.spec_to_proto(spec))
        resp = await self._call(
            lambda: self.stub.InitTable(req, timeout=self.rpc_timeout_s), "init_table"
        )
        return bool(resp.created), rows_wire.spec_from_proto(resp.spec)

    async def pull_rows(
        self,
        table: str,
        ids: npt.ArrayLike,
        *,
        timeout_s: float | None = None,
        observer: bool = False,
    ) -> np.ndarray:
        """Rows of ``ids`` in the caller's order (duplicates allowed).

        Args:
            table: Table name.
            ids: 1-D integer ids (each >= 0; < num_embeddings when the table bounds them).
            timeout_s: Deadline of the consistency wait (default: the client's).
            observer: Read without a consistency wait (no registration needed).

        Returns:
            A new (len(ids), dim) array of the table's storage dtype.

        Raises:
            KeyNotFound (NOT_FOUND), InvalidArgument (INVALID_ARGUMENT), WaitTimeout
            (DEADLINE_EXCEEDED).
        """
        arr = check_ids(ids)
        wait_ms, deadline_s = self._pull_deadlines(timeout_s)

        async def attempt() -> np.ndarray:
            header = tpb.RowsHeader(
                table=table,
                worker_id="" if observer else self.worker_id,
                num_ids=int(arr.shape[0]),
                timeout_ms=wait_ms,
            )
            return await self.transports.send(lambda t: t.pull_rows(header, arr, deadline_s))

        if observer:
            out: np.ndarray = await self._call(attempt, "pull_rows")
        else:
            out = await self._member_call(attempt, "pull_rows")
        if out.shape[0] != arr.shape[0]:
            raise MalformedStream(f"table {table!r}: {out.shape[0]} rows for {arr.shape[0]} ids")
        return out

    async def push_rows(
        self,
        table: str,
        ids: npt.ArrayLike,
        grads: npt.ArrayLike,
        *,
        timeout_s: float | None = None,
    ) -> RowPushAck:
        """Push gradient rows of ``ids`` for the current clock (a retry is applied once).

        Args:
            table: Table name.
            ids: 1-D integer ids, shape (n,); duplicates are summed by the server.
            grads: (n, dim) float32 (or the table's dtype) gradient rows.
            timeout_s: Deadline of each attempt (default ``rpc_timeout_s``).

        Raises:
            KeyNotFound (NOT_FOUND), InvalidArgument (INVALID_ARGUMENT: ids, shape, dtype,
            NaN/Inf, limits; names the table), WorkerNotFound / StaleUpdate
            (FAILED_PRECONDITION).
        """
        arr = check_ids(ids)
        rows = check_rows(grads, arr.shape[0])
        request_id = self._row_push_request_id()
        return await self._push_rows_as(table, arr, rows, request_id, timeout_s)

    async def _push_rows_as(
        self,
        table: str,
        arr: npt.NDArray[np.int64],
        rows: np.ndarray,
        request_id: int,
        timeout_s: float | None,
    ) -> RowPushAck:
        batch = RowPush(arr, rows)  # the stream's chunks encoded once, re-sent on retry
        deadline_s = timeout_s or self.rpc_timeout_s

        async def attempt() -> tpb.PushRowsResponse:
            header = tpb.RowsHeader(
                table=table,
                worker_id=self.worker_id,
                request_id=request_id,
                clock=self.clock_value,
            )
            return await self.transports.send(lambda t: t.push_rows(header, batch, deadline_s))

        resp = await self._member_call(attempt, "push_rows", _PUSH_RETRYABLE)
        return _ack(resp)

    async def push_pull_rows(
        self,
        table: str,
        push_ids: npt.ArrayLike,
        grads: npt.ArrayLike,
        pull_ids: npt.ArrayLike,
        *,
        timeout_s: float | None = None,
    ) -> np.ndarray:
        """Push gradient rows, then pull rows of the same table, in one round trip: the
        pipelined step that pushes batch r-1's gradients and pulls batch r's rows.

        Exactly :meth:`push_rows` followed by :meth:`pull_rows`: the push is applied once
        (a retry carries the same request id and is answered as a duplicate), then the pull
        waits as the table's consistency requires and reads the rows after the push. The pull
        ids are checked first: when the push or the pull ids are refused, nothing is applied
        and no rows are returned (the refusal is raised). A pull refused after the push was
        applied (its consistency wait running out: WaitTimeout) raises with the push applied.
        Retried as :meth:`pull_rows` is (a broken link, back-pressure); a call that runs past
        its deadline (``timeout_s`` + ``rpc_timeout_s``) raises without a retry, its push
        possibly applied.

        Args:
            table: Table name.
            push_ids: 1-D integer ids of the gradient rows, shape (n,); duplicates summed.
            grads: (n, dim) float32 (or the table's dtype) gradient rows.
            pull_ids: 1-D integer ids to pull, shape (m,); duplicates allowed.
            timeout_s: Deadline of the pull's consistency wait (default: the client's).

        Returns:
            A new (m, dim) array of the table's storage dtype, in ``pull_ids``' order.

        Raises:
            As :meth:`push_rows` and :meth:`pull_rows`.
        """
        arr = check_ids(push_ids)
        rows = check_rows(grads, arr.shape[0])
        pull = check_ids(pull_ids)
        request_id = self._row_push_request_id()
        return (await self._push_pull_rows_as(table, arr, rows, pull, request_id, timeout_s))[1]

    async def _push_pull_rows_as(
        self,
        table: str,
        arr: npt.NDArray[np.int64],
        rows: np.ndarray,
        pull: npt.NDArray[np.int64],
        request_id: int,
        timeout_s: float | None,
    ) -> tuple[RowPushAck, np.ndarray]:
        """:meth:`push_pull_rows` with a given request id: (the push's ack, the rows)."""
        batch = RowPush(arr, rows)  # the stream's chunks encoded once, re-sent on retry
        wait_ms, deadline_s = self._pull_deadlines(timeout_s)

        async def attempt() -> tuple[tpb.PushRowsResponse, np.ndarray]:
            header = tpb.RowsHeader(
                table=table,
                worker_id=self.worker_id,
                request_id=request_id,
                clock=self.clock_value,
                timeout_ms=wait_ms,
            )
            return await self.transports.send(
                lambda t: t.push_pull_rows(header, batch, pull, deadline_s)
            )

        resp, out = await self._member_call(attempt, "push_pull_rows")
        if out.shape[0] != pull.shape[0]:
            raise MalformedStream(f"table {table!r}: {out.shape[0]} rows for {pull.shape[0]} ids")
        return _ack(resp), out

    async def pull_rows_many(
        self,
        ids: TableIds,
        *,
        timeout_s: float | None = None,
        observer: bool = False,
        cache_counts: Mapping[str, tuple[int, int]] | None = None,
    ) -> dict[str, np.ndarray]:
        """Rows of several tables in one request (``PullRowsMany``): every table's
        consistency wait, then every table read at one moment of the shard.

        Args:
            ids: ``{table: 1-D ids}`` (each table once), or :class:`KeyedIds` whose keys are
                table names.
            timeout_s: Deadline of the consistency waits (default: the client's).
            observer: Read without a consistency wait (no registration needed).
            cache_counts: ``{table: (rows requested, rows hit)}`` of a worker-side row cache
                since its last report, for the server's Status (tables of this request only).

        Returns:
            ``{table: (len(ids), dim) rows}`` of each table's storage dtype, in the ids' order.

        Raises:
            As :meth:`pull_rows`, naming the table.
        """
        arrays = check_ids_many(ids)
        wait_ms, deadline_s = self._pull_deadlines(timeout_s)
        tables = list(arrays)
        counts = dict(cache_counts or {})

        async def attempt() -> dict[str, np.ndarray]:
            worker_id = "" if observer else self.worker_id
            header = _pull_many_header(worker_id, wait_ms, arrays, counts)
            requests = _pull_many_requests(header, arrays)
            return await read_rows_many(
                self.stub.PullRowsMany(
                    requests,  # type: ignore[arg-type]  # chunks as wire bytes: ParameterServerStub
                    timeout=deadline_s,
                ),
                tables,
            )

        if observer:
            out: dict[str, np.ndarray] = await self._call(attempt, "pull_rows_many")
        else:
            out = await self._member_call(attempt, "pull_rows_many")
        for t in tables:
            if out[t].shape[0] != arrays[t].shape[0]:
                raise MalformedStream(
                    f"table {t!r}: {out[t].shape[0]} rows for {arrays[t].shape[0]} ids"
                )
        return out

    async def pull_rows_validated(
        self,
        ids: Mapping[str, npt.NDArray[np.int64]],
        held: Mapping[str, npt.NDArray[np.int64]],
        *,
        max_version_lag: int,
        timeout_s: float | None = None,
        cache_counts: Mapping[str, tuple[int, int]] | None = None,
    ) -> dict[str, ValidatedRows]:
        """A version-validated ``PullRowsMany`` (a worker-side row cache's pull; HET's
        per-embedding clocks, Miao et al., VLDB 2022): each id goes with the version of the
        row the caller holds, and the server sends a row (with its version) only where
        nothing is held, the held version is of another epoch or ahead of the server's, or
        the server's row has had more than ``max_version_lag`` pushes since; the table's
        consistency wait applies as to any pull, and every table is read at one moment.

        Args:
            ids: ``{table: distinct int64 ids}``.
            held: ``{table: int64 versions}``, one per id (-1: no row held).
            max_version_lag: Pushes a held row may lag the server's row (0: unchanged only).
            timeout_s: Deadline of the consistency waits (default: the client's).
            cache_counts: As :meth:`pull_rows_many`.

        Returns:
            ``{table: ValidatedRows}``.

        Raises:
            As :meth:`pull_rows_many`; MalformedStream: a reply whose rows disagree with its
                bitmap.
        """
        arrays = check_ids_many(ids)
        tables = list(arrays)
        versions = {t: np.ascontiguousarray(held[t], np.int64) for t in tables}
        for t in tables:
            if versions[t].shape != arrays[t].shape:
                raise InvalidArgument(
                    f"table {t!r}: {versions[t].shape[0]} held versions for "
                    f"{arrays[t].shape[0]} ids"
                )
        wait_ms, deadline_s = self._pull_deadlines(timeout_s)
        counts = dict(cache_counts or {})
        epochs: dict[str, int] = self.__dict__.setdefault("_row_version_epochs", {})
        sent_epochs = {t: epochs.get(t, 0) for t in tables}

        async def attempt() -> _RowsManyReply:
            header = _pull_many_header(
                self.worker_id, wait_ms, arrays, counts, (max_version_lag, sent_epochs)
            )
            requests = _pull_many_requests(header, arrays, versions)
            return await read_rows_many_infos(
                self.stub.PullRowsMany(
                    requests,  # type: ignore[arg-type]  # chunks as wire bytes: ParameterServerStub
                    timeout=deadline_s,
                ),
                tables,
            )

        infos, rows, got_versions = await self._member_call(attempt, "pull_rows_validated")
        out: dict[str, ValidatedRows] = {}
        for t, info in zip(tables, infos, strict=True):
            n = arrays[t].shape[0]
            if info.row_versions:
                bits = np.frombuffer(info.resent, np.uint8)
                if bits.shape[0] != (n + 7) // 8:
                    raise MalformedStream(f"table {t!r}: a resent bitmap for other than {n} ids")
                mask = np.unpackbits(bits, count=n, bitorder="little").astype(bool)
                got_v = got_versions[t]
                changed = int(info.version_epoch) != sent_epochs[t]
                epochs[t] = int(info.version_epoch)
            else:  # a server that predates row versions: every row, no versions
                mask = np.ones(n, bool)
                got_v = np.full(n, -1, np.int64)
                changed = True
                epochs.pop(t, None)
            if int(mask.sum()) != rows[t].shape[0]:
                raise MalformedStream(
                    f"table {t!r}: {rows[t].shape[0]} rows for {int(mask.sum())} resent ids"
                )
            out[t] = ValidatedRows(mask, rows[t], got_v, changed)
        return out

    async def push_rows_many(
        self,
        ids: TableIds,
        grads: Mapping[str, npt.ArrayLike],
        *,
        timeout_s: float | None = None,
    ) -> dict[str, RowPushAck]:
        """Push gradient rows of several tables in one request (``PushRowsMany``), all or
        nothing: a refusal of any table refuses the whole request with nothing applied.
        A retry is applied once (table i of the request carries request id base + i).

        Args:
            ids: ``{table: 1-D ids}`` (each table once), or :class:`KeyedIds`.
            grads: ``{table: (len(ids), dim) gradient rows}``, the same tables.
            timeout_s: Deadline of each attempt (default ``rpc_timeout_s``).

        Returns:
            ``{table: RowPushAck}``.

        Raises:
            As :meth:`push_rows`, naming the table.
        """
        arrays = check_ids_many(ids)
        rows = check_rows_many(arrays, grads)
        base = self._row_push_request_id(max(1, len(arrays)))
        return await self._push_rows_many_as(arrays, rows, base, timeout_s)

    async def _push_rows_many_as(
        self,
        arrays: Mapping[str, npt.NDArray[np.int64]],
        rows: Mapping[str, np.ndarray],
        request_id: int,
        timeout_s: float | None,
    ) -> dict[str, RowPushAck]:
        tables = list(arrays)
        segments = [
            tpb.RowsSegment(
                table=t,
                num_ids=arrays[t].shape[0],
                dtype=tensor.dtype_to_wire(rows[t].dtype),
                dim=int(rows[t].shape[1]),
            )
            for t in tables
        ]
        chunks = [m for t in tables for m in rows_wire.chunk_messages(arrays[t], rows[t])]
        deadline_s = timeout_s or self.rpc_timeout_s

        async def attempt() -> tpb.PushRowsManyResponse:
            header = tpb.RowsManyHeader(
                worker_id=self.worker_id,
                request_id=request_id,
                clock=self.clock_value,
                segments=segments,
            )

            def requests() -> Iterator[tpb.PushRowsManyRequest | bytes]:
                yield tpb.PushRowsManyRequest(header=header)
                yield from chunks  # PushRowsManyRequest(chunk=...)s' wire bytes

            resp: tpb.PushRowsManyResponse = await self.stub.PushRowsMany(
                requests(),  # type: ignore[arg-type]  # chunks as wire bytes: ParameterServerStub
                timeout=deadline_s,
            )
            return resp

        resp = await self._member_call(attempt, "push_rows_many", _PUSH_RETRYABLE)
        if len(resp.tables) != len(tables):
            raise MalformedStream(f"{len(resp.tables)} answers for {len(tables)} tables")
        return {t: _ack(r) for t, r in zip(tables, resp.tables, strict=True)}


#: A ``PullRowsMany`` reply: its info per table, ``{table: rows}``, ``{table: versions}``.
_RowsManyReply = tuple[list[tpb.PullRowsInfo], dict[str, np.ndarray], dict[str, np.ndarray]]


def _pull_many_header(
    worker_id: str,
    wait_ms: int,
    arrays: Mapping[str, npt.NDArray[np.int64]],
    counts: Mapping[str, tuple[int, int]],
    validated: tuple[int, Mapping[str, int]] | None = None,
) -> tpb.RowsManyHeader:
    """The header of a ``PullRowsMany``: a segment per table of ``arrays`` with its row-cache
    counts; ``validated`` = (max version lag, {table: version epoch held}) asks for rows by
    version (:meth:`TableClientMixin.pull_rows_validated`)."""
    segments = []
    for t, arr in arrays.items():
        requested, hit = counts.get(t, (0, 0))
        segment = tpb.RowsSegment(
            table=t, num_ids=arr.shape[0], cache_rows_requested=requested, cache_rows_hit=hit
        )
        if validated is not None:
            segment.row_versions = True
            segment.max_version_lag, segment.version_epoch = validated[0], validated[1][t]
        segments.append(segment)
    return tpb.RowsManyHeader(worker_id=worker_id, timeout_ms=wait_ms, segments=segments)


def _pull_many_requests(
    header: tpb.RowsManyHeader,
    arrays: Mapping[str, npt.NDArray[np.int64]],
    versions: Mapping[str, npt.NDArray[np.int64]] | None = None,
) -> Iterator[tpb.PullRowsManyRequest | bytes]:
    """The request stream of a ``PullRowsMany``: the header, then every table's ids (with
    the versions held, for a validated pull) in chunks (their messages' wire bytes)."""
    yield tpb.PullRowsManyRequest(header=header)
    for t, arr in arrays.items():
        held = None if versions is None else versions[t]
        yield from rows_wire.chunk_messages(arr, None, versions=held)


async def read_rows_many(
    stream: AsyncIterable[tpb.PullRowsManyResponse], tables: list[str]
) -> dict[str, np.ndarray]:
    """The rows of a ``PullRowsMany`` reply stream: ``{table: (num_ids, dim)}``.

    Raises:
        MalformedStream: info missing, repeated or after rows; rows that do not add up.
    """
    return (await read_rows_many_infos(stream, tables))[1]


async def read_rows_many_infos(
    stream: AsyncIterable[tpb.PullRowsManyResponse], tables: list[str]
) -> _RowsManyReply:
    """A ``PullRowsMany`` reply stream: its ``PullRowsInfo`` per table, the rows
    ``{table: (num_ids, dim)}`` and their versions ``{table: int64 (num_ids,)}`` (empty for a
    segment answered without versions).

    Raises:
        MalformedStream: info missing, repeated or after rows; rows that do not add up.
    """
    many: rows_wire.SegmentsReceiver | None = None
    infos: list[tpb.PullRowsInfo] = []
    async for msg in stream:
        if msg.WhichOneof("body") == "info":
            if many is not None:
                raise MalformedStream("a second PullRowsManyInfo")
            infos = list(msg.info.tables)
            if len(infos) != len(tables):
                raise MalformedStream(f"{len(infos)} table infos for {len(tables)} tables")
            many = rows_wire.SegmentsReceiver(
                [
                    rows_wire.RowsReceiver(
                        f"table {t!r}",
                        int(i.num_ids),
                        int(i.dim),
                        tensor.dtype_from_wire(i.dtype, t),
                        with_ids=False,
                        with_versions=i.row_versions,
                    )
                    for t, i in zip(tables, infos, strict=True)
                ]
            )
        elif many is None:
            raise MalformedStream("rows before the PullRowsManyInfo")
        else:
            many.feed(msg.chunk)
    if many is None:
        raise MalformedStream("empty PullRowsMany reply")
    parts = many.finish()
    rows = {t: r for t, (_, r) in zip(tables, parts, strict=True)}
    versions = {t: r.versions for t, r in zip(tables, many.receivers, strict=True)}
    return infos, rows, versions
