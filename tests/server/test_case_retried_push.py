"""Case retried-push.md through real servers: a push whose reply is lost is applied once.

The lost reply is real: :class:`ReplyCuttingProxy` is a TCP proxy on 127.0.0.1 between client and
server that forwards the request untouched and reads the server's HTTP/2 frames; at the server's
first response HEADERS frame (sent only after the push committed) it either closes the
connection ("drop") or holds every server-to-client byte for a while ("hold"), so the client's
200 ms deadline expires while the reply is in flight. Expected values are closed forms: SGD with
lr 1 from zeros gives ``w = -sum(applied gradients)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from pathlib import Path
from types import TracebackType

import grpc
import numpy as np
import pytest

from paramserver.api.v1 import parameter_server_pb2 as pb
from paramserver.api.v1 import parameter_server_pb2_grpc as pb_grpc
from paramserver.errors import FailedPrecondition, StaleUpdate
from paramserver.worker_client import RetryPolicy, UpdateRule, connect
from tests.harness import ServerProcess, eventually, running_server
from tests.harness import raw_stubs as raw

pytestmark = pytest.mark.timeout(60)

SGD1 = UpdateRule("sgd", lr=1.0)
ONES = np.ones(4, np.float32)
MINUS_ONE = np.full(4, -1, np.float32)

_HTTP2_DATA = 0x0
_HTTP2_HEADERS = 0x1


class ReplyCuttingProxy:
    """A TCP proxy on 127.0.0.1 that can lose the server's next reply after it was committed.

    Client-to-server bytes are forwarded as they are. Server-to-client bytes are read as HTTP/2
    frames (9-byte header: 24-bit length, type, flags, 31-bit stream id) and forwarded whole.
    :meth:`arm` picks what happens at the next HEADERS frame on a stream (a response):
    ``"drop"`` closes both connections without forwarding it; ``"hold"`` delays it, and
    everything after it, by ``hold_s``. Either way the proxy then disarms itself.
    """

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = 0
        self.connections = 0
        self.intercepted = asyncio.Event()
        self._mode = "pass"
        self._hold_s = 0.0
        self._frame_type = _HTTP2_HEADERS
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def arm(self, mode: str, hold_s: float = 0.0, frame_type: int = _HTTP2_HEADERS) -> None:
        """``frame_type``: HEADERS (a call's reply starts) or DATA (the next message on an
        open stream, e.g. a reply on the Session stream)."""
        assert mode in ("drop", "hold")
        self._mode, self._hold_s, self._frame_type = mode, hold_s, frame_type
        self.intercepted.clear()

    async def __aenter__(self) -> ReplyCuttingProxy:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _handle(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        s_reader, s_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        pumps = {
            asyncio.ensure_future(self._forward_bytes(c_reader, s_writer)),
            asyncio.ensure_future(self._forward_frames(s_reader, c_writer)),
        }
        self._tasks |= pumps
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            for writer in (c_writer, s_writer):
                writer.transport.abort()
            self._tasks -= pumps

    @staticmethod
    async def _forward_bytes(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(1 << 16):
                writer.write(data)
                await writer.drain()

    async def _forward_frames(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                head = await reader.readexactly(9)
                payload = await reader.readexactly(int.from_bytes(head[:3], "big"))
                stream_id = int.from_bytes(head[5:9], "big") & 0x7FFFFFFF
                if head[3] == self._frame_type and stream_id != 0 and self._mode != "pass":
                    mode, self._mode = self._mode, "pass"
                    self.intercepted.set()
                    if mode == "drop":
                        return
                    await asyncio.sleep(self._hold_s)
                writer.write(head + payload)
                await writer.drain()


async def _w(stub: pb_grpc.ParameterServerStub) -> np.ndarray:
    return (await raw.pull(stub, ["w"]))["w"]


async def _setup(stub: pb_grpc.ParameterServerStub, name: str = "worker") -> str:
    wid = await raw.register(stub, name)
    await raw.init(stub, {"w": np.zeros(4, np.float32)}, SGD1)
    return wid


@pytest.mark.parametrize("lost", ["connection dropped after commit", "200 ms deadline expired"])
async def test_raw_retry_after_lost_reply_is_duplicate(lost: str) -> None:
    """Case retried-push.md: ASP, w = zeros(4), sgd lr 1; push [1,1,1,1] as r1 through the
    proxy, which loses the reply after the server applied it (connection closed at the reply,
    or reply held 1.5 s past the client's 200 ms deadline); the retry with r1 is answered OK and
    marked duplicate; w == [-1,-1,-1,-1]; applied_updates 1, duplicate_pushes 1."""
    async with (
        running_server(consistency="asp") as srv,
        ReplyCuttingProxy(srv.port) as proxy,
        raw.channel(srv.address) as direct_ch,
        raw.channel(proxy.address) as proxied_ch,
    ):
        direct = pb_grpc.ParameterServerStub(direct_ch)
        proxied = pb_grpc.ParameterServerStub(proxied_ch)
        wid = await _setup(proxied)
        r1 = 0x5EED_0001
        if lost.startswith("connection"):
            proxy.arm("drop")
            expected_code, timeout_s = grpc.StatusCode.UNAVAILABLE, 10.0
        else:
            proxy.arm("hold", hold_s=1.5)
            expected_code, timeout_s = grpc.StatusCode.DEADLINE_EXCEEDED, 0.2
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await proxied.Push(iter(raw.push_arrays(wid, r1, {"w": ONES})), timeout=timeout_s)
        assert info.value.code() == expected_code
        assert proxy.intercepted.is_set()
        # The server committed before the reply was lost (seen on a direct channel).
        st = await raw.status(direct)
        assert (st.applied_updates, st.duplicate_pushes) == (1, 0)
        np.testing.assert_array_equal(await _w(direct), MINUS_ONE)

        resp = await proxied.Push(iter(raw.push_arrays(wid, r1, {"w": ONES})), timeout=10)
        assert resp.duplicate
        assert resp.applied_updates == 1
        np.testing.assert_array_equal(await _w(direct), MINUS_ONE)
        st = await raw.status(direct)
        assert (st.applied_updates, st.duplicate_pushes, st.rejected_pushes) == (1, 1, 0)


@pytest.mark.parametrize("session", [True, False], ids=["session-stream", "push-stream"])
@pytest.mark.parametrize("lost", ["drop", "hold"])
async def test_worker_client_retries_lost_reply_with_same_request_id(
    lost: str, session: bool
) -> None:
    """Case retried-push.md with the product client: its push (200 ms per-attempt deadline)
    loses the reply after commit (connection dropped, or held past the deadline); the client
    retries with the same request id on its own and gets an OK marked duplicate; w == -1 and
    exactly one update is applied. Over the persistent Session stream (the reply is the next
    DATA frame of the open stream) and over a Push stream per call (its reply HEADERS)."""
    async with (
        running_server(consistency="asp") as srv,
        ReplyCuttingProxy(srv.port) as proxy,
        raw.channel(srv.address) as direct_ch,
    ):
        direct = pb_grpc.ParameterServerStub(direct_ch)
        retry = RetryPolicy(initial_backoff_s=0.02, max_backoff_s=0.2, deadline_s=20.0)
        async with connect(  # the proxy is on the gRPC path: no same-host local link
            proxy.address, "worker", heartbeat=False, retry=retry, session=session, local_link=False
        ) as ps:
            await ps.init({"w": np.zeros(4, np.float32)}, rule=SGD1)
            proxy.arm(lost, hold_s=1.0, frame_type=_HTTP2_DATA if session else _HTTP2_HEADERS)
            ack = await ps.push({"w": ONES}, timeout_s=0.2)
            assert proxy.intercepted.is_set()
            assert ack.duplicate
            assert ack.applied_updates == 1
            np.testing.assert_array_equal((await ps.pull(["w"]))["w"], MINUS_ONE)
            st = await raw.status(direct)
            assert st.applied_updates == 1
            assert st.duplicate_pushes >= 1  # every retry that reached the server
            assert st.rejected_pushes == 0
            if lost == "drop":
                assert proxy.connections >= 2  # the retry went over a new connection


async def test_dedup_survives_reconnect() -> None:
    """Case retried-push.md: r1 applied over one channel; the channel is closed; a new channel
    with the same worker id retries r1: duplicate, w stays -1, applied count 1."""
    async with running_server(consistency="asp") as srv:
        async with raw.channel(srv.address) as first:
            stub = pb_grpc.ParameterServerStub(first)
            wid = await _setup(stub)
            resp = await stub.Push(iter(raw.push_arrays(wid, 11, {"w": ONES})), timeout=10)
            assert not resp.duplicate
        async with raw.channel(srv.address) as second:
            stub = pb_grpc.ParameterServerStub(second)
            resp = await stub.Push(iter(raw.push_arrays(wid, 11, {"w": ONES})), timeout=10)
            assert resp.duplicate
            np.testing.assert_array_equal(await _w(stub), MINUS_ONE)
            st = await raw.status(stub)
            assert (st.applied_updates, st.duplicate_pushes) == (1, 1)


@pytest.mark.slow
async def test_dedup_survives_server_restore(tmp_path: Path) -> None:
    """Case retried-push.md: `paramserver serve --checkpoint-dir`; r1 applied; SIGTERM (final
    checkpoint, exit 0); restart on the same directory; the retry of r1 by the same worker id is
    a duplicate (w stays -1, applied 1) and a fresh r2 is still applied (w == -2)."""
    ckpt = tmp_path / "ckpt"
    args = ("--consistency", "asp", "--checkpoint-dir", str(ckpt), "--grace-s", "1")
    first = ServerProcess(tmp_path, *args)
    try:
        async with raw.channel(first.address) as ch:
            stub = pb_grpc.ParameterServerStub(ch)
            wid = await _setup(stub)
            resp = await stub.Push(iter(raw.push_arrays(wid, 21, {"w": ONES})), timeout=10)
            assert not resp.duplicate
    finally:
        assert first.stop(signal.SIGTERM) == 0, first.log()
    assert any(p.name.startswith("ckpt-") for p in ckpt.iterdir()), first.log()

    second = ServerProcess(tmp_path, *args)
    try:
        async with raw.channel(second.address) as ch:
            stub = pb_grpc.ParameterServerStub(ch)
            resp = await stub.Push(iter(raw.push_arrays(wid, 21, {"w": ONES})), timeout=10)
            assert resp.duplicate
            np.testing.assert_array_equal(await _w(stub), MINUS_ONE)
            st = await raw.status(stub)
            assert (st.applied_updates, st.duplicate_pushes) == (1, 1)
            resp = await stub.Push(iter(raw.push_arrays(wid, 22, {"w": ONES})), timeout=10)
            assert not resp.duplicate
            np.testing.assert_array_equal(await _w(stub), np.full(4, -2, np.float32))
    finally:
        assert second.stop(signal.SIGTERM) == 0, second.log()


async def test_fresh_request_ids_are_never_refused() -> None:
    """Case retried-push.md: 2,000 pushes with fresh request ids from the product client are all
    applied (w == -2000, none duplicate); two raw workers that both number pushes 1..100 are all
    applied too (ids are per worker)."""
    n = 2000
    async with running_server(consistency="asp") as srv:
        async with connect(srv.address, "client") as ps:
            await ps.init({"w": np.zeros(4, np.float32)}, rule=SGD1)
            acks = [await ps.push({"w": ONES}) for _ in range(n)]
            assert not any(a.duplicate for a in acks)
            assert [a.applied_updates for a in acks] == list(range(1, n + 1))
            assert len({a.request_id for a in acks}) == n
            np.testing.assert_array_equal((await ps.pull(["w"]))["w"], np.full(4, -n, np.float32))
        async with raw.channel(srv.address) as ch:
            stub = pb_grpc.ParameterServerStub(ch)
            a = await raw.register(stub, "a")
            b = await raw.register(stub, "b")
            for rid in range(1, 101):
                for wid in (a, b):
                    resp = await stub.Push(iter(raw.push_arrays(wid, rid, {"w": ONES})), timeout=10)
                    assert not resp.duplicate
            np.testing.assert_array_equal(await _w(stub), np.full(4, -(n + 200), np.float32))
            st = await raw.status(stub)
            assert (st.applied_updates, st.duplicate_pushes) == (n + 200, 0)


async def test_bsp_second_push_same_step_refused_retry_is_duplicate() -> None:
    """Case retried-push.md (BSP): a pushes [2] as r1 and retries r1 (OK, duplicate); a second
    push for the same step under r2 ([100]) is refused with FAILED_PRECONDITION; b pushes [4];
    after both clock, w == -(2 + 4) / 2 == -3 (the refused push is not in the mean); a retry of
    r1 after the step closed is still a duplicate and changes nothing."""
    async with running_server(consistency="bsp", aggregation="mean") as srv:
        async with raw.channel(srv.address) as ch:
            stub = pb_grpc.ParameterServerStub(ch)
            a = await raw.register(stub, "a")
            b = await raw.register(stub, "b")
            await raw.init(stub, {"w": np.zeros(1, np.float64)}, SGD1)

            def push(wid: str, rid: int, value: float) -> list[pb.PushRequest]:
                return raw.push_arrays(wid, rid, {"w": np.array([value])})

            assert not (await stub.Push(iter(push(a, 1, 2.0)), timeout=10)).duplicate
            assert (await stub.Push(iter(push(a, 1, 2.0)), timeout=10)).duplicate
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Push(iter(push(a, 2, 100.0)), timeout=10)
            assert info.value.code() in (
                grpc.StatusCode.FAILED_PRECONDITION,
                grpc.StatusCode.ALREADY_EXISTS,
            )
            await stub.Push(iter(push(b, 1, 4.0)), timeout=10)
            for wid in (a, b):
                await stub.Clock(pb.ClockRequest(worker_id=wid, clock=0), timeout=10)
            await eventually(lambda: _bsp_step_is(stub, 1), timeout_s=10, what="BSP step 0 closes")
            np.testing.assert_array_equal(await _w(stub), [-3.0])
            assert (await stub.Push(iter(push(a, 1, 2.0)), timeout=10)).duplicate
            np.testing.assert_array_equal(await _w(stub), [-3.0])
            st = await raw.status(stub)
            assert (st.applied_updates, st.duplicate_pushes, st.rejected_pushes) == (2, 2, 1)


async def _bsp_step_is(stub: pb_grpc.ParameterServerStub, step: int) -> bool:
    return (await raw.status(stub)).bsp_step == step


async def test_worker_client_second_push_same_step_raises() -> None:
    """Case retried-push.md (BSP) with the product client: the second push of a step raises
    StaleUpdate (a FailedPrecondition) and the mean is over the accepted pushes only."""
    async with running_server(consistency="bsp") as srv:
        async with connect(srv.address, "a") as a, connect(srv.address, "b") as b:
            await a.init({"w": np.zeros(1)}, rule=SGD1)
            await a.push({"w": np.array([2.0])})
            with pytest.raises(StaleUpdate) as info:
                await a.push({"w": np.array([100.0])})
            assert isinstance(info.value, FailedPrecondition)
            await b.push({"w": np.array([4.0])})
            await a.clock()
            await b.clock()
            np.testing.assert_array_equal((await a.pull(["w"]))["w"], [-3.0])
