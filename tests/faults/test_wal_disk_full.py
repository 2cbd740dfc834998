"""The write-ahead log on a disk that fills up: a refused push changes nothing, in memory or on
disk, and every acknowledged push survives a SIGKILL.

A real ``paramserver serve --wal`` process logs to a small tmpfs (mounted by the test; root
only) that a filler file keeps nearly full. Pushes of 16 KiB gradients under ASP with sgd lr 1
go on until the log cannot take the next one. Expected values are closed forms: every pushed
gradient is all ones, so ``w == -acknowledged`` element-wise.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from paramserver.api.v1 import parameter_server_pb2 as pb
from tests.conformance.protowire import ProtoWorker, trailer_class
from tests.harness import ServerProcess, status

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

N = 4096  # float32 elements: 16 KiB a gradient, ~16.5 KiB a WAL record
ONES = np.ones(N, np.float32)
SGD_LR1 = pb.UpdateRule(kind=pb.RULE_KIND_SGD, lr=1.0)


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs, unmounted afterwards (skipped where mounting is not allowed)."""
    if sys.platform != "linux" or os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root on Linux")
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


async def _health(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        resp = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        return int(resp.status)


async def test_disk_full_refuses_the_push_unapplied_and_loses_no_acknowledged_one(
    small_tmpfs: Path, tmp_path: Path
) -> None:
    wal_dir = small_tmpfs / "wal"
    filler = small_tmpfs / "filler"
    filler.write_bytes(b"\0" * (640 << 10))  # leaves room for ~20 records
    ckpt_dir = small_tmpfs / "ckpt"
    args = ("--consistency", "asp", "--wal", "--wal-dir", str(wal_dir))
    with ServerProcess(tmp_path, *args, "--checkpoint-dir", str(ckpt_dir), start=False) as server:
        server.start()
        async with grpc.aio.insecure_channel(server.address) as channel:
            w = ProtoWorker(channel, "filler-pusher")
            await w.register()
            await w.init({"w": np.zeros(N, np.float32)}, SGD_LR1)
            acked = 0
            refused: grpc.aio.AioRpcError | None = None
            for rid in range(1, 200):
                try:
                    resp = await w.push({"w": ONES}, request_id=rid)
                except grpc.aio.AioRpcError as err:
                    refused = err
                    break
                assert not resp.duplicate
                acked += 1
            assert refused is not None, "the 1 MiB log never filled"
            assert acked >= 5, f"only {acked} pushes fit: {server.log()}"
            full_rid = acked + 1
            # A code a client can act on, naming the class and the log's path.
            assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert trailer_class(refused) == "StorageFull"
            assert str(wal_dir) in (refused.details() or "")
            assert "ENOSPC" in (refused.details() or "")

            # The retry is refused again: not answered "duplicate" for a push nobody logged.
            with pytest.raises(grpc.aio.AioRpcError) as again:
                await w.push({"w": ONES}, request_id=full_rid)
            assert trailer_class(again.value) == "StorageFull"

            # Nothing of the refused pushes is visible, and the server keeps serving.
            _, values = await w.pull(["w"], observer=True)
            np.testing.assert_array_equal(values["w"], np.full(N, -acked, np.float32))
            st = await status(server.address)
            assert st.applied_updates == acked and st.duplicate_pushes == 0
            assert await _health(server.address) == health_pb2.HealthCheckResponse.SERVING

            # A checkpoint on the full disk: the same actionable code, nothing committed.
            with pytest.raises(grpc.aio.AioRpcError) as ckpt:
                await w.stub.Checkpoint(pb.CheckpointRequest(), timeout=30)
            assert ckpt.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert trailer_class(ckpt.value) == "StorageFull"
            assert str(ckpt_dir) in (ckpt.value.details() or "")
            assert not [p for p in ckpt_dir.iterdir() if not p.name.startswith(".")]

            # Room again: the very same request id is applied once, then deduplicated.
            filler.unlink()
            resp = await w.push({"w": ONES}, request_id=full_rid)
            assert not resp.duplicate
            acked += 1
            assert (await w.push({"w": ONES}, request_id=full_rid)).duplicate

        server.kill()  # SIGKILL: only the log survives
        server.start()
        async with grpc.aio.insecure_channel(server.address) as channel:
            reader = ProtoWorker(channel, "reader")
            _, values = await reader.pull(["w"], observer=True)
            np.testing.assert_array_equal(values["w"], np.full(N, -acked, np.float32))
            assert (await status(server.address)).applied_updates == acked
            # The same registration's retry after the restart is still deduplicated (the
            # registration and its request ids are replayed from the log).
            again_w = ProtoWorker(channel, w.name)
            again_w.worker_id, again_w.clock = w.worker_id, w.clock
            assert (await again_w.push({"w": ONES}, request_id=full_rid)).duplicate
            assert (await status(server.address)).applied_updates == acked
