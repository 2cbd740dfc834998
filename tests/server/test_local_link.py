"""The same-host local link (paramserver.server.transports.link_service): a Session moved off gRPC
onto a
ticketed Unix socket. Real servers on 127.0.0.1, real sockets; values checked against numpy.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import numpy as np
import pytest

from paramserver.api.v1 import parameter_server_pb2 as pb
from paramserver.protocol import link
from paramserver.server.shard_daemon import ParameterServerDaemon
from paramserver.server.transports import link_service as local_link
from paramserver.worker_client import UpdateRule, WorkerClient
from tests.harness import eventually, running_server
from tests.harness.raw_stubs import slot_batch

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not link.available(), reason="abstract Unix sockets are Linux only"),
]

ADD = UpdateRule("add")


def _client(daemon: ParameterServerDaemon, name: str, **kwargs: Any) -> WorkerClient:
    kwargs.setdefault("heartbeat", False)
    return WorkerClient(f"127.0.0.1:{daemon.port}", name, **kwargs)


def _frame(msg: Any) -> bytes:
    body = msg.SerializeToString()
    return len(body).to_bytes(4, "little") + body


async def _raw(daemon: ParameterServerDaemon) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    assert daemon.local_link is not None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(link.socket_address(daemon.local_link.address))
    return await asyncio.open_unix_connection(sock=sock)


async def _answer(reader: asyncio.StreamReader) -> pb.SessionResponse | None:
    """The next response frame, or None when the server closed the link."""
    try:
        n = int.from_bytes(await reader.readexactly(4), "little")
        return pb.SessionResponse.FromString(await reader.readexactly(n))
    except asyncio.IncompleteReadError:
        return None


async def _ticket(daemon: ParameterServerDaemon, worker_id: str) -> bytes:
    """A ticket as a gRPC Session open hands it out."""
    assert daemon.local_link is not None
    return daemon.local_link.issue_ticket(worker_id).ticket


async def _still_serves_a_link(daemon: ParameterServerDaemon) -> None:
    """A ticketed client gets its link and right values."""
    async with _client(daemon, "w0") as ps:
        await ps.init({"w": np.zeros(4, np.float32)}, rule=ADD)
        got = await ps.push_pull({"w": np.ones(4, np.float32)})
        assert ps.fastpath is not None and ps.fastpath.on_local_link
    np.testing.assert_array_equal(got["w"], np.ones(4, np.float32))


def _open(worker_id: str, ticket: bytes, seq: int = 1) -> bytes:
    return _frame(
        pb.SessionRequest(seq=seq, open=pb.SessionOpen(worker_id=worker_id, local_ticket=ticket))
    )


async def test_a_same_host_session_moves_to_the_link_and_values_match_numpy() -> None:
    rng = np.random.default_rng(3)
    big = rng.standard_normal(300_000).astype(np.float32)  # through shared memory
    small = rng.standard_normal(7).astype(np.float64)  # inline
    async with running_server(consistency="asp") as daemon:
        assert daemon.local_link is not None
        async with _client(daemon, "w0") as ps:
            await ps.init({"big": np.zeros_like(big), "small": np.zeros_like(small)}, rule=ADD)
            got = await ps.push_pull({"big": big, "small": small})
            got2 = await ps.push_pull({"big": big, "small": small})
            fp = ps.fastpath
            assert fp is not None and fp.on_local_link and fp.shm_active
            assert fp.local_links_opened == 1 and fp.local_declined is None
        np.testing.assert_array_equal(got["big"], big)
        np.testing.assert_array_equal(got["small"], small)
        np.testing.assert_array_equal(got2["big"], big + big)
        np.testing.assert_array_equal(got2["small"], small + small)
        assert daemon.local_link.links_opened == 1
        # the gRPC Session the ticket came from was ended by the client
        await eventually(lambda: daemon.servicer.sessions.open_sessions == 0)  # type: ignore[union-attr]


async def test_no_link_when_same_host_paths_are_off_on_either_side() -> None:
    async with running_server(consistency="asp", shared_memory=False) as daemon:
        assert daemon.local_link is None
        async with _client(daemon, "w0") as ps:
            await ps.init({"w": np.zeros(4, np.float32)}, rule=ADD)
            await ps.push({"w": np.ones(4, np.float32)})
            assert ps.fastpath is not None and not ps.fastpath.on_local_link
    async with running_server(consistency="asp") as daemon:
        async with _client(daemon, "w0", local_link=False) as ps:
            await ps.init({"w": np.zeros(4, np.float32)}, rule=ADD)
            await ps.push({"w": np.ones(4, np.float32)})
            assert ps.fastpath is not None and not ps.fastpath.on_local_link
        assert daemon.local_link is not None and daemon.local_link.links_opened == 0


async def test_an_unreachable_link_leaves_the_session_on_grpc() -> None:
    """Another host or network namespace: the offered socket does not exist there."""
    async with running_server(consistency="asp") as daemon:
        assert daemon.local_link is not None
        daemon.local_link.address = "@paramserver-nobody-listens-here"
        async with _client(daemon, "w0") as ps:
            await ps.init({"w": np.zeros(4, np.float32)}, rule=ADD)
            await ps.push({"w": np.ones(4, np.float32)})
            got = await ps.pull(["w"])
            fp = ps.fastpath
            assert fp is not None and not fp.on_local_link
            assert fp.local_declined is not None and "cannot reach" in fp.local_declined
        np.testing.assert_array_equal(got["w"], np.ones(4, np.float32))


@pytest.mark.parametrize("case", ["forged", "reused", "other-worker", "expired", "not-open"])
async def test_a_bad_ticket_is_unauthenticated_and_the_server_keeps_serving(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with running_server(consistency="asp") as daemon:
        link = daemon.local_link
        assert link is not None
        ticket = await _ticket(daemon, "w0")
        if case == "reused":  # first use is fine
            reader, writer = await _raw(daemon)
            writer.write(_open("w0", ticket))
            first = await _answer(reader)
            assert first is not None and first.WhichOneof("body") == "opened"
            writer.close()
        if case == "expired":
            monkeypatch.setattr(local_link, "TICKET_TTL_S", -1.0)
            ticket = await _ticket(daemon, "w0")
            monkeypatch.undo()
        request = {
            "forged": _open("w0", b"\x00" * 16),
            "reused": _open("w0", ticket),
            "other-worker": _open("intruder", ticket),
            "expired": _open("w0", ticket),
            "not-open": _frame(pb.SessionRequest(seq=1, pull=pb.PullRequest(keys=["w"]))),
        }[case]
        reader, writer = await _raw(daemon)
        writer.write(request)
        answer = await _answer(reader)
        assert answer is not None and answer.WhichOneof("body") == "error"
        assert answer.error.code == 16 and answer.error.error_class == "Unauthenticated"
        assert await _answer(reader) is None  # then closed
        writer.close()
        # nothing was opened by the refused connection, and the server keeps serving
        await _still_serves_a_link(daemon)
        assert link.links_refused == 1


@pytest.mark.parametrize("case", ["oversized", "garbage", "silent"])
async def test_a_broken_peer_is_closed_without_harm(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(local_link, "OPEN_DEADLINE_S", 0.3)
    async with running_server(consistency="asp") as daemon:
        reader, writer = await _raw(daemon)
        if case == "oversized":  # a length beyond the receive limit is refused before reading
            writer.write((1 << 31).to_bytes(4, "little"))
        elif case == "garbage":
            writer.write(b"\x05\x00\x00\x00\xff\xff\xff\xff\xff")
        # "silent": sends nothing; closed once the open deadline passes
        assert await asyncio.wait_for(_answer(reader), 5.0) is None
        writer.close()
        await _still_serves_a_link(daemon)


async def test_many_requests_in_one_write_are_answered_in_order() -> None:
    """A client that pipelines requests (several frames in one chunk, one frame split across
    chunks) gets every answer, in order."""
    async with running_server(consistency="asp") as daemon:
        async with _client(daemon, "w0") as ps:  # declares the key and registers w0
            await ps.init({"w": np.zeros(3, np.float32)}, rule=ADD)
            worker_id = ps.worker_id
            reader, writer = await _raw(daemon)
            ticket = await _ticket(daemon, worker_id)
            frames = [_open(worker_id, ticket)]
            for seq in range(2, 12):
                push = pb.SessionPush(
                    header=pb.PushHeader(worker_id=worker_id, request_id=seq),
                    slots=slot_batch(
                        [("w", np.dtype(np.float32), (3,), 0)],
                        np.full(3, seq, np.float32).tobytes() + bytes(52),  # (to 64 bytes)
                    ),
                )
                frames.append(_frame(pb.SessionRequest(seq=seq, push=push)))
            stream = b"".join(frames)
            cut = len(frames[0]) + 5  # the second frame split across two writes
            writer.write(stream[:cut])
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.write(stream[cut:])
            answers = [await _answer(reader) for _ in range(11)]
            writer.close()
            assert [a.seq for a in answers if a is not None] == list(range(1, 12))
            assert all(a is not None and a.HasField("push") for a in answers[1:])
            got = await ps.pull(["w"])
        np.testing.assert_array_equal(got["w"], np.full(3, sum(range(2, 12)), np.float32))


async def test_graceful_stop_ends_idle_links_at_once_and_the_client_reconnects() -> None:
    """A graceful stop does not wait its grace for idle local links; the client's next call
    goes to the successor on the same port (over a new link)."""
    from paramserver.server.config import ServerConfig

    daemon = ParameterServerDaemon(ServerConfig(host="127.0.0.1", port=0, consistency="asp"))
    await daemon.start()
    port = daemon.port
    successor: ParameterServerDaemon | None = None
    try:
        async with _client(daemon, "w0", close_timeout_s=0.2) as ps:
            await ps.init({"w": np.zeros(4, np.float32)}, rule=ADD)
            await ps.push_pull({"w": np.ones(4, np.float32)})
            assert ps.fastpath is not None and ps.fastpath.on_local_link
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            await daemon.stop(grace_s=5.0)
            assert loop.time() - t0 < 2.5
            successor = ParameterServerDaemon(
                ServerConfig(host="127.0.0.1", port=port, consistency="asp")
            )
            await successor.start()
            await ps.init({"w": np.zeros(4, np.float32)}, rule=ADD)
            got = await ps.push_pull({"w": np.full(4, 2, np.float32)})
            assert ps.fastpath.on_local_link and ps.fastpath.local_links_opened == 2
        np.testing.assert_array_equal(got["w"], np.full(4, 2, np.float32))
    finally:
        await daemon.stop(grace_s=0.1)
        if successor is not None:
            await successor.stop(grace_s=0.1)


def _pull(seq: int, worker_id: str, key: str) -> bytes:
    return _frame(pb.SessionRequest(seq=seq, pull=pb.PullRequest(worker_id=worker_id, keys=[key])))


async def test_a_burst_read_late_is_answered_in_full() -> None:
    """40 pulls of 12 KB values sent at once behind the open, read only later: the server
    stops reading while its answers wait and carries on when they drain — all 41 arrive."""
    async with running_server(consistency="asp") as daemon:
        async with _client(daemon, "w0", local_link=False) as ps:
            value = np.arange(3000, dtype=np.float32)
            await ps.init({"w": value}, rule=ADD)
            reader, writer = await _raw(daemon)
            burst = [_open(ps.worker_id, await _ticket(daemon, ps.worker_id))]
            burst += [_pull(seq, ps.worker_id, "w") for seq in range(2, 42)]
            writer.write(b"".join(burst))
            await asyncio.sleep(0.5)
            answers = [await asyncio.wait_for(_answer(reader), 5.0) for _ in range(41)]
            writer.close()
        assert [a.seq for a in answers if a is not None] == list(range(1, 42))
        for a in answers[1:]:
            assert a is not None and a.HasField("pull")
            got = np.frombuffer(a.pull.slots.data, np.float32, value.size)
            np.testing.assert_array_equal(got, value)


async def test_a_client_that_never_reads_holds_a_bounded_buffer() -> None:
    """Thousands of small requests for 100 KB answers, never read: the server's buffered
    answers stay bounded (it waits for the client to drain them, and stops reading), and it
    keeps serving others; a stop drops that client at once."""
    async with running_server(consistency="asp") as daemon:
        assert daemon.local_link is not None
        async with _client(daemon, "w0", local_link=False) as ps:
            await ps.init({"w": np.zeros(25_000, np.float32)}, rule=ADD)  # 100 KB
            _reader, writer = await _raw(daemon)
            flood = [_open(ps.worker_id, await _ticket(daemon, ps.worker_id))]
            flood += [_pull(seq, ps.worker_id, "w") for seq in range(2, 5002)]
            writer.write(b"".join(flood))
            await asyncio.sleep(1.0)
            (conn,) = daemon.local_link._connections
            assert conn.transport is not None
            assert conn.transport.get_write_buffer_size() < 8 << 20
            async with _client(daemon, "w1") as other:
                got = await other.pull(["w"])
                assert other.fastpath is not None and other.fastpath.on_local_link
            np.testing.assert_array_equal(got["w"], np.zeros(25_000, np.float32))
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            await daemon.local_link.stop(grace_s=0.2)
            assert loop.time() - t0 < 3.0
            writer.close()


async def test_before_its_ticket_a_connection_may_send_only_a_small_open() -> None:
    async with running_server(consistency="asp") as daemon:
        reader, writer = await _raw(daemon)
        writer.write((local_link.PRE_TICKET_FRAME_BYTES + 1).to_bytes(4, "little"))
        assert await asyncio.wait_for(_answer(reader), 5.0) is None  # closed
        writer.close()


async def test_connections_without_a_ticket_are_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local_link, "MAX_UNREDEEMED", 3)
    async with running_server(consistency="asp") as daemon:
        assert daemon.local_link is not None
        idle = [await _raw(daemon) for _ in range(3)]
        await eventually(lambda: len(daemon.local_link._waiting) == 3)  # type: ignore[union-attr]
        reader, writer = await _raw(daemon)  # a 4th: the oldest idle one is closed
        assert await asyncio.wait_for(_answer(idle[0][0]), 5.0) is None
        # and a ticketed client gets its link while the others still hold theirs
        async with _client(daemon, "w0") as ps:
            await ps.init({"w": np.zeros(2, np.float32)}, rule=ADD)
            await ps.push({"w": np.ones(2, np.float32)})
            assert ps.fastpath is not None and ps.fastpath.on_local_link
        for _r, w in [*idle, (reader, writer)]:
            w.close()


async def test_a_protocol_violation_is_invalid_argument_and_final() -> None:
    """A second open on a link: answered INVALID_ARGUMENT (as the gRPC Session aborts with),
    then closed — not a silent close the client would retry."""
    async with running_server(consistency="asp") as daemon:
        async with _client(daemon, "w0", local_link=False) as ps:
            reader, writer = await _raw(daemon)
            ticket = await _ticket(daemon, ps.worker_id)
            writer.write(_open(ps.worker_id, ticket) + _open(ps.worker_id, b"x" * 16, seq=2))
            opened = await _answer(reader)
            assert opened is not None and opened.WhichOneof("body") == "opened"
            refusal = await asyncio.wait_for(_answer(reader), 5.0)
            assert refusal is not None and refusal.seq == 2
            assert refusal.error.code == 3 and refusal.error.error_class == "MalformedStream"
            assert await _answer(reader) is None
            writer.close()
