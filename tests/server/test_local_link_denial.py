"""Local-link denial (issue 19, item 6; docs/robustness.md): a worker with a valid ticket is
served on the link under a flood of idle connections and under another worker's ticket flood.
Real servers, real Unix sockets."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import numpy as np
import pytest

from paramserver.api.v1 import parameter_server_pb2 as pb
from paramserver.protocol import link
from paramserver.server.transports import link_service as local_link
from paramserver.worker_client import UpdateRule
from paramserver.worker_client.client import WorkerClient
from tests.harness import eventually, running_server

pytestmark = pytest.mark.timeout(60)


def _client(address: str, name: str, **kwargs: Any) -> WorkerClient:
    return WorkerClient(address, name, heartbeat=False, **kwargs)


async def _raw(address: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(link.socket_address(address))
    return await asyncio.open_unix_connection(sock=sock)


async def test_65_idle_connections_do_not_keep_a_ticketed_worker_off_the_link() -> None:
    async with running_server(consistency="asp") as daemon:
        link = daemon.local_link
        assert link is not None
        flood = [await _raw(link.address) for _ in range(local_link.MAX_UNREDEEMED + 1)]
        try:
            await eventually(lambda: len(link._waiting) >= local_link.MAX_UNREDEEMED)
            async with _client(f"127.0.0.1:{daemon.port}", "w0") as ps:
                await ps.init({"w": np.zeros(3, np.float32)}, rule=UpdateRule("add"))
                got = await ps.push_pull({"w": np.ones(3, np.float32)})
                assert ps.fastpath is not None and ps.fastpath.on_local_link
                np.testing.assert_array_equal(got["w"], np.ones(3, np.float32))
        finally:
            for _, writer in flood:
                writer.close()


async def test_a_ticket_flood_by_one_worker_does_not_evict_another_workers_ticket() -> None:
    async with running_server(consistency="asp") as daemon:
        link = daemon.local_link
        assert link is not None
        address = f"127.0.0.1:{daemon.port}"
        async with (
            _client(address, "a", local_link=False) as a,
            _client(address, "b", local_link=False) as b,
        ):
            mine = link.issue_ticket(a.worker_id).ticket
            for _ in range(local_link.MAX_TICKETS):  # b asks for 4,096 tickets
                link.issue_ticket(b.worker_id)
            reader, writer = await _raw(link.address)
            try:
                body = pb.SessionRequest(
                    seq=1, open=pb.SessionOpen(worker_id=a.worker_id, local_ticket=mine)
                ).SerializeToString()
                writer.write(len(body).to_bytes(4, "little") + body)
                n = int.from_bytes(await asyncio.wait_for(reader.readexactly(4), 10), "little")
                answer = pb.SessionResponse.FromString(await reader.readexactly(n))
                assert answer.WhichOneof("body") == "opened", answer
            finally:
                writer.close()
            held_by_b = sum(1 for wid, *_ in link._tickets.values() if wid == b.worker_id)
            assert held_by_b <= local_link.MAX_TICKETS_PER_WORKER
