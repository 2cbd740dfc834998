"""``paramserver spmd-demo`` driving rank servers that already run, and the rank servers' gRPC
health service (what the docker-compose cluster relies on).

Four real rank-server subprocesses (instance A ranks 0, 1 and instance B ranks 0, 1) on
127.0.0.1 ephemeral ports, one object store shared by both instances, started once for the
module; the demo runs as a subprocess against them, as the compose ``spmd-demo`` service does.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from paramserver.cli.demos.rank_launcher import RankServerCluster, wait_serving
from paramserver.cli.rank import run_event_loop
from paramserver.errors import InvalidArgument, ResourceExhausted
from paramserver.spmd import SpmdParallelWorkers
from paramserver.spmd.layout import Layout
from paramserver.spmd.objects import FilesystemObjectStore, _FsWriter
from paramserver.spmd.rank_server import (
    SERVICE_NAME,
    RankServerConfig,
    start_rank_server,
)
from tests.harness import ScriptProcess
from tests.harness.timing import scaled

pytestmark = pytest.mark.slow

LOOPS = ["asyncio", "uvloop"]
LAYOUT = Layout(0, num_layers=2, outer_dim=2, page_size=8, inner_dim=64)  # 4 KiB blocks
LAYOUT_ARG = "num_layers=2,outer_dim=2,page_size=8,inner_dim=64,dtype=float16"
BLOCKS = 16  # per rank; B.G2 needs 4 x BLOCKS (four onboard paths)


def run(loop: str, body: Callable[[], Awaitable[Any]]) -> Any:
    return run_event_loop(body(), loop)


def demo(*args: str, env: dict[str, str] | None = None, timeout_s: float = 90) -> Any:
    """Run ``paramserver spmd-demo`` as a subprocess; the CompletedProcess."""
    return subprocess.run(
        [sys.executable, "-m", "paramserver", "--log-level", "WARNING", "spmd-demo", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=dict(os.environ, **(env or {})),
    )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RankServerCluster]:
    base = tmp_path_factory.mktemp("spmd-running")
    c = RankServerCluster(base, layout=LAYOUT, host_blocks=4 * BLOCKS, disk_blocks=BLOCKS)
    try:
        c.spawn_instance("A", 2)
        c.spawn_instance("B", 2)
        c.wait_ready(timeout_s=scaled(60))
        yield c
    finally:
        c.stop()


def bytes_moved(addresses: list[str]) -> int:
    async def body() -> int:
        async with SpmdParallelWorkers(addresses) as g:
            return sum(s.bytes_moved for s in await g.status())

    return int(run("asyncio", body))


# --------------------------------------------------------------------------- spmd-demo


@pytest.mark.timeout(120)
def test_demo_drives_running_rank_servers(cluster: RankServerCluster) -> None:
    a, b = cluster.addresses("A"), cluster.addresses("B")
    before = bytes_moved(b)
    out = demo("--instance-a", ",".join(a), "--instance-b", ",".join(b), "--blocks", str(BLOCKS))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "verified" in out.stdout and "every byte matches" in out.stdout
    # 2 ranks x (A.G3 + four B.G2 ranges) x BLOCKS blocks, each compared by digest
    assert f"OK: {2 * 5 * BLOCKS} blocks verified" in out.stdout
    for path in ("local offload (disk)", "gRPC stream", "object store", "GB/s"):
        assert path in out.stdout
    assert f"A at {','.join(a)}" in out.stdout
    # The demo moved its bytes through *these* servers: B received 4 ranges per rank.
    assert bytes_moved(b) - before >= 2 * 4 * BLOCKS * LAYOUT.bytes_per_block


@pytest.mark.timeout(120)
def test_demo_from_environment_twice_with_json(cluster: RankServerCluster) -> None:
    env = {
        "PARAMSERVER_SPMD_INSTANCE_A": ",".join(cluster.addresses("A")),
        "PARAMSERVER_SPMD_INSTANCE_B": ",".join(cluster.addresses("B")),
        "PARAMSERVER_SPMD_WAIT_S": "30",
    }
    seeds = set()
    for _ in range(2):  # a rerun against the same servers and object store verifies afresh
        out = demo("--blocks", "8", "--json", "--layout", LAYOUT_ARG, env=env)
        assert out.returncode == 0, out.stdout + out.stderr
        lines = [json.loads(line) for line in out.stdout.splitlines()]
        summary = lines[-1]
        assert summary["mismatches"] == 0
        assert summary["verified_blocks"] == 2 * 5 * 8
        assert summary["instance_b"] == cluster.addresses("B")
        paths = {line["path"]: line for line in lines[:-1]}
        assert paths["G4->B.G2 onboard (object store)"]["bytes"] == 2 * 8 * LAYOUT.bytes_per_block
        assert paths["G4->B.G2 onboard (object store)"]["transport"] == ["object"]
        seeds.add(summary["run_seed"])
    assert len(seeds) == 2


@pytest.mark.timeout(60)
def test_demo_refuses_servers_too_small_or_of_another_format(cluster: RankServerCluster) -> None:
    args = ["--instance-a", ",".join(cluster.addresses("A"))]
    args += ["--instance-b", ",".join(cluster.addresses("B"))]
    out = demo(*args, "--blocks", str(BLOCKS + 1))
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"G2 holds {4 * BLOCKS} blocks, the demo needs {4 * (BLOCKS + 1)}" in out.stderr
    out = demo(*args, "--blocks", "4", "--layout", "num_layers=3")
    assert out.returncode == 2, out.stdout + out.stderr
    assert "block format" in out.stderr
    out = demo(*args, "--ranks", "3")
    assert out.returncode == 2 and "--ranks 3" in out.stderr
    out = demo("--instance-a", ",".join(cluster.addresses("A")))
    assert out.returncode == 2 and "both" in out.stderr
    out = demo("--instance-a", "nohost", "--instance-b", "127.0.0.1:1")
    assert out.returncode == 2 and "HOST:PORT" in out.stderr


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@pytest.mark.timeout(90)
def test_demo_waits_for_rank_servers_that_start_later(tmp_path: Path) -> None:
    ports = free_ports(4)
    a = [f"127.0.0.1:{p}" for p in ports[:2]]
    b = [f"127.0.0.1:{p}" for p in ports[2:]]
    cmd = [
        "-m",
        "paramserver",
        "--log-level",
        "WARNING",
        "spmd-demo",
        "--blocks",
        "4",
    ]
    cmd += ["--instance-a", ",".join(a), "--instance-b", ",".join(b), "--wait-s", "60"]
    proc = ScriptProcess(tmp_path, "spmd-demo", cmd)
    c = RankServerCluster(tmp_path, layout=LAYOUT, host_blocks=16, disk_blocks=4)
    try:
        time.sleep(1.0)  # the demo is polling servers that do not exist yet
        assert proc.proc.poll() is None, proc.stderr()
        for k, port in enumerate(ports):
            c.spawn("AB"[k // 2], k % 2, extra_args=["--port", str(port)])
        stdout, stderr = proc.communicate(timeout_s=80)
        assert proc.proc.returncode == 0, stdout + stderr
        assert "verified" in stdout
    finally:
        proc.close()
        c.stop()


@pytest.mark.timeout(60)
def test_demo_gives_up_on_servers_that_never_answer() -> None:
    ports = free_ports(2)
    t0 = time.monotonic()
    out = demo(
        "--instance-a",
        f"127.0.0.1:{ports[0]}",
        "--instance-b",
        f"127.0.0.1:{ports[1]}",
        "--wait-s",
        "1.5",
    )
    assert out.returncode == 1, out.stdout + out.stderr
    assert "not SERVING after 1.5 s" in out.stderr
    assert f"127.0.0.1:{ports[0]}: UNAVAILABLE" in out.stderr
    assert time.monotonic() - t0 < 30


# --------------------------------------------------------------------------- health


@pytest.mark.timeout(60)
def test_health_command_without_allow_unimplemented(cluster: RankServerCluster) -> None:
    for address in cluster.addresses("A") + cluster.addresses("B"):
        for service in ("", SERVICE_NAME):
            cmd = [sys.executable, "-m", "paramserver", "health", "--server", address]
            out = subprocess.run(
                [*cmd, "--service", service],
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert out.returncode == 0, out.stdout + out.stderr
            assert out.stdout.strip() == f"{address}: SERVING"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "paramserver",
            "health",
            "--server",
            cluster.addresses("A")[0],
            "--service",
            "nope",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 1 and "NOT_FOUND" in out.stderr


def _small_rank(tmp_path: Path, instance_id: str, **overrides: Any) -> RankServerConfig:
    """Rank 0 of ``instance_id`` with 4 G2 and 4 G3 blocks and an object store, under
    ``tmp_path``, on an ephemeral port."""
    return RankServerConfig(
        instance_id=instance_id,
        rank=0,
        port=0,
        layout=LAYOUT,
        host_blocks=4,
        disk_blocks=4,
        disk_dir=tmp_path / "disk",
        object_dir=tmp_path / "objects",
        **overrides,
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("loop", LOOPS)
def test_health_serving_then_not_serving_on_graceful_shutdown(tmp_path: Path, loop: str) -> None:
    async def body() -> None:
        handle = await start_rank_server(_small_rank(tmp_path, "health"))
        address = f"127.0.0.1:{handle.port}"
        stopped = False
        try:
            await wait_serving([address], timeout_s=10)
            async with grpc.aio.insecure_channel(address) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                for service in ("", SERVICE_NAME):
                    reply = await stub.Check(
                        health_pb2.HealthCheckRequest(service=service), timeout=5
                    )
                    assert reply.status == health_pb2.HealthCheckResponse.SERVING
                watch = stub.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
                first = await asyncio.wait_for(watch.read(), 5)
                assert first.status == health_pb2.HealthCheckResponse.SERVING
                stopping = asyncio.create_task(handle.stop(grace_s=2.0))
                stopped = True
                second = await asyncio.wait_for(watch.read(), 5)
                assert second.status == health_pb2.HealthCheckResponse.NOT_SERVING
                await stopping
        finally:
            if not stopped:
                await handle.stop(0)

    run(loop, body)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("loop", LOOPS)
def test_put_object_refuses_what_cannot_be_stored_and_keeps_nothing(
    tmp_path: Path, loop: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over max_object_bytes: INVALID_ARGUMENT before a byte is written. More than the store's
    disk has free: RESOURCE_EXHAUSTED up front. The disk filling mid-write (ENOSPC):
    RESOURCE_EXHAUSTED, the temp file removed. Each time the object stays absent, and the
    server then stores a valid object."""
    limit = 1 << 20

    async def body() -> None:
        config = _small_rank(tmp_path, "caps", object_durable=False, max_object_bytes=limit)
        handle = await start_rank_server(config)
        try:
            async with SpmdParallelWorkers([f"127.0.0.1:{handle.port}"]) as group:
                client = group.client(0)
                with pytest.raises(InvalidArgument, match=f"exceeds max_object_bytes {limit}"):
                    await client.put_object(1, bytes(limit + 1))
                with monkeypatch.context() as m:
                    m.setattr(FilesystemObjectStore, "free_bytes", lambda self: 1000)
                    with pytest.raises(ResourceExhausted, match="has 1000 free"):
                        await client.put_object(2, bytes(4096))
                written: list[int] = []

                def full(self: Any, data: Any) -> None:
                    if written:
                        raise OSError(errno.ENOSPC, "No space left on device")
                    written.append(len(data))

                with monkeypatch.context() as m:
                    m.setattr(_FsWriter, "write", full)
                    with pytest.raises(ResourceExhausted, match="object store full"):
                        await client.put_object(3, bytes(limit), chunk_bytes=1 << 18)
                assert written == [1 << 18]
                assert await client.has_objects([1, 2, 3]) == {1: None, 2: None, 3: None}
                assert os.listdir(tmp_path / "objects" / ".tmp") == []
                assert await client.put_object(4, bytes(limit)) is True
                assert len(await client.get_object(4)) == limit
        finally:
            await handle.stop(0)

    run(loop, body)
