"""Transport ceilings of the push+pull workload (runners for :class:`benchlib.WorkerPool`).

Each round moves the same payload as one paramserver round, N float32 out and N back:

- ``memcpy``: two ``np.copyto`` of N*4 bytes in the worker process (memory bandwidth).
- ``socket``: a raw TCP ping-pong on 127.0.0.1: the client ``sendall``s N*4 bytes, the server
  (one thread per connection, a separate process) receives them all and sends them back.
- ``grpc_raw``: a raw ``grpc.aio`` bidirectional stream of bytes (no protobuf): the client streams
  N*4 bytes in 1 MiB chunks and the server echoes each chunk as it arrives; the client copies
  the echoed chunks into one receive buffer. The send chunks are cut once, before timing, so
  this is the transport alone.
- ``grpc_raw_unary``: one raw ``grpc.aio`` unary call per round carrying all N*4 bytes each way
  (message limits raised to fit).
- ``grpc_raw_session``: one long-lived bidirectional stream per worker, opened before timing;
  each round writes the N*4 bytes in 1 MiB chunks and reads the echoed chunks back (writer and
  reader run concurrently): what a persistent push/pull session stream could reach, with no
  per-call setup.
- ``grpc_raw_seq``: a new bidi stream per round, every chunk up, then every chunk back (the
  store-and-forward ceiling of an atomic push followed by a pull).
- ``asyncio_unix`` (Linux): a uvloop ``asyncio.Protocol`` echo of one 4-byte-length-prefixed
  frame per round on an abstract Unix socket, a marker per round checked: the local link's
  transport, framing and event loops with no work on either side. At small N it is the floor of
  any asyncio request/reply design on the host; at large N it carries the tensor bytes through
  the socket, which the local link does not (they go through shared memory there).
"""

from __future__ import annotations

import asyncio
import socket
import threading
from typing import Any

import numpy as np

CHUNK_BYTES = 1 << 20
ECHO_METHOD = "/bench.Echo/Stream"
UNARY_METHOD = "/bench.Echo/Unary"
SEQ_METHOD = "/bench.Echo/StoreForward"
MAX_MESSAGE_BYTES = 256 << 20
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]


# ---------------------------------------------------------------------- memcpy
class Memcpy:
    def __init__(self, rank: int, cfg: dict[str, Any]) -> None:
        self.n = int(cfg["n"])

    def setup(self) -> None:
        self.src = np.ones(self.n, dtype=np.float32)
        self.dst = np.empty_like(self.src)
        self.rounds = 0

    def round(self) -> None:
        np.copyto(self.dst, self.src)
        np.copyto(self.src, self.dst)
        self.rounds += 1

    def finish(self) -> dict[str, Any]:
        return {"rounds": self.rounds, "ok": bool(np.array_equal(self.src, self.dst))}


def memcpy(rank: int, cfg: dict[str, Any]) -> Memcpy:
    return Memcpy(rank, cfg)


# ---------------------------------------------------------------------- raw TCP
def _recv_exact(conn: socket.socket, view: memoryview) -> bool:
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if n == 0:
            return False
        got += n
    return True


def _echo_conn(conn: socket.socket) -> None:
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        head = bytearray(8)
        if not _recv_exact(conn, memoryview(head)):
            return
        buf = bytearray(int.from_bytes(head, "little"))
        view = memoryview(buf)
        while _recv_exact(conn, view):
            conn.sendall(view)


def socket_echo_serve(port_queue: Any) -> None:
    """Process entry: accept on 127.0.0.1:0, echo fixed-size messages, one thread per peer."""
    srv = socket.create_server(("127.0.0.1", 0))
    port_queue.put(srv.getsockname()[1])
    while True:
        conn, _ = srv.accept()
        threading.Thread(target=_echo_conn, args=(conn,), daemon=True).start()


class SocketPingPong:
    def __init__(self, rank: int, cfg: dict[str, Any]) -> None:
        self.n = int(cfg["n"])
        self.port = int(cfg["port"])

    def setup(self) -> None:
        self.payload = np.ones(self.n, dtype=np.float32)
        self.back = np.empty_like(self.payload)
        self.sock = socket.create_connection(("127.0.0.1", self.port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.sendall(self.payload.nbytes.to_bytes(8, "little"))
        self.out = memoryview(self.payload).cast("B")
        self.inn = memoryview(self.back).cast("B")
        self.rounds = 0

    def round(self) -> None:
        self.sock.sendall(self.out)
        if not _recv_exact(self.sock, self.inn):
            raise ConnectionError("echo server closed the connection")
        self.rounds += 1

    def finish(self) -> dict[str, Any]:
        ok = bool(np.array_equal(self.payload, self.back))
        self.sock.close()
        return {"rounds": self.rounds, "ok": ok}


def socket_pingpong(rank: int, cfg: dict[str, Any]) -> SocketPingPong:
    return SocketPingPong(rank, cfg)


# ---------------------------------------------------------------------- raw grpc.aio
def grpc_echo_serve(port_queue: Any, use_uvloop: bool = True) -> None:
    """Process entry: a grpc.aio server echoing a bytes stream chunk by chunk."""
    import grpc

    async def echo(request_iterator: Any, context: Any) -> Any:
        async for chunk in request_iterator:
            yield chunk

    async def echo_unary(request: bytes, context: Any) -> bytes:
        return request

    async def store_forward(request_iterator: Any, context: Any) -> Any:
        # The whole payload up first, then all of it back: no overlap of the two directions,
        # the most an atomic push (applied after its last chunk) followed by a pull can reach.
        chunks = [chunk async for chunk in request_iterator]
        for chunk in chunks:
            yield chunk

    async def main() -> None:
        server = grpc.aio.server(options=GRPC_OPTIONS)
        handler = grpc.method_handlers_generic_handler(
            "bench.Echo",
            {
                "Stream": grpc.stream_stream_rpc_method_handler(echo),
                "Unary": grpc.unary_unary_rpc_method_handler(echo_unary),
                "StoreForward": grpc.stream_stream_rpc_method_handler(store_forward),
            },
        )
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        port_queue.put(port)
        await server.wait_for_termination()

    if use_uvloop:
        import uvloop

        uvloop.run(main())
    else:
        asyncio.run(main())


class GrpcEcho:
    def __init__(self, rank: int, cfg: dict[str, Any]) -> None:
        self.n = int(cfg["n"])
        self.address = f"127.0.0.1:{int(cfg['port'])}"

    async def setup(self) -> None:
        import grpc

        payload = np.ones(self.n, dtype=np.float32)
        raw = memoryview(payload).cast("B")
        self.chunks = [bytes(raw[i : i + CHUNK_BYTES]) for i in range(0, len(raw), CHUNK_BYTES)]
        self.back = np.empty(len(raw), dtype=np.uint8)
        self.channel = grpc.aio.insecure_channel(self.address)
        self.call = self.channel.stream_stream(ECHO_METHOD)
        self.rounds = 0

    async def _requests(self) -> Any:
        for chunk in self.chunks:
            yield chunk

    async def round(self) -> None:
        offset = 0
        back = self.back
        async for chunk in self.call(self._requests()):
            end = offset + len(chunk)
            back[offset:end] = np.frombuffer(chunk, dtype=np.uint8)
            offset = end
        if offset != back.nbytes:
            raise ConnectionError(f"echo returned {offset} of {back.nbytes} bytes")
        self.rounds += 1

    async def finish(self) -> dict[str, Any]:
        ok = bool(np.array_equal(self.back.view(np.float32), np.ones(self.n, np.float32)))
        await self.channel.close()
        return {"rounds": self.rounds, "ok": ok}


def grpc_echo(rank: int, cfg: dict[str, Any]) -> GrpcEcho:
    return GrpcEcho(rank, cfg)


class GrpcUnaryEcho:
    def __init__(self, rank: int, cfg: dict[str, Any]) -> None:
        self.n = int(cfg["n"])
        self.address = f"127.0.0.1:{int(cfg['port'])}"

    async def setup(self) -> None:
        import grpc

        self.payload = np.ones(self.n, dtype=np.float32).tobytes()
        self.channel = grpc.aio.insecure_channel(self.address, options=GRPC_OPTIONS)
        self.call = self.channel.unary_unary(UNARY_METHOD)
        self.rounds = 0
        self.back = b""

    async def round(self) -> None:
        self.back = await self.call(self.payload)
        self.rounds += 1

    async def finish(self) -> dict[str, Any]:
        ok = self.back == self.payload
        await self.channel.close()
        return {"rounds": self.rounds, "ok": ok}


def grpc_unary_echo(rank: int, cfg: dict[str, Any]) -> GrpcUnaryEcho:
    return GrpcUnaryEcho(rank, cfg)


class GrpcSessionEcho(GrpcEcho):
    async def setup(self) -> None:
        await super().setup()
        self.stream = self.call()

    async def _write_all(self) -> None:
        for chunk in self.chunks:
            await self.stream.write(chunk)

    async def _read_all(self) -> None:
        offset = 0
        back = self.back
        for _ in range(len(self.chunks)):
            chunk = await self.stream.read()
            end = offset + len(chunk)
            back[offset:end] = np.frombuffer(chunk, dtype=np.uint8)
            offset = end
        if offset != back.nbytes:
            raise ConnectionError(f"echo returned {offset} of {back.nbytes} bytes")

    async def round(self) -> None:
        if len(self.chunks) == 1:
            # One message each way: a plain write then read (no gather per round) is the
            # cheapest pattern grpc.aio allows, so it is the ceiling for small tensors.
            await self.stream.write(self.chunks[0])
            chunk = await self.stream.read()
            self.back[: len(chunk)] = np.frombuffer(chunk, dtype=np.uint8)
            if len(chunk) != self.back.nbytes:
                raise ConnectionError(f"echo returned {len(chunk)} of {self.back.nbytes} bytes")
        else:
            await asyncio.gather(self._write_all(), self._read_all())
        self.rounds += 1

    async def finish(self) -> dict[str, Any]:
        await self.stream.done_writing()
        return await super().finish()


def grpc_session_echo(rank: int, cfg: dict[str, Any]) -> GrpcSessionEcho:
    return GrpcSessionEcho(rank, cfg)


class GrpcSeqEcho(GrpcEcho):
    """One stream per round: every chunk up, then every chunk back (store and forward)."""

    async def setup(self) -> None:
        await super().setup()
        self.call = self.channel.stream_stream(SEQ_METHOD)


def grpc_seq_echo(rank: int, cfg: dict[str, Any]) -> GrpcSeqEcho:
    return GrpcSeqEcho(rank, cfg)


# ---------------------------------------------------------------------- asyncio Unix socket
def _unix_echo_name(server_pid: int) -> str:
    return f"\0paramserver-bench-echo-{server_pid}"


class _FrameEcho(asyncio.Protocol):
    """Server side: collect one 4-byte-length-prefixed frame, send it back whole."""

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.buf = bytearray()

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        if not buf and len(data) >= 4 and int.from_bytes(data[:4], "little") + 4 == len(data):
            self.transport.write(data)  # one whole frame in one read (as the local link): no copy
            return
        buf += data
        while len(buf) >= 4:
            end = 4 + int.from_bytes(buf[:4], "little")
            if len(buf) < end:
                return
            self.transport.write(bytes(memoryview(buf)[:end]))  # one copy out of the buffer
            del buf[:end]


def asyncio_unix_echo_serve(port_queue: Any) -> None:
    """Process entry: a uvloop ``asyncio.Protocol`` echo of length-prefixed frames on an
    abstract Unix socket (the local link's transport, framing and event loop, with no work);
    puts the server's pid, from which clients derive the socket name."""
    import os

    import uvloop

    async def main() -> None:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # (uvloop takes abstract
        sock.bind(_unix_echo_name(os.getpid()))  # names only as bound sockets)
        server = await loop.create_unix_server(_FrameEcho, sock=sock)
        port_queue.put(os.getpid())
        await server.serve_forever()

    uvloop.run(main())


class _FrameClient(asyncio.Protocol):
    def __init__(self, back: memoryview) -> None:
        self.back = back
        self.got = -4  # bytes of the current reply (the header counts below 0)
        self.waiter: asyncio.Future[None] | None = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        view = memoryview(data)
        if self.got < 0:  # the echoed header (sizes are fixed: not parsed)
            skip = min(-self.got, len(view))
            self.got += skip
            view = view[skip:]
        if view:
            self.back[self.got : self.got + len(view)] = view
            self.got += len(view)
        if self.got == len(self.back) and self.waiter is not None:
            self.got = -4
            self.waiter.set_result(None)
            self.waiter = None


class AsyncioUnixEcho:
    """Each round: one framed write of N*4 bytes, awaited until the whole echo is back (the
    floor of an asyncio request/reply on a Unix socket, as the local link's round trip)."""

    def __init__(self, rank: int, cfg: dict[str, Any]) -> None:
        self.n = int(cfg["n"])
        self.name = _unix_echo_name(int(cfg["port"]))

    async def setup(self) -> None:
        self.payload = payload = np.ones(self.n, dtype=np.float32)
        self.header = payload.nbytes.to_bytes(4, "little")
        self.out = memoryview(payload).cast("B")
        self.back = np.empty(self.n, dtype=np.float32)
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(self.name)
        _, self.proto = await loop.create_unix_connection(
            lambda: _FrameClient(memoryview(self.back).cast("B")), sock=sock
        )
        self.rounds = 0

    async def round(self) -> None:
        proto = self.proto
        self.payload[0] = self.rounds  # a marker per round, checked in the echo
        proto.waiter = asyncio.get_running_loop().create_future()
        proto.transport.writelines((self.header, self.out))
        await proto.waiter
        if self.back[0] != self.rounds:
            raise ConnectionError(f"round {self.rounds}: echo carries marker {self.back[0]}")
        self.rounds += 1

    async def finish(self) -> dict[str, Any]:
        ok = bool(np.array_equal(self.back, self.payload))
        self.proto.transport.close()
        return {"rounds": self.rounds, "ok": ok}


def asyncio_unix_echo(rank: int, cfg: dict[str, Any]) -> AsyncioUnixEcho:
    return AsyncioUnixEcho(rank, cfg)
