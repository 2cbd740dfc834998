"""Case ssp-bound.md through a real server, real gRPC clients and a real (killed) worker process.

SSP(s): a pull by a worker at clock c is admitted iff the live minimum clock >= c - s, so it
reflects every update from clocks <= c - s - 1 (docs/semantics.md). Timings are bounds for the
product, measured generously (cases/README.md).
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from paramserver.errors import WaitTimeout
from paramserver.worker_client import UpdateRule, WorkerClient, connect
from tests.harness import PlanWorker, running_server

pytestmark = pytest.mark.timeout(60)

ADD = UpdateRule("add")


async def _open(address: str, name: str, **kwargs: object) -> WorkerClient:
    client = connect(address, name, auto_reregister=False, **kwargs)
    await client.open()
    return client


async def _close(*clients: WorkerClient) -> None:
    for client in clients:
        await client.close()


async def _waits_for(client: WorkerClient, names: list[str], wait_s: float = 0.3) -> None:
    """A pull with a short deadline runs out, naming exactly the workers it waited for."""
    with pytest.raises(WaitTimeout) as err:
        await client.pull(["w"], timeout_s=wait_s)
    assert err.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
    for name in names:
        assert f"{name}" in str(err.value)


async def test_pull_waits_only_past_the_bound_and_wakes_promptly() -> None:
    """cases/ssp-bound.md: s = 2, B at clock 0. A pulls at clocks 0, 1 and 2 without waiting
    (2 - 0 <= 2); at clock 3 it waits, and returns well under a second after B clocks to 1."""
    async with running_server(consistency="ssp", staleness=2) as srv:
        a = await _open(srv.address, "A")
        b = await _open(srv.address, "B")
        try:
            await a.init({"w": np.zeros(1)}, ADD)
            for c in (0, 1, 2):
                assert a.clock_value == c
                # B never moves here, so any wait would run into this deadline.
                await a.pull(["w"], timeout_s=2.0)
                await a.clock()
            assert a.clock_value == 3
            await _waits_for(a, ["B"])
            pull = asyncio.create_task(a.pull(["w"], timeout_s=10.0))
            await asyncio.sleep(0.2)
            assert not pull.done()
            start = time.monotonic()
            await b.clock()
            await asyncio.wait_for(pull, 5.0)
            elapsed = time.monotonic() - start
            assert elapsed < 1.0, f"pull returned {elapsed:.3f} s after B clocked"
            assert a.view is not None and a.view.min_clock == 1
        finally:
            await _close(a, b)


@pytest.mark.parametrize("consistency", ["ssp", "bsp"])
async def test_ssp_with_zero_staleness_behaves_as_bsp(consistency: str) -> None:
    """cases/ssp-bound.md: with s = 0 the same script gives the same admissions and values as
    BSP (sum aggregation, rule add): each pull at clock c waits for clock c of the other and
    sees exactly the gradients of clocks < c."""
    async with running_server(consistency=consistency, staleness=0, aggregation="sum") as srv:
        a = await _open(srv.address, "A")
        b = await _open(srv.address, "B")
        try:
            await a.init({"w": np.zeros(2)}, ADD)
            seen = []
            for c, (ga, gb) in enumerate([(1.0, 2.0), (4.0, 8.0)]):
                seen.append((await a.pull(["w"], timeout_s=2.0))["w"])
                seen.append((await b.pull(["w"], timeout_s=2.0))["w"])
                await a.push({"w": np.array([ga, 0.0])})
                await a.clock()
                await _waits_for(a, ["B"])
                await b.push({"w": np.array([0.0, gb])})
                await b.clock()
                assert (a.clock_value, b.clock_value) == (c + 1, c + 1)
            seen.append((await a.pull(["w"], timeout_s=2.0))["w"])
            seen.append((await b.pull(["w"], timeout_s=2.0))["w"])
        finally:
            await _close(a, b)
    expected = [[0, 0], [0, 0], [1, 2], [1, 2], [5, 10], [5, 10]]
    np.testing.assert_array_equal(np.array(seen), np.array(expected, dtype=np.float64))


@pytest.mark.slow
async def test_killed_slowest_worker_releases_the_wait_after_its_lease(tmp_path: Path) -> None:
    """cases/ssp-bound.md: A waits at clock 3 for B at clock 0; B (a real worker process) is
    SIGKILLed; once B's lease (1 s, heartbeats every 0.25 s) runs out the minimum is over live
    workers only and A's pull returns."""
    lease_s = 1.0
    async with running_server(consistency="ssp", staleness=2, lease_ms=int(lease_s * 1000)) as srv:
        a = await _open(srv.address, "A")
        b = PlanWorker(srv.address, "B", {"grads": [], "then": "hang"}, tmp_path)
        try:
            await a.init({"w": np.zeros(1)}, ADD)
            await b.ready()
            assert b.clock == 0
            for _ in range(3):
                await a.clock()
            await _waits_for(a, ["B"])
            pull = asyncio.create_task(a.pull(["w"], timeout_s=20.0))
            start = time.monotonic()
            b.kill()
            await asyncio.wait_for(pull, 10.0)
            elapsed = time.monotonic() - start
            # B renewed its lease at most a heartbeat (lease / 4) before the kill.
            assert 0.5 * lease_s <= elapsed < 3 * (lease_s + lease_s / 4), elapsed
            assert a.view is not None
            assert (a.view.live_workers, a.view.min_clock) == (1, 3)
            status = await a.status()
            assert {w.worker_name: w.live for w in status.workers} == {"A": True, "B": False}
        finally:
            b.kill()
            await _close(a)


def _bit(worker: int, clock: int, workers: int) -> int:
    return clock * workers + worker


async def test_every_pull_holds_all_terms_older_than_the_bound() -> None:
    """cases/ssp-bound.md freshness: s = 2, three workers at different paces; worker p pushes
    2**(clock * 3 + p) at each clock (rule add, float64, so the sum is exact). Every pull at
    clock c decodes to a set holding every term of clocks <= c - s - 1 of every worker, and
    the worker's own earlier terms; at the end the value is exactly the sum of all terms."""
    s, workers, clocks = 2, 3, 10
    pace_s = [0.0, 0.004, 0.012]  # A fast, C slow: A runs up against the bound
    async with running_server(consistency="ssp", staleness=s) as srv:
        clients = [await _open(srv.address, name) for name in ("A", "B", "C")]
        try:
            await clients[0].init({"w": np.zeros(())}, ADD)
            observed: list[tuple[int, int, int]] = []  # (worker, clock, decoded value)

            async def run(p: int) -> None:
                ps = clients[p]
                rng = random.Random(p)
                for c in range(clocks):
                    assert ps.clock_value == c
                    value = (await ps.pull(["w"], timeout_s=20.0))["w"]
                    assert value.dtype == np.float64 and value == int(value)
                    observed.append((p, c, int(value)))
                    await ps.push({"w": np.array(float(2 ** _bit(p, c, workers)))})
                    await ps.clock()
                    await asyncio.sleep(pace_s[p] * rng.random())

            await asyncio.gather(*(run(p) for p in range(workers)))
            final = (await clients[0].pull(["w"], observer=True))["w"]
        finally:
            await _close(*clients)
    assert len(observed) == workers * clocks
    for p, c, value in observed:
        required = {_bit(q, t, workers) for q in range(workers) for t in range(c - s)}
        required |= {_bit(p, t, workers) for t in range(c)}  # read-my-writes
        present = {bit for bit in range(workers * clocks) if value >> bit & 1}
        assert value < 2 ** (workers * clocks)
        assert required <= present, (p, c, sorted(required - present))
    assert final == float(2 ** (workers * clocks) - 1)


async def test_late_joiner_starts_at_the_current_minimum() -> None:
    """cases/ssp-bound.md: a worker that joins late starts at the live minimum clock, not 0."""
    async with running_server(consistency="ssp", staleness=2) as srv:
        a = await _open(srv.address, "A")
        b = await _open(srv.address, "B")
        late: list[WorkerClient] = []
        try:
            await a.init({"w": np.zeros(1)}, ADD)
            for _ in range(5):
                await a.clock()
            for _ in range(3):
                await b.clock()
            c = await _open(srv.address, "C")
            late.append(c)
            assert c.clock_value == 3
            assert c.view is not None and c.view.min_clock == 3
            await c.pull(["w"], timeout_s=2.0)  # 3 - 2 <= 3: no wait
            await c.clock()
            await b.leave()  # the minimum is now min(A = 5, C = 4)
            d = await _open(srv.address, "D")
            late.append(d)
            assert d.clock_value == 4
        finally:
            await _close(a, b, *late)
