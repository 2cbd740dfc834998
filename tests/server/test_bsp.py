"""BSP through the real gRPC server: the single-process SGD oracle, aggregation denominators."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from paramserver.errors import StaleUpdate
from paramserver.worker_client import UpdateRule, connect
from tests.harness import running_server

pytestmark = pytest.mark.timeout(60)


def _batches(seed: int, workers: int, steps: int, batch: int, dim: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(steps, workers, batch, dim + 1))


def _grad(w: np.ndarray, data: np.ndarray) -> np.ndarray:
    """Least-squares gradient of mean 0.5 (x.w - y)^2 over a batch. data: (batch, dim + 1)."""
    x, y = data[:, :-1], data[:, -1]
    return x.T @ (x @ w - y) / len(y)


async def test_bsp_equals_single_process_sgd_on_union_batch() -> None:
    """4 workers, mean aggregation, plain SGD, equal batches, float64, 20 steps: parameters equal
    single-process SGD on the union of the batches to 1e-9 (the oracle runs in this test)."""
    workers, steps, batch, dim, lr = 4, 20, 8, 5, 0.05
    data = _batches(7, workers, steps, batch, dim)
    w0 = np.linspace(-1, 1, dim)

    oracle = w0.copy()
    for t in range(steps):
        union = data[t].reshape(workers * batch, dim + 1)
        oracle -= lr * _grad(oracle, union)

    async with running_server(consistency="bsp", aggregation="mean") as srv:
        clients = [connect(srv.address, worker_name=f"w{i}") for i in range(workers)]
        for c in clients:
            await c.open()
        try:
            await clients[0].init({"w": w0}, rule=UpdateRule("sgd", lr=lr))

            async def run(i: int) -> np.ndarray:
                ps = clients[i]
                for t in range(steps):
                    w = (await ps.pull(["w"]))["w"]
                    await ps.push({"w": _grad(w, data[t, i])}, num_samples=batch)
                    await ps.clock()
                return (await ps.pull(["w"]))["w"]

            finals = await asyncio.gather(*(run(i) for i in range(workers)))
        finally:
            for c in clients:
                await c.close()
    for final in finals:
        assert final.dtype == np.float64
        np.testing.assert_allclose(final, oracle, rtol=0, atol=1e-9)


@pytest.mark.parametrize(
    ("aggregation", "expected"),
    [("mean", -13 / 3), ("sum", -13.0), ("weighted_mean", -8.3)],
)
async def test_aggregation_denominator(aggregation: str, expected: float) -> None:
    """Case aggregation-denominator.md: W1 [1,1] n=1, W2 [2,2] n=1, W3 [10,10] n=8, SGD lr 1
    from zeros: one step gives w = -(mean | sum | weighted mean), divided once."""
    async with running_server(consistency="bsp", aggregation=aggregation) as srv:
        clients = [connect(srv.address, worker_name=f"W{i}") for i in (1, 2, 3)]
        for c in clients:
            await c.open()
        try:
            await clients[0].init({"g": np.zeros(2, np.float32)}, rule=UpdateRule("sgd", lr=1.0))
            for c, (v, n) in zip(clients, [(1, 1), (2, 1), (10, 8)], strict=True):
                await c.push({"g": np.full(2, v, np.float32)}, num_samples=n)
            for c in clients:
                await c.clock()
            got = (await clients[0].pull(["g"]))["g"]
        finally:
            for c in clients:
                await c.close()
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, np.full(2, expected, np.float32), rtol=1e-6)


async def test_evicted_worker_leaves_the_denominator() -> None:
    """Case aggregation-denominator.md: W3 pushed but is evicted before the step completes:
    the mean of W1 and W2 alone is applied (w = -[1.5, 1.5])."""
    async with running_server(consistency="bsp", aggregation="mean", lease_ms=300) as srv:
        w1 = connect(srv.address, worker_name="W1")
        w2 = connect(srv.address, worker_name="W2")
        w3 = connect(srv.address, worker_name="W3", heartbeat=False)
        for c in (w1, w2, w3):
            await c.open()
        try:
            await w1.init({"g": np.zeros(2, np.float32)}, rule=UpdateRule("sgd", lr=1.0))
            await w1.push({"g": np.full(2, 1, np.float32)})
            await w2.push({"g": np.full(2, 2, np.float32)})
            await w3.push({"g": np.full(2, 10, np.float32)}, num_samples=8)
            await w1.clock()
            await w2.clock()
            # W3 sends no heartbeats: its lease lapses and the step completes without it.
            got = (await w1.pull(["g"], timeout_s=10))["g"]
            assert (await w1.status()).view.live_workers == 2
        finally:
            for c in (w1, w2, w3):
                await c.close()
    np.testing.assert_array_equal(got, np.full(2, -1.5, np.float32))


async def test_second_push_in_one_step_is_refused_and_not_in_mean() -> None:
    """Case retried-push.md (BSP part): a second push for the same (worker, step) under a
    different request id is refused with FAILED_PRECONDITION and does not enter the mean."""
    async with running_server(consistency="bsp") as srv:
        a = connect(srv.address, worker_name="a")
        b = connect(srv.address, worker_name="b")
        await a.open()
        await b.open()
        try:
            await a.init({"w": np.zeros(1)}, rule=UpdateRule("sgd", lr=1.0))
            await a.push({"w": np.array([2.0])})
            with pytest.raises(StaleUpdate, match=r"duplicate|already"):
                await a.push({"w": np.array([100.0])})
            await b.push({"w": np.array([4.0])})
            await a.clock()
            await b.clock()
            got = (await a.pull(["w"]))["w"]
            status = await a.status()
        finally:
            await a.close()
            await b.close()
    np.testing.assert_array_equal(got, [-3.0])
    assert status.rejected_pushes == 1
