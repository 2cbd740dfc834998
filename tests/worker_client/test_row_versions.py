"""Per-row versions and version-validated pulls (HET's per-embedding clocks) on real servers
(127.0.0.1:0): what a cached worker sees under the bound, against a numpy oracle, on one shard
and two; versions rebuilt by checkpoint restore and WAL replay after SIGKILL."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import numpy as np
import pytest

from paramserver.core.tables import Initializer, TableRule, TableSpec
from paramserver.worker_client import connect
from paramserver.worker_client.row_cache import RowCache
from tests.harness import ServerProcess, running_cluster, running_server

pytestmark = pytest.mark.timeout(120)

N_IDS, DIM = 24, 3


def _sgd_zeros() -> TableSpec:
    # lr 1, zeros, integer gradients: every row is a sum of small integers, exact in float32,
    # so the oracle below is exact whatever the order of additions.
    return TableSpec("emb", DIM, rule=TableRule("sgd", lr=1.0), initializer=Initializer("zeros"))


@pytest.mark.parametrize("shards", [1, 2])
@pytest.mark.parametrize("s", [1, 2])
async def test_cached_reads_lack_at_most_s_pushes_of_other_workers(shards: int, s: int) -> None:
    """Worker A reads through a RowCache (bound s) and pushes (deferred, flushed within s
    clocks, applied to its copies); worker B pushes directly. The oracle keeps, per id, A's
    flushed sum and B's pushes in order: every row A reads must be ``-(A's flushed sum) -
    (the sum of B's first k pushes)`` for some k with ``nB - s <= k <= nB``; and rows are
    served from the cache (not re-sent) while that holds."""
    rng = np.random.default_rng(11 + s + 10 * shards)
    a_flushed = np.zeros((N_IDS, DIM), np.float64)
    a_pending: list[tuple[np.ndarray, np.ndarray]] = []
    b_pushes: list[list[np.ndarray]] = [[] for _ in range(N_IDS)]
    async with running_cluster(shards, consistency="asp") as daemons:
        async with connect(daemons[0].address, "a") as a, connect(daemons[0].address, "b") as b:
            await a.init_table(_sgd_zeros())
            cache = RowCache(a, staleness=s)
            for _clock in range(14):
                # B pushes to a random subset (one push: +1 version of each distinct id)
                ids_b = rng.choice(N_IDS, size=8, replace=False).astype(np.int64)
                g_b = rng.integers(1, 4, size=(8, DIM)).astype(np.float32)
                await b.push_rows("emb", ids_b, g_b)
                for i, g in zip(ids_b, g_b, strict=True):
                    b_pushes[i].append(g.astype(np.float64))
                # A reads a random batch (duplicates allowed) and checks the bound
                ids_a = rng.integers(0, N_IDS, size=12).astype(np.int64)
                rows = await cache.pull_rows("emb", ids_a)
                for i, row in zip(ids_a, rows, strict=True):
                    n_b = len(b_pushes[i])
                    prefixes = [
                        -(a_flushed[i] + sum(b_pushes[i][:k], np.zeros(DIM)))
                        for k in range(max(0, n_b - s), n_b + 1)
                    ]
                    assert any(np.array_equal(row, p.astype(np.float32)) for p in prefixes), (
                        f"id {i}: {row} lacks more than {s} of B's pushes"
                    )
                # A pushes through the cache (deferred); the oracle flushes as the cache does
                g_a = rng.integers(1, 4, size=(12, DIM)).astype(np.float32)
                await cache.push_rows("emb", ids_a, g_a)
                a_pending.append((ids_a, g_a))
                flushes = cache.stats.flushes
                await cache.clock()
                await b.clock()
                if cache.stats.flushes > flushes:
                    for ids, g in a_pending:
                        np.add.at(a_flushed, ids, g.astype(np.float64))
                    a_pending.clear()
            await cache.flush()
            for ids, g in a_pending:
                np.add.at(a_flushed, ids, g.astype(np.float64))
            final = await b.pull_rows("emb", np.arange(N_IDS), observer=True)
    want = -(a_flushed + np.array([sum(p, np.zeros(DIM)) for p in b_pushes]))
    np.testing.assert_array_equal(final, want.astype(np.float32))
    st = cache.stats
    assert st.rows_hit > 0 and st.rows_hit + st.rows_pulled == st.rows_requested


def _planned_versions(batches: list[np.ndarray], n: int) -> np.ndarray:
    """A row's version: the pushes that held its id (a push counts once per distinct id)."""
    out = np.zeros(n, np.int64)
    for ids in batches:
        out[np.unique(ids)] += 1
    return out


async def _versions(w: object, probe: np.ndarray, held: np.ndarray) -> object:
    got = await w.pull_rows_validated(  # type: ignore[attr-defined]
        {"emb": probe}, {"emb": held}, max_version_lag=0
    )
    return got["emb"]


def _ones(ids: np.ndarray) -> np.ndarray:
    return np.ones((ids.shape[0], 4), np.float32)


SPEC = TableSpec("emb", 4, rule=TableRule("adagrad", lr=0.1), seed=3)


async def test_versions_survive_checkpoint_restore(tmp_path: Path) -> None:
    """Versions are checkpointed with the rows: after a restore every row's version is its
    planned push count; the restored shard has a new version epoch, so a version held from
    before is re-sent once (same row, same version), then validated."""
    rng = np.random.default_rng(7)
    batches = [rng.integers(0, 50, size=30).astype(np.int64) for _ in range(4)]
    probe = np.arange(60, dtype=np.int64)
    none = np.full(60, -1, np.int64)
    async with running_server(consistency="asp", checkpoint_dir=str(tmp_path)) as d:
        async with connect(d.address, "w") as w:
            await w.init_table(SPEC)
            for ids in batches:
                await w.push_rows("emb", ids, _ones(ids))
            before = await _versions(w, probe, none)
            await d.checkpoint()
    want = _planned_versions(batches, 60)
    np.testing.assert_array_equal(before.versions, want)  # type: ignore[attr-defined]
    async with running_server(consistency="asp", checkpoint_dir=str(tmp_path)) as d:
        async with connect(d.address, "w2") as w:
            after = await _versions(w, probe, want)
            again = await _versions(w, probe, want)
    assert after.resent.all() and after.epoch_changed  # type: ignore[attr-defined]
    np.testing.assert_array_equal(after.versions, want)  # type: ignore[attr-defined]
    assert after.rows.tobytes() == before.rows.tobytes()  # type: ignore[attr-defined]
    assert not again.resent.any() and again.rows.shape == (0, 4)  # type: ignore[attr-defined]


@pytest.mark.slow
async def test_versions_are_rebuilt_by_wal_replay_after_sigkill(tmp_path: Path) -> None:
    """WAL on, SIGKILL, restart: replaying the logged pushes rebuilds every version."""
    rng = np.random.default_rng(8)
    batches = [rng.integers(0, 50, size=30).astype(np.int64) for _ in range(5)]
    probe = np.arange(60, dtype=np.int64)
    args = ("--consistency", "asp", "--checkpoint-dir", str(tmp_path / "ck"), "--wal")
    server = ServerProcess(tmp_path, *args)
    try:
        async with connect(server.address, "w", auto_reregister=False) as w:
            await w.init_table(SPEC)
            for ids in batches:
                await w.push_rows("emb", ids, _ones(ids))  # acknowledged: durable
            server.stop(signal.SIGKILL)
    finally:
        server.stop(signal.SIGKILL)
    server = ServerProcess(tmp_path, *args)
    try:
        async with connect(server.address, "w2") as w:
            got = await asyncio.wait_for(_versions(w, probe, np.full(60, -1, np.int64)), 30)
    finally:
        server.stop()
    np.testing.assert_array_equal(got.versions, _planned_versions(batches, 60))  # type: ignore[attr-defined]
