"""A lost or hung backup costs the primary at most a few seconds, then training goes on and
the backup is seeded again (issue 31, item 1), with real processes: ``local_cluster(shards=1,
replicas=2)``, replica 0 primary (no election needed). Expected values are sums computed
here."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import numpy as np
import pytest

from paramserver.api.v1 import parameter_server_pb2 as pb
from paramserver.api.v1 import parameter_server_pb2_grpc as pb_grpc
from paramserver.cli.demos.local_cluster import local_cluster
from paramserver.core.optimizers import UpdateRule
from paramserver.security.tls import open_channel
from paramserver.server.replication import ACK_TIMEOUT_S
from tests.harness.polling import eventually
from tests.harness.timing import scaled

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(180),
    pytest.mark.asyncio(loop_factories=["asyncio"]),
]


async def _applied_at(address: str) -> int:
    channel = open_channel(address)
    try:
        stub = pb_grpc.ParameterServerStub(channel)
        return int((await stub.Status(pb.StatusRequest(), timeout=5)).applied_updates)
    finally:
        await channel.close()


async def test_hung_backup_is_dropped_then_reseeded() -> None:
    async with local_cluster(
        shards=1, replicas=2, consistency="asp", no_shared_memory=True
    ) as cluster:
        backup = cluster.process(0, 1)
        async with cluster.connect("w0") as ps:
            await ps.init({"w": np.zeros(32, np.float32)}, rule=UpdateRule("add"))
            pushed = 0
            for _ in range(5):
                await ps.push({"w": np.ones(32, np.float32)})
                pushed += 1
            backup_address = cluster.replica_address(0, 1)
            await eventually(
                lambda: _applied_at(backup_address), timeout_s=10, what="backup answering"
            )
            assert await _applied_at(backup_address) == pushed  # acked => held by the backup
            os.kill(backup.pid, signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                await ps.push({"w": np.ones(32, np.float32)})
                pushed += 1
                stalled = time.monotonic() - t0
                assert stalled < ACK_TIMEOUT_S + scaled(5), stalled
                for _ in range(5):  # no stall once the backup is out of sync
                    await asyncio.wait_for(
                        ps.push({"w": np.ones(32, np.float32)}), timeout=scaled(5)
                    )
                    pushed += 1
            finally:
                os.kill(backup.pid, signal.SIGCONT)

            async def reseeded() -> bool:
                return await _applied_at(backup_address) == pushed

            await eventually(reseeded, timeout_s=30, what="the backup seeded again")
            for _ in range(3):
                await ps.push({"w": np.ones(32, np.float32)})
                pushed += 1
            assert await _applied_at(backup_address) == pushed
            got = await ps.pull(["w"])
        np.testing.assert_array_equal(got["w"], np.full(32, pushed, np.float32))
        print(f"the push during the hang took {stalled:.2f} s")
