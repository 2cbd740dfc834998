"""The rank server's gRPC servicer: ``paramserver.api.v1.RankServer`` for one rank.

One process per rank (``paramserver rank-server``, :mod:`~paramserver.spmd.rank_server.rank_daemon`)
owns that rank's G2 host pool (shared memory), G3 disk pool (one file), G1 device pool (GPU
hosts only) and a handle on the object tier G4, and executes the commands that
:class:`paramserver.spmd.SpmdParallelWorkers` fans out to every rank (after Dynamo KVBM's
``SpmdParallelWorkers`` / ``PhysicalWorker`` split).

Each handler only decodes its request, calls the rank's logic and encodes the answer:

* :mod:`~paramserver.spmd.rank_server.rank_state`: the pools, peers, counters and the one
  command funnel (reservation, invalid-until-done destinations, deadline, cancellation);
* :mod:`~paramserver.spmd.rank_server.transfer`: local transfers and the one remote transfer
  path (onboard | offload; shared memory or gRPC streams);
* :mod:`~paramserver.spmd.rank_server.object_tier`: blocks <-> objects and object streams;
* :mod:`paramserver.serving`: the error mapping every handler wears (:func:`rank_rpc`
  wraps :func:`~paramserver.serving.error_status.grpc_errors`) and, in
  :mod:`~paramserver.spmd.rank_server.rank_daemon`, the ``grpc.aio`` bootstrap.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Any, Literal, Protocol, TypeVar, cast

import grpc
from google.protobuf.message import Message

from paramserver.api.v1 import spmd_pb2, spmd_pb2_grpc
from paramserver.errors import InvalidArgument, MalformedStream
from paramserver.method_handlers import ServicerContext
from paramserver.serving.error_status import grpc_errors
from paramserver.spmd.layout import Tier
from paramserver.spmd.rank_server.object_tier import (
    get_object,
    has_objects,
    key_response,
    object_command,
    put_object,
)
from paramserver.spmd.rank_server.rank_config import RankServerConfig
from paramserver.spmd.rank_server.rank_state import RankState, parse_tier
from paramserver.spmd.rank_server.transfer import (
    Direction,
    RemoteBlocks,
    local_transfer,
    receive_stream,
    remote_transfer,
    send_stream,
)

__all__ = ["RankServicer", "rank_rpc"]

F = TypeVar("F", bound=Callable[..., Any])
H_co = TypeVar("H_co", covariant=True)
C_co = TypeVar("C_co", covariant=True)


class _HeaderOrChunk(Protocol[H_co, C_co]):
    """A client-stream message of ``oneof body {header, chunk}``."""

    @property
    def header(self) -> H_co: ...

    @property
    def chunk(self) -> C_co: ...

    def WhichOneof(self, oneof_group: Literal["body"]) -> str | None: ...


def _cancel_when_rpc_ends(context: ServicerContext) -> Callable[[], None]:
    """Cancel the handler task if the RPC ends (client gone, deadline) while it still runs.

    A belt-and-braces guard: whatever the handler awaits (a peer rank, a worker thread, the
    request stream), it unwinds once its RPC is over, so reservations and temp objects are
    released. (With a client SIGKILLed mid-stream, grpc.aio 1.85 sometimes closes the handler
    coroutine instead of cancelling it; cleanup in ``finally`` blocks is therefore synchronous.)
    Returns the "handler finished" marker to call when the handler returns.
    """
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    finished = False

    def cancel_if_running() -> None:
        if not finished and task is not None and not task.done():
            task.cancel()

    # types-grpcio declares the callback a class of its own, so no function matches it.
    context.add_done_callback(lambda _: loop.call_soon_threadsafe(cancel_if_running))  # type: ignore[arg-type]

    def mark_finished() -> None:
        nonlocal finished
        finished = True

    return mark_finished


@contextlib.contextmanager
def _guarded(servicer: RankServicer, context: ServicerContext) -> Iterator[None]:
    """Count a failure of the handler (not an abort) and cancel it if its RPC ends first."""
    mark_finished = _cancel_when_rpc_ends(context)
    try:
        yield
    except grpc.aio.AbortError:
        raise
    except Exception:
        servicer.count_failure()
        raise
    finally:
        mark_finished()


def rank_rpc(fn: F) -> F:
    """The decorator of every rank-server handler (unary or server-streaming).

    :func:`paramserver.serving.error_status.grpc_errors` maps the errors (a
    :class:`~paramserver.errors.ParamServerError` becomes its status, anything else a logged
    INTERNAL); inside it each failure is counted (``Status.commands_failed``) and the handler is
    cancelled when its RPC ends first (:func:`_cancel_when_rpc_ends`).
    """
    if inspect.isasyncgenfunction(fn):

        @functools.wraps(fn)
        async def streaming(
            self: RankServicer, request: Message, context: ServicerContext
        ) -> AsyncIterator[Message]:
            with _guarded(self, context):
                async for item in fn(self, request, context):
                    yield item

        return cast(F, grpc_errors(streaming))

    @functools.wraps(fn)
    async def unary(self: RankServicer, request: object, context: ServicerContext) -> object:
        with _guarded(self, context):
            return await fn(self, request, context)

    return cast(F, grpc_errors(unary))


def _ids(values: Iterable[int]) -> list[int]:
    return [int(v) for v in values]


def _blocks(request: Message, end: str) -> tuple[Tier, list[int]]:
    """The ``{end}_tier`` and ``{end}_block_ids`` of a request (``end``: src or dst)."""
    what = "source" if end == "src" else "destination"
    return parse_tier(getattr(request, f"{end}_tier"), what), _ids(
        getattr(request, f"{end}_block_ids")
    )


async def _header_then_chunks(
    requests: AsyncIterator[_HeaderOrChunk[H_co, C_co]], rpc: str, prefix: str
) -> tuple[H_co, AsyncIterator[C_co]]:
    """Split a client stream of ``oneof body {header, chunk}`` into its header and chunks.

    Raises:
        MalformedStream: the stream does not start with a header, or repeats it
            (INVALID_ARGUMENT).
    """
    first = await anext(aiter(requests), None)
    if first is None or first.WhichOneof("body") != "header":
        raise MalformedStream(f"{prefix}: {rpc} must start with a header")

    async def chunks() -> AsyncIterator[C_co]:
        async for message in requests:
            if message.WhichOneof("body") != "chunk":
                raise MalformedStream(f"{prefix}: second header in {rpc}")
            yield message.chunk

    return first.header, chunks()


class RankServicer(spmd_pb2_grpc.RankServerServicer):
    """Implements ``paramserver.api.v1.RankServer`` for one rank (decode, call, encode).

    Construct with :meth:`create` (allocates the pools); call :meth:`close` to release them.

    Attributes:
        state: the rank (:class:`~paramserver.spmd.rank_server.rank_state.RankState`).
    """

    def __init__(self, state: RankState) -> None:
        self.state = state

    @classmethod
    def create(cls, config: RankServerConfig) -> RankServicer:
        """Allocate the pools and the object store described by ``config``.

        Raises:
            TierNotRegistered: ``device_blocks > 0`` on a host without a GPU
                (FAILED_PRECONDITION).
        """
        return cls(RankState.create(config))

    def count_failure(self) -> None:
        """Count one failed RPC (called by :func:`rank_rpc`)."""
        self.state.failed += 1

    async def close(self) -> None:
        """Close peer channels, unmap peer segments, release every pool (idempotent)."""
        await self.state.close()

    # ------------------------------------------------------------------ metadata

    @rank_rpc
    async def ExportMetadata(
        self, request: spmd_pb2.ExportMetadataRequest, context: ServicerContext
    ) -> spmd_pb2.RankMetadata:
        return self.state.metadata()

    @rank_rpc
    async def ImportMetadata(
        self, request: spmd_pb2.ImportMetadataRequest, context: ServicerContext
    ) -> spmd_pb2.ImportMetadataResponse:
        replaced = await self.state.import_remote(request.remote)
        return spmd_pb2.ImportMetadataResponse(replaced=replaced)

    @rank_rpc
    async def ForgetRemote(
        self, request: spmd_pb2.ForgetRemoteRequest, context: ServicerContext
    ) -> spmd_pb2.ForgetRemoteResponse:
        return spmd_pb2.ForgetRemoteResponse(
            removed=await self.state.forget_remote(request.instance_id)
        )

    # ------------------------------------------------------------------ transfers

    @rank_rpc
    async def LocalTransfer(
        self, request: spmd_pb2.LocalTransferRequest, context: ServicerContext
    ) -> spmd_pb2.TransferResponse:
        return await local_transfer(
            self.state,
            request.options,
            context,
            _blocks(request, "src"),
            _blocks(request, "dst"),
        )

    @rank_rpc
    async def RemoteOnboard(
        self, request: spmd_pb2.RemoteOnboardRequest, context: ServicerContext
    ) -> spmd_pb2.TransferResponse:
        return await self._remote(Direction.ONBOARD, request, context)

    @rank_rpc
    async def RemoteOffload(
        self, request: spmd_pb2.RemoteOffloadRequest, context: ServicerContext
    ) -> spmd_pb2.TransferResponse:
        return await self._remote(Direction.OFFLOAD, request, context)

    async def _remote(
        self,
        direction: Direction,
        request: spmd_pb2.RemoteOnboardRequest | spmd_pb2.RemoteOffloadRequest,
        context: ServicerContext,
    ) -> spmd_pb2.TransferResponse:
        """Both remote RPCs: the local blocks (the destination onboard, the source offload) and
        the other end, objects or a connected peer's layout."""
        onboard = direction is Direction.ONBOARD
        local = _blocks(request, "dst" if onboard else "src")
        end = "source" if onboard else "destination"
        which = (
            request.WhichOneof("source")
            if isinstance(request, spmd_pb2.RemoteOnboardRequest)
            else request.WhichOneof("destination")
        )
        name = f"remote_{direction.value}"
        if which == "object":
            hashes = _ids(request.object.sequence_hashes)
            response, _ = await object_command(
                self.state, direction, name, request.options, context, local, hashes, per_key=False
            )
            return response
        if which != "layout":
            raise InvalidArgument(f"{self.state.prefix}: {direction.value} without a {end}")
        return await remote_transfer(
            self.state,
            direction,
            request.options,
            context,
            local,
            RemoteBlocks(request.layout, f"remote {end}"),
            allow_shared_memory=isinstance(request, spmd_pb2.RemoteOnboardRequest)
            and request.allow_shared_memory,
        )

    # ------------------------------------------------------------------ object tier

    @rank_rpc
    async def HasObjects(
        self, request: spmd_pb2.HasObjectsRequest, context: ServicerContext
    ) -> spmd_pb2.HasObjectsResponse:
        return await has_objects(self.state, _ids(request.sequence_hashes))

    @rank_rpc
    async def PutBlocks(
        self, request: spmd_pb2.PutBlocksRequest, context: ServicerContext
    ) -> spmd_pb2.ObjectBlocksResponse:
        return await self._per_key(Direction.OFFLOAD, "put_blocks", request, context)

    @rank_rpc
    async def GetBlocks(
        self, request: spmd_pb2.GetBlocksRequest, context: ServicerContext
    ) -> spmd_pb2.ObjectBlocksResponse:
        return await self._per_key(Direction.ONBOARD, "get_blocks", request, context)

    async def _per_key(
        self,
        direction: Direction,
        name: str,
        request: spmd_pb2.PutBlocksRequest | spmd_pb2.GetBlocksRequest,
        context: ServicerContext,
    ) -> spmd_pb2.ObjectBlocksResponse:
        blocks = _blocks(request, "dst" if direction is Direction.ONBOARD else "src")
        hashes = _ids(request.sequence_hashes)
        response, results = await object_command(
            self.state, direction, name, request.options, context, blocks, hashes, per_key=True
        )
        return key_response(self.state, results, response.bytes_moved)

    @rank_rpc
    async def PutObject(
        self,
        request_iterator: AsyncIterator[spmd_pb2.PutObjectRequest],
        context: ServicerContext,
    ) -> spmd_pb2.PutObjectResponse:
        self.state.object_store()  # no object tier: refused before the stream is read
        header, chunks = await _header_then_chunks(request_iterator, "PutObject", self.state.prefix)
        return await put_object(self.state, header, chunks, context)

    @rank_rpc
    async def GetObject(
        self, request: spmd_pb2.GetObjectRequest, context: ServicerContext
    ) -> AsyncIterator[spmd_pb2.GetObjectResponse]:
        async for message in get_object(self.state, int(request.sequence_hash)):
            yield message

    # ------------------------------------------------------------------ block streams

    @rank_rpc
    async def ReadBlocks(
        self, request: spmd_pb2.ReadBlocksRequest, context: ServicerContext
    ) -> AsyncIterator[spmd_pb2.BlockChunk]:
        async for chunk in send_stream(self.state, request):
            yield chunk

    @rank_rpc
    async def WriteBlocks(
        self,
        request_iterator: AsyncIterator[spmd_pb2.WriteBlocksRequest],
        context: ServicerContext,
    ) -> spmd_pb2.WriteBlocksResponse:
        header, chunks = await _header_then_chunks(
            request_iterator, "WriteBlocks", self.state.prefix
        )
        written = await receive_stream(self.state, header, chunks, context)
        return spmd_pb2.WriteBlocksResponse(bytes_written=written)

    @rank_rpc
    async def CheckBlocks(
        self, request: spmd_pb2.CheckBlocksRequest, context: ServicerContext
    ) -> spmd_pb2.CheckBlocksResponse:
        ids = _ids(request.block_ids)
        pool = self.state.checked_pool(
            parse_tier(request.tier, "check"), ids, request.incarnation_id
        )
        return spmd_pb2.CheckBlocksResponse(invalid_block_ids=[b for b in ids if not pool.valid[b]])

    @rank_rpc
    async def Status(
        self, request: spmd_pb2.RankStatusRequest, context: ServicerContext
    ) -> spmd_pb2.RankStatusResponse:
        s = self.state
        return spmd_pb2.RankStatusResponse(
            instance_id=s.config.instance_id,
            rank=s.rank,
            incarnation_id=s.incarnation_id,
            inflight_commands=s.inflight,
            object_writes_in_progress=s.store.writes_in_progress if s.store else 0,
            commands_completed=s.completed,
            commands_failed=s.failed,
            remote_instances=len(s.remotes),
            bytes_moved=s.bytes_moved,
        )
