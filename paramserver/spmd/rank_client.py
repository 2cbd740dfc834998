"""Async client of one rank server (one ``grpc.aio`` channel, bound to one event loop).

:class:`RankClient` is what :class:`paramserver.spmd.SpmdParallelWorkers` holds per rank; it is
also usable alone (tests, tools). Construction opens nothing: the channel is created by
:meth:`RankClient.open` (or ``async with``) inside the running loop, and a client refuses to be
used from any other loop (no channel is ever cached across event loops; case
``event-loops.md``). Every failed RPC goes through the client funnel
:func:`paramserver.errors.from_rpc_error`, its message prefixed with the rank and address.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
import numpy as np
import numpy.typing as npt
from google.protobuf.message import Message

from paramserver.api.v1 import spmd_pb2, spmd_pb2_grpc
from paramserver.closing import AsyncClosing
from paramserver.errors import FailedPrecondition, MalformedStream, ParamServerError, from_rpc_error
from paramserver.security.tls import ClientSecurity, open_channel
from paramserver.spmd.layout import Tier
from paramserver.spmd.planning import MAX_CHUNK_BYTES
from paramserver.spmd.rank_server.rank_config import CHANNEL_OPTIONS

if TYPE_CHECKING:
    from paramserver.api.v1.spmd_pb2_grpc import RankServerAsyncStub

__all__ = ["RankClient", "rank_error"]

_Request = TypeVar("_Request", bound=Message)


def rank_error(rank: int, address: str, exc: BaseException) -> ParamServerError:
    """Turn a failed call to rank ``rank`` into a :class:`ParamServerError` naming that rank.

    The class and status code come from :func:`~paramserver.errors.from_rpc_error` for RPC
    errors (DEADLINE_EXCEEDED when the client deadline passed, UNAVAILABLE when the rank server
    is gone); other exceptions become INTERNAL.
    """
    if isinstance(exc, grpc.aio.AioRpcError):
        base = from_rpc_error(exc)
        detail = exc.details() or exc.code().name
        if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "rank" not in detail:
            detail = f"no answer before the command deadline ({detail}); its work is cancelled"
        err = type(base)(f"rank {rank} ({address}): {detail}")
        err.code = base.code
        return err
    if isinstance(exc, ParamServerError):
        err = type(exc)(f"rank {rank} ({address}): {exc.message}")
        err.code = exc.code
        return err
    return ParamServerError(f"rank {rank} ({address}): {type(exc).__name__}: {exc}")


async def _client_stream(
    request: Callable[..., _Request],
    header: Message,
    chunk: Callable[..., Message],
    payload: memoryview,
    chunk_bytes: int,
) -> AsyncIterator[_Request]:
    """A client stream of ``oneof body {header, chunk}``: the header, then ``payload`` in
    chunks of at most ``chunk_bytes`` bytes, each with its offset."""
    yield request(header=header)
    for pos in range(0, len(payload), chunk_bytes):
        yield request(chunk=chunk(offset_bytes=pos, data=bytes(payload[pos : pos + chunk_bytes])))


class RankClient(AsyncClosing):
    """Client of the rank server for ``rank`` at ``address``.

    Args:
        address: ``host:port`` of the rank server.
        rank: the rank index this address should serve (checked against its metadata by the
            group).
        security: TLS / mutual TLS and bearer token of the channel
            (:class:`paramserver.security.tls.ClientSecurity`); None: plain text, no token.
    """

    def __init__(self, address: str, rank: int, security: ClientSecurity | None = None) -> None:
        self.address = address
        self.rank = rank
        self.security = security
        self._channel: grpc.aio.Channel | None = None
        self._stub: RankServerAsyncStub | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def open(self) -> RankClient:
        """Create the channel in the running loop (idempotent within that loop)."""
        loop = asyncio.get_running_loop()
        if self._channel is not None:
            self._check_loop()
            return self
        self._channel = open_channel(self.address, self.security, CHANNEL_OPTIONS)
        self._stub = spmd_pb2_grpc.RankServerStub(self._channel)
        self._loop = loop
        return self

    async def close(self) -> None:
        """Close the channel (idempotent)."""
        channel, self._channel = self._channel, None
        self._stub = None
        if channel is not None:
            await channel.close(grace=None)

    def _check_loop(self) -> None:
        if self._channel is None:
            raise FailedPrecondition(f"rank {self.rank} client is not open (use async with)")
        if asyncio.get_running_loop() is not self._loop:
            raise FailedPrecondition(
                f"rank {self.rank} client belongs to another event loop; create a client per "
                "loop (channels are never shared across loops)"
            )

    @property
    def stub(self) -> RankServerAsyncStub:
        """The ``RankServerStub`` (checks that the caller runs in the client's loop)."""
        self._check_loop()
        assert self._stub is not None  # open: it has a channel
        return self._stub

    async def unary(self, method: str, request: object, timeout_s: float | None) -> Any:
        """Call a unary RPC by name.

        Raises:
            ParamServerError: the rank's refusal or a transport failure, naming the rank.
        """
        try:
            return await getattr(self.stub, method)(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise rank_error(self.rank, self.address, exc) from exc

    async def status(self, timeout_s: float = 5.0) -> spmd_pb2.RankStatusResponse:
        """The rank server's counters."""
        result: spmd_pb2.RankStatusResponse = await self.unary(
            "Status", spmd_pb2.RankStatusRequest(), timeout_s
        )
        return result

    async def export_metadata(self, timeout_s: float = 10.0) -> spmd_pb2.RankMetadata:
        """The rank's metadata."""
        result: spmd_pb2.RankMetadata = await self.unary(
            "ExportMetadata", spmd_pb2.ExportMetadataRequest(), timeout_s
        )
        return result

    async def read_blocks(
        self,
        tier: Tier,
        block_ids: Sequence[int],
        bytes_per_block: int,
        *,
        timeout_s: float = 30.0,
        incarnation_id: str = "",
    ) -> bytearray:
        """The bytes of ``block_ids`` of ``tier``, concatenated in request order.

        Returns:
            ``len(block_ids) * bytes_per_block`` bytes.

        Raises:
            ParamServerError: refusal (e.g. BlockNotValid: FAILED_PRECONDITION) or a short
                stream (MalformedStream: INVALID_ARGUMENT), naming the rank.
        """
        out = bytearray(len(block_ids) * bytes_per_block)
        view = memoryview(out)
        pos = 0
        request = spmd_pb2.ReadBlocksRequest(
            tier=tier.wire, block_ids=list(block_ids), incarnation_id=incarnation_id
        )
        try:
            async for chunk in self.stub.ReadBlocks(request, timeout=timeout_s):
                n = len(chunk.data)
                if chunk.offset_bytes != pos or pos + n > len(out):
                    raise MalformedStream(
                        f"rank {self.rank}: chunk at {chunk.offset_bytes}+{n}, expected {pos}"
                    )
                view[pos : pos + n] = chunk.data
                pos += n
        except grpc.aio.AioRpcError as exc:
            raise rank_error(self.rank, self.address, exc) from exc
        if pos != len(out):
            raise MalformedStream(f"rank {self.rank}: read returned {pos} of {len(out)} bytes")
        return out

    async def write_blocks(
        self,
        tier: Tier,
        block_ids: Sequence[int],
        data: bytes | bytearray | memoryview | npt.NDArray[np.generic],
        *,
        timeout_s: float = 30.0,
        incarnation_id: str = "",
    ) -> int:
        """Overwrite ``block_ids`` of ``tier`` with ``data`` (their bytes in request order).

        Args:
            tier: destination tier.
            block_ids: unique destination ids, length n.
            data: ``n * bytes_per_block`` bytes, or an array with that many bytes (C order).
            timeout_s: deadline, seconds.
            incarnation_id: expected incarnation of the rank server, or empty.

        Returns:
            Bytes written.
        """
        if isinstance(data, np.ndarray):
            payload = np.ascontiguousarray(data).view(np.uint8).reshape(-1).data
        else:
            payload = memoryview(data).cast("B")

        header = spmd_pb2.WriteBlocksHeader(
            tier=tier.wire,
            block_ids=list(block_ids),
            incarnation_id=incarnation_id,
            timeout_ms=int(timeout_s * 1000),
        )
        requests = _client_stream(
            spmd_pb2.WriteBlocksRequest, header, spmd_pb2.BlockChunk, payload, MAX_CHUNK_BYTES
        )
        response = await self.unary("WriteBlocks", requests, timeout_s)
        return int(response.bytes_written)

    async def put_object(
        self,
        sequence_hash: int,
        data: bytes | bytearray | memoryview,
        *,
        timeout_s: float = 60.0,
        chunk_bytes: int = MAX_CHUNK_BYTES,
    ) -> bool:
        """Store ``data`` as object ``"{rank}/{sequence_hash}"``, streamed in chunks.

        Returns:
            True when this call committed it; False when it was already present (success).
        """
        payload = memoryview(data).cast("B")

        header = spmd_pb2.PutObjectHeader(
            sequence_hash=sequence_hash, size_bytes=len(payload), timeout_ms=int(timeout_s * 1000)
        )
        requests = _client_stream(
            spmd_pb2.PutObjectRequest, header, spmd_pb2.DataChunk, payload, chunk_bytes
        )
        response = await self.unary("PutObject", requests, timeout_s)
        return bool(response.status == spmd_pb2.KEY_STATUS_STORED)

    async def get_object(self, sequence_hash: int, *, timeout_s: float = 60.0) -> bytes:
        """The whole object ``"{rank}/{sequence_hash}"``.

        Raises:
            KeyNotFound: absent (NOT_FOUND), naming the rank.
            MalformedStream: the stream disagrees with its announced size (INVALID_ARGUMENT).
        """
        # The announced size is the server's claim, not trusted for allocation: the buffer
        # grows with the bytes that actually arrive, and may never pass the claim.
        out = bytearray()
        size: int | None = None
        try:
            call = self.stub.GetObject(
                spmd_pb2.GetObjectRequest(sequence_hash=sequence_hash), timeout=timeout_s
            )
            async for message in call:
                if message.WhichOneof("body") == "info":
                    if size is not None:
                        raise MalformedStream(f"rank {self.rank}: second object info")
                    size = int(message.info.size_bytes)
                    continue
                if size is None:
                    raise MalformedStream(f"rank {self.rank}: object chunk before its info")
                data = message.chunk.data
                if message.chunk.offset_bytes != len(out) or len(out) + len(data) > size:
                    raise MalformedStream(
                        f"rank {self.rank}: object chunk at {message.chunk.offset_bytes}+"
                        f"{len(data)} out of order or past the announced {size} bytes"
                    )
                out += data
        except grpc.aio.AioRpcError as exc:
            raise rank_error(self.rank, self.address, exc) from exc
        if size is None or len(out) != size:
            raise MalformedStream(
                f"rank {self.rank}: object stream ended after {len(out)} of {size} bytes"
            )
        return bytes(out)

    async def has_objects(
        self, sequence_hashes: Sequence[int], *, timeout_s: float = 10.0
    ) -> dict[int, int | None]:
        """sequence hash -> object size in bytes, or ``None`` when absent."""
        response = await self.unary(
            "HasObjects",
            spmd_pb2.HasObjectsRequest(sequence_hashes=list(sequence_hashes)),
            timeout_s,
        )
        return {
            int(o.sequence_hash): (int(o.size_bytes) if o.present else None)
            for o in response.objects
        }
