"""Half-precision overflow through a real server (issue 19, item 2): refused with
INVALID_ARGUMENT naming the key and the range, never stored as Inf. See docs/robustness.md."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import numpy as np
import pytest

from paramserver.core.tables import Initializer, TableRule, TableSpec
from paramserver.errors import InvalidArgument, ValueOutOfRange
from paramserver.worker_client import UpdateRule, connect
from tests.harness import running_server

pytestmark = pytest.mark.timeout(60)


async def test_asp_add_overflowing_float16_is_invalid_argument_and_nothing_applied() -> None:
    async with running_server(consistency="asp") as srv:
        async with connect(srv.address, "w0") as ps:
            await ps.init({"h": np.full(4, 60000, np.float16)}, rule=UpdateRule("add"))
            await ps.init({"k": np.zeros(2, np.float16)}, rule=UpdateRule("add"))
            with pytest.raises(InvalidArgument, match=r"'h'.*float16 \[-65504, 65504\]") as info:
                await ps.push({"k": np.ones(2, np.float16), "h": np.full(4, 10000, np.float16)})
            cause = info.value.__cause__
            assert isinstance(cause, grpc.aio.AioRpcError)
            assert cause.code() == grpc.StatusCode.INVALID_ARGUMENT
            got = await ps.pull(["h", "k"])
            np.testing.assert_array_equal(got["h"], np.full(4, 60000, np.float16))
            np.testing.assert_array_equal(got["k"], np.zeros(2, np.float16))
            await ps.push({"h": np.full(4, 1000, np.float16)})  # in range: applied
            np.testing.assert_array_equal(
                (await ps.pull(["h"]))["h"], np.full(4, 61000, np.float16)
            )


async def test_bsp_sum_aggregate_overflowing_float16_drops_that_key_for_the_step() -> None:
    """Two workers each push 40000 (finite float16); the float32 sum 80000 does not fit: the
    key keeps its value for that step and the drop is counted, the other key is applied, and the
    next step applies normally."""
    async with running_server(consistency="bsp", aggregation="sum") as srv:
        a, b = connect(srv.address, "a"), connect(srv.address, "b")
        await a.open()
        await b.open()
        try:
            await a.init(
                {"h": np.zeros(2, np.float16), "f": np.zeros(2, np.float32)},
                rule=UpdateRule("add"),
            )
            await b.init(
                {"h": np.zeros(2, np.float16), "f": np.zeros(2, np.float32)},
                rule=UpdateRule("add"),
            )

            async def step(ps: object, h: float, f: float) -> None:
                assert isinstance(ps, type(a))
                await ps.pull(["h", "f"])
                await ps.push({"h": np.full(2, h, np.float16), "f": np.full(2, f, np.float32)})
                await ps.clock()

            await asyncio.gather(step(a, 40000, 1), step(b, 40000, 2))
            got = await a.pull(["h", "f"])
            np.testing.assert_array_equal(got["h"], np.zeros(2, np.float16))
            np.testing.assert_array_equal(got["f"], np.full(2, 3, np.float32))
            assert srv.engine is not None
            assert srv.engine.core.rejected_aggregates == 1
            assert srv.engine.obs.dropped_by_reason["out_of_range"] == 1
            await asyncio.gather(step(a, 100, 1), step(b, 200, 1))
            got = await b.pull(["h", "f"])
            np.testing.assert_array_equal(got["h"], np.full(2, 300, np.float16))
            np.testing.assert_array_equal(got["f"], np.full(2, 5, np.float32))
        finally:
            await a.close()
            await b.close()


async def test_a_row_push_overflowing_a_half_table_is_refused_and_never_logged(
    tmp_path: Path,
) -> None:
    """float16 and bfloat16 tables (sgd, lr 1, zero rows): id 5 is pushed to the dtype's largest
    value; then a push whose id 5 would pass it (65504 + 32 for float16), and one whose new id 9
    would, are refused as INVALID_ARGUMENT (ValueOutOfRange) naming the table, the id and the
    column. Every row pulled before and after is bit for bit the same, the table's counters do
    not move, the WAL holds no record of them, and a restart replays to the same rows."""
    config = {"consistency": "asp", "wal": True, "wal_dir": tmp_path / "wal"}
    probe = np.arange(12, dtype=np.int64)
    # name: (dtype, its largest value, a step past it from there, a value past it from 0)
    dtypes = {
        "h": ("float16", 65504.0, 32.0, 70000.0),
        "b": ("bfloat16", 3.3895313892515355e38, 2e36, 3.4e38),
    }
    async with running_server(**config) as d:
        async with connect(d.address, "w") as w:
            for name, (dtype, top, _, _) in dtypes.items():
                spec = TableSpec(name, 4, dtype, TableRule("sgd", lr=1.0), Initializer("zeros"))
                await w.init_table(spec)
                await w.push_rows(name, [5], np.full((1, 4), -top, np.float32))
            before = {name: await w.pull_rows(name, probe) for name in dtypes}
            status_before = [(t.pushes, t.rows_pushed, t.rows) for t in (await w.status()).tables]
            for name, (dtype, top, step, beyond) in dtypes.items():
                np.testing.assert_array_equal(before[name][5].astype(np.float32), top)
                over = np.zeros((2, 4), np.float32)
                over[0] = 1.0  # id 3: in range
                over[1, 2] = -step  # id 5, column 2: past the largest value
                fresh = np.zeros((2, 4), np.float32)
                fresh[1, 0] = -beyond  # id 9 (no row yet), column 0
                refusals = [([3, 5], over, "id 5 column 2"), ([3, 9], fresh, "id 9 column 0")]
                for ids, grads, where in refusals:
                    with pytest.raises(ValueOutOfRange) as info:
                        await w.push_rows(name, ids, grads)
                    message = str(info.value)
                    assert f"table {name!r}" in message and where in message, message
                    assert f"outside the range of {dtype}" in message
                    cause = info.value.__cause__
                    assert isinstance(cause, grpc.aio.AioRpcError)
                    assert cause.code() == grpc.StatusCode.INVALID_ARGUMENT
            for name in dtypes:
                after = await w.pull_rows(name, probe)
                assert after.tobytes() == before[name].tobytes()
            status_after = [(t.pushes, t.rows_pushed, t.rows) for t in (await w.status()).tables]
            assert status_after == status_before
        assert d.engine is not None and d.engine.wal is not None
        pushes = [r.push_rows.table for r in d.engine.wal.replay() if r.HasField("push_rows")]
        assert pushes == ["h", "b"]  # the two accepted pushes only
    async with running_server(**config) as d:
        async with connect(d.address, "r") as r:
            for name in dtypes:
                got = await r.pull_rows(name, probe, observer=True)
                assert got.tobytes() == before[name].tobytes()
