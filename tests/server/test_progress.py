"""Each worker name's progress (iterations completed, clock reached): kept across
re-registration and replacement, read with ``client.progress()``, and rebuilt after a restart
by checkpoint restore and WAL replay as the clocks are (in process here; a real worker killed
and replaced under ``paramserver run`` in ``tests/cli/test_run.py``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from paramserver.core.shard import PROGRESS_NAMES_KEPT, NameProgress, ServerCore
from paramserver.server.checkpoint import CheckpointManager
from paramserver.server.config import ServerConfig
from paramserver.server.reshard import _merged_progress
from paramserver.server.wal_records import replay_into
from paramserver.worker_client import UpdateRule, WorkerClient, WorkerProgress
from tests.harness import running_server
from tests.server.test_status_counts import FakeClock, LoggedCore, observed, run_job

pytestmark = pytest.mark.timeout(60)


def ticks_per_name(job: LoggedCore) -> dict[str, int]:
    """Clock records per worker name, counted from the job's own log (each advanced a clock:
    the job never repeats a clock)."""
    names = {}
    counts: dict[str, int] = {}
    for record in job.records:
        kind = record.WhichOneof("body")
        if kind == "register":
            names[record.register.worker_id] = record.register.worker_name
        elif kind == "clock":
            name = names[record.clock.worker_id]
            counts[name] = counts.get(name, 0) + 1
    return counts


@pytest.mark.parametrize("consistency", ["bsp", "ssp"])
@pytest.mark.parametrize("path", ["wal", "checkpoint", "checkpoint+wal"])
def test_progress_survives_replacement_and_restart(
    tmp_path: Path, consistency: str, path: str
) -> None:
    live = LoggedCore(consistency)
    ckpts = CheckpointManager(tmp_path)
    cut: list[int] = []

    def checkpoint() -> None:
        ckpts.save(live.core, wal_sequence=len(live.records))
        cut.append(len(live.records))

    run_job(live, checkpoint=checkpoint if path == "checkpoint+wal" else None)
    if path == "checkpoint":
        checkpoint()
    # a and b ended steps 0..6 (a's last under a new registration), c steps 0..5
    assert ticks_per_name(live) == {"a": 7, "b": 7, "c": 6}
    assert {n: p.steps for n, p in live.core.progress.items()} == ticks_per_name(live)
    assert live.core.progress["a"] == NameProgress(steps=7, clock=7)

    core, _ = observed(live.config, FakeClock())
    if path != "wal":
        assert ckpts.restore_latest(core) is not None
    replay_into(core, iter(live.records[cut[0] if cut else 0 :]), now=0.0)
    assert core.progress == live.core.progress


def test_a_late_joiner_has_done_nothing_yet() -> None:
    core = ServerCore(ServerConfig(consistency="ssp", staleness=5))
    a = core.register("a", 0.0).worker_id
    for c in range(3):
        core.clock(a, c)
    late = core.register("late", 0.0)
    assert late.clock == 3
    core.clock(late.worker_id, 3)
    core.clock(late.worker_id, 3)  # a repeat changes nothing
    assert core.progress["late"] == NameProgress(steps=1, clock=4)
    assert core.progress["a"] == NameProgress(steps=3, clock=3)


def test_the_oldest_names_are_forgotten_beyond_the_limit() -> None:
    core = ServerCore(ServerConfig(consistency="asp"))
    for i in range(PROGRESS_NAMES_KEPT + 2):
        core._count_progress(f"w{i}", 1)
    core._count_progress("w2", 2)  # updated: now the newest
    assert len(core.progress) == PROGRESS_NAMES_KEPT
    assert "w0" not in core.progress and "w1" not in core.progress
    assert list(core.progress)[-1] == "w2"


def test_resharding_keeps_what_every_shard_saw() -> None:
    manifests = [
        {"progress": {"a": [5, 5], "b": [3, 9]}},
        {"progress": {"a": [4, 4], "b": [3, 9], "c": [1, 1]}},
    ]
    assert _merged_progress(manifests) == {"a": (4, 4), "b": (3, 9)}


async def test_client_progress_after_replace() -> None:
    async with running_server(consistency="asp") as daemon:
        address = f"127.0.0.1:{daemon.port}"
        async with WorkerClient(address, "w", heartbeat=False) as first:
            await first.init({"x": np.zeros(1, np.float32)}, rule=UpdateRule("add"))
            assert await first.progress() == WorkerProgress("w", 0, 0)
            for _ in range(4):
                await first.clock()
            async with WorkerClient(address, "w", heartbeat=False, replace=True) as again:
                assert await again.progress() == WorkerProgress("w", 4, 4)
                await again.clock()
                assert await again.progress() == WorkerProgress("w", 5, 5)
                assert await again.progress("nobody") == WorkerProgress("nobody", 0, 0)
