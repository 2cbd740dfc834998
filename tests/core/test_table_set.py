"""Per-table consistency, BSP row aggregation, row-push dedup and table state round trips
(docs/embedding-tables.md)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from paramserver.core.consistency import ClusterState, Consistency
from paramserver.core.shard import ServerCore
from paramserver.core.table_set import TableSet
from paramserver.core.tables import (
    EmbeddingTable,
    Initializer,
    TableRule,
    TableSpec,
    initial_rows,
    shard_of_ids,
)
from paramserver.errors import (
    AlreadyExists,
    DimensionMismatch,
    KeyNotFound,
    StaleUpdate,
    TableConflict,
    TableNotFound,
)
from paramserver.server.checkpoint import CheckpointManager
from paramserver.server.config import ServerConfig
from paramserver.server.reshard import reshard


def _cluster(*names: str) -> tuple[ClusterState, list[str]]:
    c = ClusterState(consistency=Consistency.BSP, lease_s=100.0)
    return c, [c.register(n, 0.0)[0].worker_id for n in names]


def _spec(name: str, consistency: str, staleness: int = 0) -> TableSpec:
    return TableSpec(
        name,
        2,
        rule=TableRule("sgd", lr=1.0),
        initializer=Initializer("zeros"),
        consistency=consistency,
        staleness=staleness,
    )


def test_each_table_has_its_own_bound() -> None:
    c, (a, b) = _cluster("a", "b")
    ts = TableSet()
    for spec in (_spec("fast", "asp"), _spec("ssp2", "ssp", 2), _spec("sync", "bsp")):
        assert ts.init(spec)[0]
    for _ in range(3):
        c.clock(a, c.workers[a].clock)
    # a is at clock 3, b at 0
    assert ts.check_pull(c, a, "fast").admitted
    adm = ts.check_pull(c, a, "ssp2")
    assert not adm.admitted and adm.waiting_for == ("b",) and "table 'ssp2'" in adm.reason
    assert not ts.check_pull(c, a, "sync").admitted
    c.clock(b, 0)
    assert ts.check_pull(c, a, "ssp2").admitted and not ts.check_pull(c, a, "sync").admitted


def test_bsp_rows_are_the_mean_over_workers_applied_when_the_step_closes() -> None:
    c, (a, b) = _cluster("a", "b")
    ts = TableSet()
    ts.init(_spec("t", "bsp"))
    ids = np.array([1, 1, 2], np.int64)
    ga = np.array([[1, 1], [2, 2], [4, 4]], np.float32)
    gb = np.array([[8, 8]], np.float32)
    out = ts.commit(ts.prepare(c, a, 1, 0, "t", ids, ga), now_s=0.0)
    assert out.queued
    ts.commit(ts.prepare(c, b, 1, 0, "t", np.array([2], np.int64), gb), now_s=0.0)
    assert ts.close_steps(c.min_clock(), 2) == 0  # step 0 still open
    np.testing.assert_array_equal(ts.get("t").pull(np.array([1, 2], np.int64)), 0)
    c.clock(a, 0)
    c.clock(b, 0)
    assert ts.close_steps(c.min_clock(), 2) == 1
    # sum over the step / 2 live workers, then sgd lr 1
    np.testing.assert_array_equal(
        ts.get("t").pull(np.array([1, 2], np.int64)), [[-1.5, -1.5], [-6, -6]]
    )
    with pytest.raises(StaleUpdate, match="closed"):
        ts.prepare(c, a, 2, 0, "t", ids, ga)


def test_retried_row_push_applies_once_per_registration() -> None:
    c, (a,) = _cluster("a")
    ts = TableSet()
    ts.init(_spec("t", "asp"))
    ids, g = np.array([3], np.int64), np.ones((1, 2), np.float32)
    assert not ts.commit(ts.prepare(c, a, 7, 0, "t", ids, g), now_s=0.0).duplicate
    assert ts.commit(ts.prepare(c, a, 7, 0, "t", ids, g), now_s=0.0).duplicate
    np.testing.assert_array_equal(ts.get("t").pull(ids), [[-1, -1]])
    # a new registration of the same name starts its request ids afresh
    c.leave(a)
    a2 = c.register("a", 0.0)[0].worker_id
    assert not ts.commit(ts.prepare(c, a2, 7, 0, "t", ids, g), now_s=0.0).duplicate
    np.testing.assert_array_equal(ts.get("t").pull(ids), [[-2, -2]])


def test_declaration_errors() -> None:
    ts = TableSet()
    assert ts.init(_spec("t", "asp")) == (True, _spec("t", "asp"))
    assert ts.init(_spec("t", "asp"))[0] is False
    with pytest.raises(TableConflict, match="table 't'") as conflict:
        ts.init(_spec("t", "bsp"))
    assert isinstance(conflict.value, AlreadyExists)  # ALREADY_EXISTS, as KeyConflict
    with pytest.raises(TableNotFound, match="table 'nope'") as missing:
        ts.get("nope")
    assert isinstance(missing.value, KeyNotFound)  # NOT_FOUND: callers of KeyNotFound catch it


def test_a_queued_bsp_push_answers_its_distinct_count() -> None:
    c, (a, _) = _cluster("a", "b")
    ts = TableSet()
    ts.init(_spec("t", "bsp"))
    ids = np.array([5, 1, 5, 9, 1, 1], np.int64)
    out = ts.commit(ts.prepare(c, a, 1, 0, "t", ids, np.ones((6, 2), np.float32)), now_s=0.0)
    assert out.queued and not out.duplicate
    assert (out.result.distinct, out.result.applied, out.result.filtered) == (3, 0, 0)
    again = ts.commit(ts.prepare(c, a, 1, 0, "t", ids, np.ones((6, 2), np.float32)), now_s=0.0)
    assert again.duplicate and again.queued and again.result.distinct == 3


@pytest.mark.parametrize("consistency", ["asp", "bsp"])
def test_a_push_of_no_ids_is_checked_then_changes_nothing(consistency: str) -> None:
    c, (a,) = _cluster("a")
    ts = TableSet()
    ts.init(_spec("t", consistency))
    empty_ids, empty_g = np.zeros(0, np.int64), np.zeros((0, 2), np.float32)
    out = ts.commit(ts.prepare(c, a, 1, 0, "t", empty_ids, empty_g), now_s=0.0)
    assert (out.duplicate, out.queued, out.result.distinct, out.result.applied) == (
        False,
        False,
        0,
        0,
    )
    stats = ts.stats["t"]
    assert stats.queued_pushes() == 0 and ts.get("t").pushes == 0 and ts.get("t").n == 0
    # not remembered: the request id still applies a real push once
    ids, g = np.array([4], np.int64), np.ones((1, 2), np.float32)
    assert not ts.commit(ts.prepare(c, a, 1, 0, "t", ids, g), now_s=0.0).duplicate
    # still checked: another dim, or a clock ahead of the worker's
    with pytest.raises(DimensionMismatch):
        ts.prepare(c, a, 2, 0, "t", empty_ids, np.zeros((0, 3), np.float32))
    with pytest.raises(StaleUpdate):
        ts.prepare(c, a, 3, 5, "t", empty_ids, empty_g)


def test_state_round_trip_with_queued_steps() -> None:
    c, (a, b) = _cluster("a", "b")
    ts = TableSet()
    ts.init(TableSpec("u", 3, "float16", TableRule("adagrad"), Initializer("normal", 0.3), 5))
    ts.init(_spec("q", "bsp"))
    rng = np.random.default_rng(0)
    for rid in range(3):
        ids = rng.integers(0, 50, 16).astype(np.int64)
        ts.commit(
            ts.prepare(c, a, rid, 0, "u", ids, rng.normal(size=(16, 3)).astype(np.float32)),
            now_s=0.0,
        )
    ts.commit(
        ts.prepare(c, a, 10, 0, "q", np.array([4], np.int64), np.ones((1, 2), np.float32)),
        now_s=0.0,
    )
    arrays, manifest = ts.state()
    other = TableSet()
    other.restore(arrays, manifest)
    probe = np.arange(60, dtype=np.int64)
    assert other.get("u").pull(probe).tobytes() == ts.get("u").pull(probe).tobytes()
    assert other.commit(
        other.prepare(c, a, 1, 0, "u", probe[:1], np.ones((1, 3), np.float32)), now_s=0.0
    ).duplicate
    c.clock(a, 0)
    c.clock(b, 0)
    for s in (ts, other):
        s.close_steps(c.min_clock(), 2)
    np.testing.assert_array_equal(other.get("q").pull(np.array([4], np.int64)), [[-0.5, -0.5]])
    # untouched rows of u equal their initial rows
    fresh = np.array([59], np.int64)
    if 59 not in arrays["table/u/ids"]:
        want = initial_rows(5, fresh, 3, Initializer("normal", 0.3)).astype(np.float16)
        assert other.get("u").pull(fresh).tobytes() == want.tobytes()


def test_reshard_3_to_2_moves_rows_bit_exactly(tmp_path: Path) -> None:
    """Checkpoints of 3 shards resharded to 2 (real files): every row, its optimizer state and
    filter count lands on hash64(table, id) mod 2, equal to a one-table oracle."""
    spec = TableSpec(
        "t", 4, "bfloat16", TableRule("adam", lr=0.05), Initializer("normal", 0.2), 3, min_pushes=2
    )
    oracle = EmbeddingTable(spec)
    cores = []
    for i in range(3):
        core = ServerCore(
            ServerConfig(consistency="asp", shard_index=i, shard_addresses="a:1,b:2,c:3")
        )
        core.tables.init(spec)
        cores.append(core)
    rng = np.random.default_rng(7)
    for _ in range(5):
        ids = rng.integers(0, 400, 128).astype(np.int64)
        g = rng.normal(size=(128, 4)).astype(np.float32)
        oracle.push(ids, g, now_s=0.0, clock=0)
        where = shard_of_ids("t", ids, 3)
        for i, core in enumerate(cores):
            core.tables.get("t").push(ids[where == i], g[where == i], now_s=0.0, clock=0)
    dirs = []
    for i, core in enumerate(cores):
        d = tmp_path / f"old/shard-{i}"
        CheckpointManager(d).save(core)
        dirs.append(d)
    reshard(dirs, 2, tmp_path / "new", allow_inexact=True)
    probe = np.arange(400, dtype=np.int64)
    got = np.empty((400, 4), oracle.spec.np_dtype)
    where = shard_of_ids("t", probe, 2)
    new_cores = []
    for i in range(2):
        core = ServerCore(ServerConfig(consistency="asp", shard_index=i, shard_addresses="a:1,b:2"))
        assert CheckpointManager(tmp_path / f"new/shard-{i}").restore_latest(core) is not None
        got[where == i] = core.tables.get("t").pull(probe[where == i])
        new_cores.append(core)
    assert got.tobytes() == oracle.pull(probe).tobytes()
    # optimizer state and filter counts moved too: one more push agrees bit for bit
    g = np.ones((400, 4), np.float32)
    oracle.push(probe, g, now_s=0.0, clock=0)
    for i, core in enumerate(new_cores):
        core.tables.get("t").push(probe[where == i], g[where == i], now_s=0.0, clock=0)
        got[where == i] = core.tables.get("t").pull(probe[where == i])
    assert got.tobytes() == oracle.pull(probe).tobytes()


def test_table_metrics_series() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from paramserver.server.engine import ServerEngine
    from paramserver.server.observability.table_metrics import TableCollector

    engine = ServerEngine(ServerConfig(consistency="asp"))
    engine.core.tables.init(TableSpec("clicks", 2, min_pushes=2))
    engine.core.tables.get("clicks").push(
        np.array([1, 2, 2], np.int64), np.ones((3, 2), np.float32), now_s=0.0, clock=0
    )
    reg = CollectorRegistry()
    reg.register(TableCollector(engine))
    text = generate_latest(reg).decode()
    assert 'paramserver_table_filtered_total{shard="0",table="clicks"} 2.0' in text
    assert 'paramserver_table_rows{shard="0",table="clicks"} 0.0' in text
