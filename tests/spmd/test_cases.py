"""The SPMD cases of shared/cases/ with real rank-server processes on 127.0.0.1.

Instances started once for the module (all at once, so they boot in parallel):

* ``S``: 2 ranks, healthy (onboard slots, concurrent object puts).
* ``F``: 4 ranks; rank 2 runs with the TEST-ONLY fault ``disk_write_error``.
* ``H``: 4 ranks; rank 1 runs with the TEST-ONLY fault ``hang_commands``.
* ``K``: 2 ranks; rank 1 runs with the TEST-ONLY fault ``io_delay_ms=150`` (slow copies),
  killed with SIGKILL mid-transfer and respawned; ``J``: 2 ranks connected to ``K``.

Faults are injected through ``PARAMSERVER_SPMD_FAULTS`` (see :mod:`paramserver.spmd.faults`).
Every async body runs under the default asyncio loop and under uvloop.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from paramserver.cli.demos.rank_launcher import RankServerCluster, async_wait_for
from paramserver.cli.rank import run_event_loop
from paramserver.errors import FailedPrecondition, InvalidArgument, KeyNotFound
from paramserver.spmd import (
    ObjectKeys,
    SpmdParallelWorkers,
    Tier,
    TransferFailed,
    content_hash,
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
FAULTS = "PARAMSERVER_SPMD_FAULTS"


def run(loop: str, body: Callable[[], Awaitable[Any]]) -> Any:
    return run_event_loop(body(), loop)


def pattern(rank: int, block: int, salt: int) -> np.ndarray:
    rng = np.random.default_rng([rank, block, salt])
    return rng.integers(0, 256, size=BPB, dtype=np.uint8)


def as_bytes(arr: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(arr).view(np.uint8).reshape(arr.shape[0], -1)


def fresh_hashes(n: int) -> list[int]:
    tokens = np.arange(n * LAYOUT.page_size, dtype=np.int64)
    return sequence_hashes(tokens, LAYOUT.page_size, parent_hash=random.getrandbits(64))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RankServerCluster]:
    base = tmp_path_factory.mktemp("spmd-cases")
    c = RankServerCluster(base, layout=LAYOUT, host_blocks=64, disk_blocks=32)
    try:
        c.spawn_instance("S", 2)
        c.spawn_instance("F", 4, env_per_rank={2: {FAULTS: "disk_write_error"}})
        c.spawn_instance("H", 4, env_per_rank={1: {FAULTS: "hang_commands"}})
        c.spawn_instance("K", 2, env_per_rank={1: {FAULTS: "io_delay_ms=150"}})
        c.spawn_instance("J", 2)
        c.wait_ready(timeout_s=scaled(90))
        yield c
    finally:
        c.stop()


# --------------------------------------------------------------------------- destination slots


@pytest.mark.parametrize("loop", LOOPS)
def test_onboarded_blocks_land_exactly_in_the_slots_asked_for(
    cluster: RankServerCluster, loop: str
) -> None:
    """Case onboard-destination-slots.md."""

    async def body() -> None:
        async with SpmdParallelWorkers(cluster.addresses("S")) as s:
            x = {r: np.stack([pattern(r, k, 1) for k in range(3)]) for r in range(2)}
            sentinel = np.full((3, BPB), 0xA5, dtype=np.uint8)
            for r in range(2):
                await s.write_blocks(r, Tier.G2, [0, 1, 2], x[r])
            h = fresh_hashes(3)
            await (await s.execute_remote_offload(Tier.G2, [0, 1, 2], ObjectKeys(h)))
            for r in range(2):
                await s.write_blocks(r, Tier.G2, [10, 11, 12], sentinel)
            result = await (await s.execute_remote_onboard(ObjectKeys(h[:2]), Tier.G2, [10, 11]))
            for r in range(2):
                got = as_bytes(await s.read_blocks(r, Tier.G2, [10, 11, 12]))
                assert got[0].tobytes() == x[r][0].tobytes()
                assert got[1].tobytes() == x[r][1].tobytes()
                assert got[2].tobytes() == sentinel[0].tobytes()
                placements = result.results[r].placements
                assert [(p.src, p.dst) for p in placements] == [(h[0], 10), (h[1], 11)]
                assert all(p.src_is_object and not p.dst_is_object for p in placements)
            before = [(st.commands_completed, st.commands_failed) for st in await s.status()]
            with pytest.raises(InvalidArgument) as info:
                await s.execute_remote_onboard(ObjectKeys(h), Tier.G2, [10, 11])
            assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "3 sequence hashes but 2 block ids" in info.value.message
            # nothing written, and no rank even received the command
            after = [(st.commands_completed, st.commands_failed) for st in await s.status()]
            assert after == before
            for r in range(2):
                got = as_bytes(await s.read_blocks(r, Tier.G2, [10, 11, 12]))
                assert got[0].tobytes() == x[r][0].tobytes()
                assert got[2].tobytes() == sentinel[0].tobytes()

    run(loop, body)


# --------------------------------------------------------------------------- failed / idle rank


@pytest.mark.parametrize("loop", LOOPS)
def test_failed_rank_is_named_promptly_with_the_other_ranks_results(
    cluster: RankServerCluster, loop: str
) -> None:
    """Case spmd-failed-or-idle-rank.md: rank 2's disk write fails."""

    async def body() -> None:
        async with SpmdParallelWorkers(cluster.addresses("F"), default_timeout_s=10) as f:
            for r in range(4):
                await f.write_blocks(
                    r, Tier.G2, range(8), np.stack([pattern(r, k, 2) for k in range(8)])
                )
            t0 = time.monotonic()
            note = await f.execute_local_transfer(Tier.G2, Tier.G3, range(8), range(8))
            with pytest.raises(TransferFailed) as info:
                await note
            elapsed = time.monotonic() - t0
            assert elapsed < 3.0  # "within ~1 s", measured generously (shared, loaded machine)
            err = info.value
            assert err.failed_ranks == [2]
            assert "rank 2" in err.failures[2].message
            assert "injected disk write error" in err.failures[2].message
            assert sorted(err.results) == [0, 1, 3]
            for r in (0, 1, 3):
                assert len(err.results[r].placements) == 8
                assert err.results[r].bytes_moved == 8 * BPB
            assert "rank 2" in str(err)
            with pytest.raises(TransferFailed):
                note.poll()
            assert note.failure is err
            # the failed rank's destination blocks are not valid; the others' are
            with pytest.raises(FailedPrecondition, match="hold no valid data"):
                await f.read_blocks(2, Tier.G3, [0])
            ok = as_bytes(await f.read_blocks(3, Tier.G3, [7]))
            assert ok[0].tobytes() == pattern(3, 7, 2).tobytes()

    run(loop, body)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_rank_with_no_blocks_still_reports_an_empty_completion(
    cluster: RankServerCluster, loop: str
) -> None:
    """Case spmd-failed-or-idle-rank.md: a command that gives rank 3 no blocks."""

    async def body() -> None:
        async with SpmdParallelWorkers(cluster.addresses("F")) as f:
            for r in range(3):
                await f.write_blocks(r, Tier.G2, [0, 1], np.zeros((2, BPB), np.uint8))
            ids = {r: [0, 1] for r in range(3)}
            dst = {r: [20, 21] for r in range(3)}
            result = await (await f.execute_local_transfer(Tier.G2, Tier.G2, ids, dst))
            assert sorted(result.results) == [0, 1, 2, 3]
            assert result.results[3].placements == ()
            assert result.results[3].bytes_moved == 0
            assert result.bytes_moved == 3 * 2 * BPB

    run(loop, body)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_hanging_rank_times_out_is_cancelled_and_hands_out_nothing(
    cluster: RankServerCluster, loop: str
) -> None:
    """Case spmd-failed-or-idle-rank.md: rank 1's handler hangs; the 2 s deadline fires."""

    async def body() -> None:
        async with SpmdParallelWorkers(cluster.addresses("H")) as h:
            for r in range(4):
                await h.write_blocks(
                    r, Tier.G2, range(8), np.stack([pattern(r, k, 3) for k in range(8)])
                )
            baseline = [s.inflight_commands for s in await h.status()]
            t0 = time.monotonic()
            note = await h.execute_local_transfer(
                Tier.G2, Tier.G3, range(8), range(8), timeout_s=2.0
            )
            assert note.poll() is None  # pollable while rank 1 hangs
            with pytest.raises(TransferFailed) as info:
                await note
            elapsed = time.monotonic() - t0
            assert 1.5 <= elapsed < 5.0
            err = info.value
            assert err.failed_ranks == [1]
            assert err.failures[1].code == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "rank 1" in err.failures[1].message
            assert err.code == grpc.StatusCode.DEADLINE_EXCEEDED
            assert sorted(err.results) == [0, 2, 3]

            async def back_to_baseline() -> bool:
                status = await h.client(1).status()
                return status.inflight_commands == baseline[1]

            await async_wait_for(back_to_baseline, timeout_s=5, what="rank 1 in-flight count")
            with pytest.raises(FailedPrecondition, match="hold no valid data"):
                await h.read_blocks(1, Tier.G3, [0])
            got = as_bytes(await h.read_blocks(0, Tier.G3, [0]))
            assert got[0].tobytes() == pattern(0, 0, 3).tobytes()

    run(loop, body)


@pytest.mark.parametrize("loop", LOOPS)
def test_offload_complete_means_another_client_can_get_every_byte(
    cluster: RankServerCluster, loop: str
) -> None:
    """Case spmd-failed-or-idle-rank.md: as soon as an offload reports complete, a get of those
    hashes from another client returns all bytes."""

    async def body() -> None:
        async with SpmdParallelWorkers(cluster.addresses("F")) as f:
            src = {r: np.stack([pattern(r, k, 4) for k in range(8)]) for r in range(4)}
            for r in range(4):
                await f.write_blocks(r, Tier.G2, range(30, 38), src[r])
            h = fresh_hashes(8)
            await (await f.execute_remote_offload(Tier.G2, range(30, 38), ObjectKeys(h)))
            async with SpmdParallelWorkers(cluster.addresses("F")) as other:
                for r in range(4):
                    for k in range(8):
                        data = await other.client(r).get_object(h[k])
                        assert data == src[r][k].tobytes()
                got = await other.get_blocks(h, Tier.G2, range(40, 48))
                assert all(k.ok for k in got)
                for r in range(4):
                    arr = as_bytes(await other.read_blocks(r, Tier.G2, range(40, 48)))
                    np.testing.assert_array_equal(arr, src[r])

    run(loop, body)


# --------------------------------------------------------------------------- killed rank


async def _fill(group: SpmdParallelWorkers, ids: list[int], salt: int) -> dict[int, np.ndarray]:
    src = {r: np.stack([pattern(r, k, salt) for k in range(len(ids))]) for r in range(2)}
    for r in range(2):
        await group.write_blocks(r, Tier.G2, ids, src[r])
    return src


@pytest.mark.timeout(60)
@pytest.mark.parametrize("loop", LOOPS)
def test_slow_copy_past_its_deadline_is_cancelled_mid_way(
    cluster: RankServerCluster, loop: str
) -> None:
    """Rank 1 is really copying (150 ms per block) when its 0.6 s deadline fires."""

    async def body() -> None:
        async with SpmdParallelWorkers(cluster.addresses("K")) as k:
            src_ids = [0, 2, 4, 6, 8, 10, 12, 14]  # one run per block -> one delay per block
            await _fill(k, src_ids, 5)
            note = await k.execute_local_transfer(
                Tier.G2, Tier.G3, src_ids, [1, 3, 5, 7, 9, 11, 13, 15], timeout_s=0.6
            )
            with pytest.raises(TransferFailed) as info:
                await note
            assert info.value.failed_ranks == [1]
            assert info.value.failures[1].code == grpc.StatusCode.DEADLINE_EXCEEDED
            assert list(info.value.results) == [0]

            async def idle() -> bool:
                return (await k.client(1).status()).inflight_commands == 0

            await async_wait_for(idle, timeout_s=5, what="rank 1 to stop the copy")
            with pytest.raises(FailedPrecondition):
                await k.read_blocks(1, Tier.G3, [1])
            with pytest.raises(FailedPrecondition):
                await k.read_blocks(1, Tier.G3, [15])

    run(loop, body)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("loop", LOOPS)
def test_rank_killed_mid_transfer_and_reconnect_replaces_the_stale_mapping(
    cluster: RankServerCluster, loop: str
) -> None:
    """A rank server SIGKILLed mid-transfer: the merged completion fails within the deadline,
    naming that rank, with the other rank's result. After a restart, connect_remote replaces
    the stale mapping of the instance."""

    async def body() -> None:
        async with (
            SpmdParallelWorkers(cluster.addresses("K")) as k,
            SpmdParallelWorkers(cluster.addresses("J")) as j,
        ):
            src_ids = [20, 22, 24, 26, 28, 30, 32, 34]
            src = await _fill(k, src_ids, 6)
            await j.connect_remote("K", await k.export_metadata())
            before = await (
                await j.execute_remote_onboard_for_instance("K", "G2", src_ids, "G2", range(8))
            )
            assert sorted(before.results) == [0, 1]

            deadline_s = 10.0
            t0 = time.monotonic()
            note = await k.execute_local_transfer(
                Tier.G2, Tier.G3, src_ids, [21, 23, 25, 27, 29, 31, 0, 2], timeout_s=deadline_s
            )

            async def copying() -> bool:
                return (await k.client(1).status()).inflight_commands >= 1

            await async_wait_for(copying, timeout_s=5, what="rank 1 to start copying")
            victim = cluster.process("K", 1)
            victim.kill()
            with pytest.raises(TransferFailed) as info:
                await note
            assert time.monotonic() - t0 < deadline_s
            err = info.value
            assert err.failed_ranks == [1]
            assert "rank 1" in err.failures[1].message
            assert err.failures[1].code == grpc.StatusCode.UNAVAILABLE
            assert sorted(err.results) == [0]
            assert len(err.results[0].placements) == 8

            # J's mapping of K is stale for rank 1 now: its onboard fails there, by name
            with pytest.raises(TransferFailed) as stale:
                await (
                    await j.execute_remote_onboard_for_instance(
                        "K", "G2", src_ids, "G2", range(8, 16), timeout_s=5
                    )
                )
            assert stale.value.failed_ranks == [1]

        # restart rank 1 of K; re-connecting replaces the old mapping
        new = cluster.spawn("K", 1, env={FAULTS: "io_delay_ms=150"})
        await asyncio.to_thread(cluster.wait_ready, [new], 30.0)
        async with (
            SpmdParallelWorkers(cluster.addresses("K")) as k2,
            SpmdParallelWorkers(cluster.addresses("J")) as j2,
        ):
            src = await _fill(k2, src_ids, 7)
            await j2.connect_remote("K", await k2.export_metadata())
            await (
                await j2.execute_remote_onboard_for_instance(
                    "K", "G2", src_ids, "G2", range(16, 24)
                )
            )
            for r in range(2):
                got = as_bytes(await j2.read_blocks(r, Tier.G2, range(16, 24)))
                np.testing.assert_array_equal(got, src[r])

    run(loop, body)


# --------------------------------------------------------------------------- concurrent puts


@pytest.mark.timeout(120)
@pytest.mark.parametrize("loop", LOOPS)
def test_concurrent_puts_of_one_64_mib_object(cluster: RankServerCluster, loop: str) -> None:
    """Case concurrent-object-puts.md: eight clients put (key, V) at once in 1 MiB chunks while
    a poller calls has/get every 5 ms."""
    value = np.random.default_rng().integers(0, 256, 64 << 20, dtype=np.uint8).tobytes()
    key = content_hash(value)
    digest = hashlib.blake2b(value).digest()
    address = cluster.addresses("S")[0]

    async def body() -> None:
        writers = [RankClient(address, 0) for _ in range(8)]
        poller = RankClient(address, 0)
        for c in [*writers, poller]:
            await c.open()
        try:
            history: list[bool] = []
            gets_ok = 0
            done = asyncio.Event()

            async def poll() -> None:
                nonlocal gets_ok
                while not done.is_set():
                    present = (await poller.has_objects([key]))[key] is not None
                    history.append(present)
                    try:
                        data = await poller.get_object(key)
                    except KeyNotFound:
                        assert not present or not history[-1]
                    else:
                        assert len(data) == len(value)
                        assert hashlib.blake2b(data).digest() == digest
                        gets_ok += 1
                    await asyncio.sleep(0.005)

            poll_task = asyncio.create_task(poll())
            results = await asyncio.gather(*(w.put_object(key, value) for w in writers))
            # a few more polls after every writer returned
            seen = len(history)
            await async_wait_for(
                lambda: asyncio.sleep(0, len(history) >= seen + 3), timeout_s=10, what="polls"
            )
            done.set()
            await poll_task
            assert sorted(results) == [False] * 7 + [True]  # one stored, seven already present
            assert history[0] is False  # polled before any writer could commit 64 MiB
            first = history.index(True)
            assert all(history[first:]), "presence went back to false"
            assert gets_ok >= 3
            assert (await poller.status()).object_writes_in_progress == 0
        finally:
            for c in [*writers, poller]:
                await c.close()

    run(loop, body)


@pytest.mark.parametrize("loop", LOOPS)
def test_put_batch_stores_new_keys_and_reports_existing_ones(
    cluster: RankServerCluster, loop: str
) -> None:
    """Case concurrent-object-puts.md: batch [k1 new, k2 existing, k3 new] succeeds."""

    async def body() -> None:
        async with SpmdParallelWorkers(cluster.addresses("S")) as s:
            for r in range(2):
                await s.write_blocks(
                    r, Tier.G2, [50, 51, 52], np.stack([pattern(r, i, 8) for i in range(3)])
                )
            k1, k2, k3 = fresh_hashes(3)
            (pre,) = await s.put_blocks([k2], Tier.G2, [51])
            assert pre.ok and not pre.already_present
            out = await s.put_blocks([k1, k2, k3], Tier.G2, [50, 51, 52])
            assert [o.sequence_hash for o in out] == [k1, k2, k3]
            assert all(o.ok for o in out)
            assert [o.rank_status[0] for o in out] == ["stored", "already_present", "stored"]
            assert [p.present for p in await s.has_blocks([k1, k2, k3])] == [True] * 3

    run(loop, body)


WRITER = """
import asyncio, sys
from paramserver.api.v1 import spmd_pb2
from paramserver.spmd.rank_client import RankClient

async def main(address, key):
    async with RankClient(address, 0) as c:
        async def requests():
            yield spmd_pb2.PutObjectRequest(header=spmd_pb2.PutObjectHeader(
                sequence_hash=key, size_bytes=64 << 20, timeout_ms=60000))
            for i in range(16):
                yield spmd_pb2.PutObjectRequest(chunk=spmd_pb2.DataChunk(
                    offset_bytes=i << 20, data=bytes([i]) * (1 << 20)))
            print("sent", flush=True)
            await asyncio.Event().wait()
        await c.stub.PutObject(requests())

asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("loop", LOOPS)
def test_a_writer_killed_mid_stream_leaves_nothing_visible(
    cluster: RankServerCluster, loop: str, tmp_path: Path
) -> None:
    """Case concurrent-object-puts.md: a writer killed mid-stream leaves nothing visible."""
    address = cluster.addresses("S")[0]
    key = random.getrandbits(64)

    async def body() -> None:
        async with RankClient(address, 0) as c:
            with ScriptProcess(tmp_path, "writer", ["-c", WRITER, address, str(key)]) as writer:
                assert (await writer.readline(timeout_s=30)).strip() == "sent", writer.stderr()

                async def writing() -> bool:
                    return (await c.status()).object_writes_in_progress >= 1

                await async_wait_for(writing, timeout_s=10, what="the write to start")
                assert (await c.has_objects([key]))[key] is None
                await asyncio.to_thread(writer.kill)

            async def aborted() -> bool:
                return (await c.status()).object_writes_in_progress == 0

            await async_wait_for(aborted, timeout_s=10, what="the write to be aborted")
            assert (await c.has_objects([key]))[key] is None
            with pytest.raises(KeyNotFound):
                await c.get_object(key)
        temp = cluster.object_dir / ".tmp"
        assert list(temp.glob("*.part")) == []

    run(loop, body)
