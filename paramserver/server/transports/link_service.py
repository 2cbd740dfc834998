"""Same-host local link: the Session protocol over a Unix-domain stream socket.

A worker on the server's host spends most of a small round in gRPC's machinery, not in the
parameter server (a 1,000-element push+pull costs ~250 us of gRPC per round trip on a 2-core
VM, against ~50 us of the server's own work). BytePS answers the same cost with shared memory
and a local socket between the co-located worker and server processes; this is ours:

1. The worker opens its ``Session`` over gRPC as usual (authenticated, TLS if configured) and
   asks for a local link (``SessionOpen.want_local_link``).
2. The server answers with a :class:`LocalLink`: a socket address (a Linux abstract socket,
   ``@paramserver-<pid>-<hex>``) and a ticket of 16 random bytes, valid once, for that worker
   id, for :data:`TICKET_TTL_S` seconds.
3. The worker connects and sends ``SessionOpen`` with the ticket; from then on the very same
   ``SessionRequest``/``SessionResponse`` messages travel over the socket, each framed by a
   4-byte little-endian length, served by the same :meth:`SessionService.serve` (so dedup,
   back-pressure, the WAL commit, shared-memory slots and every error code are those of the
   gRPC Session). The worker then ends its gRPC Session.

A worker that cannot reach the socket (another host, another network namespace) or whose
ticket is refused stays on the gRPC Session. Without a ticket nothing is served: the socket
answers a wrong first message with an UNAUTHENTICATED ``SessionError`` and closes. The server
keeps its tickets in memory only; they die with it, and so does the abstract socket (no file
to clean up).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import secrets
import socket
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar, cast

import grpc

from paramserver.api.v1 import parameter_server_pb2 as pb
from paramserver.errors import MalformedStream, Unauthenticated
from paramserver.protocol.link import FrameReader, socket_address, write_frame
from paramserver.security.tokens import CALLER_WORKER_NAME
from paramserver.server.observability.hooks import CURRENT_RPC
from paramserver.server.transports.session_service import error_response

if TYPE_CHECKING:
    from paramserver.server.transports.session_service import SessionService

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

#: Seconds a ticket stays valid after the gRPC Session handed it out.
TICKET_TTL_S = 30.0
#: The ``rpc`` label of pushes and pulls served on the local link (metrics).
LOCAL_LINK_RPC = "LocalLink"
#: Most tickets outstanding at once (a client asking again and again cannot grow the table).
MAX_TICKETS = 4096
#: Most tickets outstanding per worker id: a worker asking for more replaces its own oldest,
#: so no worker can evict another worker's ticket by asking again and again.
MAX_TICKETS_PER_WORKER = 4
#: Seconds a new connection has to present its ticket.
OPEN_DEADLINE_S = 10.0
#: Largest frame (bytes) a connection may send before its ticket is redeemed: an open.
PRE_TICKET_FRAME_BYTES = 4096
#: Most connections at once that have not presented a ticket yet. One more closes the *oldest*
#: of them, never the newcomer: a worker presents its ticket at once, so a local process holding
#: idle connections cannot keep a ticketed worker off the link.
MAX_UNREDEEMED = 64
#: Frames parsed ahead of the handler before the socket stops being read (back-pressure).
_MAX_QUEUED = 8


class _Connection(asyncio.Protocol):
    """One local-link connection: frames in, :meth:`read` / :meth:`write` for the session.

    Back-pressure both ways: the socket is not read while :data:`_MAX_QUEUED` requests wait
    for the handler or while the client does not read its responses (the transport's write
    buffer is over its high-water mark), and :meth:`write` waits for that buffer to drain.
    """

    def __init__(self, link: LocalLinkServer) -> None:
        self._link = link
        # Until its ticket is redeemed a connection may send only a small open message.
        self._frames = FrameReader(pb.SessionRequest, PRE_TICKET_FRAME_BYTES)
        self._queue: collections.deque[pb.SessionRequest] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._drained: asyncio.Future[None] | None = None
        self._closed = False
        self._write_blocked = False  # the client is not reading its responses
        self._reading = True
        self._ticket_ok = False
        self._open_parsed = False  # the first frame (which must be the open) was parsed
        #: seq of the last request handed to the session (for a protocol-violation answer).
        self.last_seq = 0
        self.transport: asyncio.Transport | None = None
        self.task: asyncio.Task[None] | None = None

    # ---------------------------------------------------------------- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # (uvloop's is not a subclass)
        self.task = asyncio.get_running_loop().create_task(
            self._link._serve(self), name="paramserver-local-link"
        )

    def data_received(self, data: bytes) -> None:
        try:
            frames = self._frames.feed(data, self._room())
        except MalformedStream as exc:
            logger.warning("local link closed: %s", exc)
            self._close()
            return
        if frames:
            self._open_parsed = True
            self._queue.extend(frames)
            self._wake()
        self._update_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._wake()
        self._release_writer()

    def pause_writing(self) -> None:  # the client is not reading: stop reading its requests
        self._write_blocked = True
        self._update_reading()

    def resume_writing(self) -> None:
        self._write_blocked = False
        self._release_writer()
        self._update_reading()

    # ---------------------------------------------------------------- flow control
    def _room(self) -> int:
        """Requests that may be parsed now: one (the open) until the ticket is redeemed; the
        frames behind it wait in the buffer for the full frame limit."""
        if self._ticket_ok:
            return _MAX_QUEUED - len(self._queue)
        return 0 if self._open_parsed else 1

    def _update_reading(self) -> None:
        """Read the socket exactly when there is room for requests and responses."""
        transport = self.transport
        if transport is None or self._closed:
            return
        want = not self._write_blocked and self._room() > 0
        if want != self._reading:
            self._reading = want
            if want:
                transport.resume_reading()
            else:
                transport.pause_reading()

    def _release_writer(self) -> None:
        drained, self._drained = self._drained, None
        if drained is not None and not drained.done():
            drained.set_result(None)

    # ---------------------------------------------------------------- session side
    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _close(self, *, abort: bool = False) -> None:
        self._closed = True
        if self.transport is not None:
            if abort:
                self.transport.abort()
            else:
                self.transport.close()
        self._wake()
        self._release_writer()

    def abort(self) -> None:
        """Drop the connection now, unsent responses included."""
        self._close(abort=True)

    def redeemed(self, max_frame_bytes: int) -> None:
        """The ticket was valid: requests may now be as large as the server accepts."""
        self._frames.max_frame_bytes = max_frame_bytes
        self._ticket_ok = True
        self._update_reading()

    async def read(self) -> Any:
        """The next request, or ``grpc.aio.EOF`` once the client is gone.

        Raises:
            MalformedStream: a buffered frame is too large or not a message.
        """
        while not self._queue:
            if self._frames.buffered_bytes and not self._closed and self._room() > 0:
                self._queue.extend(self._frames.feed(b"", self._room()))
                self._open_parsed = True
                if self._queue:
                    break
            if self._closed:
                return grpc.aio.EOF
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        req = self._queue.popleft()
        self.last_seq = req.seq
        self._update_reading()
        return req

    async def write(self, resp: pb.SessionResponse) -> None:
        """Send one response; waits while the client is not reading (its buffer is full).

        Raises:
            ConnectionResetError: the client is gone.
        """
        while self._write_blocked and not self._closed:
            if self._drained is None:
                self._drained = asyncio.get_running_loop().create_future()
            await self._drained
        transport = self.transport
        if self._closed or transport is None or transport.is_closing():
            raise ConnectionResetError("local link closed by the client")
        write_frame(transport, resp)


class LocalLinkServer:
    """Listens on an abstract Unix socket and serves ticketed sessions.

    Args:
        sessions: The Session service whose :meth:`SessionService.serve` answers every request.
        max_frame_bytes: Largest request frame (bytes): the server's receive-message limit.
    """

    def __init__(self, sessions: SessionService, max_frame_bytes: int) -> None:
        self.sessions = sessions
        self.max_frame_bytes = max_frame_bytes
        self.address = f"@paramserver-{os.getpid()}-{secrets.token_hex(8)}"
        #: ticket -> (worker id, loop time it expires)
        #: ticket -> (worker id, loop time it expires, worker name its token is bound to)
        self._tickets: dict[bytes, tuple[str, float, str | None]] = {}
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[_Connection] = set()
        self._unredeemed = 0  # connections that have not presented a valid ticket yet
        #: Those connections, oldest first (the one closed when a newcomer exceeds the cap).
        self._waiting: dict[_Connection, None] = {}
        #: Sessions served over the link so far, and refused connections (for tests/status).
        self.links_opened = 0
        self.links_refused = 0

    async def start(self) -> None:
        """Bind the abstract socket (OSError when it cannot)."""
        loop = asyncio.get_running_loop()
        # A socket of our own: uvloop refuses abstract names as paths (EINVAL).
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(socket_address(self.address))
            sock.setblocking(False)
            self._server = await loop.create_unix_server(lambda: _Connection(self), sock=sock)
        except BaseException:
            sock.close()
            raise

    def issue_ticket(self, worker_id: str) -> pb.LocalLink:
        """A fresh single-use ticket for ``worker_id`` (expired ones are dropped first)."""
        now = asyncio.get_running_loop().time()
        tickets = self._tickets
        own = [t for t, (wid, _, _) in tickets.items() if wid == worker_id]
        for t in own[: max(0, len(own) - MAX_TICKETS_PER_WORKER + 1)]:  # its own oldest
            del tickets[t]
        if len(tickets) >= MAX_TICKETS // 2:
            for t in [t for t, (_, exp, _) in tickets.items() if exp <= now]:
                del tickets[t]
            while len(tickets) >= MAX_TICKETS:  # the oldest of the worker holding the most
                counts = collections.Counter(wid for wid, _, _ in tickets.values())
                greedy = counts.most_common(1)[0][0]
                del tickets[next(t for t, (wid, _, _) in tickets.items() if wid == greedy)]
        ticket = secrets.token_bytes(16)
        # The identity of the token that asked (per-worker tokens) holds on the link too.
        tickets[ticket] = (worker_id, now + TICKET_TTL_S, CALLER_WORKER_NAME.get())
        return pb.LocalLink(address=self.address, ticket=ticket)

    def _redeem(self, req: Any) -> str | None:
        """Why the first message is refused (None: a valid ticket, now spent; the identity of
        the token it was issued to then holds for this connection's task)."""
        if req is grpc.aio.EOF:
            return "closed before presenting a ticket"
        if req.WhichOneof("body") != "open" or not req.open.local_ticket:
            return "the first message must be an open with its local_ticket"
        entry = self._tickets.pop(req.open.local_ticket, None)
        if entry is None:
            return "unknown or already used local-link ticket"
        worker_id, expires, bound = entry
        if asyncio.get_running_loop().time() > expires:
            return "expired local-link ticket"
        if worker_id != req.open.worker_id:
            return "local-link ticket issued to another worker id"
        CALLER_WORKER_NAME.set(bound)
        return None

    async def _serve(self, conn: _Connection) -> None:
        # (this connection's task: its pushes and pulls are labelled rpc="LocalLink")
        CURRENT_RPC.set(LOCAL_LINK_RPC)
        self._connections.add(conn)
        self._unredeemed += 1
        self._waiting[conn] = None
        redeemed = False
        try:
            if len(self._waiting) > MAX_UNREDEEMED:
                oldest = next(iter(self._waiting))
                del self._waiting[oldest]
                self.links_refused += 1
                logger.warning(
                    "local link: %d connections without a ticket; the oldest is closed",
                    MAX_UNREDEEMED,
                )
                oldest.abort()
            try:
                first = await asyncio.wait_for(conn.read(), OPEN_DEADLINE_S)
            except TimeoutError:
                first = grpc.aio.EOF
            refusal = self._redeem(first)
            if refusal is not None:
                self.links_refused += 1
                logger.warning("local link refused: %s", refusal)
                if first is not grpc.aio.EOF:
                    with contextlib.suppress(ConnectionError):
                        await conn.write(error_response(first.seq, Unauthenticated(refusal)))
                return
            redeemed = True
            self._unredeemed -= 1
            self._waiting.pop(conn, None)
            conn.redeemed(self.max_frame_bytes)
            self.links_opened += 1
            await self.sessions.serve(_prepend(first, conn.read), conn.write)
        except MalformedStream as exc:
            # A protocol violation is final, as on the gRPC Session (INVALID_ARGUMENT).
            logger.warning("local link closed: %s", exc)
            with contextlib.suppress(ConnectionError):
                await asyncio.wait_for(conn.write(error_response(conn.last_seq, exc)), 1.0)
        except (ConnectionError, TimeoutError) as exc:
            logger.debug("local link ended: %r", exc)
        except Exception:
            logger.exception("local link failed")
        finally:
            if not redeemed:
                self._unredeemed -= 1
                self._waiting.pop(conn, None)
            self._connections.discard(conn)
            conn._close()

    async def stop(self, grace_s: float) -> None:
        """Stop accepting; let requests in hand finish within ``grace_s`` seconds (idle
        sessions end at once through :meth:`SessionService.begin_shutdown`), then drop every
        connection (unsent responses too) and cancel what still runs. Their clients reconnect
        (to a successor) and retry with the same request ids."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        self._tickets.clear()
        tasks = [c.task for c in self._connections if c.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=grace_s)
        for conn in list(self._connections):
            conn.abort()
        late = [t for t in tasks if not t.done()]
        for task in late:
            task.cancel()
        if late:
            await asyncio.wait(late, timeout=1.0)
        if server is not None:
            # Python >= 3.12 waits here for every connection: they were all dropped above.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(server.wait_closed(), 1.0)


def _prepend(first: _T, read: Callable[[], Awaitable[_T]]) -> Callable[[], Awaitable[_T]]:
    """``read`` that returns ``first`` once, then reads on."""
    pending = [first]

    async def reader() -> _T:
        if pending:
            return pending.pop()
        return await read()

    return reader
