"""Opt-in gradient casting on the client: ``push(..., cast=True)`` and
``WorkerClient(cast_gradients=True)``; never a silent cast."""

from __future__ import annotations

import numpy as np
import pytest

from paramserver.errors import InvalidArgument
from paramserver.worker_client import UpdateRule, WorkerClient, connect
from tests.harness import running_cluster, running_server

pytestmark = pytest.mark.timeout(60)

W0 = np.arange(4, dtype=np.float32)
#: float64 on purpose (numpy's default); 0.1 is not a float32, so the oracle casts it too.
G = np.array([0.1, -0.2, 0.3, 1e-9], dtype=np.float64)


async def test_a_float64_gradient_is_refused_unless_cast_is_asked_for() -> None:
    async with running_server(consistency="asp") as daemon:
        address = f"127.0.0.1:{daemon.port}"
        async with WorkerClient(address, "w", heartbeat=False) as ps:
            await ps.init({"w": W0, "n": np.zeros(4, np.int32)}, rule=UpdateRule("add"))
            with pytest.raises(InvalidArgument, match=r"(?i)dtype"):
                await ps.push({"w": G})
            assert (await ps.status()).applied_updates == 0  # refused, nothing applied
            await ps.push({"w": G}, cast=True)
            got = await ps.pull(["w"])
            np.testing.assert_array_equal(got["w"], W0 + G.astype(np.float32))
            assert got["w"].dtype == np.float32
            with pytest.raises(InvalidArgument, match=r"cannot cast dtype float64 to .* int32"):
                await ps.push({"w": G, "n": G}, cast=True)  # float -> int is not same-kind
            np.testing.assert_array_equal((await ps.pull(["w"]))["w"], got["w"])  # unapplied


async def test_the_client_setting_casts_every_push_and_push_pull() -> None:
    async with running_server(consistency="asp") as daemon:
        address = f"127.0.0.1:{daemon.port}"
        async with WorkerClient(address, "w", heartbeat=False, cast_gradients=True) as ps:
            await ps.init({"w": W0}, rule=UpdateRule("add"))
            await ps.push({"w": G})
            got = await ps.push_pull({"w": G})
            np.testing.assert_array_equal(got["w"], W0 + G.astype(np.float32) * 2)
            with pytest.raises(InvalidArgument, match=r"(?i)dtype"):
                await ps.push({"w": G}, cast=False)  # a per-push False wins


async def test_a_sharded_cluster_casts_before_splitting() -> None:
    """A key sliced over 2 shards (slice_bytes 64: 40 float32 per shard-slice span)."""
    w0 = np.linspace(0, 1, 80, dtype=np.float32)
    g = np.linspace(-1, 1, 80)  # float64
    async with running_cluster(2, consistency="asp", slice_bytes=64) as daemons:
        async with connect(daemons[0].address, "w", heartbeat=False) as ps:
            assert ps.sharded
            await ps.init({"big": w0}, rule=UpdateRule("add"))
            with pytest.raises(InvalidArgument, match=r"(?i)dtype"):
                await ps.push({"big": g})
            await ps.push({"big": g}, cast=True)
            got = (await ps.pull(["big"]))["big"]
            np.testing.assert_array_equal(got, w0 + g.astype(np.float32))
