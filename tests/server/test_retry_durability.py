"""A retry is answered only once its original is durable: with a group-commit window of 1.5 s,
a retried push that arrives while its original waits for the fsync is answered after that
fsync, never before (an OS crash in between would lose an update acknowledged twice)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import numpy as np
import pytest

from paramserver.api.v1 import parameter_server_pb2_grpc as pb_grpc
from paramserver.core.optimizers import UpdateRule
from tests.harness import eventually, running_server
from tests.harness.raw_stubs import init, push_arrays, register

pytestmark = pytest.mark.timeout(60)


async def test_a_retry_waits_for_its_originals_fsync(tmp_path: Path) -> None:
    async with running_server(
        consistency="asp",
        wal=True,
        wal_dir=str(tmp_path / "wal"),
        wal_fsync_interval_ms=1500.0,
        lease_ms=600_000,
    ) as daemon:
        wal = daemon.engine.wal
        address = f"127.0.0.1:{daemon.port}"
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.ParameterServerStub(channel)
            worker = await register(stub, "w0")
            await init(stub, {"w": np.zeros(4, np.float32)}, UpdateRule("add"))
            before = wal.next_sequence
            grad = {"w": np.full(4, 2.0, np.float32)}
            original = asyncio.ensure_future(
                stub.Push(iter(push_arrays(worker, 1, grad)), timeout=30)
            )
            await eventually(lambda: wal.next_sequence > before, what="the original is logged")
            original_seq = wal.next_sequence - 1
            retry = await stub.Push(iter(push_arrays(worker, 1, grad)), timeout=30)
            assert retry.duplicate
            durable = wal._synced  # at the moment the retry was answered
            first = await original
            assert not first.duplicate
        assert durable >= original_seq, (durable, original_seq)
        np.testing.assert_array_equal(
            daemon.engine.core.store.get("w").value, np.full(4, 2.0, np.float32)
        )
