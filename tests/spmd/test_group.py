"""Integration tests of SpmdParallelWorkers against real rank-server processes on 127.0.0.1.

Two instances, A and B, of two rank servers each run as subprocesses on ephemeral ports for the
whole module; A's rank servers run on uvloop and B's on the default asyncio loop, so every
A <-> B transfer exercises both server loops. Every client body runs under both the default
asyncio loop and uvloop.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from paramserver.api.v1 import spmd_pb2
from paramserver.cli.demos.rank_launcher import RankServerCluster, wait_for
from paramserver.cli.rank import run_event_loop
from paramserver.errors import FailedPrecondition, InvalidArgument, KeyNotFound, ParamServerError
from paramserver.spmd import (
    RankFailures,
    RemoteLayout,
    RemoteNotConnected,
    SpmdParallelWorkers,
    Tier,
    TierNotRegistered,
    TransferFailed,
    sequence_hashes,
)
from paramserver.spmd.layout import Layout
from paramserver.spmd.rank_client import RankClient
from tests.harness import ScriptProcess
from tests.harness.timing import scaled

pytestmark = pytest.mark.slow

LOOPS = ["asyncio", "uvloop"]
LAYOUT = Layout(0, num_layers=2, outer_dim=2, page_size=8, inner_dim=64)  # 4 KiB blocks
BPB = LAYOUT.bytes_per_block


def run(loop: str, body: Callable[[], Awaitable[Any]]) -> Any:
    return run_event_loop(body(), loop)


def data_for(rank: int, n: int, salt: int = 0) -> np.ndarray:
    """Distinct bytes per rank, block and salt: shape (n, BPB), uint8."""
    rng = np.random.default_rng(rank * 1_000_003 + salt)
    return rng.integers(0, 256, size=(n, BPB), dtype=np.uint8)


def as_bytes(arr: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(arr).view(np.uint8).reshape(arr.shape[0], -1)


def fresh_hashes(n: int) -> list[int]:
    tokens = np.arange(n * LAYOUT.page_size, dtype=np.int64)
    return sequence_hashes(tokens, LAYOUT.page_size, parent_hash=random.getrandbits(64))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RankServerCluster]:
    base = tmp_path_factory.mktemp("spmd-group")
    c = RankServerCluster(base, layout=LAYOUT, host_blocks=128, disk_blocks=64)
    try:
        c.spawn_instance("A", 2, extra_args=["--loop", "uvloop"])
        c.spawn_instance("B", 2, extra_args=["--loop", "asyncio"])
        c.wait_ready(timeout_s=scaled(60))
        yield c
    finally:
        c.stop()


async def counters(group: SpmdParallelWorkers) -> list[tuple[int, int]]:
    return [(s.commands_completed, s.commands_failed) for s in await group.status()]


# --------------------------------------------------------------------------- metadata


@pytest.mark.parametrize("loop", LOOPS)
def test_open_export_metadata_and_worker_count(cluster: RankServerCluster, loop: str) -> None:
    async def body() -> None:
        async with SpmdParallelWorkers(cluster.addresses("A")) as a:
            assert a.worker_count() == 2
            assert a.instance_id == "A"
            md = await a.export_metadata()
            assert [m.rank for m in md] == [0, 1]
            assert [m.address for m in md] == cluster.addresses("A")
            for m in md:
                tiers = {spec.tier for spec in m.layouts}
                assert tiers == {spmd_pb2.TIER_G2_HOST, spmd_pb2.TIER_G3_DISK}
                assert m.object_tier and m.incarnation_id and m.host_key
            assert a.layouts(0)[Tier.G2].bytes_per_block == BPB
            assert a.layouts(1)[Tier.G2].num_blocks == 128
            assert a.layouts(1)[Tier.G3].num_blocks == 64

    run(loop, body)


def test_group_refuses_addresses_out_of_rank_order(cluster: RankServerCluster) -> None:
    async def body() -> None:
        with pytest.raises(RankFailures) as info:
            await SpmdParallelWorkers.create(list(reversed(cluster.addresses("A"))))
        assert info.value.failed_ranks == [0, 1]
        assert "server reports rank 1" in info.value.message
        with pytest.raises(RankFailures) as mixed:
            await SpmdParallelWorkers.create([cluster.addresses("A")[0], cluster.addresses("B")[1]])
        assert "mixed" in mixed.value.message
        with pytest.raises(InvalidArgument):
            SpmdParallelWorkers([])

    run("asyncio", body)


# --------------------------------------------------------------------------- local transfers


@pytest.mark.parametrize("loop", LOOPS)
def test_local_transfer_round_trip(cluster: RankServerCluster, loop: str) -> None:
    async def body() -> None:
        async with SpmdParallelWorkers(cluster.addresses("A")) as a:
            src = {r: data_for(r, 8, salt=1) for r in range(2)}
            for r in range(2):
                await a.write_blocks(r, Tier.G2, range(8), src[r])
            note = await a.execute_local_transfer(Tier.G2, Tier.G3, range(8), range(10, 18))
            first = note.poll()
            assert first is None or first.operation == "execute_local_transfer"
            result = await note
            assert note.done() and note.poll() is result
            assert sorted(result.results) == [0, 1]
            assert result.bytes_moved == 2 * 8 * BPB
            for r in range(2):
                rr = result.results[r]
                assert rr.path == "local"
                assert [(p.src, p.dst) for p in rr.placements] == list(
                    zip(range(8), range(10, 18), strict=True)
                )
            # back into other host slots, permuted
            src_ids = [17, 10, 13]
            dst_ids = [40, 41, 42]
            await (await a.execute_local_transfer("G3", "G2", src_ids, dst_ids))
            for r in range(2):
                got = as_bytes(await a.read_blocks(r, Tier.G2, dst_ids))
                np.testing.assert_array_equal(got, src[r][[7, 0, 3]])
                g3 = as_bytes(await a.read_blocks(r, Tier.G3, range(10, 18)))
                np.testing.assert_array_equal(g3, src[r])

    run(loop, body)


BAD_LOCAL = [
    # (src tier, dst tier, src ids, dst ids, error, fragment)
    (Tier.G2, Tier.G2, [0, 1], [1, 2], InvalidArgument, "overlap"),
    (Tier.G2, Tier.G3, [0, 1], [5, 5], InvalidArgument, "not unique"),
    (Tier.G2, Tier.G3, [0, 1, 2], [5, 6], InvalidArgument, "3 ids"),
    (Tier.G2, Tier.G3, [0], [64], InvalidArgument, "out of range [0, 64)"),
    (Tier.G2, Tier.G4, [0], [0], InvalidArgument, "never a local-transfer endpoint"),
    (Tier.G1, Tier.G2, [0], [0], TierNotRegistered, "G1 not registered"),
]


@pytest.mark.parametrize("loop", LOOPS)
def test_invalid_commands_are_refused_before_any_rank_starts(
    cluster: RankServerCluster, loop: str
) -> None:
    async def body() -> None:
        async with SpmdParallelWorkers(cluster.addresses("A")) as a:
            before = await counters(a)
            for src_t, dst_t, s, d, err, fragment in BAD_LOCAL:
                with pytest.raises(err) as info:
                    await a.execute_local_transfer(src_t, dst_t, s, d)
                assert fragment in info.value.message
                assert "rank 0" in info.value.message and "rank 1" in info.value.message
            # only rank 1 is out of range: still nothing starts anywhere
            with pytest.raises(InvalidArgument) as one:
                await a.execute_local_transfer(Tier.G2, Tier.G3, [0], {0: [1], 1: [99]})
            assert "rank 1" in one.value.message and "rank 0:" not in one.value.message
            with pytest.raises(TierNotRegistered) as g1:
                await a.read_blocks(0, Tier.G1, [0])
            assert g1.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert await counters(a) == before

    run(loop, body)


@pytest.mark.parametrize("loop", LOOPS)
def test_rank_server_validates_direct_clients_too(cluster: RankServerCluster, loop: str) -> None:
    async def body() -> None:
        async with RankClient(cluster.addresses("A")[0], 0) as c:
            cases = [
                (
                    spmd_pb2.TIER_G2_HOST,
                    spmd_pb2.TIER_G2_HOST,
                    [0, 1],
                    [1, 2],
                    "INVALID",
                    "overlap",
                ),
                (spmd_pb2.TIER_G1_DEVICE, spmd_pb2.TIER_G2_HOST, [0], [0], "FAILED", "G1 not reg"),
                (spmd_pb2.TIER_G2_HOST, spmd_pb2.TIER_G4_OBJECT, [0], [0], "INVALID", "G4"),
                (spmd_pb2.TIER_UNSPECIFIED, spmd_pb2.TIER_G2_HOST, [0], [0], "INVALID", "unspec"),
            ]
            for src, dst, s, d, code, fragment in cases:
                request = spmd_pb2.LocalTransferRequest(
                    src_tier=src, dst_tier=dst, src_block_ids=s, dst_block_ids=d
                )
                with pytest.raises(ParamServerError) as info:
                    await c.unary("LocalTransfer", request, 5.0)
                assert info.value.code.name.startswith(code)
                assert fragment in info.value.message
            stale = spmd_pb2.LocalTransferRequest(
                options=spmd_pb2.CommandOptions(incarnation_id="0" * 32),
                src_tier=spmd_pb2.TIER_G2_HOST,
                dst_tier=spmd_pb2.TIER_G3_DISK,
                src_block_ids=[0],
                dst_block_ids=[0],
            )
            with pytest.raises(FailedPrecondition, match="restarted"):
                await c.unary("LocalTransfer", stale, 5.0)
            # a never-written block is not valid data
            with pytest.raises(FailedPrecondition, match="hold no valid data"):
                await c.read_blocks(Tier.G2, [127], BPB)

    run(loop, body)


# --------------------------------------------------------------------------- remote


@pytest.mark.parametrize("loop", LOOPS)
def test_connect_remote_and_onboard_via_shared_memory_and_grpc(
    cluster: RankServerCluster, loop: str
) -> None:
    async def body() -> None:
        async with (
            SpmdParallelWorkers(cluster.addresses("A")) as a,
            SpmdParallelWorkers(cluster.addresses("B")) as b,
        ):
            src = {r: data_for(r, 6, salt=2) for r in range(2)}
            for r in range(2):
                await a.write_blocks(r, Tier.G2, range(60, 66), src[r])
            await (await a.execute_local_transfer(Tier.G2, Tier.G3, range(60, 66), range(0, 6)))
            with pytest.raises(RemoteNotConnected) as nc:
                await b.execute_remote_onboard_for_instance("A", Tier.G2, [60], Tier.G2, [0])
            assert nc.value.code == grpc.StatusCode.NOT_FOUND
            assert not b.has_remote_metadata("A")
            await b.connect_remote("A", await a.export_metadata())
            assert b.has_remote_metadata("A")
            shm = await (
                await b.execute_remote_onboard_for_instance(
                    "A", Tier.G2, range(60, 66), Tier.G2, range(0, 6)
                )
            )
            assert {r.path for r in shm.results.values()} == {"shared-memory"}
            net = await (
                await b.execute_remote_onboard(
                    RemoteLayout("A", Tier.G2, range(60, 66)),
                    Tier.G2,
                    range(10, 16),
                    allow_shared_memory=False,
                )
            )
            assert {r.path for r in net.results.values()} == {"grpc"}
            disk = await (
                await b.execute_remote_onboard_for_instance(
                    "A", Tier.G3, [5, 4, 3, 2, 1, 0], "G3", [20, 21, 22, 23, 24, 25]
                )
            )
            assert disk.bytes_moved == 2 * 6 * BPB
            for r in range(2):
                for ids in (range(0, 6), range(10, 16)):
                    got = as_bytes(await b.read_blocks(r, Tier.G2, ids))
                    np.testing.assert_array_equal(got, src[r])
                got = as_bytes(await b.read_blocks(r, Tier.G3, range(20, 26)))
                np.testing.assert_array_equal(got, src[r][::-1])
            # validated against the remote layout before any rank starts
            with pytest.raises(InvalidArgument, match="remote \\(G3\\)"):
                await b.execute_remote_onboard_for_instance("A", Tier.G3, [64], Tier.G2, [0])
            # never-written source blocks are refused by the peer, naming both sides
            with pytest.raises(TransferFailed) as invalid:
                await (
                    await b.execute_remote_onboard_for_instance(
                        "A", Tier.G2, [127], Tier.G2, [30], allow_shared_memory=False
                    )
                )
            assert invalid.value.failed_ranks == [0, 1]
            assert "hold no valid data" in invalid.value.message

    run(loop, body)


@pytest.mark.parametrize("loop", LOOPS)
def test_connect_remote_is_idempotent_and_failed_connects_roll_back(
    cluster: RankServerCluster, loop: str
) -> None:
    async def body() -> None:
        async with (
            SpmdParallelWorkers(cluster.addresses("A")) as a,
            SpmdParallelWorkers(cluster.addresses("B")) as b,
        ):
            md = await a.export_metadata()
            await b.connect_remote("A", md)
            await b.connect_remote("A", list(reversed(md)))  # matched by rank, not position
            assert b.has_remote_metadata("A")
            remotes = [s.remote_instances for s in await b.status()]
            # validation errors import nothing
            with pytest.raises(InvalidArgument, match="1 remote ranks"):
                await b.connect_remote("A", md[:1])
            with pytest.raises(InvalidArgument, match="belongs to instance"):
                await b.connect_remote("Z", md)
            dup = [md[0], md[0]]
            with pytest.raises(InvalidArgument, match="appears twice"):
                await b.connect_remote("A", dup)
            # rank 1 refuses (no address): rank 0 is rolled back, the group keeps "A"
            broken = [spmd_pb2.RankMetadata(), spmd_pb2.RankMetadata()]
            for m, src in zip(broken, md, strict=True):
                m.CopyFrom(src)
            broken[1].address = ""
            with pytest.raises(RankFailures) as info:
                await b.connect_remote("A", broken)
            assert info.value.failed_ranks == [1]
            assert list(info.value.results) == [0]
            assert b.has_remote_metadata("A")
            for r in range(a.worker_count()):  # the source block holds data (test order aside)
                await a.write_blocks(r, Tier.G2, [60], bytes(a.layouts(r)[Tier.G2].bytes_per_block))
            ok = await (await b.execute_remote_onboard_for_instance("A", "G2", [60], "G2", [50]))
            assert sorted(ok.results) == [0, 1]
            # a failed first connect of a new instance leaves nothing behind anywhere
            for m in broken:
                m.instance_id = "Q"
            with pytest.raises(RankFailures):
                await b.connect_remote("Q", broken)
            assert not b.has_remote_metadata("Q")
            assert [s.remote_instances for s in await b.status()] == remotes
            # disconnect forgets everywhere
            await b.disconnect_remote("A")
            assert not b.has_remote_metadata("A")
            assert [s.remote_instances for s in await b.status()] == [n - 1 for n in remotes]

    run(loop, body)


@pytest.mark.parametrize("loop", LOOPS)
def test_remote_offload_into_a_peer_layout(cluster: RankServerCluster, loop: str) -> None:
    async def body() -> None:
        async with (
            SpmdParallelWorkers(cluster.addresses("A")) as a,
            SpmdParallelWorkers(cluster.addresses("B")) as b,
        ):
            src = {r: data_for(r, 4, salt=3) for r in range(2)}
            for r in range(2):
                await a.write_blocks(r, Tier.G2, range(70, 74), src[r])
            await a.connect_remote("B", await b.export_metadata())
            result = await (
                await a.execute_remote_offload(
                    Tier.G2, range(70, 74), RemoteLayout("B", Tier.G3, [33, 31, 35, 37])
                )
            )
            assert {r.path for r in result.results.values()} == {"grpc"}
            for r in range(2):
                got = as_bytes(await b.read_blocks(r, Tier.G3, [33, 31, 35, 37]))
                np.testing.assert_array_equal(got, src[r])
            with pytest.raises(InvalidArgument, match="not unique"):
                await a.execute_remote_offload(Tier.G2, [70, 71], RemoteLayout("B", "G3", [1, 1]))

    run(loop, body)


@pytest.mark.parametrize("loop", LOOPS)
def test_raw_import_metadata(cluster: RankServerCluster, loop: str) -> None:
    async def body() -> None:
        async with (
            SpmdParallelWorkers(cluster.addresses("A")) as a,
            SpmdParallelWorkers(cluster.addresses("B")) as b,
        ):
            md = await a.export_metadata()
            for m in md:
                m.instance_id = f"raw-{loop}"
            before = [s.remote_instances for s in await b.status()]
            assert await b.import_metadata(md) == [False, False]
            assert await b.import_metadata(md) == [True, True]  # replaced, not duplicated
            assert [s.remote_instances for s in await b.status()] == [n + 1 for n in before]
            assert not b.has_remote_metadata(f"raw-{loop}")  # raw import: no group mapping
            with pytest.raises(InvalidArgument, match="1 entries for 2 ranks"):
                await b.import_metadata(md[:1])
            with pytest.raises(RankFailures) as info:
                await b.import_metadata(list(reversed(md)))  # rank i accepts only rank i
            assert info.value.failed_ranks == [0, 1]
            await b.disconnect_remote(f"raw-{loop}")
            assert [s.remote_instances for s in await b.status()] == before

    run(loop, body)


# --------------------------------------------------------------------------- object tier


@pytest.mark.parametrize("loop", LOOPS)
def test_put_has_get_blocks(cluster: RankServerCluster, loop: str) -> None:
    async def body() -> None:
        async with (
            SpmdParallelWorkers(cluster.addresses("A")) as a,
            SpmdParallelWorkers(cluster.addresses("B")) as b,
        ):
            src = {r: data_for(r, 3, salt=4) for r in range(2)}
            for r in range(2):
                await a.write_blocks(r, Tier.G2, range(80, 83), src[r])
            h = fresh_hashes(3)
            put = await a.put_blocks(h[:2], Tier.G2, [80, 81])
            assert [(k.sequence_hash, k.ok, k.already_present) for k in put] == [
                (h[0], True, False),
                (h[1], True, False),
            ]
            assert put[0].rank_status == {0: "stored", 1: "stored"}
            # batch [k1 new, k2 existing, k3 new]
            batch = [fresh_hashes(1)[0], h[0], h[2]]
            out = await a.put_blocks(batch, "G2", [82, 80, 82])
            assert [k.ok for k in out] == [True, True, True]
            assert [k.already_present for k in out] == [False, True, False]
            present = await b.has_blocks([h[0], h[1], h[2], 12345])
            assert [p.present for p in present] == [True, True, True, False]
            assert present[0].size_bytes == 2 * BPB
            got = await b.get_blocks([h[1], h[0]], Tier.G2, [91, 90])
            assert all(k.ok for k in got)
            missing = await b.get_blocks([h[0], 999], Tier.G3, [40, 41])
            assert [k.ok for k in missing] == [True, False]
            assert missing[1].rank_status == {0: "not_found", 1: "not_found"}
            for r in range(2):
                np.testing.assert_array_equal(
                    as_bytes(await b.read_blocks(r, Tier.G2, [90, 91])), src[r][:2]
                )
                np.testing.assert_array_equal(
                    as_bytes(await b.read_blocks(r, Tier.G3, [40])), src[r][:1]
                )
                # the failed key's block is not valid
                with pytest.raises(FailedPrecondition):
                    await b.read_blocks(r, Tier.G3, [41])
            with pytest.raises(InvalidArgument, match="not unique"):
                await a.put_blocks([h[0], h[0]], Tier.G2, [80, 81])
            with pytest.raises(InvalidArgument, match="2 sequence hashes but 1 block ids"):
                await a.get_blocks(h[:2], Tier.G2, [1])

    run(loop, body)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_block_counts_only_if_every_rank_has_its_shard(
    cluster: RankServerCluster, loop: str
) -> None:
    async def body() -> None:
        async with SpmdParallelWorkers(cluster.addresses("A")) as a:
            (h,) = fresh_hashes(1)
            assert await a.client(0).put_object(h, bytes(BPB)) is True
            (presence,) = await a.has_blocks([h])
            assert not presence.present and presence.ranks_present == (0,)
            (got,) = await a.get_blocks([h], Tier.G2, [100])
            assert not got.ok
            assert got.rank_status == {0: "retrieved", 1: "not_found"}
            assert "1/" in got.errors[1]
            with pytest.raises(KeyNotFound):
                await a.client(1).get_object(h)
            assert await a.client(1).put_object(h, bytes(BPB)) is True
            (presence,) = await a.has_blocks([h])
            assert presence.present and presence.ranks_present == (0, 1)

    run(loop, body)


# --------------------------------------------------------------------------- event loops


def test_two_consecutive_runs_and_loop_binding(cluster: RankServerCluster) -> None:
    """Case event-loops.md: no channel is cached across loops."""
    addresses = cluster.addresses("A")
    holder: dict[str, SpmdParallelWorkers] = {}

    async def body() -> int:
        group = await SpmdParallelWorkers.create(addresses)
        holder["g"] = group
        try:
            return len(await group.export_metadata())
        finally:
            await group.close()

    assert asyncio.run(body()) == 2
    assert asyncio.run(body()) == 2
    assert run_event_loop(body(), "uvloop") == 2

    async def reuse_elsewhere() -> None:
        group = SpmdParallelWorkers(addresses)
        await group.open()
        holder["g"] = group
        client = group.client(0)
        await client.open()

    asyncio.run(reuse_elsewhere())

    async def other_loop() -> None:
        with pytest.raises(FailedPrecondition, match="another event loop"):
            await holder["g"].client(0).status()

    asyncio.run(other_loop())


@pytest.mark.timeout(60)
def test_import_creates_no_asyncio_objects_and_uvloop_after_import_works(
    cluster: RankServerCluster,
) -> None:
    code = f"""
import asyncio, sys
import paramserver.spmd, paramserver.spmd.rank_server, paramserver.spmd.group
import paramserver.cli.rank, paramserver.cli.demos.spmd_demo
policy = asyncio.get_event_loop_policy()
assert policy._local._loop is None, "a loop was created at import"
import uvloop
from paramserver.spmd import SpmdParallelWorkers
async def main():
    async with SpmdParallelWorkers({cluster.addresses("B")!r}) as g:
        return g.worker_count()
assert uvloop.run(main()) == 2
assert asyncio.run(main()) == 2
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


# --------------------------------------------------------------------------- CLI


@pytest.mark.timeout(60)
def test_rank_server_cli_ephemeral_port_and_clean_shutdown(tmp_path: Path) -> None:
    port_file = tmp_path / "port"
    env = dict(os.environ, PARAMSERVER_SPMD_HOST_BLOCKS="8")
    proc = ScriptProcess(
        tmp_path,
        "rank-server",
        [
            "-m",
            "paramserver",
            "rank-server",
            "--instance-id",
            "cli",
            "--rank",
            "0",
            "--port",
            "0",
            "--port-file",
            str(port_file),
            "--disk-blocks",
            "4",
            "--disk-dir",
            str(tmp_path / "disk"),
            "--object-dir",
            str(tmp_path / "obj"),
            "--layout",
            "num_layers=1,outer_dim=1,page_size=4,inner_dim=8,dtype=float32",
        ],
        env=env,
    )
    try:
        port = int(wait_for(lambda: port_file.exists() and port_file.read_text(), timeout_s=30))
        assert proc.proc.stdout is not None
        ready = proc.proc.stdout.readline()
        assert f"address=127.0.0.1:{port}" in ready

        async def inspect() -> spmd_pb2.RankMetadata:
            async with RankClient(f"127.0.0.1:{port}", 0) as c:
                return await c.export_metadata()

        md = asyncio.run(inspect())
        specs = {s.tier: s for s in md.layouts}
        assert specs[spmd_pb2.TIER_G2_HOST].num_blocks == 8  # from the environment
        assert specs[spmd_pb2.TIER_G3_DISK].num_blocks == 4  # from the flag
        assert specs[spmd_pb2.TIER_G2_HOST].bytes_per_block == 4 * 8 * 4
        shm = Path("/dev/shm") / specs[spmd_pb2.TIER_G2_HOST].shm_name
        disk_file = Path(specs[spmd_pb2.TIER_G3_DISK].path)
        assert disk_file.exists()
        if Path("/dev/shm").is_dir():
            assert shm.exists()
        proc.signal(signal.SIGTERM)
        assert proc.proc.wait(timeout=20) == 0, proc.stderr()
        assert not shm.exists()
        assert not disk_file.exists()
    finally:
        proc.close()


@pytest.mark.timeout(90)
def test_spmd_demo_command_verifies_every_byte() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "paramserver",
            "--log-level",
            "WARNING",
            "spmd-demo",
            "--blocks",
            "16",
        ],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "every byte matches" in out.stdout
    for path in ("shared memory", "gRPC stream", "object store", "local offload (disk)"):
        assert path in out.stdout
    assert "GB/s" in out.stdout
