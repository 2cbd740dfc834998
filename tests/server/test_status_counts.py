"""``paramserver status``: per-worker update counts per registration (the rows sum to the
server's total after a worker registered again), the checkpoint a server restored, and the
per-worker counts across a restart: checkpoint restore and WAL replay rebuild them (in
process here; with real server processes killed and restarted in
``tests/faults/test_status_counts_restart.py``)."""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from paramserver.api.v1 import wal_pb2 as wal_pb
from paramserver.core.consistency import DEPARTED_KEPT
from paramserver.core.shard import ServerCore
from paramserver.server import wal_records
from paramserver.server.checkpoint import CheckpointManager
from paramserver.server.config import ServerConfig
from paramserver.server.observability.hooks import ShardObservations
from paramserver.server.observability.status_table import render_status
from paramserver.server.wal_records import replay_into
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


# ---------------------------------------------------------------------------------------------
# The per-worker counts survive a restart (issue 28, item 5): checkpoint restore and WAL replay
# rebuild the applied gradients per registration and the barrier totals per worker exactly.
# In process and time-controlled: a fake clock drives the observer, and each logged record
# carries the fake time it was written at (as WriteAheadLog.append stamps the real one).


#: The fake wall-clock time the job starts at (a record's time 0 means "not logged").
T0 = 1_700_000_000.0


class FakeClock:
    def __init__(self) -> None:
        self.t = T0

    def __call__(self) -> float:
        return self.t


class LoggedCore:
    """A live core whose every mutation is also logged as the engine logs it."""

    def __init__(self, consistency: str) -> None:
        self.config = ServerConfig(consistency=consistency, staleness=1)
        self.clock = FakeClock()
        self.core, self.obs = observed(self.config, self.clock)
        self.records: list[wal_pb.WalRecord] = []
        #: (worker id, step) of every push answered as new (not a duplicate).
        self.pushes: list[tuple[str, int]] = []

    def log(self, record: wal_pb.WalRecord) -> None:
        record.sequence = len(self.records) + 1
        record.unix_s = self.clock.t
        self.records.append(record)

    def register(self, name: str, *, replace: bool = False) -> str:
        wid = self.core.register(name, 0.0, replace=replace).worker_id
        self.log(wal_records.register(name, replace, "", wid))
        return wid

    def init(self) -> None:
        init = {"w": np.zeros(2)}
        self.core.init(init, UpdateRule("add"))
        self.log(wal_records.init(UpdateRule("add"), init))

    def push(self, wid: str, rid: int, clock: int) -> None:
        grads = {"w": np.ones(2)}
        logged: list[wal_pb.WalRecord] = []
        record = wal_records.push(wid, rid, clock, 1, None, grads)
        result = self.core.push(wid, rid, clock, grads, 0.0, log=lambda: logged.append(record))
        for record in logged:  # none for a duplicate: the engine logs decided pushes only
            self.log(record)
        if not result.duplicate:
            self.pushes.append((wid, clock))

    def tick(self, wid: str, clock: int, at: float) -> None:
        self.clock.t = at
        self.core.clock(wid, clock)
        self.log(wal_records.clock(wid, clock))


def observed(config: ServerConfig, now: FakeClock) -> tuple[ServerCore, ShardObservations]:
    core = ServerCore(config)
    obs = ShardObservations(now, bsp=config.consistency == "bsp")
    core.observer = obs
    return core, obs


def expected_applied(job: LoggedCore) -> dict[str, int]:
    """Applied gradients per registration, from the job's own record of its pushes: under
    SSP/ASP every new push, under BSP one per worker in each step that closed."""
    if job.config.consistency != "bsp":
        return dict(Counter(wid for wid, _ in job.pushes))
    closed = job.core.bsp_step
    return dict(Counter(wid for wid, step in set(job.pushes) if step < closed))


def run_job(job: LoggedCore, *, checkpoint: Callable[[], None] | None = None) -> list[str]:
    """Workers a, b, c; in step t worker i pushes iff t % (i + 1) == 0 (a's first push once
    more: a duplicate) and they clock at T + 10 t, + 1, + 3 s (c the straggler). In step
    3 ``checkpoint`` runs after a and b clocked and before c did (the step is open). After step
    5 ``a`` registers again (replace) and pushes for step 6; a and b clock step 6, c does not:
    step 6 stays open. Returns the live worker ids ``[a, b, c]``."""
    job.init()
    ids = [job.register(n) for n in ("a", "b", "c")]
    rid = 0
    for step in range(7):
        if step == 6:
            ids[0] = job.register("a", replace=True)
        for i, wid in enumerate(ids):
            if step % (i + 1) == 0:
                rid += 1
                job.push(wid, rid, step)
                if rid == 1:
                    job.push(wid, rid, step)  # a retry: a duplicate, not counted
        for i, wid in enumerate(ids):
            if step == 6 and i == 2:
                break  # c still works on step 6
            if step == 3 and i == 2 and checkpoint is not None:
                checkpoint()
            job.tick(wid, step, T0 + 10.0 * step + (0.0, 1.0, 3.0)[i])
    return ids


def assert_same_counts(live: LoggedCore, core: ServerCore, obs: ShardObservations) -> None:
    assert core.applied_by_registration == live.core.applied_by_registration
    assert core.applied_updates == live.core.applied_updates
    assert {n: vars(b) for n, b in obs.barrier.items()} == {
        n: vars(b) for n, b in live.obs.barrier.items()
    }


@pytest.mark.parametrize("consistency", ["bsp", "ssp", "asp"])
@pytest.mark.parametrize("path", ["wal", "checkpoint", "checkpoint+wal"])
def test_a_restart_restores_the_counts_per_registration(
    tmp_path: Path, consistency: str, path: str
) -> None:
    """The job above, recovered into a fresh core three ways: the whole log replayed (a
    SIGKILL with --wal and no checkpoint), the checkpoint written at the end (SIGTERM), and
    the checkpoint written in open step 3 plus the log after it (a SIGKILL with both). Each
    registration's applied count equals the one the job computes from its own pushes, and
    equals the live server's, as do the barrier totals; then c ends step 6 on both and they
    still agree (the clock times of the open step came back too)."""
    live = LoggedCore(consistency)
    ckpts = CheckpointManager(tmp_path)
    cut: list[int] = []

    def checkpoint() -> None:
        ckpts.save(live.core, wal_sequence=len(live.records))
        cut.append(len(live.records))

    ids = run_job(live, checkpoint=checkpoint if path == "checkpoint+wal" else None)
    if path == "checkpoint":
        checkpoint()
    expected = expected_applied(live)
    assert live.core.applied_by_registration == expected
    assert sum(expected.values()) == live.core.applied_updates
    assert expected[ids[0]] == 1 if consistency != "bsp" else ids[0] not in expected

    core, obs = observed(live.config, FakeClock())
    if path != "wal":
        assert ckpts.restore_latest(core) is not None
    replay_into(core, iter(live.records[cut[0] if cut else 0 :]), now=0.0)
    assert_same_counts(live, core, obs)
    if consistency == "bsp":
        assert {n: b.steps for n, b in obs.barrier.items()} == {"a": 6, "b": 6, "c": 6}
        assert obs.barrier["c"].lag_s == 6 * 3.0 and obs.barrier["a"].wait_s == 6 * 3.0

    # c ends step 6 on both: the step closes, a's second registration is counted.
    obs.now.t = live.clock.t = T0 + 63.0  # type: ignore[attr-defined]
    live.core.clock(ids[2], 6)
    core.clock(ids[2], 6)
    assert_same_counts(live, core, obs)
    assert live.core.applied_by_registration == expected_applied(live)
    if consistency == "bsp":
        assert {n: b.steps for n, b in obs.barrier.items()} == {"a": 7, "b": 7, "c": 7}


@pytest.mark.parametrize("consistency", ["bsp", "asp"])
def test_a_checkpoint_written_before_the_counts_were_saved_still_loads(
    tmp_path: Path, consistency: str
) -> None:
    """A manifest without ``applied_by_registration`` and ``observations`` (an older server's)
    restores; the counts start from what it tells: under ASP each registration's applied
    pushes from its remembered request ids (exact within the dedup window), under BSP 0.
    The total stays exact."""
    live = LoggedCore(consistency)
    run_job(live)
    path = CheckpointManager(tmp_path).save(live.core)
    manifest = json.loads((path / "manifest.json").read_text())
    del manifest["applied_by_registration"], manifest["observations"]
    (path / "manifest.json").write_text(json.dumps(manifest))

    core, obs = observed(live.config, FakeClock())
    assert CheckpointManager(tmp_path).restore_latest(core) == path
    assert core.applied_updates == live.core.applied_updates
    expected = {} if consistency == "bsp" else expected_applied(live)
    assert core.applied_by_registration == expected
    assert obs.barrier == {}


def test_counts_of_registrations_the_cluster_forgot_are_dropped() -> None:
    """Per-registration counts are bounded like the dedup windows: a registration the cluster
    no longer remembers (beyond DEPARTED_KEPT departed ones) loses its count."""
    core = ServerCore(ServerConfig(consistency="asp"))
    core.init({"w": np.zeros(2)}, UpdateRule("add"))
    first = core.register("a", 0.0).worker_id
    core.push(first, 1, 0, {"w": np.ones(2)}, 0.0)
    for _ in range(DEPARTED_KEPT + 2):
        wid = core.register("a", 0.0, replace=True).worker_id
        core.push(wid, 1, 0, {"w": np.ones(2)}, 0.0)
        assert len(core.applied_by_registration) <= len(core.cluster.workers) + 1
    assert first not in core.cluster.workers and first not in core.applied_by_registration
    assert core.applied_by_registration[wid] == 1
    assert core.applied_updates == DEPARTED_KEPT + 3
