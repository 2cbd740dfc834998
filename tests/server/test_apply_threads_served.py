"""Big pushes applied and big pulls copied in worker threads (paramserver.server.apply_threads).

Several clients push and pull two keys above the offload threshold at once, over real gRPC.
Every legal value is known in closed form: ``a`` (rule ``add``, gradients of ones) is a
uniform array of the number of pushes applied so far; ``s`` (rule ``assign``, worker w's r-th
push fills it with ``100 * w + r``) is a uniform array of one pushed fill. A torn read (a pull
copying while a thread applies) would show a non-uniform array; a lost or doubled update would
show in the final ``a``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import numpy as np
import pytest

from paramserver.api.v1 import parameter_server_pb2 as pb
from paramserver.api.v1 import parameter_server_pb2_grpc as pb_grpc
from paramserver.worker_client import UpdateRule
from tests.harness import raw_stubs as raw
from tests.harness import running_server

pytestmark = pytest.mark.timeout(120)

THRESHOLD = 1 << 20  # the servers here offload from 1 MiB (offload_min_bytes)
N = 1 << 19  # float32 elements: 2 MiB per key, above the offload threshold
WORKERS = 3
PUSHES = 6
PULLERS = 2


def _uniform(value: np.ndarray) -> float:
    assert value.shape == (N,) and value.dtype == np.float32
    first = float(value[0])
    assert np.array_equal(value, np.full(N, first, np.float32)), "torn read: not uniform"
    return first


async def test_concurrent_big_pushes_and_pulls_are_never_torn_and_apply_once() -> None:
    assert N * 4 >= THRESHOLD
    ones = np.ones(N, np.float32)
    legal_fills = {0.0} | {100.0 * w + r for w in range(WORKERS) for r in range(PUSHES)}
    async with (
        running_server(consistency="asp", offload_min_bytes=THRESHOLD) as srv,
        raw.channel(srv.address) as ch,
    ):
        stub = pb_grpc.ParameterServerStub(ch)
        await raw.init(stub, {"a": np.zeros(N, np.float32)}, UpdateRule("add"))
        await raw.init(stub, {"s": np.zeros(N, np.float32)}, UpdateRule("assign"))
        ids = [await raw.register(stub, f"w{w}") for w in range(WORKERS)]
        pushing = True
        pulled: list[tuple[float, float]] = []

        async def pusher(w: int) -> None:
            for r in range(PUSHES):
                fill = np.full(N, 100.0 * w + r, np.float32)
                msgs = raw.push_arrays(ids[w], r, {"a": ones, "s": fill})
                resp = await stub.Push(iter(msgs), timeout=60)
                assert not resp.duplicate
            # A retry of the last request is answered as a duplicate and not applied again.
            msgs = raw.push_arrays(ids[w], PUSHES - 1, {"a": ones, "s": ones})
            resp = await stub.Push(iter(msgs), timeout=60)
            assert resp.duplicate

        async def puller() -> None:
            while pushing:
                got = await raw.pull(stub, ["a", "s"])
                pulled.append((_uniform(got["a"]), _uniform(got["s"])))

        pullers = [asyncio.create_task(puller()) for _ in range(PULLERS)]
        try:
            await asyncio.gather(*(pusher(w) for w in range(WORKERS)))
        finally:
            pushing = False
            await asyncio.gather(*pullers)

        total = WORKERS * PUSHES
        assert pulled, "no pull completed while pushing"
        for a, s in pulled:
            assert a == int(a) and 0 <= a <= total
            assert s in legal_fills
        final = await raw.pull(stub, ["a", "s"])
        assert _uniform(final["a"]) == total
        assert _uniform(final["s"]) in legal_fills - {0.0}
        status = await stub.Status(pb.StatusRequest(), timeout=10)
        assert status.applied_updates == total
        assert status.duplicate_pushes == WORKERS
        offload = srv.engine.offload
        assert offload.offloaded >= total  # the big applies (and copies) ran in threads
        assert offload.gate.busy_keys() == []


async def test_checkpoint_while_big_pushes_apply_is_consistent(tmp_path: Path) -> None:
    """A checkpoint taken amid threaded applies holds exactly the pushes its counters claim."""
    ones = np.ones(N, np.float32)
    async with running_server(
        consistency="asp", checkpoint_dir=str(tmp_path), offload_min_bytes=THRESHOLD
    ) as srv:
        async with raw.channel(srv.address) as ch:
            stub = pb_grpc.ParameterServerStub(ch)
            await raw.init(stub, {"a": np.zeros(N, np.float32)}, UpdateRule("add"))
            wid = await raw.register(stub, "w0")

            async def pushes() -> None:
                for r in range(8):
                    await stub.Push(iter(raw.push_arrays(wid, r, {"a": ones})), timeout=60)

            task = asyncio.create_task(pushes())
            checked = 0
            while not task.done() or checked == 0:
                path = await srv.request_checkpoint()
                assert path is not None and srv.checkpoints is not None
                tensors, manifest = srv.checkpoints.load(path)  # before it is rotated away
                # Counters decided on the loop against the values written by the threads.
                applied = manifest["applied_updates"]
                assert manifest["store"]["a"]["updates"] == applied
                assert len(manifest["dedup"].get(wid, [])) == applied  # per registration
                assert np.array_equal(tensors["param/a"], np.full(N, float(applied), np.float32))
                checked += 1
            await task


async def test_bsp_steps_of_a_big_key_apply_off_loop_and_pulls_see_whole_steps() -> None:
    """BSP: a clock closing a step hands its aggregate to a thread; every pull admitted after
    the step sees the whole step applied (``add`` of the mean of ones: the step count)."""
    steps = 4
    ones = np.ones(N, np.float32)
    async with (
        running_server(consistency="bsp", offload_min_bytes=THRESHOLD) as srv,
        raw.channel(srv.address) as ch,
    ):
        stub = pb_grpc.ParameterServerStub(ch)
        await raw.init(stub, {"a": np.zeros(N, np.float32)}, UpdateRule("add"))
        ids = [await raw.register(stub, f"w{w}") for w in range(2)]
        observed: list[float] = []
        running = True

        async def worker(wid: str) -> None:
            for step in range(steps):
                await stub.Push(iter(raw.push_arrays(wid, step, {"a": ones}, clock=step)))
                await stub.Clock(pb.ClockRequest(worker_id=wid, clock=step), timeout=30)
                got = await raw.pull(stub, ["a"], worker_id=wid)  # admitted once step closed
                assert _uniform(got["a"]) >= step + 1

        async def observer() -> None:
            while running:
                observed.append(_uniform((await raw.pull(stub, ["a"]))["a"]))

        watcher = asyncio.create_task(observer())
        try:
            await asyncio.gather(*(worker(wid) for wid in ids))
        finally:
            running = False
            await watcher
        assert all(v == int(v) and 0 <= v <= steps for v in observed)
        assert _uniform((await raw.pull(stub, ["a"]))["a"]) == steps
        assert srv.engine.offload.offloaded >= steps


async def test_big_push_with_a_nan_is_refused_whole() -> None:
    """The NaN scan of a big push runs in a thread; a NaN anywhere still refuses the push with
    INVALID_ARGUMENT naming the worker, and nothing of it is applied."""
    grad = np.ones(N, np.float32)
    grad[-1] = np.nan
    async with (
        running_server(consistency="asp", offload_min_bytes=THRESHOLD) as srv,
        raw.channel(srv.address) as ch,
    ):
        stub = pb_grpc.ParameterServerStub(ch)
        await raw.init(stub, {"a": np.zeros(N, np.float32)}, UpdateRule("add"))
        wid = await raw.register(stub, "w0")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Push(iter(raw.push_arrays(wid, 1, {"a": grad})), timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "1 non-finite" in str(info.value.details()) and wid in str(info.value.details())
        assert _uniform((await raw.pull(stub, ["a"]))["a"]) == 0.0
        resp = await stub.Push(iter(raw.push_arrays(wid, 2, {"a": np.ones(N, np.float32)})))
        assert not resp.duplicate
        assert _uniform((await raw.pull(stub, ["a"]))["a"]) == 1.0
        status = await stub.Status(pb.StatusRequest(), timeout=10)
        assert (status.applied_updates, status.rejected_pushes) == (1, 1)
