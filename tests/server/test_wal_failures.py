"""Write-ahead-log failures on a real in-process server: a write the disk refuses changes
nothing; an fsync that fails stops the server from mutating (memory may be ahead of the log)
and turns its health NOT_SERVING, with an error naming the log.

Expected values are closed forms (sgd lr 1 on gradients of ones: ``w == -applied``).
"""

from __future__ import annotations

import asyncio
import errno
import os
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from paramserver.api.v1 import parameter_server_pb2 as pb
from paramserver.server import wal as wal_module
from tests.conformance.protowire import ProtoWorker, trailer_class
from tests.harness import running_server

pytestmark = pytest.mark.timeout(60)

ONES = np.ones(8, np.float32)
SGD_LR1 = pb.UpdateRule(kind=pb.RULE_KIND_SGD, lr=1.0)


def _file_size(path: Path | None) -> int:
    assert path is not None
    return path.stat().st_size


async def _health(channel: grpc.aio.Channel) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    resp = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    return int(resp.status)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
async def test_a_refused_log_write_applies_nothing_and_the_server_keeps_serving(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    async with running_server(consistency="asp", wal=True, wal_dir=tmp_path / "wal") as d:
        log = d.engine.wal
        assert log is not None
        async with grpc.aio.insecure_channel(d.address) as channel:
            w = ProtoWorker(channel)
            await w.register()
            await w.init({"w": np.zeros(8, np.float32)}, SGD_LR1)
            assert not (await w.push({"w": ONES}, request_id=1)).duplicate
            size_before = _file_size(log._segment)
            real_write = os.write

            def half_then_fail(fd: int, data: object) -> int:
                if fd != log._fd:
                    return real_write(fd, data)  # type: ignore[arg-type]
                view = memoryview(data)  # type: ignore[arg-type]
                real_write(fd, view[: len(view) // 2])  # a torn record reaches the file
                raise OSError(code, os.strerror(code))

            monkeypatch.setattr(wal_module.os, "write", half_then_fail)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await w.push({"w": ONES}, request_id=2)
            monkeypatch.setattr(wal_module.os, "write", real_write)
            expected = (
                (grpc.StatusCode.RESOURCE_EXHAUSTED, "StorageFull")
                if code == errno.ENOSPC
                else (grpc.StatusCode.UNAVAILABLE, "StorageError")
            )
            assert (info.value.code(), trailer_class(info.value)) == expected
            assert str(tmp_path / "wal") in (info.value.details() or "")
            # The torn half was cut off, nothing applied, the request id not recorded.
            assert _file_size(log._segment) == size_before
            _, values = await w.pull(["w"], observer=True)
            np.testing.assert_array_equal(values["w"], -ONES)
            assert not (await w.push({"w": ONES}, request_id=2)).duplicate
            _, values = await w.pull(["w"])
            np.testing.assert_array_equal(values["w"], -2 * ONES)
            assert await _health(channel) == health_pb2.HealthCheckResponse.SERVING
        records = [r.WhichOneof("body") for r in log.replay()]
        assert records == ["register", "init", "push", "push"]


async def test_a_failed_fsync_stops_mutations_and_pulls_and_turns_health_not_serving(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with running_server(consistency="asp", wal=True, wal_dir=tmp_path / "wal") as d:
        log = d.engine.wal
        assert log is not None
        async with grpc.aio.insecure_channel(d.address) as channel:
            w = ProtoWorker(channel)
            await w.register()
            await w.init({"w": np.zeros(8, np.float32)}, SGD_LR1)
            real_fsync = os.fsync

            def eio_on_the_log(fd: int) -> None:
                assert log._fd is not None
                if os.path.sameopenfile(fd, log._fd):  # the log's segment (by any descriptor)
                    raise OSError(errno.EIO, os.strerror(errno.EIO))
                real_fsync(fd)

            monkeypatch.setattr(wal_module.os, "fsync", eio_on_the_log)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await w.push({"w": ONES}, request_id=1)
            monkeypatch.setattr(wal_module.os, "fsync", real_fsync)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert trailer_class(info.value) == "StorageError"
            assert "fsync" in (info.value.details() or "")
            # From now on: every mutation and pull refused, naming the log; health NOT_SERVING.
            for call in (
                w.push({"w": ONES}, request_id=2),
                w.end_clock(),
                w.pull(["w"]),
                w.init({"v": np.zeros(2, np.float32)}),
                ProtoWorker(channel).register(),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, call
                assert str(tmp_path / "wal") in (refused.value.details() or "")
            assert await _health(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
            # Status still answers (operators need to see why).
            await w.stub.Status(pb.StatusRequest(), timeout=5)


async def test_an_overflow_refusal_is_decided_before_the_log_even_behind_a_pending_apply(
    tmp_path: Path,
) -> None:
    """A float16 ``add`` whose result leaves float16's range is refused (ValueOutOfRange) when
    it is decided, also while an earlier push of the key is still applying in a thread: it is
    not logged, not counted, its request id not recorded, and the log replays cleanly after a
    restart. Closed form: only the in-range pushes are in the value."""
    n = 1 << 16  # 128 KiB of float16: over offload_min_bytes, so applies go to a thread
    wal_dir = tmp_path / "wal"
    config = {"consistency": "asp", "wal": True, "wal_dir": wal_dir, "offload_min_bytes": 1024}
    add = pb.UpdateRule(kind=pb.RULE_KIND_ADD)
    ok = np.full(n, 30000.0, np.float16)
    async with running_server(**config) as d:
        async with grpc.aio.insecure_channel(d.address) as channel:
            w = ProtoWorker(channel)
            await w.register()
            await w.init({"h": np.zeros(n, np.float16)}, add)
            # The second push is decided while the first may still apply in a thread:
            # 30000 + 30000 = 60000 fits float16 (max 65504); a third 30000 would not.
            results = await asyncio.gather(
                w.push({"h": ok}, request_id=1),
                w.push({"h": ok}, request_id=2),
                w.push({"h": ok}, request_id=3),
                return_exceptions=True,
            )
            refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
            assert len(refused) == 1, results
            _expect = (grpc.StatusCode.INVALID_ARGUMENT, "ValueOutOfRange")
            assert (refused[0].code(), trailer_class(refused[0])) == _expect
            refused_rid = 1 + results.index(refused[0])
            again = await asyncio.gather(
                w.push({"h": ok}, request_id=refused_rid), return_exceptions=True
            )
            assert isinstance(again[0], grpc.aio.AioRpcError)  # refused again, not "duplicate"
            _, values = await w.pull(["h"], observer=True)
            np.testing.assert_array_equal(values["h"], np.full(n, 60000.0, np.float16))
            st = await w.stub.Status(pb.StatusRequest(), timeout=5)
            assert st.applied_updates == 2
    # The log holds exactly the two applied pushes and replays into the same state.
    async with running_server(**config) as d:
        async with grpc.aio.insecure_channel(d.address) as channel:
            _, values = await ProtoWorker(channel).pull(["h"], observer=True)
            np.testing.assert_array_equal(values["h"], np.full(n, 60000.0, np.float16))
