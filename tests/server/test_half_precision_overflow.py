"""Half-precision overflow through a real server (issue 19, item 2): refused with
INVALID_ARGUMENT naming the key and the range, never stored as Inf. See docs/robustness.md."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from paramserver.errors import InvalidArgument
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
