"""The chunked gRPC streams of the ``ParameterServer`` service as a :class:`Transport`.

One call per request: ``Push`` (tensor frames, any size, compressed gradients too), ``Pull``
(frames reassembled into the client's recycled pull buffers), ``PushRows`` / ``PullRows`` /
``PushPullRows`` (chunked as ``tables.proto`` describes). It never declines a request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, Callable, Iterator
from typing import Any, Literal, Protocol, TypeVar

import grpc
import numpy as np

from paramserver.api.v1 import parameter_server_pb2 as pb
from paramserver.api.v1 import tables_pb2 as tpb
from paramserver.errors import REFUSAL_METADATA_KEY, MalformedStream
from paramserver.protocol import headed_stream, rows_wire, tensor
from paramserver.worker_client.pull_buffers import PullBuffers
from paramserver.worker_client.transport.base import (
    IdArray,
    PullResult,
    PullSpec,
    PushPayload,
    RowPush,
)

__all__ = ["SEND_CHUNK_BYTES", "StreamTransport", "read_rows"]

#: Payload bytes per frame sent to the server: 16 KiB under 1 MiB, so a whole message (frame
#: header, key, shape, proto framing) stays within a server receive limit as low as 1 MiB.
SEND_CHUNK_BYTES = tensor.DEFAULT_CHUNK_BYTES - (16 << 10)


class StreamTransport:
    """One Push / Pull / PushRows / PullRows stream per request.

    Args:
        stub: Returns the client's ``ParameterServerStub`` (the channel may be reopened).
        pull_buffers: Where pulled values are assembled (recycled memory).
        sizes: key -> payload bytes, updated by every pull (the Session's record of sizes:
            the next pull of these keys is placed up front, or skips the Session).
    """

    def __init__(
        self,
        stub: Callable[[], Any],
        pull_buffers: PullBuffers,
        sizes: dict[str, int] | None = None,
    ) -> None:
        self._stub = stub
        self.pull_buffers = pull_buffers
        self.sizes = sizes

    @property
    def ready(self) -> bool:
        """Always: every request opens its own stream."""
        return True

    def close(self) -> None:
        """Nothing to release (each stream ends with its request)."""

    async def push(self, push: PushPayload) -> pb.PushResponse:
        """Push over a Push stream (stops sending at once when the server announces a
        refusal in its initial metadata)."""
        return await self._push(push.header(), push)

    async def _push(self, header: pb.PushHeader, push: PushPayload) -> pb.PushResponse:
        refused = asyncio.Event()
        parts = push.parts

        def messages() -> Iterator[pb.PushRequest | bytes]:
            yield pb.PushRequest(header=header)
            for key, key_parts in parts.items():
                for part in key_parts:
                    # Wire bytes of the frames (paramserver.protocol.wire: the payload copied
                    # once).
                    for frame in tensor.encode_frame_bytes(
                        key,
                        part.array,
                        SEND_CHUNK_BYTES,
                        role=part.role,
                        dense_shape=part.dense_shape,
                    ):
                        if refused.is_set():
                            return  # half-close: the refusal's status follows at once
                        yield frame

        call = self._stub().Push(messages(), timeout=push.deadline_s)
        watch = asyncio.ensure_future(_watch_refusal(call, refused))
        try:
            resp: pb.PushResponse = await call
            return resp
        finally:
            watch.cancel()

    async def pull(self, pull: PullSpec, *, record_sizes: bool = True) -> PullResult:
        """Pull over a Pull stream; values are always fresh arrays (``pull.copy`` has no
        effect). ``record_sizes``: update ``sizes`` with the pulled values' sizes."""
        call = self._stub().Pull(pull.request, timeout=pull.deadline_s)
        buffers = self.pull_buffers
        info, out = await headed_stream.read_headed_stream(
            call, head="info", what="pull stream", allocate=buffers.empty
        )
        for key, value in out.items():
            buffers.keep(key, value)
        if record_sizes and self.sizes is not None:
            self.sizes.update((k, v.nbytes) for k, v in out.items())
        return info, out

    async def push_pull(self, push: PushPayload, pull: PullSpec) -> tuple[pb.PushResponse, None]:
        """The push, refused unapplied by the server when a pull key does not exist; the
        values are then pulled separately (this returns None for them)."""
        header = push.header()
        header.require_keys.extend(pull.request.keys)
        return await self._push(header, push), None

    async def pull_rows(
        self, header: tpb.RowsHeader, ids: IdArray, deadline_s: float
    ) -> np.ndarray:
        """Rows over a PullRows stream (ids chunked after the header)."""

        def requests() -> Iterator[tpb.PullRowsRequest | bytes]:
            yield tpb.PullRowsRequest(header=header)
            yield from rows_wire.chunk_messages(ids, None)

        return await read_rows(self._stub().PullRows(requests(), timeout=deadline_s), header.table)

    async def push_rows(
        self, header: tpb.RowsHeader, rows: RowPush, deadline_s: float
    ) -> tpb.PushRowsResponse:
        """Rows over a PushRows stream (the header also names count, dtype and dim)."""
        full = rows.header(header)
        chunks = rows.chunks

        def requests() -> Iterator[tpb.PushRowsRequest | bytes]:
            yield tpb.PushRowsRequest(header=full)
            yield from chunks

        resp: tpb.PushRowsResponse = await self._stub().PushRows(requests(), timeout=deadline_s)
        return resp

    async def push_pull_rows(
        self, header: tpb.RowsHeader, rows: RowPush, pull_ids: IdArray, deadline_s: float
    ) -> tuple[tpb.PushRowsResponse, np.ndarray]:
        """A row push, then a row pull, over one PushPullRows stream (the push's chunks, then
        the pull's ids)."""
        fused = tpb.PushPullRowsHeader(
            push=rows.header(header), pull_num_ids=int(pull_ids.shape[0])
        )
        chunks = rows.chunks

        def requests() -> Iterator[tpb.PushPullRowsRequest | bytes]:
            yield tpb.PushPullRowsRequest(header=fused)
            yield from chunks
            yield from rows_wire.chunk_messages(pull_ids, None)

        stream = self._stub().PushPullRows(requests(), timeout=deadline_s)
        info, got = await _read_rows_reply(stream, header.table, "PushPullRowsInfo", _pulled)
        return info.pushed, got


InfoT = TypeVar("InfoT")
InfoT_co = TypeVar("InfoT_co", covariant=True)


class _RowsReply(Protocol[InfoT_co]):
    """A message of a ``PullRows`` or ``PushPullRows`` reply stream: an info, or rows."""

    @property
    def info(self) -> InfoT_co: ...

    @property
    def chunk(self) -> rows_wire.RowsChunkLike: ...

    def WhichOneof(self, oneof_group: Literal["body"], /) -> str | None: ...


def _pulled(info: tpb.PushPullRowsInfo) -> tpb.PullRowsInfo:
    return info.pulled


def _same(info: tpb.PullRowsInfo) -> tpb.PullRowsInfo:
    return info


async def read_rows(stream: AsyncIterable[tpb.PullRowsResponse], table: str) -> np.ndarray:
    """The rows of a ``PullRows`` reply stream: (num_ids, dim) of the table's dtype.

    Raises:
        MalformedStream: info missing, repeated or after rows; rows that do not add up.
    """
    return (await _read_rows_reply(stream, table, "PullRowsInfo", _same))[1]


async def _read_rows_reply(
    stream: AsyncIterable[_RowsReply[InfoT]],
    table: str,
    info_name: str,
    rows_info: Callable[[InfoT], tpb.PullRowsInfo],
) -> tuple[InfoT, np.ndarray]:
    """A ``PullRows`` or ``PushPullRows`` reply stream: its info message (a ``PullRowsInfo``,
    or a ``PushPullRowsInfo`` whose ``pulled`` describes the rows: ``rows_info`` says which)
    and the rows, (num_ids, dim) of the table's dtype.

    Raises:
        MalformedStream: info missing, repeated or after rows; rows that do not add up.
    """
    receiver: rows_wire.RowsReceiver | None = None
    first: InfoT | None = None
    async for msg in stream:
        which = msg.WhichOneof("body")
        if which == "info":
            if receiver is not None:
                raise MalformedStream(f"table {table!r}: a second {info_name}")
            first = msg.info
            info = rows_info(first)
            dtype = tensor.dtype_from_wire(info.dtype, table)
            receiver = rows_wire.RowsReceiver(
                f"table {table!r}", int(info.num_ids), int(info.dim), dtype, with_ids=False
            )
        elif receiver is None:
            raise MalformedStream(f"table {table!r}: rows before the {info_name}")
        else:
            receiver.feed(msg.chunk)
    if receiver is None or first is None:
        raise MalformedStream(f"table {table!r}: empty reply without a {info_name}")
    return first, receiver.finish()[1]


async def _watch_refusal(call: grpc.aio.Call, refused: asyncio.Event) -> None:
    """Set ``refused`` when the server announces a refusal of the stream being written
    (:data:`~paramserver.errors.REFUSAL_METADATA_KEY` in the initial metadata)."""
    try:
        metadata = await call.initial_metadata()
    except Exception:  # the call failed: its own await reports that
        return
    if any(key == REFUSAL_METADATA_KEY for key, _ in metadata or ()):
        refused.set()
