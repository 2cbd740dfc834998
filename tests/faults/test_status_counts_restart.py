"""Per-worker status counts across a server restart (issue 28, item 5): the applied updates of
each registration, and under BSP each worker's barrier steps, lag and wait, are after the
restart what they were before the kill, like the clocks, on each way a server comes back:

* ``--wal`` without checkpoints, SIGKILL: the whole log is replayed;
* ``--wal --checkpoint-dir``, a checkpoint in the middle of the job, SIGKILL: the checkpoint is
  restored and the log's tail after it replayed;
* ``--checkpoint-dir`` without a log, SIGTERM: the final checkpoint is restored.

The server is a real ``paramserver serve`` process on 127.0.0.1 (port 0, then the same port),
the workers raw gRPC stubs (no heartbeats, a lease longer than the test) so that the test
decides every push, retry and clock. The expected counts are computed here from the test's
own plan of pushes; the server's ``Status`` (and ``paramserver status --json``) must agree
before the kill and after the restart, and keep counting afterwards.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from paramserver.api.v1 import parameter_server_pb2 as pb
from paramserver.api.v1 import parameter_server_pb2_grpc as pb_grpc
from paramserver.worker_client import UpdateRule
from tests.harness import ServerProcess, wait_serving
from tests.harness import raw_stubs as raw

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(180),
    pytest.mark.asyncio(loop_factories=["asyncio"]),
]

WORKERS = 3
#: Steps every worker ends before the kill; under BSP the next one is left open with the first
#: two workers clocked in it (their clock times are part of what must survive).
STEPS = 5
#: The checkpoint of the checkpoint + WAL way is written in this step, after the first two
#: workers clocked it and before the last one did.
CHECKPOINT_STEP = 3
#: The last worker clocks each step this long after the others: the straggler.
STRAGGLE_S = 0.03
#: Barrier lag and wait are seconds summed over steps, shown in whole milliseconds. The log
#: stamps a clock's record just before the live server reads its own clock for it (a few
#: microseconds, more if the OS preempts the server in between on a loaded machine), so a
#: replayed total may differ from the live one by that and a millisecond of truncation. A
#: reset (what this test catches) loses STEPS * STRAGGLE_S = 150 ms or more.
MS_SLACK = 25

WAYS = {
    "wal-sigkill": (("--wal",), signal.SIGKILL),
    "checkpoint-and-wal-sigkill": (("--wal", "--checkpoint-dir", "{tmp}/ckpt"), signal.SIGKILL),
    "final-checkpoint-sigterm": (("--checkpoint-dir", "{tmp}/ckpt"), signal.SIGTERM),
}


class Job:
    """Raw workers of one server and the test's own record of what it pushed."""

    def __init__(self, stub: pb_grpc.ParameterServerStub, consistency: str) -> None:
        self.stub = stub
        self.bsp = consistency == "bsp"
        self.ids: list[str] = []
        self.request_ids: dict[str, int] = {}
        #: (worker id, clock) of every push the server answered as new.
        self.pushes: list[tuple[str, int]] = []

    async def push(self, wid: str, clock: int, *, retry: bool = False) -> None:
        if not retry:
            self.request_ids[wid] = self.request_ids.get(wid, 0) + 1
        msgs = raw.push_arrays(wid, self.request_ids[wid], {"w": np.ones(4)}, clock=clock)
        resp = await self.stub.Push(iter(msgs), timeout=30)
        assert resp.duplicate == retry, (wid, clock, retry)
        if not retry:
            self.pushes.append((wid, clock))

    async def clock(self, wid: str, clock: int) -> None:
        await self.stub.Clock(pb.ClockRequest(worker_id=wid, clock=clock), timeout=30)

    def expected_applied(self, closed_steps: int) -> dict[str, int]:
        """Applied updates per worker id: every push under ASP, one per worker and step that
        closed under BSP (never more than one here: a worker pushes once per step)."""
        counted = (p for p in self.pushes if not self.bsp or p[1] < closed_steps)
        got = Counter(wid for wid, _ in counted)
        return {wid: got.get(wid, 0) for wid in self.ids}


async def run_plan(job: Job, checkpoint: bool) -> None:
    """In step t worker i pushes iff t % (i + 1) == 0 (each worker's first push is retried
    once: a duplicate, not counted); then the workers clock, the last one STRAGGLE_S later.
    Then step STEPS: the first two push and clock, the last one does neither (yet)."""
    for step in range(STEPS + 1):
        for i, wid in enumerate(job.ids):
            if step % (i + 1) == 0 and (step < STEPS or i < WORKERS - 1):
                await job.push(wid, step)
                if step == 0:
                    await job.push(wid, step, retry=True)
        for i, wid in enumerate(job.ids):
            if i == WORKERS - 1:
                if step == STEPS:
                    break
                if checkpoint and step == CHECKPOINT_STEP:
                    resp = await job.stub.Checkpoint(pb.CheckpointRequest(), timeout=60)
                    assert resp.path
                await asyncio.sleep(STRAGGLE_S)
            await job.clock(wid, step)


def per_worker(st: pb.StatusResponse) -> dict[str, dict[str, int]]:
    return {
        w.worker_id: {
            "clock": w.clock,
            "applied_updates": w.applied_updates,
            "barrier_steps": w.barrier_steps,
            "barrier_lag_ms": w.barrier_lag_ms,
            "barrier_wait_ms": w.barrier_wait_ms,
        }
        for w in st.workers
    }


def assert_same(after: dict[str, dict[str, int]], before: dict[str, dict[str, int]]) -> None:
    assert after.keys() == before.keys()
    for wid, b in before.items():
        a = after[wid]
        exact = ("clock", "applied_updates", "barrier_steps")
        assert {k: a[k] for k in exact} == {k: b[k] for k in exact}, (wid, a, b)
        for k in ("barrier_lag_ms", "barrier_wait_ms"):
            assert abs(a[k] - b[k]) <= MS_SLACK, (wid, k, a, b)


async def cli_status(address: str) -> dict[str, dict[str, int]]:
    """``paramserver status ADDRESS --json``: its per-worker rows, as :func:`per_worker`."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        *("-m", "paramserver", "status", address, "--json"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, err.decode()
    rows = json.loads(out)["workers"]
    keys = ("clock", "applied_updates", "barrier_steps", "barrier_lag_ms", "barrier_wait_ms")
    return {w["worker_id"]: {k: int(w[k]) for k in keys} for w in rows}


@pytest.mark.parametrize("consistency", ["asp", "bsp"])
@pytest.mark.parametrize("way", list(WAYS))
async def test_per_worker_counts_survive_a_restart(
    tmp_path: Path, way: str, consistency: str
) -> None:
    flags, stop = WAYS[way]
    args = [a.format(tmp=tmp_path) for a in flags]
    if "--checkpoint-dir" not in args:
        args += ["--wal-dir", str(tmp_path / "wal")]
    args += ["--consistency", consistency, "--lease-ms", "600000", "--grace-s", "1"]
    with ServerProcess(tmp_path, *args, start=False) as server:
        server.start()
        async with raw.channel(server.address) as ch:
            job = Job(pb_grpc.ParameterServerStub(ch), consistency)
            job.ids = [await raw.register(job.stub, f"w{i}") for i in range(WORKERS)]
            await raw.init(job.stub, {"w": np.zeros(4)}, UpdateRule("add"))
            await run_plan(job, checkpoint=way.startswith("checkpoint-and-wal"))
            st = await raw.status(job.stub)
        closed = st.bsp_step if job.bsp else 0
        assert closed == (STEPS if job.bsp else 0)
        expected = job.expected_applied(closed)
        before = per_worker(st)
        assert {w: r["applied_updates"] for w, r in before.items()} == expected
        assert sum(expected.values()) == st.applied_updates
        if job.bsp:
            assert {r["barrier_steps"] for r in before.values()} == {STEPS}
            # the straggler's lag: STRAGGLE_S per step at least (a bound, not a timing claim)
            assert before[job.ids[-1]]["barrier_lag_ms"] >= STEPS * STRAGGLE_S * 1000

        if stop == signal.SIGKILL:
            server.kill()
        else:
            server.signal(stop)
            assert await server.wait_exit(timeout_s=60) == 0, server.log()
        await server.astart()
        after = per_worker(await wait_serving(server.address, timeout_s=60))
        assert_same(after, before)
        assert_same(await cli_status(server.address), before)
        if way != "wal-sigkill":
            assert "restored checkpoint" in server.last_log()

        # The restarted server counts on from the restored values.
        async with raw.channel(server.address) as ch:
            job.stub = pb_grpc.ParameterServerStub(ch)
            last = job.ids[-1]
            if job.bsp:  # the straggler ends the open step: it closes, every worker's 6th
                await job.push(last, STEPS)
                await job.clock(last, STEPS)
            else:
                for wid in job.ids:
                    await job.push(wid, STEPS)
            st = await raw.status(job.stub)
    final = per_worker(st)
    assert {w: r["applied_updates"] for w, r in final.items()} == job.expected_applied(
        st.bsp_step if job.bsp else 0
    )
    assert sum(r["applied_updates"] for r in final.values()) == st.applied_updates
    if job.bsp:
        assert st.bsp_step == STEPS + 1
        assert {r["barrier_steps"] for r in final.values()} == {STEPS + 1}
