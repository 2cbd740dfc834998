"""Embedding tables on real servers (127.0.0.1:0): hybrid consistency, shards, checkpoints,
WAL after SIGKILL, bad input (docs/embedding-tables.md)."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from paramserver.core.tables import (
    EmbeddingTable,
    Initializer,
    TableRule,
    TableSpec,
    shard_of_ids,
)
from paramserver.errors import (
    DTypeMismatch,
    InvalidArgument,
    KeyNotFound,
    TableConflict,
    TableNotFound,
    WaitTimeout,
    WrongShard,
)
from paramserver.worker_client import UpdateRule, connect
from tests.harness import ServerProcess, running_cluster, running_server

pytestmark = pytest.mark.timeout(120)


def _spec(**kw: object) -> TableSpec:
    base: dict[str, object] = {
        "name": "emb",
        "dim": 8,
        "rule": TableRule("adagrad", lr=0.1),
        "initializer": Initializer("normal", 0.1),
        "seed": 11,
    }
    base.update(kw)
    return TableSpec(**base)  # type: ignore[arg-type]


def _batches(n: int, seed: int = 0, dim: int = 8) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ids = (rng.zipf(1.2, 300) % 5000).astype(np.int64)
        out.append((ids, rng.normal(size=(300, dim)).astype(np.float32)))
    return out


async def test_asp_table_beside_bsp_dense_keys() -> None:
    """Server dense keys under BSP; the table under ASP: its pulls never wait, dense pulls do."""
    async with running_server(consistency="bsp", wait_timeout_ms=300) as d:
        async with connect(d.address, "a") as a, connect(d.address, "b") as b:
            await a.init({"w": np.zeros(4, np.float32)}, rule=UpdateRule("sgd", lr=1.0))
            created, _ = await a.init_table(_spec())
            assert created and not (await b.init_table(_spec()))[0]
            await a.push({"w": np.ones(4, np.float32)})
            await a.clock()
            # a is one clock ahead of b: a dense pull by a waits for b (BSP) ...
            with pytest.raises(WaitTimeout):
                await a.pull(["w"], timeout_s=0.3)
            # ... while the asp table answers at once, with the pushes applied on arrival
            ids, g = _batches(1)[0]
            await a.push_rows("emb", ids, g)
            oracle = EmbeddingTable(_spec())
            oracle.push(ids, g, now_s=0.0, clock=0)
            probe = np.arange(0, 5000, 7, dtype=np.int64)
            np.testing.assert_array_equal(await a.pull_rows("emb", probe), oracle.pull(probe))
            await b.push({"w": np.ones(4, np.float32)})
            await b.clock()
            np.testing.assert_array_equal((await a.pull(["w"]))["w"], -np.ones(4, np.float32))
            info = (await a.status()).tables[0]
            assert info.spec.name == "emb" and info.rows == np.unique(ids).shape[0]
            assert info.pushes == 1 and info.rows_pushed == np.unique(ids).shape[0]


async def test_ssp_table_waits_within_its_own_bound() -> None:
    async with running_server(consistency="asp", wait_timeout_ms=300) as d:
        async with connect(d.address, "a") as a, connect(d.address, "b") as b:
            await a.init_table(_spec(consistency="ssp", staleness=1))
            ids = np.arange(5, dtype=np.int64)
            await a.clock()
            await a.pull_rows("emb", ids)  # 1 ahead of b: within s = 1
            await a.clock()
            with pytest.raises(WaitTimeout, match="table 'emb'"):
                await a.pull_rows("emb", ids, timeout_s=0.3)
            await b.clock()
            await a.pull_rows("emb", ids)


@pytest.mark.slow
async def test_one_and_three_shards_give_identical_rows() -> None:
    batches = _batches(6, seed=1)
    results = []
    for shards in (1, 3):
        async with running_cluster(shards, consistency="asp") as daemons:
            async with connect(daemons[0].address, "w") as w:
                await w.init_table(_spec(rule=TableRule("adam", lr=0.05), dtype="bfloat16"))
                for ids, g in batches:
                    await w.push_rows("emb", ids, g)
                probe = np.concatenate([np.arange(5000), [4, 4, 3]]).astype(np.int64)
                results.append(await w.pull_rows("emb", probe))
                if shards == 3:
                    rows = [(await c.status()).tables[0].rows for c in w.shards]  # type: ignore[attr-defined]
                    assert all(r > 0 for r in rows)
                    merged = (await w.status()).tables
                    assert len(merged) == 1 and merged[0].rows == sum(rows)
    assert results[0].tobytes() == results[1].tobytes()


async def test_bad_input_is_invalid_argument_naming_the_table_and_applies_nothing() -> None:
    async with running_server(consistency="asp", table_max_ids=1000) as d:
        async with connect(d.address, "w") as w:
            await w.init_table(_spec(num_embeddings=100))
            ids = np.array([1, 2, 3], np.int64)
            g = np.ones((3, 8), np.float32)
            await w.push_rows("emb", ids, g)
            before = await w.pull_rows("emb", np.arange(100))
            bad = [
                (np.array([1, -1, 2]), g, "negative id -1"),
                (np.array([1, 2, 100]), g, "out of range [0, 100)"),
                (ids, np.ones((3, 4), np.float32), "dim"),
                (ids, np.ones((3, 8), np.float16), "float32"),
                (ids, np.array([[np.nan] * 8] * 3, np.float32), "NaN/Inf"),
                (ids, np.array([[np.inf] * 8] * 3, np.float32), "NaN/Inf"),
                (np.zeros(1001, np.int64), np.ones((1001, 8), np.float32), "limit of 1000"),
            ]
            for bad_ids, bad_g, needle in bad:
                with pytest.raises(InvalidArgument) as err:
                    await w.push_rows("emb", bad_ids, bad_g)
                assert "table 'emb'" in str(err.value) and needle in str(err.value), err.value
            for bad_ids, needle in [(np.array([-5]), "negative"), (np.arange(1001), "limit")]:
                with pytest.raises(InvalidArgument, match=needle):
                    await w.pull_rows("emb", bad_ids)
            with pytest.raises(TableNotFound, match="table 'nope'"):
                await w.pull_rows("nope", ids)
            after = await w.pull_rows("emb", np.arange(100))
            assert after.tobytes() == before.tobytes()
            await w.push_rows("emb", ids, g)  # still serving
            assert (await w.status()).tables[0].pushes == 2


@pytest.mark.parametrize("session", [True, False])
async def test_table_refusals_reach_the_client_as_their_classes(session: bool) -> None:
    """Over the Session and over the PullRows/PushRows streams alike."""
    async with running_server(consistency="asp") as d:
        async with connect(d.address, "w", session=session) as w:
            await w.init_table(_spec(dtype="float16"))
            ids = np.array([1, 2], np.int64)
            with pytest.raises(TableNotFound, match="table 'nope'") as missing:
                await w.pull_rows("nope", ids)
            assert isinstance(missing.value, KeyNotFound)  # still NOT_FOUND's class
            with pytest.raises(TableNotFound, match="table 'nope'"):
                await w.push_rows("nope", ids, np.ones((2, 8), np.float32))
            with pytest.raises(TableConflict, match="table 'emb'"):
                await w.init_table(_spec(dim=4))
            with pytest.raises(DTypeMismatch) as wrong:
                await w.push_rows("emb", ids, np.ones((2, 8), ml_dtypes.bfloat16))
            text = str(wrong.value)
            assert "table 'emb'" in text and "bfloat16" in text and "float32 or float16" in text
            assert (await w.status()).tables[0].pushes == 0


async def test_ids_from_2_63_are_refused_by_the_client_as_the_caller_gave_them() -> None:
    """Ids are int64 >= 0 on the wire: a uint64 id >= 2**63 would wrap to a negative one,
    which the server would name instead of the id the caller sent."""
    async with running_server(consistency="asp") as d:
        async with connect(d.address, "w") as w:
            await w.init_table(_spec())
            big = np.array([3, 2**63 + 5], np.uint64)
            grads = np.ones((2, 8), np.float32)
            for call in (w.pull_rows("emb", big), w.push_rows("emb", big, grads)):
                with pytest.raises(InvalidArgument) as err:
                    await call
                assert "id 9223372036854775813 (position 1)" in str(err.value), err.value
            for ids in ([1, 2**63], [1, 2**64], (-1, 2**63)):
                with pytest.raises(InvalidArgument, match=f"id {ids[1]} "):
                    await w.pull_rows("emb", ids)
            info = (await w.status()).tables[0]
            assert info.pulls == 0 and info.pushes == 0  # nothing was sent
            top = np.array([2**63 - 1], np.uint64)  # the largest id still goes through
            assert (await w.pull_rows("emb", top)).shape == (1, 8)


async def test_a_shard_refuses_ids_it_does_not_own_and_the_sharded_client_sends_none(
    tmp_path: Path,
) -> None:
    spec = _spec(rule=TableRule("sgd", lr=1.0))
    ids = np.arange(600, dtype=np.int64)
    grads = np.random.default_rng(9).normal(size=(600, 8)).astype(np.float32)
    owner = shard_of_ids("emb", ids, 3)
    wal = [{"wal": True, "checkpoint_dir": str(tmp_path / f"shard-{i}")} for i in range(3)]
    async with running_cluster(3, consistency="asp", per_shard=wal) as daemons:
        async with connect(daemons[0].address, "routed") as w:  # splits by shard
            await w.init_table(spec)
            await w.push_rows("emb", ids, grads)
            routed = await w.pull_rows("emb", ids)
            rows = [(await c.status()).tables[0].rows for c in w.shards]  # type: ignore[attr-defined]
        assert rows == [int(np.count_nonzero(owner == s)) for s in range(3)]
        oracle = EmbeddingTable(spec)
        oracle.push(ids, grads, now_s=0.0, clock=0)
        assert routed.tobytes() == oracle.pull(ids).tobytes()
        async with connect(daemons[1].address, "direct", discover=False) as direct:
            logged = (await direct.status()).wal_sequence
            assert logged >= 2  # its init_table and the routed push
            foreign = int(ids[owner != 1][0])
            with pytest.raises(WrongShard) as err:
                await direct.push_rows("emb", ids, grads)
            text = str(err.value)
            assert f"id {foreign} " in text and "index 1 of 3" in text and "'emb'" in text
            with pytest.raises(WrongShard, match="index 1 of 3"):
                await direct.pull_rows("emb", ids)
            mine = ids[owner == 1]
            assert (await direct.pull_rows("emb", mine)).tobytes() == routed[owner == 1].tobytes()
            status = await direct.status()
            assert status.tables[0].pushes == 1  # the refused push: nothing applied ...
            assert status.wal_sequence == logged  # ... nor logged


async def test_checkpoint_restore_round_trips_rows_bit_exactly(tmp_path: Path) -> None:
    spec = _spec(rule=TableRule("adam", lr=0.05), dtype="float16", min_pushes=2)
    probe = np.arange(5000, dtype=np.int64)
    async with running_server(consistency="asp", checkpoint_dir=str(tmp_path)) as d:
        async with connect(d.address, "w") as w:
            await w.init_table(spec)
            for ids, g in _batches(4, seed=2):
                await w.push_rows("emb", ids, g)
            want = await w.pull_rows("emb", probe)
            await d.request_checkpoint()
    async with running_server(consistency="asp", checkpoint_dir=str(tmp_path)) as d:
        async with connect(d.address, "w2") as w:
            assert (await w.pull_rows("emb", probe)).tobytes() == want.tobytes()
            # optimizer state and filter counts came back too: the same next push agrees
            ids, g = _batches(1, seed=3)[0]
            await w.push_rows("emb", ids, g)
            got = await w.pull_rows("emb", probe)
    oracle = EmbeddingTable(spec)
    for ids, g in [*_batches(4, seed=2), *_batches(1, seed=3)]:
        oracle.push(ids, g, now_s=0.0, clock=0)
    assert got.tobytes() == oracle.pull(probe).tobytes()


@pytest.mark.slow
async def test_sigkill_loses_no_acknowledged_row_push(tmp_path: Path) -> None:
    """WAL on: every acknowledged row push survives a SIGKILL (replayed on restart)."""
    spec = _spec(rule=TableRule("rowwise_adagrad", lr=0.1), min_pushes=2)
    batches = _batches(8, seed=4)
    args = ("--consistency", "asp", "--checkpoint-dir", str(tmp_path / "ck"), "--wal")
    server = ServerProcess(tmp_path, *args)
    try:
        async with connect(server.address, "w", auto_reregister=False) as w:
            await w.init_table(spec)
            for ids, g in batches[:3]:
                await w.push_rows("emb", ids, g)
            for ids, g in batches[3:]:
                await w.push_rows("emb", ids, g)  # acknowledged: durable
            server.stop(signal.SIGKILL)
    finally:
        server.stop(signal.SIGKILL)
    server = ServerProcess(tmp_path, *args)
    try:
        async with connect(server.address, "reader") as r:
            probe = np.arange(5000, dtype=np.int64)
            got = await asyncio.wait_for(r.pull_rows("emb", probe, observer=True), 30)
    finally:
        server.stop()
    oracle = EmbeddingTable(spec)
    for ids, g in batches:
        oracle.push(ids, g, now_s=0.0, clock=0)
    assert got.tobytes() == oracle.pull(probe).tobytes()


def test_sync_facade_rows() -> None:
    from paramserver.worker_client import TableSpec, connect_sync

    async def main() -> None:
        async with running_server(consistency="asp") as d:

            def blocking() -> np.ndarray:
                with connect_sync(d.address, "s") as ps:
                    ps.init_table(
                        TableSpec(
                            "t", 3, rule=TableRule("sgd", lr=1.0), initializer=Initializer("zeros")
                        )
                    )
                    ps.push_rows("t", [5, 5, 1], np.ones((3, 3), np.float32))
                    return ps.pull_rows("t", [1, 5, 9])

            got = await asyncio.to_thread(blocking)
            np.testing.assert_array_equal(got, [[-1] * 3, [-2] * 3, [0] * 3])

    asyncio.run(main())


@pytest.mark.slow
async def test_sigkill_replays_bsp_row_steps_and_clocks(tmp_path: Path) -> None:
    """A bsp table under WAL: queued row pushes and the clocks that close their steps replay to
    the same rows (two workers, mean over them), including a step still open at the kill."""
    spec = _spec(name="sync", rule=TableRule("sgd", lr=0.5), consistency="bsp")
    args = ("--consistency", "asp", "--checkpoint-dir", str(tmp_path / "ck"), "--wal")
    b = _batches(4, seed=6)
    server = ServerProcess(tmp_path, *args)
    try:
        async with (
            connect(server.address, "a", auto_reregister=False, heartbeat=False) as a,
            connect(server.address, "b", auto_reregister=False, heartbeat=False) as w,
        ):
            await a.init_table(spec)
            for step in range(2):  # two closed steps
                await a.push_rows("sync", *b[2 * step])
                await w.push_rows("sync", *b[2 * step + 1])
                await a.clock()
                await w.clock()
            await a.push_rows("sync", *b[0])  # step 2: open (acknowledged, queued)
            before = await a.pull_rows("sync", np.arange(5000), observer=True)
            server.stop(signal.SIGKILL)
    finally:
        server.stop(signal.SIGKILL)
    server = ServerProcess(tmp_path, *args)
    try:
        async with connect(server.address, "reader") as r:
            probe = np.arange(5000, dtype=np.int64)
            got = await r.pull_rows("sync", probe, observer=True)
            info = (await r.status()).tables[0]
    finally:
        server.stop()
    oracle = EmbeddingTable(spec)
    for step in range(2):
        ids = np.concatenate([b[2 * step][0], b[2 * step + 1][0]])
        g = np.concatenate([b[2 * step][1], b[2 * step + 1][1]])
        u, s = coalesce_sum(ids, g)
        oracle.apply_coalesced(u, s / np.float32(2), now_s=0.0, clock=step)
    assert got.tobytes() == before.tobytes()  # bit for bit what was acknowledged
    np.testing.assert_allclose(got, oracle.pull(probe), rtol=1e-5, atol=1e-6)
    assert info.queued_pushes == 1


def coalesce_sum(ids: np.ndarray, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-id sums in float64 then float32 (an independent reference of the server's sum)."""
    u, inv = np.unique(ids, return_inverse=True)
    out = np.zeros((u.shape[0], g.shape[1]), np.float64)
    np.add.at(out, inv, g.astype(np.float64))
    return u, out.astype(np.float32)


async def test_rows_over_the_session_and_shared_memory_match_the_streams() -> None:
    """Large row calls ride the Session (shared memory, local link), small ones inline; both
    give the same bits as the plain PullRows/PushRows streams."""
    rng = np.random.default_rng(8)
    big_ids = rng.integers(0, 100_000, 20_000).astype(np.int64)
    big_g = rng.normal(size=(20_000, 32)).astype(np.float32)
    small_ids = np.array([3, 3, 9], np.int64)
    small_g = np.ones((3, 32), np.float32)
    got = {}
    async with running_server(consistency="asp") as d:
        for session in (True, False):
            name = f"t{int(session)}"
            async with connect(d.address, f"w{name}", session=session) as ps:
                await ps.init_table(_spec(name=name, dim=32, rule=TableRule("adam", lr=0.01)))
                for ids, g in ((big_ids, big_g), (small_ids, small_g), (big_ids, big_g)):
                    await ps.push_rows(name, ids, g)
                    await ps.pull_rows(name, ids)
                got[session] = await ps.pull_rows(name, np.arange(100_000))
                if session and ps.fastpath is not None and ps.fastpath.shared_memory:
                    assert ps.fastpath.offers_accepted >= 1  # the big calls used the segment
    assert got[True].tobytes() == got[False].tobytes()


async def test_a_first_large_row_pull_through_shared_memory_returns_the_rows_asked_for() -> None:
    """A fresh client's first row pull whose ids go through shared memory and whose rows do not
    fit its pull region yet: the client grows the segment and asks again, with the caller's ids
    (not the new segment's zeros). Checked against the plain PullRows stream."""
    ids = np.arange(1, 20_001, dtype=np.int64)[::-1].copy()  # 160 KB of ids, 2.56 MB of rows
    async with running_server(consistency="asp") as d:
        async with connect(d.address, "w0") as ps:
            await ps.init_table(_spec(dim=32))
            got = await ps.pull_rows("emb", ids)
            assert ps.fastpath is not None and ps.fastpath.shm_active
        async with connect(d.address, "w1", session=False) as plain:
            want = await plain.pull_rows("emb", ids)
    assert got.shape == (20_000, 32) and got.tobytes() == want.tobytes()
