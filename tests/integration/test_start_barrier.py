"""The workers' start barrier (paramserver.worker_client.training.wait_for_workers)."""

from __future__ import annotations

import numpy as np
import pytest

from paramserver.errors import WaitTimeout
from paramserver.worker_client import UpdateRule, WorkerClient
from paramserver.worker_client.training import wait_for_workers

from .ps_helpers import running_server

pytestmark = pytest.mark.timeout(30)


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
            await wait_for_workers(late, 3, timeout_s=5.0)  # returns, no WaitTimeout


async def test_nobody_else_came_is_a_wait_timeout() -> None:
    async with running_server(consistency="asp") as daemon:
        async with WorkerClient(f"127.0.0.1:{daemon.port}", "alone", heartbeat=False) as ps:
            with pytest.raises(WaitTimeout, match=r"1 of 2 workers registered after 0\.3 s"):
                await wait_for_workers(ps, 2, timeout_s=0.3)
