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
from paramserver.worker_client import (
    Initializer,
    TableRule,
    TableSpec,
    UpdateRule,
    WorkerClient,
    connect,
)
from paramserver.worker_client.request_ids import RequestIds
from tests.harness import running_cluster, running_server

pytestmark = [pytest.mark.timeout(60)]


@pytest.mark.asyncio(loop_factories=["asyncio"])
@pytest.mark.parametrize("resume", [True, False])
@pytest.mark.parametrize("consistency", ["asp", "ssp", "bsp"])
async def test_successor_repush_of_an_unclocked_batch_is_a_duplicate(
    consistency: str, resume: bool
) -> None:
    """With ``resume`` the re-push is one push with its predecessor's (under BSP the
    successor took over the queued push with the predecessor's clock); without, every push of
    the successor is new (under BSP the queued push left the open step with its registration,
    so the batch is applied once either way)."""
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
            assert ack.duplicate == resume
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


def _row_oracle(pushes: list[tuple[np.ndarray, float]]) -> np.ndarray:
    """Rows after sgd(lr=1) pushes of ``grad`` rows (all ones times the factor) to ``ids``
    from zero initial rows: minus the sum of the factors per id, counted here."""
    rows = np.zeros((16, 2), np.float32)
    for ids, factor in pushes:
        for i in ids:
            rows[i] -= factor
    return rows


@pytest.mark.asyncio(loop_factories=["asyncio"])
@pytest.mark.parametrize("resume", [True, False])
@pytest.mark.parametrize("shards", [1, 2])
@pytest.mark.parametrize("consistency", ["asp", "ssp", "bsp"])
async def test_successor_repush_of_unclocked_rows_is_a_duplicate(
    consistency: str, shards: int, resume: bool
) -> None:
    """Row pushes (one table, and several tables in one call) are numbered as dense pushes
    are: with ``resume`` a successor's push of the batch its predecessor pushed but never
    clocked is the predecessor's push, applied once, on one shard or many (under BSP the
    successor took over the queued pushes); without, the successor's pushes are new (under
    BSP the queued pushes left the open step with their registration: applied once either
    way)."""
    table = {
        "initializer": Initializer("zeros"),
        "rule": TableRule("sgd", lr=1.0),
        "consistency": consistency,
        "staleness": 2 if consistency == "ssp" else 0,
    }
    spec = TableSpec("emb", 2, **table)
    other = TableSpec("emb2", 2, **table)
    ids = np.arange(8, dtype=np.int64)  # on both shards with 2

    def g(factor: float) -> np.ndarray:
        return np.full((ids.shape[0], 2), factor, np.float32)

    async with running_cluster(
        shards, consistency=consistency, staleness=2, aggregation="sum"
    ) as daemons:
        address = daemons[0].address
        lost = connect(address, "w", heartbeat=False, resume=resume)
        await lost.__aenter__()
        await lost.init_table(spec)
        await lost.init_table(other)
        await lost.push_rows("emb", ids, g(1))  # batch 0
        await lost.clock()
        await lost.push_rows("emb", ids, g(10))  # batch 1, pushed; the worker dies before
        await lost.push_rows_many({"emb": ids, "emb2": ids}, {"emb": g(10), "emb2": g(10)})
        async with connect(address, "w", heartbeat=False, replace=True, resume=resume) as successor:
            assert successor.clock_value == 1
            ack = await successor.push_rows("emb", ids, g(10))  # batch 1 again
            acks = await successor.push_rows_many(
                {"emb": ids, "emb2": ids}, {"emb": g(10), "emb2": g(10)}
            )
            dup = resume
            assert ack.duplicate == dup
            assert [a.duplicate for a in acks.values()] == [dup, dup]
            await successor.clock()
            ack = await successor.push_rows("emb", ids, g(100))  # batch 2: new
            assert not ack.duplicate
            await successor.clock()
            emb = await successor.pull_rows("emb", np.arange(16, dtype=np.int64))
            emb2 = await successor.pull_rows("emb2", np.arange(16, dtype=np.int64))
        once = resume or consistency == "bsp"
        np.testing.assert_array_equal(
            emb,
            _row_oracle(
                [(ids, 1), (ids, 10), (ids, 10), (ids, 100)]
                + ([] if once else [(ids, 10), (ids, 10)])
            ),
        )
        np.testing.assert_array_equal(
            emb2, _row_oracle([(ids, 10)] + ([] if once else [(ids, 10)]))
        )
        try:
            await lost.__aexit__(None, None, None)  # fenced: its leave is refused
        except ParamServerError:
            pass


def test_row_push_ids_follow_the_name_clock_and_count() -> None:
    """Row push ids: the same for the same name, clock and count; consecutive for a
    multi-table push; never the ids of a lower clock after the clock went back."""
    a = RequestIds("w", resume=True)
    b = RequestIds("w", resume=True)
    first = [a.take(3), a.take(3, 4), a.take(3)]
    assert first == [b.take(3), b.take(3, 4), b.take(3)]
    assert first[1] == first[0] + 1 and first[2] == first[1] + 4  # 4 ids for 4 tables
    assert RequestIds("v", resume=True).take(3) not in first
    assert a.take(4) not in first
    assert a.take(3) not in first  # the clock went back: a new salt
    assert RequestIds("w", resume=False).take(3) != first[0]


@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_a_worker_lost_between_its_clocks_of_two_shards_loses_no_batch() -> None:
    """BSP, two shards: the worker pushed a batch (dense and rows) to both shards and died
    after clocking shard 0 but before clocking shard 1 (a node loss between the two calls).
    Its resumed successor finds shard 0 one clock ahead; it clocks shard 1 forward, so its
    name completed the batch on both shards and it does not push it again. Shard 1's step must
    still hold the batch the predecessor queued there: every key and row gets the gradient
    exactly once (the oracle: the pushed values, counted here)."""
    keys = {f"k{i}": np.zeros(2, np.float32) for i in range(8)}
    spec = TableSpec(
        "emb",
        2,
        initializer=Initializer("zeros"),
        rule=TableRule("sgd", lr=1.0),
        consistency="bsp",
    )
    ids = np.arange(16, dtype=np.int64)
    async with running_cluster(2, consistency="bsp", aggregation="sum") as daemons:
        address = daemons[0].address
        lost = connect(address, "w", heartbeat=False, resume=True)
        await lost.__aenter__()
        await lost.init(keys, rule=UpdateRule("add"))
        await lost.init_table(spec)
        await lost.push({k: np.array([1.0, 2.0], np.float32) for k in keys})
        await lost.push_rows("emb", ids, np.ones((16, 2), np.float32))
        assert len(lost.shards) == 2
        await lost.shards[0].clock()  # shard 1 never sees this clock: the node went
        async with connect(address, "w", heartbeat=False, replace=True, resume=True) as successor:
            assert successor.clock_value == 1  # shard 1 was clocked forward
            assert (await successor.progress()).steps == 1  # it will not redo the batch
            values = await successor.pull(list(keys))
            rows = await successor.pull_rows("emb", ids)
            statuses = await successor.shard_statuses()
        for key, value in values.items():
            np.testing.assert_array_equal(value, [1.0, 2.0], err_msg=key)
        np.testing.assert_array_equal(rows, np.full((16, 2), -1.0, np.float32))
        # both shards held some of the keys (else the case above is not the one named)
        assert all(st.applied_updates == 1 for st in statuses), [
            st.applied_updates for st in statuses
        ]
        try:
            await lost.__aexit__(None, None, None)  # fenced: its leave is refused
        except ParamServerError:
            pass
