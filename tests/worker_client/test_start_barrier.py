"""The workers' start barrier: ``WorkerClient.wait_for_workers`` (and its blocking and
sharded-cluster forms)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from paramserver.errors import InvalidArgument, WaitTimeout
from paramserver.worker_client import UpdateRule, WorkerClient, connect_sync
from tests.harness import running_server

pytestmark = pytest.mark.timeout(60)


async def test_a_late_poller_passes_once_the_others_trained_and_left() -> None:
    """ASP: two workers see 3 live, train and leave before the third polls again (a fast job
    did this within one 0.2 s poll interval). The third must not wait for a count of live
    workers that will never come back: applied updates show the barrier was passed."""
    async with running_server(consistency="asp") as daemon:
        address = f"127.0.0.1:{daemon.port}"
        async with WorkerClient(address, "late", heartbeat=False) as late:
            for name in ("a", "b"):
                async with WorkerClient(address, name, heartbeat=False) as ps:
                    await ps.init({"w": np.zeros(3, np.float32)}, rule=UpdateRule("add"))
                    await ps.push({"w": np.ones(3, np.float32)})
            assert (await late.heartbeat()).view.live_workers == 1
            assert await late.wait_for_workers(3, timeout_s=5.0) == 0  # no WaitTimeout


async def test_nobody_else_came_is_a_wait_timeout() -> None:
    async with running_server(consistency="asp") as daemon:
        async with WorkerClient(f"127.0.0.1:{daemon.port}", "alone", heartbeat=False) as ps:
            with pytest.raises(WaitTimeout, match=r"1 of 2 workers registered after 0\.3 s"):
                await ps.wait_for_workers(2, timeout_s=0.3)


async def test_the_barrier_holds_the_first_worker_until_the_last_registers() -> None:
    """BSP: the first worker waits at the barrier; it passes only after the second worker
    registered (ordering the test controls: the second joins after the first is waiting)."""
    async with running_server(consistency="bsp") as daemon:
        address = f"127.0.0.1:{daemon.port}"
        async with WorkerClient(address, "first", heartbeat=False) as first:
            waiting = asyncio.create_task(first.wait_for_workers(2, timeout_s=30.0))
            await asyncio.sleep(0.3)
            assert not waiting.done()  # nobody else yet: still waiting
            async with WorkerClient(address, "second", heartbeat=False):
                assert await asyncio.wait_for(waiting, 30.0) == 2


async def test_bad_arguments_are_invalid_argument() -> None:
    async with running_server(consistency="asp") as daemon:
        async with WorkerClient(f"127.0.0.1:{daemon.port}", "w", heartbeat=False) as ps:
            for n, timeout_s in [(0, 1.0), (True, 1.0), (2, 0), (2, -1.0)]:
                with pytest.raises(InvalidArgument, match="wait_for_workers"):
                    await ps.wait_for_workers(n, timeout_s=timeout_s)


def test_the_blocking_client_waits_too() -> None:
    async def serve_and_check() -> None:
        async with running_server(consistency="bsp") as daemon:
            address = f"127.0.0.1:{daemon.port}"
            async with WorkerClient(address, "async-one", heartbeat=False):

                def blocking() -> int:
                    with connect_sync(address, "sync-one", heartbeat=False) as ps:
                        return ps.wait_for_workers(2, timeout_s=10.0)

                assert await asyncio.to_thread(blocking) == 2

    asyncio.run(serve_and_check())
