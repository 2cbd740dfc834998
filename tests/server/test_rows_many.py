"""Several tables in one request per shard (PullRowsMany / PushRowsMany) on real servers
(127.0.0.1:0): the same rows as one table at a time, all-or-nothing pushes, retries applied
once, one WAL record per table that replays after a restart (docs/embedding-tables.md)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from paramserver.core.tables import EmbeddingTable, Initializer, TableRule, TableSpec
from paramserver.errors import InvalidArgument, NonFiniteGradient, TableNotFound
from paramserver.worker_client import KeyedIds, connect, connect_sync
from tests.harness import running_cluster, running_server

pytestmark = pytest.mark.timeout(120)

SPECS = [
    TableSpec("users", 8, rule=TableRule("sgd", lr=0.5), initializer=Initializer("normal", 0.1)),
    TableSpec("items", 4, rule=TableRule("adagrad", lr=0.1), seed=3),
    TableSpec("genres", 2, rule=TableRule("sgd", lr=1.0), dtype="float16", seed=5),
]


def _batch(seed: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    ids = {s.name: (rng.zipf(1.3, 200) % 1000).astype(np.int64) for s in SPECS}
    grads = {
        s.name: rng.normal(size=(200, s.dim)).astype(np.float32) * np.float32(0.01) for s in SPECS
    }
    return ids, grads


def _oracles() -> dict[str, EmbeddingTable]:
    return {s.name: EmbeddingTable(s) for s in SPECS}


@pytest.mark.parametrize("shards", [1, 3])
async def test_many_tables_equal_single_process_tables(shards: int) -> None:
    probe = np.arange(1000, dtype=np.int64)
    async with running_cluster(shards, consistency="asp") as daemons:
        async with connect(daemons[0].address, "w") as w:
            for s in SPECS:
                await w.init_table(s)
            oracles = _oracles()
            for step in range(3):
                ids, grads = _batch(step)
                before = await w.pull_rows_many(ids)
                for name, o in oracles.items():
                    assert before[name].tobytes() == o.pull(ids[name]).tobytes()
                acks = await w.push_rows_many(ids, grads)
                for name, o in oracles.items():
                    o.push(ids[name], grads[name], now_s=0.0, clock=0)
                    assert acks[name].distinct == np.unique(ids[name]).shape[0]
            got = await w.pull_rows_many({s.name: probe for s in SPECS})
            # one table at a time gives the same bits
            for s in SPECS:
                assert got[s.name].tobytes() == oracles[s.name].pull(probe).tobytes()
                assert got[s.name].dtype == s.np_dtype
                assert (await w.pull_rows(s.name, probe)).tobytes() == got[s.name].tobytes()
            # no ids at all still answers each table's (0, dim) of its dtype
            empty = await w.pull_rows_many({s.name: [] for s in SPECS})
            assert {k: v.shape for k, v in empty.items()} == {s.name: (0, s.dim) for s in SPECS}


async def test_keyed_ids_are_taken_as_tables() -> None:
    kj = KeyedIds.from_lists({"users": [[1, 2], [2]], "items": [[], [7, 7, 9]]})
    assert kj.stride == 2
    assert kj.ids_of("items").tolist() == [7, 7, 9]
    assert kj.offsets_of("users").tolist() == [0, 2, 3]
    async with running_server(consistency="asp") as d:
        async with connect(d.address, "w") as w:
            for s in SPECS[:2]:
                await w.init_table(s)
            got = await w.pull_rows_many(kj)
    oracles = _oracles()
    assert got["users"].tobytes() == oracles["users"].pull(np.array([1, 2, 2])).tobytes()
    assert got["items"].tobytes() == oracles["items"].pull(np.array([7, 7, 9])).tobytes()


async def test_a_refused_table_refuses_the_whole_push_and_logs_nothing(tmp_path: Path) -> None:
    async with running_server(consistency="asp", wal=True, checkpoint_dir=str(tmp_path)) as d:
        async with connect(d.address, "w") as w:
            for s in SPECS:
                await w.init_table(s)
            ids, grads = _batch(1)
            logged = (await w.status()).wal_sequence
            bad = dict(grads)
            bad["genres"] = bad["genres"].copy()
            bad["genres"][5, 1] = np.nan
            with pytest.raises(NonFiniteGradient, match="genres"):
                await w.push_rows_many(ids, bad)
            with pytest.raises(TableNotFound, match="nope"):
                await w.push_rows_many({**ids, "nope": [1]}, {**grads, "nope": np.ones((1, 2))})
            with pytest.raises(InvalidArgument, match="must match"):
                await w.push_rows_many(ids, {"users": grads["users"]})
            status = await w.status()
            assert status.wal_sequence == logged  # nothing logged ...
            assert all(t.pushes == 0 and t.rows == 0 for t in status.tables)  # ... or applied
            got = await w.pull_rows_many(ids)
    for name, o in _oracles().items():
        assert got[name].tobytes() == o.pull(ids[name]).tobytes()


async def test_retry_is_applied_once_and_wal_replays_every_table(tmp_path: Path) -> None:
    probe = np.arange(1000, dtype=np.int64)
    config = {"consistency": "asp", "wal": True, "checkpoint_dir": str(tmp_path)}
    async with running_server(**config) as d:
        async with connect(d.address, "w", discover=False) as w:
            for s in SPECS:
                await w.init_table(s)
            ids, grads = _batch(2)
            logged = (await w.status()).wal_sequence
            api = w._api  # the single-shard WorkerClient: resend with the same request ids
            base = api._next_request_id
            first = await api._push_rows_many_as(ids, grads, base, None)
            again = await api._push_rows_many_as(ids, grads, base, None)
            assert not any(a.duplicate for a in first.values())
            assert all(a.duplicate for a in again.values())
            assert (await w.status()).wal_sequence == logged + len(SPECS)  # one per table
    oracles = _oracles()
    for name, o in oracles.items():
        o.push(ids[name], grads[name], now_s=0.0, clock=0)
    async with running_server(**config) as d:  # replays the log
        async with connect(d.address, "r") as r:
            got = await r.pull_rows_many({s.name: probe for s in SPECS}, observer=True)
    for name, o in oracles.items():
        assert got[name].tobytes() == o.pull(probe).tobytes()


def test_sync_client_many() -> None:
    async def main() -> None:
        async with running_cluster(2, consistency="asp") as daemons:

            def blocking() -> dict[str, np.ndarray]:
                with connect_sync(daemons[0].address, "s") as ps:
                    for s in SPECS[:2]:
                        ps.init_table(s)
                    ids = {"users": [5, 5, 1], "items": [2]}
                    grads = {
                        "users": np.ones((3, 8), np.float32),
                        "items": np.ones((1, 4), np.float32),
                    }
                    ps.push_rows_many(ids, grads)
                    return ps.pull_rows_many({"users": [1, 5, 9], "items": [2]})

            got = await asyncio.to_thread(blocking)
            o = _oracles()
            o["users"].push(np.array([5, 5, 1]), np.ones((3, 8), np.float32), now_s=0.0, clock=0)
            o["items"].push(np.array([2]), np.ones((1, 4), np.float32), now_s=0.0, clock=0)
            assert got["users"].tobytes() == o["users"].pull(np.array([1, 5, 9])).tobytes()
            assert got["items"].tobytes() == o["items"].pull(np.array([2])).tobytes()

    asyncio.run(main())
