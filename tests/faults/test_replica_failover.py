"""Shard replicas with failover, real processes: ``local_cluster(shards=2, replicas=2)`` with
etcd electing each shard's primary (issue 31, items 1, 2 and 7).

A training job (3 workers, ``add`` rule; BSP with ``sum`` aggregation or SSP(1)) runs while
the test SIGKILLs the primary of shard 0 **and deletes its state directory**. The job must end
with every planned push applied exactly once: the final values equal the sum of every
gradient the workers planned (computed here, in float64, independently of the servers), each
shard counts exactly the planned pushes as applied, and every push was acknowledged. The
killed replica comes back empty and is seeded from the new primary while training goes on.

A partition test SIGSTOPs a primary until its etcd lease lapses and the backup takes over,
then SIGCONTs it: a push sent to it while stopped is never acknowledged by it, and it refuses
everything afterwards.

Skipped when there is no etcd binary (Debian: ``apt-get install etcd-server``; ``.ci/run``
installs it).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time

import grpc
import numpy as np
import pytest

from paramserver.api.v1 import parameter_server_pb2 as pb
from paramserver.api.v1 import parameter_server_pb2_grpc as pb_grpc
from paramserver.cli.demos.local_cluster import local_cluster
from paramserver.cli.demos.local_etcd import etcd_binary
from paramserver.core.optimizers import UpdateRule
from paramserver.worker_client import RetryPolicy
from tests.harness import raw_stubs as raw
from tests.harness.polling import eventually
from tests.harness.timing import scaled

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.asyncio(loop_factories=["asyncio"]),
    pytest.mark.skipif(
        etcd_binary() is None, reason="no etcd binary (Debian: apt-get install etcd-server)"
    ),
]

WORKERS = 3
STEPS = 24
KILL_AT = 8


def _keys() -> dict[str, int]:
    """Two keys on each of the two shards (placement by hash: whatever names land there)."""
    from paramserver.core.sharding import home_shard

    out: dict[str, int] = {}
    per_shard = [0, 0]
    n = 0
    while min(per_shard) < 2:
        name = f"k{n}"
        shard = home_shard(name, 2)
        if per_shard[shard] < 2:
            per_shard[shard] += 1
            out[name] = 16 + 8 * len(out)
        n += 1
    return out


KEYS = _keys()


def grad(worker: int, step: int, key: str) -> np.ndarray:
    """The gradient worker ``worker`` pushes at ``step`` for ``key`` (small integers: float32
    sums are exact, so the expected values are exact)."""
    n = KEYS[key]
    return ((np.arange(n) + 7 * worker + 3 * step + len(key)) % 5 - 2).astype(np.float32)


def expected() -> dict[str, np.ndarray]:
    return {
        k: sum(
            (grad(w, s, k).astype(np.float64) for w in range(WORKERS) for s in range(STEPS)),
            np.zeros(n),
        )
        for k, n in KEYS.items()
    }


async def _statuses(addresses: list[str]) -> list[pb.StatusResponse]:
    from paramserver.security.tls import open_channel

    out = []
    for address in addresses:
        channel = open_channel(address)
        try:
            out.append(
                await pb_grpc.ParameterServerStub(channel).Status(pb.StatusRequest(), timeout=10)
            )
        finally:
            await channel.close()
    return out


@pytest.mark.parametrize("consistency", ["bsp", "ssp"])
async def test_primary_killed_with_its_disk_mid_training(consistency: str) -> None:
    retry = RetryPolicy(deadline_s=scaled(60))
    async with local_cluster(
        shards=2,
        replicas=2,
        consistency=consistency,
        staleness=1 if consistency == "ssp" else None,
        aggregation="sum",
        lease_ms=5000,
        election="etcd",
        no_shared_memory=True,
    ) as cluster:
        for shard in range(2):
            await eventually(
                lambda s=shard: cluster.primary(s) is not None,  # type: ignore[misc]
                timeout_s=20,
                what=f"shard {shard} has a primary",
            )
        acked = 0
        duplicates = 0
        killed = asyncio.Event()
        progress = [0] * WORKERS

        async def worker(w: int) -> None:
            nonlocal acked, duplicates
            async with cluster.connect(f"w{w}", retry=retry) as ps:
                await ps.init(
                    {k: np.zeros(n, np.float32) for k, n in KEYS.items()},
                    rule=UpdateRule("add"),
                )
                await ps.wait_for_workers(WORKERS, timeout_s=scaled(30))
                for s in range(STEPS):
                    if s == KILL_AT + 2:
                        await killed.wait()
                    await ps.pull(list(KEYS))
                    acks = await ps.push({k: grad(w, s, k) for k in KEYS})
                    for ack in acks if isinstance(acks, list) else [acks]:
                        duplicates += int(getattr(ack, "duplicate", False))
                    acked += 1
                    await ps.clock()
                    progress[w] = s + 1

        tasks = [asyncio.ensure_future(worker(w)) for w in range(WORKERS)]
        await eventually(lambda: min(progress) >= KILL_AT, timeout_s=60, what="training")
        await eventually(lambda: cluster.in_sync(0) == [0, 1], timeout_s=20, what="backup in sync")
        victim = cluster.primary(0)
        assert victim is not None
        proc = cluster.process(0, victim)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        shutil.rmtree(cluster.replica_dir(0, victim))
        t_kill = time.monotonic()
        killed.set()
        await eventually(
            lambda: cluster.primary(0) not in (None, victim),
            timeout_s=20,
            what="the backup of shard 0 promoted",
        )
        print(f"promoted {time.monotonic() - t_kill:.2f} s after the kill")
        cluster.restart(0, victim)  # comes back empty; seeded by the new primary
        await asyncio.gather(*tasks)
        assert acked == WORKERS * STEPS
        async with cluster.connect("reader", retry=retry) as ps:
            got = await ps.pull(list(KEYS))
        want = expected()
        for k in KEYS:
            np.testing.assert_array_equal(got[k].astype(np.float64), want[k])
        # Each shard applied exactly the planned pushes (every push touches both shards).
        statuses = await _statuses(cluster.addresses)
        planned = WORKERS * STEPS
        assert [s.applied_updates for s in statuses] == [planned, planned], statuses

        # The restarted replica (empty) was seeded and holds the same state.
        async def seeded() -> bool:
            one = await _statuses([cluster.replica_address(0, victim)])
            return one[0].applied_updates == planned

        await eventually(seeded, timeout_s=30, what="the killed replica re-seeded")
        del duplicates  # answered duplicates are retries the dedup windows caught


async def test_deposed_primary_acknowledges_nothing() -> None:
    async with local_cluster(
        shards=1,
        replicas=2,
        consistency="asp",
        election="etcd",
        no_shared_memory=True,
    ) as cluster:
        await eventually(lambda: cluster.primary(0) is not None, timeout_s=20, what="primary")
        old = cluster.primary(0)
        assert old is not None
        async with cluster.connect("w0") as ps:
            await ps.init({"w": np.zeros(8, np.float32)}, rule=UpdateRule("add"))
            await ps.push({"w": np.ones(8, np.float32)})
        await eventually(lambda: cluster.in_sync(0) == [0, 1], timeout_s=20, what="backup in sync")
        # A raw client pinned to the old primary (no failover) sends a push while it is
        # stopped: the push waits in its socket.
        direct = grpc.aio.insecure_channel(cluster.replica_address(0, old))
        stub = pb_grpc.ParameterServerStub(direct)
        worker_id = await raw.register(stub, "pinned")
        proc = cluster.process(0, old)
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            messages = raw.push_arrays(worker_id, 1, {"w": np.full(8, 100, np.float32)})
            pending = asyncio.ensure_future(stub.Push(iter(messages), timeout=scaled(30)))
            await eventually(
                lambda: cluster.primary(0) not in (None, old),
                timeout_s=20,
                what="the backup promoted while the primary is stopped",
            )
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pending
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
        # Anything new at the old primary is refused too.
        with pytest.raises(grpc.aio.AioRpcError) as err2:
            await stub.Register(pb.RegisterRequest(worker_name="late"), timeout=10)
        assert err2.value.code() == grpc.StatusCode.UNAVAILABLE
        await direct.close()
        # The shard's value holds only the acknowledged push.
        async with cluster.connect("reader") as ps:
            got = await ps.pull(["w"])
        np.testing.assert_array_equal(got["w"], np.ones(8, np.float32))
