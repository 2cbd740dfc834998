"""A stalled server does not evict the workers that kept heartbeating (issue 19, item 1;
docs/robustness.md): the server process is SIGSTOPped for longer than the lease, then
resumed. Leases measure a worker's silence, not the server's."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from paramserver.worker_client import UpdateRule, connect
from tests.harness import ServerProcess

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

LEASE_MS = 2000
STOP_S = 5.0  # 2.5 leases


def test_sigstop_longer_than_the_lease_evicts_nobody_who_kept_heartbeating(
    tmp_path: Path,
) -> None:
    server = ServerProcess(tmp_path, "--consistency", "asp", "--lease-ms", str(LEASE_MS))

    async def body() -> None:
        live = connect(server.address, "live", local_link=False, session=False)
        silent = connect(server.address, "silent", heartbeat=False)
        await live.open()
        await silent.open()
        try:
            await live.init({"w": np.zeros(2, np.float32)}, rule=UpdateRule("add"))
            worker_id = live.worker_id
            os.kill(server.proc.pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(STOP_S)  # the live worker keeps sending heartbeats
            finally:
                os.kill(server.proc.pid, signal.SIGCONT)
            await asyncio.sleep(LEASE_MS / 1000 * 1.5)  # a lease of silence for "silent"
            status = await live.status()
            by_name = {w.worker_name: w for w in status.workers}
            assert by_name["live"].live, "a heartbeating worker was evicted by the stall"
            assert by_name["live"].worker_id == worker_id
            await live.push({"w": np.ones(2, np.float32)})  # still a member
            np.testing.assert_array_equal((await live.pull(["w"]))["w"], np.ones(2, np.float32))
            # A worker that really is silent still loses its lease (its own silence counts).
            deadline = time.monotonic() + 30
            while True:
                status = await live.status()
                if not {w.worker_name: w for w in status.workers}["silent"].live:
                    break
                assert time.monotonic() < deadline, "a silent worker was never evicted"
                await asyncio.sleep(0.1)
        finally:
            await live.close()
            try:
                await silent.close()
            except Exception:  # its lease lapsed: the leave is refused
                pass

    try:
        asyncio.run(body())
    finally:
        os.kill(server.proc.pid, signal.SIGCONT) if server.proc.poll() is None else None
        server.stop()
