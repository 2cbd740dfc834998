"""The worker-side row cache (HET's bounded staleness) on a real server (127.0.0.1:0): exact
at s = 0, reads and deferred pushes within the bound for s >= 1 (worker_client.row_cache)."""

from __future__ import annotations

import numpy as np
import pytest

from paramserver.core.tables import Initializer, TableRule, TableSpec, initial_rows
from paramserver.errors import InvalidArgument
from paramserver.worker_client import connect
from paramserver.worker_client.row_cache import RowCache
from tests.harness import running_server

pytestmark = pytest.mark.timeout(120)

INIT = Initializer("normal", 0.1)


def _spec(rule: TableRule) -> TableSpec:
    return TableSpec("emb", 4, rule=rule, initializer=INIT, seed=7)


async def _train(ps: object, cache: RowCache | None, steps: int) -> np.ndarray:
    """Zipf ids; gradient = rows - target (so every step depends on what was read)."""
    rng = np.random.default_rng(5)
    reader = cache if cache is not None else ps
    for _ in range(steps):
        ids = ((rng.zipf(1.2, 64) - 1) % 200).astype(np.int64)
        rows = await reader.pull_rows_many({"emb": ids})  # type: ignore[attr-defined]
        grads = rows["emb"] - np.float32(1.0)
        await reader.push_rows_many({"emb": ids}, {"emb": grads})  # type: ignore[attr-defined]
        await reader.clock()  # type: ignore[attr-defined]
    return await ps.pull_rows("emb", np.arange(200))  # type: ignore[attr-defined,no-any-return]


async def test_staleness_zero_is_bit_for_bit_no_cache() -> None:
    rule = TableRule("adagrad", lr=0.3)
    async with running_server(consistency="asp") as d:
        async with connect(d.address, "plain") as ps:
            await ps.init_table(_spec(rule))
            want = await _train(ps, None, 12)
    async with running_server(consistency="asp") as d:
        async with connect(d.address, "cached") as ps:
            await ps.init_table(_spec(rule))
            cache = RowCache(ps, staleness=0)
            got = await _train(ps, cache, 12)
    assert got.tobytes() == want.tobytes()
    assert cache.stats.rows_hit == 0 and cache.stats.rows_pulled == cache.stats.rows_requested


async def test_reads_and_deferred_pushes_stay_within_the_bound() -> None:
    """sgd lr 0.5, gradient 1.0 on id 3 every clock, s = 2, one worker: the gradients of
    clocks 0..2 reach the server at the clock ending 2 and are applied to the cached copy
    (its version advanced with the server's), so every read after the first is validated,
    not re-sent, and equals the server's row."""
    s, lr = 2, 0.5
    init = initial_rows(7, np.array([3]), 4, INIT)[0]
    async with running_server(consistency="asp") as d:
        async with connect(d.address, "w") as ps, connect(d.address, "obs") as obs:
            await ps.init_table(_spec(TableRule("sgd", lr=lr)))
            cache = RowCache(ps, staleness=s)
            one = np.ones((1, 4), np.float32)
            for clock in range(6):
                row = (await cache.pull_rows("emb", [3]))[0]
                pushed_clocks = 0 if clock <= s else 3  # the flush at the end of clock 2
                want = init - np.float32(lr) * np.float32(pushed_clocks)
                np.testing.assert_array_equal(row, want.astype(np.float32))
                await cache.push_rows("emb", [3], one)
                server = (await obs.pull_rows("emb", [3], observer=True))[0]
                np.testing.assert_array_equal(server, want.astype(np.float32))  # deferred
                await cache.clock()
            server = (await obs.pull_rows("emb", [3], observer=True))[0]
    # clocks 0..2 flushed at the end of 2, clocks 3..5 at the end of 5
    np.testing.assert_allclose(server, init - np.float32(lr * 6), rtol=1e-6)
    assert cache.stats.rows_pulled == 1 and cache.stats.rows_hit == 5
    assert cache.stats.rows_validated == 5
    assert cache.stats.flushes == 2 and cache.stats.hit_rate == pytest.approx(5 / 6)


async def test_other_workers_updates_show_within_s_clocks() -> None:
    """Another worker pushes to id 9 every clock; a cached read at clock c returns the server's
    row as it was at some clock >= c - s (observed independently by a plain reader)."""
    s = 1
    async with running_server(consistency="asp") as d:
        async with connect(d.address, "a") as a, connect(d.address, "b") as b:
            await a.init_table(_spec(TableRule("sgd", lr=1.0)))
            cache = RowCache(a, staleness=s)
            seen: list[np.ndarray] = []
            for clock in range(6):
                seen.append((await b.pull_rows("emb", [9]))[0].copy())
                row = (await cache.pull_rows("emb", [9]))[0]
                assert any(np.array_equal(row, v) for v in seen[max(0, clock - s) :])
                await b.push_rows("emb", [9], np.ones((1, 4), np.float32))
                await b.clock()
                await cache.clock()


def test_negative_staleness_is_refused() -> None:
    with pytest.raises(InvalidArgument):
        RowCache(object(), staleness=-1)


@pytest.mark.parametrize("kind", ["sgd", "adagrad"])
async def test_a_flushed_row_stays_cached(kind: str) -> None:
    """s = 2: a gradient of id 5 at clock 0 makes the clock ending 2 flush everything,
    id 3's gradient of clock 1 too. id 3 (pulled at clock 1) stays cached through clock 3:
    an sgd table's copy holds the flushed update (init - lr * g, the server's row), another
    rule's copy is the row as pulled. Before: the flush dropped it and clock 3 pulled it."""
    lr = 0.5
    init = initial_rows(7, np.array([3]), 4, INIT)[0]
    g = np.full((1, 4), 0.25, np.float32)
    async with running_server(consistency="asp") as d:
        async with connect(d.address, "w") as ps, connect(d.address, "obs") as obs:
            await ps.init_table(_spec(TableRule(kind, lr=lr)))
            cache = RowCache(ps, staleness=2)
            await cache.push_rows("emb", [5], g)  # clock 0: the oldest deferred gradient
            await cache.clock()
            np.testing.assert_array_equal((await cache.pull_rows("emb", [3]))[0], init)
            await cache.push_rows("emb", [3], g)  # clock 1
            await cache.clock()
            np.testing.assert_array_equal((await cache.pull_rows("emb", [3]))[0], init)
            await cache.clock()  # ends clock 2: flushes clocks 0 and 1
            assert cache.stats.flushes == 1
            row = (await cache.pull_rows("emb", [3]))[0]  # clock 3: 3 - 1 <= 2, cached
            server = (await obs.pull_rows("emb", [3], observer=True))[0]
    assert cache.stats.rows_pulled == 1 and cache.stats.rows_hit == 2
    if kind == "sgd":
        want = (init.astype(np.float32) - np.float32(lr) * g[0]).astype(np.float32)
        np.testing.assert_array_equal(row, want)
        np.testing.assert_array_equal(server, want)
    else:
        np.testing.assert_array_equal(row, init)
        assert not np.array_equal(server, init)
