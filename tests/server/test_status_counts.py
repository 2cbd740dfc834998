"""``paramserver status``: per-worker update counts per registration (the rows sum to the
server's total after a worker registered again) and the checkpoint a server restored."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from paramserver.server.observability.status_table import render_status
from paramserver.worker_client import UpdateRule, WorkerClient
from tests.harness import running_server

pytestmark = pytest.mark.timeout(60)


async def _push(ps: WorkerClient, times: int) -> None:
    for _ in range(times):
        await ps.push({"w": np.ones(2, np.float32)})


async def test_rows_sum_to_the_total_after_a_worker_registered_again() -> None:
    async with running_server(consistency="asp") as daemon:
        address = f"127.0.0.1:{daemon.port}"
        async with WorkerClient(address, "b", heartbeat=False) as b:
            await b.init({"w": np.zeros(2, np.float32)}, rule=UpdateRule("add"))
            await _push(b, 1)
            first = WorkerClient(address, "a", heartbeat=False)
            async with first:
                await _push(first, 3)
                first_id = first.worker_id
                async with WorkerClient(address, "a", heartbeat=False, replace=True) as again:
                    await _push(again, 2)
                    status = await b.status()
                    again_id = again.worker_id
    assert first_id != again_id
    assert status.applied_updates == 6
    rows = {w.worker_id: w.applied_updates for w in status.workers}
    assert sum(rows.values()) == 6, rows
    assert rows[again_id] == 2
    assert rows.get(first_id, 3) == 3  # the fenced registration keeps its own count, if listed


async def test_status_names_the_checkpoint_restored_at_start(tmp_path: Path) -> None:
    async with running_server(consistency="asp", checkpoint_dir=str(tmp_path)) as daemon:
        async with WorkerClient(f"127.0.0.1:{daemon.port}", "a", heartbeat=False) as ps:
            await ps.init({"w": np.zeros(2, np.float32)}, rule=UpdateRule("add"))
            assert (await ps.status()).last_checkpoint == ""
            assert "last checkpoint none" in render_status(await ps.status())
            written = await daemon.checkpoint()
            st = await ps.status()
            assert written is not None
            assert (st.last_checkpoint, st.last_checkpoint_restored) == (Path(written).name, False)
    newest = max(n for n in os.listdir(tmp_path) if n.startswith("ckpt-"))  # stop wrote one
    assert newest > Path(written).name
    async with running_server(consistency="asp", checkpoint_dir=str(tmp_path)) as daemon:
        async with WorkerClient(f"127.0.0.1:{daemon.port}", "a", heartbeat=False) as ps:
            st = await ps.status()
            assert (st.last_checkpoint, st.last_checkpoint_restored) == (newest, True)
            assert st.last_checkpoint_age_ms > 0
            text = render_status(st)
            assert f"last checkpoint {newest} (restored at start, written " in text
            again = await daemon.checkpoint()
            st = await ps.status()
            assert (st.last_checkpoint, st.last_checkpoint_restored) == (Path(again).name, False)
