"""Reduction service (``paramserver serve --mode reduce``, issue #3 item 3) over real gRPC.

Expected aggregates are computed here with numpy from what the workers were given (mean over
the workers' gradients; FedAvg ``sum_k n_k w_k / sum_k n_k``, McMahan et al. 2017), never taken
from the service's own output.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import numpy as np
import pytest

from paramserver.errors import DimensionMismatch, InvalidArgument, WaitTimeout
from paramserver.reduction.reduce_client import ReductionClient, connect_reduction
from tests.harness import ScriptProcess, ServerProcess, eventually, running_server
from tests.harness.processes import REDUCE_WORKER

WORKERS = 4
STEPS = 3
LAYERS: dict[str, tuple[tuple[int, ...], type[np.floating]]] = {
    "conv.w": ((2, 3, 4), np.float32),
    "fc.b": ((5,), np.float64),
    "temperature": ((), np.float32),
}


def _spawn_worker(tmp: Path, address: str, name: str, *extra: str) -> ScriptProcess:
    return ScriptProcess(
        tmp, f"reduce-{name}", [str(REDUCE_WORKER), "--address", address, "--name", name, *extra]
    )


async def _open(address: str, names: list[str]) -> list[ReductionClient]:
    clients = [connect_reduction(address, worker_name=n) for n in names]
    for c in clients:
        await c.open()
    await clients[0].wait_for_workers(len(names), timeout_s=10)
    return clients


async def _close(clients: list[ReductionClient]) -> None:
    for c in clients:
        await c.close()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_four_worker_processes_receive_the_numpy_mean(tmp_path: Path) -> None:
    """4 worker processes, 3 steps, 3 layers (one scalar), synchronous mean: every worker
    receives bit-identical aggregates equal to the numpy mean of the 4 gradients."""
    rng = np.random.default_rng(2024)
    inputs = [
        {
            f"{t}/{layer}": rng.normal(scale=10.0, size=shape).astype(dtype)
            for t in range(STEPS)
            for layer, (shape, dtype) in LAYERS.items()
        }
        for _ in range(WORKERS)
    ]
    server = ServerProcess(
        tmp_path, "--mode", "reduce", "--reduce-strategy", "synchronous",
        "--aggregation", "mean", "--lease-ms", "5000",
    )  # fmt: skip
    procs: list[ScriptProcess] = []
    try:
        for i, grads in enumerate(inputs):
            np.savez(tmp_path / f"in{i}.npz", **grads)
            args = [
                "--inputs",
                str(tmp_path / f"in{i}.npz"),
                "--out",
                str(tmp_path / f"out{i}.npz"),
            ]
            args += ["--steps", str(STEPS), "--world", str(WORKERS)]
            procs.append(_spawn_worker(tmp_path, server.address, f"w{i}", *args))
        for proc in procs:
            out, err = proc.communicate(timeout_s=40)
            assert proc.proc.returncode == 0, out + err
    finally:
        for proc in procs:
            proc.close()
        server.stop()
    received = [dict(np.load(tmp_path / f"out{i}.npz")) for i in range(WORKERS)]
    for t in range(STEPS):
        for layer, (shape, _) in LAYERS.items():
            name = f"{t}/{layer}"
            expected = np.mean(np.stack([g[name].astype(np.float64) for g in inputs]), axis=0)
            first = received[0][name]
            assert first.shape == shape and first.dtype == np.float64
            np.testing.assert_allclose(first, expected, rtol=1e-12, atol=1e-12)
            for other in received[1:]:
                assert np.array_equal(other[name], first), f"{name} differs between workers"


@pytest.mark.timeout(30)
async def test_weighted_federated_average_through_the_service() -> None:
    """FedAvg, 3 workers with n = 1, 3, 6 samples over two rounds: every worker receives
    sum_k n_k w_k / sum_k n_k, with 3 contributors and 10 samples."""
    samples = [1, 3, 6]
    rng = np.random.default_rng(7)
    async with running_server(
        mode="reduce", reduce_strategy="federated_average", min_updates=3
    ) as srv:
        clients = await _open(srv.address, ["a", "b", "c"])
        try:
            for round_ in range(2):
                weights = [{"w": rng.normal(size=(3, 2)), "b": rng.normal(size=4)} for _ in samples]
                results = await asyncio.gather(
                    *(
                        c.reduce(round_, w, num_samples=n, timeout_s=10)
                        for c, w, n in zip(clients, weights, samples, strict=True)
                    )
                )
                for layer in ("w", "b"):
                    expected = sum(n * w[layer] for n, w in zip(samples, weights, strict=True)) / 10
                    for result in results:
                        np.testing.assert_allclose(result[layer], expected, rtol=1e-13, atol=0)
                for c in clients:
                    assert c.last is not None and c.last.step == round_
                    info = c.last.layers["w"]
                    assert (info.contributing_workers, info.total_samples) == (3, 10)
                    assert c.step == round_ + 1
        finally:
            await _close(clients)


@pytest.mark.slow
@pytest.mark.timeout(40)
async def test_killed_worker_leaves_the_quorum_after_its_lease(tmp_path: Path) -> None:
    """A worker process registers, then is SIGKILLed while 3 others wait for step 0: once its
    lease (600 ms) lapses it is evicted and the 3 receive the mean of their own gradients."""
    ready = tmp_path / "ready"
    async with running_server(mode="reduce", lease_ms=600) as srv:
        proc = _spawn_worker(tmp_path, srv.address, "doomed", "--hang", "--ready", str(ready))
        clients: list[ReductionClient] = []
        try:
            await eventually(ready.exists, timeout_s=20, what="the doomed worker registered")
            doomed_id = ready.read_text()
            clients = await _open(srv.address, ["w0", "w1", "w2"])
            await clients[0].wait_for_workers(4, timeout_s=10)
            grads = [{"g": np.array([1.0, -2.0]) * (i + 1)} for i in range(3)]
            waiting = asyncio.gather(
                *(c.reduce(0, g, timeout_s=20) for c, g in zip(clients, grads, strict=True))
            )

            async def only_doomed_missing() -> bool:
                status = await clients[0].status()
                return [list(o.waiting_for) for o in status.open_layers] == [[doomed_id]]

            await eventually(only_doomed_missing, timeout_s=10, what="3 updates queued")
            assert not waiting.done()
            await asyncio.to_thread(proc.kill)
            results = await asyncio.wait_for(waiting, timeout=10)
            expected = np.mean([g["g"] for g in grads], axis=0)
            for c, result in zip(clients, results, strict=True):
                np.testing.assert_allclose(result["g"], expected, rtol=1e-15)
                assert c.last is not None and c.last.layers["g"].contributing_workers == 3
            status = await clients[0].status()
            assert status.evicted_workers == 1 and status.view.active_workers == 3
            assert doomed_id not in {w.worker_id for w in status.workers}
        finally:
            proc.close()
            await _close(clients)


@pytest.mark.timeout(30)
async def test_deadline_names_the_missing_worker_and_a_retry_resumes() -> None:
    """Two of three workers reduce with a 0.3 s deadline: DEADLINE_EXCEEDED naming the third.
    Calling reduce again for the same step resumes the wait (first gradients count)."""
    async with running_server(mode="reduce") as srv:
        clients = await _open(srv.address, ["w0", "w1", "w2"])
        try:
            grads = [{"g": np.full(3, float(i))} for i in range(3)]
            outcomes = await asyncio.gather(
                *(clients[i].reduce(0, grads[i], timeout_s=0.3) for i in (0, 1)),
                return_exceptions=True,
            )
            for exc in outcomes:
                assert isinstance(exc, WaitTimeout), exc
                assert exc.code == grpc.StatusCode.DEADLINE_EXCEEDED
                missing = str(exc).split("for workers [", 1)[1].split("]", 1)[0]
                assert missing == clients[2].worker_id, str(exc)
            resumed = asyncio.gather(
                *(clients[i].reduce(0, {"g": np.full(3, 99.0)}, timeout_s=10) for i in (0, 1))
            )
            last = await clients[2].reduce(0, grads[2], timeout_s=10)
            for result in [*(await resumed), last]:
                np.testing.assert_array_equal(result["g"], np.full(3, 1.0))  # mean of 0, 1, 2
        finally:
            await _close(clients)


@pytest.mark.timeout(30)
async def test_bad_shape_is_invalid_argument_naming_the_layer() -> None:
    """A layer whose shape differs from its first update: INVALID_ARGUMENT naming the layer,
    and nothing of that reduce is queued (the corrected retry is not a duplicate)."""
    async with running_server(mode="reduce") as srv:
        clients = await _open(srv.address, ["w0", "w1"])
        try:
            good = {"emb": np.ones((4, 3), np.float32), "head": np.ones(2, np.float32)}
            first = asyncio.ensure_future(clients[0].reduce(0, good, timeout_s=10))

            async def first_queued() -> bool:
                status = await clients[1].status()
                return {o.layer: o.pending_updates for o in status.open_layers} == {
                    "emb": 1,
                    "head": 1,
                }

            await eventually(first_queued, timeout_s=10, what="w0's reduce is queued")
            bad = {"emb": np.ones((4, 3), np.float32), "head": np.ones(3, np.float32)}
            with pytest.raises(DimensionMismatch, match="'head'") as info:
                await clients[1].reduce(0, bad, timeout_s=10)
            assert isinstance(info.value, InvalidArgument)
            assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "(3,)" in str(info.value) and "(2,)" in str(info.value)
            second = await clients[1].reduce(0, {k: v * 3 for k, v in good.items()}, timeout_s=10)
            for result in (await first, second):
                np.testing.assert_array_equal(result["emb"], np.full((4, 3), 2.0))
                np.testing.assert_array_equal(result["head"], np.full(2, 2.0))
        finally:
            await _close(clients)
