"""A successor that replaces a lost worker and pushes again the batch its predecessor pushed
but never clocked (it died between the two) has that push answered as a duplicate: applied
once, on every shard that applied the original (a resumed worker retrains no batch twice under
SSP and ASP either). Pushes of different batches, and a client whose clock went back, are
never taken for duplicates.

Expected values: sums of the pushed gradients counted here.
"""

from __future__ import annotations

import numpy as np
import pytest

from paramserver.errors import ParamServerError
from paramserver.worker_client import UpdateRule, WorkerClient
from tests.harness import running_server

pytestmark = [pytest.mark.timeout(60)]


@pytest.mark.asyncio(loop_factories=["asyncio"])
@pytest.mark.parametrize("resume", [True, False])
@pytest.mark.parametrize("consistency", ["asp", "ssp", "bsp"])
async def test_successor_repush_of_an_unclocked_batch_is_a_duplicate(
    consistency: str, resume: bool
) -> None:
    """With ``resume`` the re-push is one push with its predecessor's (under BSP the queued
    push left the open step with its registration, so the re-push is applied: once either
    way); without, every push of the successor is new."""
    g = np.array([1.0, 2.0], np.float32)
    async with running_server(consistency=consistency, staleness=2, aggregation="sum") as daemon:
        address = f"127.0.0.1:{daemon.port}"
        lost = WorkerClient(address, "w", heartbeat=False, resume=resume)
        await lost.__aenter__()
        await lost.init({"x": np.zeros(2, np.float32)}, rule=UpdateRule("add"))
        await lost.push({"x": g})  # batch 0
        await lost.clock()
        await lost.push({"x": 10 * g})  # batch 1, pushed; the worker dies before its clock
        # (no leave: the process is gone; its successor fences it)
        async with WorkerClient(
            address, "w", heartbeat=False, replace=True, resume=resume
        ) as successor:
            assert successor.clock_value == 1
            ack = await successor.push({"x": 10 * g})  # batch 1 again, as a resumed worker
            assert ack.duplicate == (resume and consistency != "bsp")
            await successor.clock()
            ack = await successor.push({"x": 100 * g})  # batch 2: new
            assert not ack.duplicate
            if consistency != "bsp":  # (BSP takes one push per worker and step)
                ack = await successor.push({"x": 1000 * g})  # a second push at this clock
                assert not ack.duplicate
            await successor.clock()
            values = await successor.pull(["x"])
        later = 0 if consistency == "bsp" else 1000
        once = (111 + later) * g
        twice = (121 + later) * g  # batch 1 applied twice: predecessor's push and successor's
        expected = once if resume or consistency == "bsp" else twice
        np.testing.assert_array_equal(values["x"], expected)
        try:
            await lost.__aexit__(None, None, None)  # fenced: its leave is refused
        except ParamServerError:
            pass


def test_ids_are_the_name_clock_and_count_and_change_after_the_clock_went_back() -> None:
    a = WorkerClient("127.0.0.1:1", "w", heartbeat=False, resume=True)
    b = WorkerClient("127.0.0.1:1", "w", heartbeat=False, resume=True)
    other = WorkerClient("127.0.0.1:1", "v", heartbeat=False, resume=True)
    a.clock_value = b.clock_value = other.clock_value = 7
    ids_a = [a._push_request_id() for _ in range(3)]
    assert ids_a == [b._push_request_id() for _ in range(3)]  # same name, clock, count
    assert len(set(ids_a)) == 3
    assert not set(ids_a) & {other._push_request_id() for _ in range(3)}
    a.clock_value = 8
    later = a._push_request_id()
    assert later not in ids_a
    a.clock_value = 7  # re-registered at a lower clock: new ids, never the old ones
    assert not {a._push_request_id() for _ in range(3)} & set(ids_a)
