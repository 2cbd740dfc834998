"""Observability for real: Prometheus metrics scraped over HTTP, gRPC reflection, health during
shutdown, the ``paramserver status`` table, JSON logs, rank-server transfer metrics.

Expected values are computed from what each test did (pushes made, drops provoked, bytes moved
from the layout), never read back from the server's own counters.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from paramserver.api.v1 import parameter_server_pb2 as pb
from paramserver.api.v1 import parameter_server_pb2_grpc as pb_grpc
from paramserver.errors import InvalidArgument
from paramserver.protocol import link as local_link
from paramserver.protocol import tensor
from paramserver.spmd import SpmdParallelWorkers, Tier
from paramserver.spmd.layout import Layout
from paramserver.spmd.rank_server import RankServerConfig, start_rank_server
from paramserver.worker_client import UpdateRule, WorkerClient, connect
from tests.harness import ServerProcess, running_server

pytestmark = pytest.mark.timeout(60)


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        return str(resp.read().decode())


async def scrape(port: int) -> str:
    return await asyncio.get_running_loop().run_in_executor(None, _scrape, port)


def sample(body: str, name: str, **labels: str) -> float:
    """The value of one series in a Prometheus text exposition (labels matched exactly)."""
    for line in body.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        m = re.fullmatch(r"([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)", line)
        if m is None or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        if got == labels:
            return float(m.group(3))
    raise AssertionError(f"no series {name}{labels} in the scrape")


def total(body: str, name: str, **labels: str) -> float:
    """The sum of every series of ``name`` whose labels include ``labels`` (e.g. over ``rpc``:
    pushes reach the seams through the Push stream or the Session RPC)."""
    found = 0.0
    for line in body.splitlines():
        m = re.fullmatch(r"([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)", line)
        if m is None or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        if labels.items() <= got.items():
            found += float(m.group(3))
    return found


async def test_staleness_histogram_counts_every_applied_update() -> None:
    """SSP(3), two workers: w0 runs two clocks ahead, w1 pushes at clock 0, one NaN push is
    refused and one push is retried with the same request id.

    Staleness in clocks (highest clock applied before minus the gradient's clock): w0 pushes at
    clocks 0, 1, 2 -> 0, 0, 0; w1 at clock 0 after them -> 2; the retry adds nothing.
    Staleness in versions (applied before minus base_version 0): 0, 1, 2, 3.
    """
    grad = np.ones(4, np.float32)
    async with running_server(consistency="ssp", staleness=3, metrics_port=0) as srv:
        assert srv.metrics is not None
        async with connect(srv.address, "w0") as w0, connect(srv.address, "w1") as w1:
            await w0.init({"k": np.zeros(4, np.float32)}, rule=UpdateRule("add"))
            for step in range(3):
                await w0.push({"k": grad})
                if step < 2:
                    await w0.clock()
            await w1.push({"k": grad})
            with pytest.raises(InvalidArgument):
                await w1.push({"k": np.full(4, np.nan, np.float32)})
            # A retried push (same request id twice) on a raw stream: applied once.
            async with grpc.aio.insecure_channel(srv.address) as channel:
                stub = pb_grpc.ParameterServerStub(channel)
                for _ in range(2):
                    msgs = [
                        pb.PushRequest(
                            header=pb.PushHeader(
                                worker_id=w1.worker_id, request_id=10_000, clock=0, base_version=4
                            )
                        )
                    ] + [pb.PushRequest(frame=f) for f in tensor.encode_frames("k", grad)]
                    await stub.Push(iter(msgs), timeout=10)
            await w1.pull(["k"])
            body = await scrape(srv.metrics.port)

    pushes_made, refused_non_finite, duplicates = 3 + 1 + 1 + 1 + 1, 1, 1
    applied = pushes_made - refused_non_finite - duplicates
    assert applied == 5
    assert sample(body, "paramserver_applied_updates_total", shard="0") == applied
    assert sample(body, "paramserver_update_staleness_clocks_count", shard="0") == applied
    # clocks: 0, 0, 0 (w0), 2 (w1 at clock 0), 2 (raw push at clock 0)
    assert sample(body, "paramserver_update_staleness_clocks_bucket", shard="0", le="0.0") == 3
    assert sample(body, "paramserver_update_staleness_clocks_bucket", shard="0", le="1.0") == 3
    assert sample(body, "paramserver_update_staleness_clocks_bucket", shard="0", le="2.0") == 5
    assert sample(body, "paramserver_update_staleness_clocks_sum", shard="0") == 4
    # versions: 0, 1, 2, 3 (base version 0: nothing pulled yet), then 4 - 4 = 0
    assert sample(body, "paramserver_update_staleness_versions_count", shard="0") == applied
    assert sample(body, "paramserver_update_staleness_versions_sum", shard="0") == 6
    for reason, n in {"non_finite": 1, "duplicate": 1, "stale": 0, "invalid": 0}.items():
        assert sample(body, "paramserver_dropped_updates_total", shard="0", reason=reason) == n
    # Bytes and counts at the push/pull seams, per RPC.
    ok_pushes = 5 + 1  # the duplicate is answered (ok) without being applied
    assert total(body, "paramserver_push_bytes_count", outcome="ok") == ok_pushes
    assert total(body, "paramserver_push_bytes_sum", outcome="ok") == 16 * ok_pushes
    assert total(body, "paramserver_push_bytes_count", outcome="error") == 1
    assert sample(body, "paramserver_push_bytes_count", rpc="Push", outcome="ok") == 2  # raw
    pulls = total(body, "paramserver_pulls_total", outcome="ok")  # init reads back, then pull
    assert pulls >= 1
    assert total(body, "paramserver_pull_bytes_total") == 16 * pulls
    assert sample(body, "paramserver_key_pulled_bytes_total", key="k") == 16 * pulls
    assert sample(body, "paramserver_key_pushed_bytes_total", key="k") == 16 * ok_pushes
    assert sample(body, "paramserver_key_stored_bytes", shard="0", key="k") == 16
    assert sample(body, "paramserver_rpcs_total", method="Push", outcome="ok") == 2
    assert sample(body, "paramserver_live_workers", shard="0") == 2


async def test_same_host_sessions_are_labelled_by_transport() -> None:
    """A same-host client's session moves to the local link and its shared-memory segment is
    mapped; a network-only client stays on the gRPC Session. Their pushes are labelled by the
    transport that carried them; the open sessions, mapped segments and local links (one
    opened, one forged ticket refused) are exported."""
    big = np.ones(1 << 17, np.float32)  # 512 KiB: through the shared-memory segment
    async with running_server(consistency="asp", metrics_port=0) as srv:
        assert srv.metrics is not None and srv.local_link is not None
        near = WorkerClient(srv.address, "near", heartbeat=False)
        far = WorkerClient(srv.address, "far", heartbeat=False, shared_memory=False)
        async with near, far:
            await near.init({"k": np.zeros_like(big)}, rule=UpdateRule("add"))
            for _ in range(3):
                await near.push({"k": big})
            for _ in range(2):
                await far.push({"k": big})
            assert near.fastpath is not None and near.fastpath.on_local_link
            assert near.fastpath.shm_active
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(local_link.socket_address(srv.local_link.address))
            reader, writer = await asyncio.open_unix_connection(sock=sock)
            forged = pb.SessionRequest(
                seq=1, open=pb.SessionOpen(worker_id="near", local_ticket=b"\x00" * 16)
            ).SerializeToString()
            writer.write(len(forged).to_bytes(4, "little") + forged)
            assert await reader.read() != b""  # the refusal, then the server closes
            writer.close()
            body = await scrape(srv.metrics.port)
        after = await scrape(srv.metrics.port)

    labels = {"shard": "0"}
    assert sample(body, "paramserver_push_bytes_count", rpc="LocalLink", outcome="ok") == 3
    assert sample(body, "paramserver_push_bytes_count", rpc="Session", outcome="ok") == 2
    pushed = sample(body, "paramserver_push_bytes_sum", rpc="LocalLink", outcome="ok")
    assert pushed == 3 * big.nbytes
    assert sample(body, "paramserver_sessions_open", **labels) == 2
    assert sample(body, "paramserver_shared_memory_segments", **labels) == 1
    assert sample(body, "paramserver_local_links_total", **labels, outcome="opened") == 1
    assert sample(body, "paramserver_local_links_total", **labels, outcome="refused") == 1
    assert sample(after, "paramserver_sessions_open", **labels) == 0
    assert sample(after, "paramserver_shared_memory_segments", **labels) == 0


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_bsp_barrier_wait_ranks_the_straggler_first(tmp_path: Path) -> None:
    """BSP, three workers, two steps; "slow" clocks 0.3 s after the others in each step."""
    delay_s, steps = 0.3, 2
    async with running_server(
        consistency="bsp", metrics_port=0, checkpoint_dir=str(tmp_path / "ckpt")
    ) as srv:
        assert srv.metrics is not None
        names = ["fast-a", "fast-b", "slow"]
        async with (
            connect(srv.address, names[0]) as a,
            connect(srv.address, names[1]) as b,
            connect(srv.address, names[2]) as s,
        ):
            await a.init({"w": np.zeros(3)}, rule=UpdateRule("sgd", lr=0.1))

            async def work(client: object, sleep_s: float) -> None:
                for _ in range(steps):
                    await client.pull(["w"])  # type: ignore[attr-defined]
                    await client.push({"w": np.ones(3)})  # type: ignore[attr-defined]
                    await asyncio.sleep(sleep_s)
                    await client.clock()  # type: ignore[attr-defined]

            await asyncio.gather(work(a, 0.0), work(b, 0.0), work(s, delay_s))
            await a.pull(["w"])  # step 2 closed: every worker clocked
            await srv.checkpoint()
            body = await scrape(srv.metrics.port)
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "paramserver",
                "status",
                srv.address,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            out, err = await asyncio.wait_for(proc.communicate(), 120)  # a CLI start, busy machine
            assert proc.returncode == 0, err.decode()

    lag = {
        n: sample(body, "paramserver_bsp_barrier_lag_seconds_total", shard="0", worker=n)
        for n in names
    }
    wait = {
        n: sample(body, "paramserver_bsp_barrier_wait_seconds_total", shard="0", worker=n)
        for n in names
    }
    for n in names:
        assert sample(body, "paramserver_bsp_barrier_steps_total", shard="0", worker=n) == steps
    assert max(lag, key=lag.__getitem__) == "slow"
    # Per step the slow worker clocks delay_s after its push, and the fast ones as soon as their
    # own pull and push return: the gap is delay_s plus the difference of those latencies,
    # which on a loaded machine can be tens of milliseconds either way. Half the sleep is a
    # bound no such delay breaks, and still far above what a worker arriving with the others
    # accrues (~0); the upper bounds catch a wrong unit or double counting.
    assert steps * delay_s * 0.5 <= lag["slow"] < steps * (delay_s + 2.0)
    for fast in ("fast-a", "fast-b"):
        assert steps * delay_s * 0.5 <= wait[fast] < steps * (delay_s + 2.0)
    assert wait["slow"] < wait["fast-a"] and wait["slow"] < wait["fast-b"]
    # BSP: every contributor's gradient is applied at staleness 0, once per step.
    applied = len(names) * steps
    assert sample(body, "paramserver_update_staleness_clocks_count", shard="0") == applied
    assert (
        sample(body, "paramserver_update_staleness_clocks_bucket", shard="0", le="0.0") == applied
    )
    assert sample(body, "paramserver_checkpoint_duration_seconds_count", shard="0") == 1
    assert 0 <= sample(body, "paramserver_checkpoint_age_seconds", shard="0") < 30

    table = out.decode()
    assert "BSP" in table and "min clock 2" in table
    rows = [line.split() for line in table.splitlines()]
    worker_rows = [r for r in rows if r and r[0].isdigit() and len(r) >= 5 and r[1] in names]
    assert worker_rows[0][1] == "slow"  # straggler ranked first
    assert {r[1]: r[4] for r in worker_rows} == {n: str(steps) for n in names}  # clocks
    assert any(r[:2] == ["w", "float64"] for r in rows)  # keys table: key, dtype


async def test_reflection_lists_the_services() -> None:
    async with running_server() as srv, running_server(mode="reduce") as red:
        loop = asyncio.get_running_loop()
        ps_services = await loop.run_in_executor(None, _services, srv.address)
        red_services = await loop.run_in_executor(None, _services, red.address)
    assert {
        "paramserver.api.v1.ParameterServer",
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection",
    } <= ps_services
    assert "paramserver.api.v1.ReductionService" in red_services
    assert "grpc.health.v1.Health" in red_services
    assert "grpc.reflection.v1.ServerReflection" in red_services


async def test_reflection_v1_answers_on_its_own_method_path() -> None:
    """grpcurl and newer tools ask ``grpc.reflection.v1`` first: it lists the services and
    returns the descriptor of ParameterServer (v1's messages are v1alpha's, field for field)."""
    from google.protobuf import descriptor_pb2
    from grpc_reflection.v1alpha import reflection_pb2 as rpb

    async with running_server() as srv, grpc.aio.insecure_channel(srv.address) as channel:
        call = channel.stream_stream(
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            request_serializer=rpb.ServerReflectionRequest.SerializeToString,
            response_deserializer=rpb.ServerReflectionResponse.FromString,
        )(
            iter(
                [
                    rpb.ServerReflectionRequest(list_services=""),
                    rpb.ServerReflectionRequest(
                        file_containing_symbol="paramserver.api.v1.ParameterServer"
                    ),
                ]
            ),
            timeout=10,
        )
        answers = [r async for r in call]
    listed = {s.name for s in answers[0].list_services_response.service}
    assert {"paramserver.api.v1.ParameterServer", "grpc.reflection.v1.ServerReflection"} <= listed
    files = [
        descriptor_pb2.FileDescriptorProto.FromString(b)
        for b in answers[1].file_descriptor_response.file_descriptor_proto
    ]
    services = {svc.name for f in files for svc in f.service}
    assert "ParameterServer" in services


def _services(address: str) -> set[str]:
    with grpc.insecure_channel(address) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        services = set(db.get_services())
        # The descriptors resolve too (what grpcurl does next).
        for name in services:
            db.FindFileContainingSymbol(name)
        return services


@pytest.mark.slow
def test_health_goes_not_serving_during_shutdown_and_logs_are_json(tmp_path: Path) -> None:
    """A Watch stream sees SERVING, then NOT_SERVING after SIGTERM, while the server is still
    in its grace period; ``--log-format json`` writes one JSON object per line."""
    server = ServerProcess(tmp_path, "--grace-s", "2", "--log-format", "json")
    seen: list[int] = []
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            stream = stub.Watch(
                health_pb2.HealthCheckRequest(service="paramserver.api.v1.ParameterServer"),
                timeout=30,
            )
            first = next(stream)
            seen.append(first.status)
            server.proc.send_signal(signal.SIGTERM)
            for msg in stream:
                seen.append(msg.status)
                if msg.status == health_pb2.HealthCheckResponse.NOT_SERVING:
                    break
            stream.cancel()
    finally:
        rc = server.stop()
    assert rc == 0, server.log()
    assert seen[0] == health_pb2.HealthCheckResponse.SERVING
    assert seen[-1] == health_pb2.HealthCheckResponse.NOT_SERVING
    lines = [line for line in server.log().splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]  # every line parses
    assert all({"time", "level", "logger", "message"} <= r.keys() for r in records)
    assert any("listening" in r["message"] for r in records)
    assert any("shutting down" in r["message"] for r in records)


@pytest.mark.parametrize("loop_name", ["asyncio", "uvloop"])
def test_rank_server_metrics_count_the_bytes_moved(tmp_path: Path, loop_name: str) -> None:
    layout = Layout(0, num_layers=2, outer_dim=2, page_size=8, inner_dim=64, dtype="float16")
    block_bytes = 2 * 2 * 8 * 64 * 2  # layers x outer x page x inner x float16 itemsize
    moved_blocks = 5

    async def body() -> str:
        cfg = RankServerConfig(
            instance_id="obs",
            rank=0,
            layout=layout,
            host_blocks=16,
            disk_blocks=16,
            disk_dir=tmp_path / "disk",
            object_dir=tmp_path / "objects",
            object_durable=False,
            metrics_port=0,
        )
        handle = await start_rank_server(cfg)
        try:
            assert handle.metrics is not None
            async with SpmdParallelWorkers([handle.address], default_timeout_s=10) as g:
                data = np.zeros((moved_blocks, block_bytes), np.uint8)
                await g.write_blocks(0, Tier.G2, range(moved_blocks), data)
                note = await g.execute_local_transfer(
                    Tier.G2, Tier.G3, range(moved_blocks), range(moved_blocks)
                )
                await note
            services = await asyncio.get_running_loop().run_in_executor(
                None, _services, handle.address
            )
            assert "paramserver.api.v1.RankServer" in services
            return await scrape(handle.metrics.port)
        finally:
            await handle.stop(0.5)

    from paramserver.cli.rank import run_event_loop

    scraped = run_event_loop(body(), loop_name)
    labels = {"direction": "local", "src_tier": "G2", "dst_tier": "G3", "path": "local"}
    assert sample(scraped, "paramserver_rank_transfer_bytes_total", **labels) == (
        moved_blocks * block_bytes
    )
    assert sample(scraped, "paramserver_rank_transfers_total", **labels) == 1
    assert sample(scraped, "paramserver_rank_transfer_seconds_count", **labels) == 1
    assert sample(scraped, "paramserver_rank_transfer_gbps", **labels) > 0


def test_json_formatter_keeps_extra_fields() -> None:
    import logging

    from paramserver.cli.logs import JsonFormatter, resolve_log_format

    record = logging.LogRecord("paramserver.x", logging.WARNING, __file__, 1, "a %s", ("b",), None)
    record.worker = "w0"
    out = json.loads(JsonFormatter().format(record))
    assert out["message"] == "a b" and out["level"] == "WARNING" and out["worker"] == "w0"
    assert out["logger"] == "paramserver.x" and out["time"].endswith("+00:00")
    assert resolve_log_format(None, {"PARAMSERVER_LOG_FORMAT": "JSON"}) == "json"
    assert resolve_log_format("text", {"PARAMSERVER_LOG_FORMAT": "json"}) == "text"
    with pytest.raises(InvalidArgument, match="PARAMSERVER_LOG_FORMAT"):
        resolve_log_format(None, {"PARAMSERVER_LOG_FORMAT": "xml"})
