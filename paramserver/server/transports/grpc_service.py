"""gRPC servicer of the parameter server: decode, call the shard, encode. Nothing else.

Every dense-key request goes through :class:`~paramserver.server.shard_service.ShardService`;
:func:`~paramserver.serving.error_status.grpc_errors` maps errors to status codes (any exception
that is not a :class:`~paramserver.errors.ParamServerError` is logged and becomes INTERNAL, so
nothing a client sends can crash the server).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any, Literal, Protocol, TypeVar, cast

import grpc
import numpy as np

from paramserver.api.v1 import parameter_server_pb2 as pb
from paramserver.api.v1 import parameter_server_pb2_grpc as pb_grpc
from paramserver.api.v1 import tables_pb2 as tpb
from paramserver.api.v1 import tensor_pb2
from paramserver.core.consistency import Consistency
from paramserver.core.decompress import Encoded
from paramserver.core.sharding import shard_map_to_proto
from paramserver.errors import (
    DimensionMismatch,
    DTypeMismatch,
    FailedPrecondition,
    InvalidArgument,
    MalformedStream,
)
from paramserver.method_handlers import ServicerContext
from paramserver.protocol import headed_stream, tensor, wire
from paramserver.protocol.limits import shown
from paramserver.server.checkpoint_cut import shard_map_of
from paramserver.server.engine import InflightTicket
from paramserver.server.shard_service import ShardHost, ShardService
from paramserver.server.transports.session_service import SessionService
from paramserver.server.transports.table_service import TableRpcs
from paramserver.serving.error_status import abort_with, grpc_errors

logger = logging.getLogger(__name__)

_Header = TypeVar("_Header", bound="_TensorStreamHeader")
_Header_co = TypeVar("_Header_co", bound="_TensorStreamHeader", covariant=True)


class _TensorStreamHeader(Protocol):
    """The header of an Init or Push stream, as far as the tensor reader needs it."""

    @property
    def worker_id(self) -> str: ...


class _TensorStreamMessage(headed_stream.FramedMessage, Protocol[_Header_co]):
    """An Init or Push stream's message: its header first, then tensor frames."""

    @property
    def header(self) -> _Header_co: ...


_CONSISTENCY_PB = {
    Consistency.BSP: pb.CONSISTENCY_BSP,
    Consistency.SSP: pb.CONSISTENCY_SSP,
    Consistency.ASP: pb.CONSISTENCY_ASP,
}
_AGGREGATION_PB = {
    "mean": pb.AGGREGATION_MEAN,
    "sum": pb.AGGREGATION_SUM,
    "weighted_mean": pb.AGGREGATION_WEIGHTED_MEAN,
}


def _rss_bytes() -> int:
    """Resident set size of this process in bytes (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class _Handlers:
    """Stands in for a server to catch the generated registration's method handlers."""

    def __init__(self) -> None:
        self.service = ""
        self.handlers: dict[str, Any] = {}

    def add_generic_rpc_handlers(self, handlers: Iterable[grpc.GenericRpcHandler]) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        self.service, self.handlers = service, handlers


def add_to_server(servicer: ParameterServerServicer, server: grpc.aio.Server) -> None:
    """Register ``servicer`` as the generated ``add_ParameterServerServicer_to_server`` would,
    except that Push requests are read and Pull responses written by
    :mod:`paramserver.protocol.wire` (tensor frames without protobuf copies of their payload;
    same bytes on the wire), as are the row streams' chunks, and a
    request that does not decode (invalid UTF-8 in a string field, truncated bytes) is refused
    with INVALID_ARGUMENT by its handler instead of gRPC's INTERNAL (:func:`wire.tolerant`)."""
    caught = _Handlers()
    pb_grpc.add_ParameterServerServicer_to_server(servicer, cast(grpc.aio.Server, caught))
    handlers = dict(caught.handlers)
    handlers["Push"] = grpc.stream_unary_rpc_method_handler(
        servicer.Push,
        request_deserializer=wire.deserializer(pb.PushRequest),
        response_serializer=pb.PushResponse.SerializeToString,
    )
    handlers["Pull"] = grpc.unary_stream_rpc_method_handler(
        servicer.Pull,
        request_deserializer=pb.PullRequest.FromString,
        response_serializer=wire.serialize,
    )
    # The row streams: chunks written and read in place (their headers and infos by protobuf).
    for name, request, response in (
        ("PullRows", tpb.PullRowsRequest, None),
        ("PushRows", tpb.PushRowsRequest, tpb.PushRowsResponse),
        ("PushPullRows", tpb.PushPullRowsRequest, None),
        ("PullRowsMany", tpb.PullRowsManyRequest, None),
        ("PushRowsMany", tpb.PushRowsManyRequest, tpb.PushRowsManyResponse),
    ):
        method = getattr(servicer, name)
        deserialize = wire.rows_deserializer(request)
        if response is None:  # a reply stream of infos and chunk bytes
            handlers[name] = grpc.stream_stream_rpc_method_handler(
                method, request_deserializer=deserialize, response_serializer=wire.serialize
            )
        else:
            handlers[name] = grpc.stream_unary_rpc_method_handler(
                method,
                request_deserializer=deserialize,
                response_serializer=response.SerializeToString,
            )
    handlers = {
        name: h._replace(request_deserializer=wire.tolerant(h.request_deserializer))
        for name, h in handlers.items()
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(caught.service, handlers),)
    )
    server.add_registered_method_handlers(caught.service, handlers)


class ParameterServerServicer(pb_grpc.ParameterServerServicer):
    """Implements ``paramserver.api.v1.ParameterServer`` over a :class:`ServerEngine`."""

    def __init__(self, shard: ShardService, host: ShardHost | None = None) -> None:
        engine = shard.engine
        #: The funnel every dense-key request goes through.
        self.shard = shard
        self.engine = engine
        self.core = engine.core
        #: Checkpoints and the shard map of the daemon serving this (None in bare tests).
        self.host = host
        #: Embedding-table RPCs (their own push path: validate, log, apply, acknowledge).
        self.table_rpcs = TableRpcs(engine)
        #: Serves the Session RPC (fast path: inline small tensors, same-host shared memory).
        self.sessions = SessionService(
            shard, self.table_rpcs, shared_memory=getattr(engine.config, "shared_memory", True)
        )

    @grpc_errors
    async def Register(
        self, request: pb.RegisterRequest, context: ServicerContext
    ) -> pb.RegisterResponse:
        return await self.shard.register(request)

    @grpc_errors
    async def Heartbeat(
        self, request: pb.HeartbeatRequest, context: ServicerContext
    ) -> pb.HeartbeatResponse:
        return self.shard.heartbeat(request)

    @grpc_errors
    async def Leave(self, request: pb.LeaveRequest, context: ServicerContext) -> pb.LeaveResponse:
        return await self.shard.leave(request)

    async def _read_tensors(
        self,
        request_iterator: AsyncIterator[_TensorStreamMessage[_Header]],
        header_field: Literal["header"],
        ticket: InflightTicket | None = None,
        *,
        allow_encoded: bool = False,
    ) -> tuple[_Header, dict[str, np.ndarray], dict[str, Encoded]]:
        """The stream's header, its dense tensors and (pushes only) its compressed gradients
        as received (the shard decodes those against their keys)."""
        stream = headed_stream.HeadedStream[_Header](
            request_iterator,
            header_field,
            "stream",
            on_head=(lambda h: ticket.enter(h.worker_id)) if ticket is not None else None,
        )
        tensors: dict[str, np.ndarray] = {}
        encoded: dict[str, Encoded] = {}
        sparse_indices: dict[str, tuple[np.ndarray, tuple[int, ...]]] = {}
        assembler = tensor.TensorAssembler(max_tensor_bytes=self.engine.config.max_tensor_bytes)
        async for frame in stream:
            if ticket is not None and frame.HasField("header"):
                if allow_encoded:
                    self._check_push_size(frame.header)
                ticket.reserve(frame.header.size_bytes)
            done = assembler.feed(frame)
            if done is None:
                continue
            key, array = done
            h = assembler.last_header
            role = h.role if h is not None else tensor_pb2.TENSOR_ROLE_UNSPECIFIED
            if role == tensor_pb2.TENSOR_ROLE_SPARSE_VALUES:
                if key not in sparse_indices:
                    raise MalformedStream(f"sparse values for key {key!r} without indices")
                indices, dense_shape = sparse_indices.pop(key)
                encoded[key] = Encoded(array, indices, dense_shape)
                continue
            if key in tensors or key in encoded or key in sparse_indices:
                raise MalformedStream(f"key {key!r} appears twice in one stream")
            if role == tensor_pb2.TENSOR_ROLE_UNSPECIFIED:
                tensors[key] = array
            elif role == tensor_pb2.TENSOR_ROLE_CAST:
                encoded[key] = Encoded(array)
            elif role == tensor_pb2.TENSOR_ROLE_SPARSE_INDICES and h is not None:
                sparse_indices[key] = (array, tuple(int(d) for d in h.dense_shape))
            else:
                raise MalformedStream(f"key {key!r}: unknown tensor role {role}")
        header = stream.received_head()
        assembler.finish()
        if sparse_indices:
            raise MalformedStream(
                f"sparse indices without values for keys {sorted(sparse_indices)}"
            )
        if encoded and (header_field != "header" or not allow_encoded):
            raise MalformedStream("compressed tensors are accepted in pushes only")
        return header, tensors, encoded

    def _check_push_size(self, header: tensor_pb2.TensorHeader) -> None:
        """Refuse a pushed tensor's claimed size before anything is allocated for it.

        A pushed tensor belongs to a declared key, so its size is known: the dense gradient is
        exactly the key's bytes, a cast or sparse part at most ``numel * 8`` bytes. A client
        cannot make the server allocate more than that, whatever its header claims.

        Raises:
            KeyNotFound: (NOT_FOUND) the key was never declared.
            DTypeMismatch: (INVALID_ARGUMENT) a dense gradient of another dtype than the key's.
            DimensionMismatch: (INVALID_ARGUMENT) the claimed size exceeds the key's bound.
        """
        if not header.key:
            return  # malformed: the assembler names it (MalformedStream) and allocates nothing
        value = self.core.store.get(header.key).value
        if header.role == tensor_pb2.TENSOR_ROLE_UNSPECIFIED:
            try:
                pushed = tensor.dtype_from_wire(header.dtype, header.key)
            except InvalidArgument:
                return  # an unknown wire dtype: the assembler names it (MalformedStream)
            if pushed != value.dtype:
                raise DTypeMismatch(
                    f"gradient for key {shown(header.key)!r} has dtype {pushed} (expected "
                    f"{value.dtype}, shape {tuple(value.shape)}): cast it on the client"
                )
            bound = value.nbytes
        else:
            bound = max(value.nbytes, value.size * 8)
        if header.size_bytes > bound:
            raise DimensionMismatch(
                f"pushed tensor {header.key!r} claims {header.size_bytes} bytes; the key holds "
                f"{value.nbytes} bytes ({value.dtype}, shape {tuple(value.shape)})"
            )

    @grpc_errors
    async def Init(
        self, request_iterator: AsyncIterator[pb.InitRequest], context: ServicerContext
    ) -> pb.InitResponse:
        header, tensors, _ = await self._read_tensors(request_iterator, "header")
        return await self.shard.init(header, tensors)

    @grpc_errors
    async def Push(
        self, request_iterator: AsyncIterator[pb.PushRequest], context: ServicerContext
    ) -> pb.PushResponse:
        with self.engine.backpressure.ticket() as ticket:
            return await self._push(request_iterator, ticket)

    async def _push(
        self, request_iterator: AsyncIterator[pb.PushRequest], ticket: InflightTicket
    ) -> pb.PushResponse:
        header, grads, encoded = await self._read_tensors(
            request_iterator, "header", ticket, allow_encoded=True
        )
        if header.require_keys:  # push_pull over the streams: its pull keys, checked first
            self.core.require_keys(header.require_keys)
        return await self.shard.apply_push_header(header, grads, encoded=encoded)

    @grpc_errors
    async def Pull(  # type: ignore[override]  # also wire bytes: see add_to_server
        self, request: pb.PullRequest, context: ServicerContext
    ) -> AsyncIterator[pb.PullResponse | bytes]:
        shard = self.shard
        keys = await shard.admit_pull(request.worker_id, request.keys, request.timeout_ms)
        yield pb.PullResponse(info=pb.PullInfo(view=shard.view(), version=self.core.version))
        for key in keys:
            # One key at a time: a consistent value per key without holding the whole model
            # twice; each key's frames are made at once, copied once out of the store. Wire
            # bytes: the servicer must be registered by add_to_server (its Pull responses
            # are serialized by paramserver.protocol.wire.serialize).
            for msg in await shard.pull_frame_bytes(key):
                yield msg

    async def Session(  # type: ignore[override]  # writes through context.write, yields none
        self, request_iterator: AsyncIterator[pb.SessionRequest], context: ServicerContext
    ) -> None:
        """One worker client's persistent stream
        (:mod:`paramserver.server.transports.session_service`).

        Reader/writer style (``context.read`` / ``context.write``; cheaper per message than
        async generators). Errors as :func:`grpc_errors` maps them, without its request drain:
        only a protocol violation ends the stream, and a refusal then is final.
        """
        try:
            await self.sessions.serve(context.read, context.write)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await abort_with(context, exc, "Session")

    @grpc_errors
    async def InitTable(
        self, request: tpb.InitTableRequest, context: ServicerContext
    ) -> tpb.InitTableResponse:
        return await self.table_rpcs.init_table(request)

    @grpc_errors
    async def PullRows(  # type: ignore[override]  # also wire bytes: see add_to_server
        self, request_iterator: AsyncIterator[tpb.PullRowsRequest], context: ServicerContext
    ) -> AsyncIterator[tpb.PullRowsResponse | bytes]:
        async for msg in self.table_rpcs.pull_rows(request_iterator):
            yield msg

    @grpc_errors
    async def PushRows(
        self, request_iterator: AsyncIterator[tpb.PushRowsRequest], context: ServicerContext
    ) -> tpb.PushRowsResponse:
        return await self.table_rpcs.push_rows(request_iterator)

    @grpc_errors
    async def PushPullRows(  # type: ignore[override]  # also wire bytes: see add_to_server
        self, request_iterator: AsyncIterator[tpb.PushPullRowsRequest], context: ServicerContext
    ) -> AsyncIterator[tpb.PushPullRowsResponse | bytes]:
        async for msg in self.table_rpcs.push_pull_rows(request_iterator):
            yield msg

    @grpc_errors
    async def PullRowsMany(  # type: ignore[override]  # also wire bytes: see add_to_server
        self, request_iterator: AsyncIterator[tpb.PullRowsManyRequest], context: ServicerContext
    ) -> AsyncIterator[tpb.PullRowsManyResponse | bytes]:
        async for msg in self.table_rpcs.pull_rows_many(request_iterator):
            yield msg

    @grpc_errors
    async def PushRowsMany(
        self, request_iterator: AsyncIterator[tpb.PushRowsManyRequest], context: ServicerContext
    ) -> tpb.PushRowsManyResponse:
        return await self.table_rpcs.push_rows_many(request_iterator)

    @grpc_errors
    async def Clock(self, request: pb.ClockRequest, context: ServicerContext) -> pb.ClockResponse:
        return await self.shard.clock(request)

    @grpc_errors
    async def Status(
        self, request: pb.StatusRequest, context: ServicerContext
    ) -> pb.StatusResponse:
        return await self.status()

    async def status(self) -> pb.StatusResponse:
        """The shard's ``StatusResponse`` (what the Status RPC answers; also the dashboard's)."""
        core = self.core
        now = self.engine.now()
        obs = self.engine.obs
        lease_s = core.cluster.lease_s
        workers = []
        for w in core.cluster.workers.values():
            barrier = obs.barrier.get(w.name)
            workers.append(
                pb.WorkerInfo(
                    worker_id=w.worker_id,
                    worker_name=w.name,
                    clock=w.clock,
                    live=w.live,
                    lease_remaining_ms=(
                        max(0, int((w.lease_expiry_s - now) * 1000)) if w.live else 0
                    ),
                    heartbeat_age_ms=max(0, int((now - (w.lease_expiry_s - lease_s)) * 1000)),
                    barrier_wait_ms=int(barrier.wait_s * 1000) if barrier else 0,
                    barrier_lag_ms=int(barrier.lag_s * 1000) if barrier else 0,
                    barrier_steps=barrier.steps if barrier else 0,
                    applied_updates=core.applied_by_registration.get(w.worker_id, 0),
                )
            )
        keys = []
        for key in core.store.keys():
            entry = core.store.get(key)
            keys.append(
                pb.KeyInfo(
                    key=key,
                    dtype=tensor.dtype_to_wire(entry.value.dtype),
                    shape=list(entry.value.shape),
                    rule=entry.rule.to_proto().kind,
                    updates=entry.updates,
                    size_bytes=int(entry.value.nbytes),
                )
            )
        return pb.StatusResponse(
            view=self.shard.view(),
            aggregation=_AGGREGATION_PB[self.engine.config.aggregation],
            workers=workers,
            keys=keys,
            applied_updates=core.applied_updates,
            duplicate_pushes=core.duplicate_pushes,
            rejected_pushes=core.rejected_pushes,
            dropped_stale=core.dropped_stale,
            bsp_step=core.bsp_step,
            bsp_policy=self.engine.config.death_policy,
            asyncio_tasks=len(asyncio.all_tasks()),
            rss_bytes=_rss_bytes(),
            allow_non_finite=self.engine.config.allow_non_finite,
            tables=self.table_rpcs.infos(),
            inflight_pushes=self.engine.backpressure.total,
            inflight_push_bytes=self.engine.backpressure.bytes,
            refused_backpressure=self.engine.backpressure.refused,
            wal_sequence=self.engine.wal.next_sequence - 1 if self.engine.wal else 0,
            dropped_updates=dict(obs.dropped_by_reason),
            last_checkpoint_age_ms=(
                max(1, int((time.time() - obs.last_checkpoint_unix_s) * 1000))
                if obs.last_checkpoint_unix_s is not None
                else 0
            ),
            last_checkpoint=obs.last_checkpoint_name,
            last_checkpoint_restored=obs.last_checkpoint_restored,
            progress=[
                pb.WorkerProgress(worker_name=name, steps=p.steps, clock=p.clock)
                for name, p in core.progress.items()
            ],
        )

    @grpc_errors
    async def Checkpoint(
        self, request: pb.CheckpointRequest, context: ServicerContext
    ) -> pb.CheckpointResponse:
        host = self.host
        if host is None or host.checkpoints is None:
            raise FailedPrecondition("checkpoints are off: start the server with --checkpoint-dir")
        t0 = time.monotonic()
        path = await host.request_checkpoint()
        wal_sequence = host.checkpoints.last_written_wal_sequence
        return pb.CheckpointResponse(
            path=str(path),
            wal_sequence=wal_sequence,
            duration_ms=int((time.monotonic() - t0) * 1000),
        )

    @grpc_errors
    async def GetShardMap(
        self, request: pb.GetShardMapRequest, context: ServicerContext
    ) -> pb.GetShardMapResponse:
        cfg = self.engine.config
        shard_map = self.host.shard_map if self.host is not None else None
        if shard_map is None:
            shard_map = shard_map_of(cfg, f"{cfg.host}:{cfg.port}")
        return shard_map_to_proto(shard_map, cfg.shard_index)
