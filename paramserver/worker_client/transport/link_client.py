"""Client end of the same-host local link (:mod:`paramserver.server.transports.link_service`).

:class:`LocalLinkCall` stands in for the gRPC ``Session`` call inside
:class:`~paramserver.worker_client.transport.session_stream.SessionTransport` once the session
moved onto the link: the same ``write`` / ``read`` / ``cancel``, the same ``SessionRequest`` /
``SessionResponse`` messages, framed by a 4-byte little-endian length on a Unix-domain stream
socket.
"""

from __future__ import annotations

import asyncio
import collections
import socket
from typing import cast

import grpc

from paramserver.api.v1 import parameter_server_pb2 as pb
from paramserver.errors import MalformedStream
from paramserver.protocol.link import FrameReader, socket_address, write_frame

#: Largest response frame accepted (bytes): inline values are at most ~1 MiB per message.
MAX_RESPONSE_FRAME_BYTES = 64 << 20


class _Protocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.frames = FrameReader(pb.SessionResponse, MAX_RESPONSE_FRAME_BYTES)
        self.queue: collections.deque[pb.SessionResponse] = collections.deque()
        self.waiter: asyncio.Future[None] | None = None
        self.closed = False
        self.error: Exception | None = None
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # (uvloop's is not a subclass)

    def data_received(self, data: bytes) -> None:
        try:
            self.queue.extend(self.frames.feed(data))
        except MalformedStream as exc:
            self.error = exc
            self.closed = True
            if self.transport is not None:
                self.transport.close()
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class LocalLinkCall:
    """One session on the server's local-link socket (use :meth:`connect`)."""

    __slots__ = ("_p", "_transport")

    def __init__(self, transport: asyncio.Transport, protocol: _Protocol) -> None:
        self._transport = transport
        self._p = protocol

    @classmethod
    async def connect(cls, address: str, timeout_s: float) -> LocalLinkCall:
        """Connect to ``address`` (a ``LocalLink.address``).

        Raises:
            OSError: no such socket here (another host or network namespace), refused.
            TimeoutError: no connection within ``timeout_s`` seconds.
        """
        loop = asyncio.get_running_loop()
        # A socket of our own: uvloop refuses abstract names as paths (EINVAL).
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            await asyncio.wait_for(loop.sock_connect(sock, socket_address(address)), timeout_s)
            transport, protocol = await loop.create_unix_connection(_Protocol, sock=sock)
        except BaseException:
            sock.close()
            raise
        return cls(transport, protocol)

    async def write(self, req: pb.SessionRequest) -> None:
        """Send one request (buffered by the transport: one request is in flight at a time).

        Raises:
            ConnectionResetError: the link is closed.
        """
        if self._p.closed or self._transport.is_closing():
            raise ConnectionResetError("local link closed")
        write_frame(self._transport, req)

    async def read(self) -> pb.SessionResponse | object:
        """The next response, or ``grpc.aio.EOF`` once the server closed the link (typed as
        ``StreamStreamCall.read`` is: grpc's stubs type ``EOF`` as a plain object).

        Raises:
            MalformedStream: the server sent a frame that is not a ``SessionResponse``.
        """
        p = self._p
        while not p.queue:
            if p.closed:
                if p.error is not None:
                    raise p.error
                return grpc.aio.EOF
            p.waiter = asyncio.get_running_loop().create_future()
            await p.waiter
        return p.queue.popleft()

    def cancel(self) -> None:
        """Close the link (the server sees the connection end)."""
        self._p.closed = True
        self._transport.close()
