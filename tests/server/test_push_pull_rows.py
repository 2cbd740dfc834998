"""The fused row call (``push_pull_rows``; the PushPullRows RPC and a Session ``SessionRows``
carrying ``pull_ids``) on real servers (127.0.0.1:0): the same rows as ``push_rows`` then
``pull_rows`` and as a numpy oracle, on one and two shards, over every transport; a retry
applied once; a refused push or pull changes nothing (docs/embedding-tables.md)."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from paramserver.core.tables import TableRule, TableSpec
from paramserver.errors import (
    DimensionMismatch,
    DTypeMismatch,
    InvalidArgument,
    TableNotFound,
    Unavailable,
    WaitTimeout,
)
from paramserver.server.transports.table_service import TableRpcs
from paramserver.worker_client import connect, connect_sync
from paramserver.worker_client.transport.session_stream import SessionTransport
from tests.harness import eventually, running_cluster, running_server

pytestmark = pytest.mark.timeout(180)

DIM = 16
LR = 0.5
UNIVERSE = 3000

#: (session, shared_memory, local_link): the streams; the Session inline only; the Session
#: with a shared-memory segment on gRPC; and moved onto the local link.
TRANSPORTS = {
    "streams": {"session": False},
    "session-inline": {"session": True, "shared_memory": False, "local_link": False},
    "session-shm": {"session": True, "shared_memory": True, "local_link": False},
    "session-shm-link": {"session": True, "shared_memory": True, "local_link": True},
}


def _spec(name: str) -> TableSpec:
    return TableSpec(name, DIM, rule=TableRule("sgd", lr=LR), seed=11)


def _step(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Push ids (duplicates likely), gradient rows of multiples of 1/64 (sums and lr * sum
    exact in float32, so the oracle is bit-exact), and pull ids."""
    push = (rng.zipf(1.2, n) % UNIVERSE).astype(np.int64)
    grads = (rng.integers(-64, 65, size=(n, DIM)) / 64.0).astype(np.float32)
    pull = rng.integers(0, UNIVERSE, n).astype(np.int64)
    return push, grads, pull


class Oracle:
    """sgd rows in numpy: duplicates summed, then w -= lr * g once per distinct id."""

    def __init__(self, initial: np.ndarray) -> None:
        self.w = initial.copy()

    def push(self, ids: np.ndarray, grads: np.ndarray) -> None:
        total = np.zeros_like(self.w)
        np.add.at(total, ids, grads)
        touched = np.unique(ids)
        self.w[touched] -= np.float32(LR) * total[touched]

    def pull(self, ids: np.ndarray) -> np.ndarray:
        return self.w[ids]


def _sessions(w: Any) -> list[SessionTransport]:
    return [s.transports.preferred for s in _shards(w) if s.transports.preferred is not None]


def _shards(w: Any) -> list[Any]:
    api = w._api
    return list(getattr(api, "shards", [api]))


def _count_stream_calls(w: Any) -> list[int]:
    """Count the fused calls each shard's gRPC streams carry (one counter per shard)."""
    counts = [0] * len(_shards(w))
    for i, shard in enumerate(_shards(w)):
        streams = shard.transports.streams
        real = streams.push_pull_rows

        async def counted(*args: Any, _i: int = i, _real: Any = real) -> Any:
            counts[_i] += 1
            return await _real(*args)

        streams.push_pull_rows = counted
    return counts


@pytest.mark.parametrize("transport", list(TRANSPORTS))
@pytest.mark.parametrize("shards", [1, 2])
async def test_fused_equals_push_then_pull_and_the_oracle(shards: int, transport: str) -> None:
    options = TRANSPORTS[transport]
    rng = np.random.default_rng(shards * 10 + len(transport))
    everything = np.arange(UNIVERSE, dtype=np.int64)
    async with running_cluster(shards, consistency="asp") as daemons:
        async with connect(daemons[0].address, "w", **options) as w:
            await w.init_table(_spec("fused"))
            await w.init_table(_spec("plain"))
            initial = await w.pull_rows("fused", everything)
            assert initial.tobytes() == (await w.pull_rows("plain", everything)).tobytes()
            oracle = Oracle(initial)
            distinct = 0
            by_streams = _count_stream_calls(w)
            # small (inline) and large (> 64 KiB: shared memory where it is on) batches, and
            # the empty sides
            for n in (50, 3000, 200, 6000):
                push, grads, pull = _step(rng, n)
                fused = await w.push_pull_rows("fused", push, grads, pull)
                await w.push_rows("plain", push, grads)
                plain = await w.pull_rows("plain", pull)
                oracle.push(push, grads)
                distinct += np.unique(push).shape[0]
                assert fused.dtype == np.float32 and fused.shape == (n, DIM)
                assert fused.tobytes() == oracle.pull(pull).tobytes()
                assert fused.tobytes() == plain.tobytes()
            push, grads, _ = _step(rng, 40)
            none = await w.push_pull_rows("fused", push, grads, [])
            oracle.push(push, grads)
            distinct += np.unique(push).shape[0]
            assert none.shape == (0, DIM) and none.dtype == np.float32
            only = await w.push_pull_rows("fused", [], np.zeros((0, DIM), np.float32), everything)
            assert only.tobytes() == oracle.pull(everything).tobytes()
            sessions = _sessions(w)
            if options["session"]:  # every fused call went over the Session
                assert len(sessions) == shards and sum(by_streams) == 0, by_streams
                mapped = [s._segment is not None for s in sessions]
                assert all(mapped) == options["shared_memory"], mapped
                assert all(s.on_local_link for s in sessions) == options["local_link"]
            else:
                # one shard: 4 steps and the 2 calls with an empty side; several: the 4
                # steps on each shard (an empty side is a plain push or pull there)
                assert not sessions and by_streams == ([6] if shards == 1 else [4] * shards)
            status = await w.status()
            fused_info = next(t for t in status.tables if t.spec.name == "fused")
            assert fused_info.rows_pushed == distinct  # every push applied once


@pytest.mark.parametrize("transport", ["streams", "session-inline", "session-shm"])
async def test_a_retried_fused_call_applies_its_push_once(transport: str) -> None:
    rng = np.random.default_rng(7)
    everything = np.arange(UNIVERSE, dtype=np.int64)
    async with running_server(consistency="asp") as d:
        async with connect(d.address, "w", discover=False, **TRANSPORTS[transport]) as w:
            await w.init_table(_spec("emb"))
            oracle = Oracle(await w.pull_rows("emb", everything))
            push, grads, pull = _step(rng, 4000)
            api = w._api  # the single-shard WorkerClient: resend with the same request id
            request_id = api._next_request_id
            api._next_request_id += 1
            ids = np.asarray(push, np.int64)
            first, rows1 = await api._push_pull_rows_as("emb", ids, grads, pull, request_id, None)
            again, rows2 = await api._push_pull_rows_as("emb", ids, grads, pull, request_id, None)
            oracle.push(push, grads)
            assert not first.duplicate and again.duplicate
            assert first.distinct == np.unique(push).shape[0] == first.applied
            assert rows1.tobytes() == rows2.tobytes() == oracle.pull(pull).tobytes()
            assert (await w.pull_rows("emb", everything)).tobytes() == oracle.w.tobytes()
            assert (await w.status()).tables[0].pushes == 1


@pytest.mark.parametrize("transport", ["streams", "session-inline", "session-shm"])
@pytest.mark.parametrize("shards", [1, 2])
async def test_a_refused_fused_call_changes_nothing(shards: int, transport: str) -> None:
    rng = np.random.default_rng(3)
    everything = np.arange(UNIVERSE, dtype=np.int64)
    async with running_cluster(shards, consistency="asp") as daemons:
        async with connect(daemons[0].address, "w", **TRANSPORTS[transport]) as w:
            await w.init_table(_spec("emb"))
            before = await w.pull_rows("emb", everything)
            push, grads, pull = _step(rng, 500)
            with pytest.raises(DimensionMismatch, match="table 'emb'"):
                await w.push_pull_rows("emb", push, grads[:, :8], pull)
            with pytest.raises(DTypeMismatch, match="table 'emb'"):
                await w.push_pull_rows("emb", push, grads.astype(np.float64), pull)
            if shards == 1:  # (on several shards each shard's call stands or falls alone)
                bad_grads = grads.copy()
                bad_grads[3, 2] = np.nan
                with pytest.raises(InvalidArgument, match="table 'emb'"):  # NonFiniteGradient
                    await w.push_pull_rows("emb", push, bad_grads, pull)
                with pytest.raises(InvalidArgument, match="negative"):  # a bad pull id: no push
                    await w.push_pull_rows("emb", push, grads, np.array([1, -5, 2]))
            with pytest.raises(TableNotFound, match="table 'nope'"):
                await w.push_pull_rows("nope", push, grads, pull)
            status = await w.status()
            assert all(t.pushes == 0 and t.rows_pushed == 0 for t in status.tables)
            assert (await w.pull_rows("emb", everything)).tobytes() == before.tobytes()
            # and the client still serves the same call afterwards
            oracle = Oracle(before)
            got = await w.push_pull_rows("emb", push, grads, pull)
            oracle.push(push, grads)
            assert got.tobytes() == oracle.pull(pull).tobytes()


async def test_the_blocking_client_fuses_too() -> None:
    rng = np.random.default_rng(5)
    async with running_cluster(2, consistency="asp") as daemons:
        address = daemons[0].address

        def run() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            with connect_sync(address, "w") as w:
                w.init_table(_spec("emb"))
                initial = w.pull_rows("emb", np.arange(UNIVERSE))
                push, grads, pull = _step(rng, 1000)
                got = w.push_pull_rows("emb", push, grads, pull)
                oracle = Oracle(initial)
                oracle.push(push, grads)
                return got, oracle.pull(pull), pull

        got, want, _ = await asyncio.to_thread(run)
        assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("transport", ["streams", "session-inline", "session-shm"])
async def test_a_fused_call_whose_answer_is_lost_is_retried_and_applied_once(
    transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server applies the push, then its answer is lost (UNAVAILABLE, as a dropped link
    reads): the client's retry funnel sends the call again with the same request id, the
    shard answers it as a duplicate and pulls."""
    real = TableRpcs.push_decoded
    seen: list[int] = []

    async def lose_first_answer(self: TableRpcs, header: Any, ids: Any, grads: Any) -> Any:
        got = await real(self, header, ids, grads)
        seen.append(int(header.request_id))
        if len(seen) == 1:
            raise Unavailable("the answer was lost on the way back")
        return got

    rng = np.random.default_rng(9)
    everything = np.arange(UNIVERSE, dtype=np.int64)
    async with running_server(consistency="asp") as d:
        async with connect(d.address, "w", discover=False, **TRANSPORTS[transport]) as w:
            await w.init_table(_spec("emb"))
            oracle = Oracle(await w.pull_rows("emb", everything))
            push, grads, pull = _step(rng, 2000)
            monkeypatch.setattr(TableRpcs, "push_decoded", lose_first_answer)
            got = await w.push_pull_rows("emb", push, grads, pull)
            monkeypatch.undo()
            oracle.push(push, grads)
            assert len(seen) == 2 and seen[0] == seen[1]  # sent twice, one request id
            assert got.tobytes() == oracle.pull(pull).tobytes()
            assert (await w.pull_rows("emb", everything)).tobytes() == oracle.w.tobytes()
            info = (await w.status()).tables[0]
            assert info.pushes == 1 and info.rows_pushed == np.unique(push).shape[0]


@pytest.mark.parametrize("transport", ["session-inline", "session-shm"])
async def test_rows_too_large_for_the_answer_come_anyway_and_the_push_counts_once(
    transport: str,
) -> None:
    """A table's first call is a fused one whose rows do not fit where the client guessed
    (its row size unknown yet): with shared memory the region grows and the rows are pulled
    alone; without it, rows over the inline limit go by the streams, whose resend of the push
    is a duplicate. Either way the push is applied once."""
    rng = np.random.default_rng(13)
    async with running_server(consistency="asp") as d:
        async with connect(d.address, "w", discover=False, **TRANSPORTS[transport]) as w:
            await w.init_table(_spec("emb"))
            push, grads, _ = _step(rng, 100)
            pull = rng.integers(0, UNIVERSE, 24_000).astype(np.int64)  # 1.5 MB of rows
            by_streams = _count_stream_calls(w)
            got = await w.push_pull_rows("emb", push, grads, pull)
            assert by_streams == [0 if TRANSPORTS[transport]["shared_memory"] else 1]
            # the same table in a second client that only reads, after one push of ours
            async with connect(d.address, "r", register=False, session=False) as r:
                everything = await r.pull_rows("emb", np.arange(UNIVERSE))
            info = (await w.status()).tables[0]
            assert info.pushes == 1 and info.rows_pushed == np.unique(push).shape[0]
            assert got.tobytes() == everything[pull].tobytes()
            # and the rows moved: the pushed ids differ from their initial rows
            async with connect(d.address, "r2", register=False, session=False) as r:
                await r.init_table(_spec("fresh"))
                initial = await r.pull_rows("fresh", np.arange(UNIVERSE))
            oracle = Oracle(initial)
            oracle.push(push, grads)
            assert everything.tobytes() == oracle.w.tobytes()


@pytest.mark.parametrize("transport", ["streams", "session-shm"])
async def test_the_push_lands_at_once_and_the_pull_waits_as_pull_rows_does(
    transport: str,
) -> None:
    """An ssp(0) table, worker a one clock ahead of b: a's fused call applies its push on
    arrival, then its pull waits for b's clock (WaitTimeout when its wait runs out, the push
    standing), and reads the rows after the push once b clocks."""
    options = TRANSPORTS[transport]
    spec = TableSpec("emb", DIM, rule=TableRule("sgd", lr=LR), seed=11, consistency="ssp")
    rng = np.random.default_rng(17)
    everything = np.arange(UNIVERSE, dtype=np.int64)
    async with running_server(consistency="asp") as d:
        async with (
            connect(d.address, "a", **options) as a,
            connect(d.address, "b", **options) as b,
            connect(d.address, "watch", register=False, session=False) as watch,
        ):
            await a.init_table(spec)
            oracle = Oracle(await watch.pull_rows("emb", everything))
            await a.clock()  # a at 1, b at 0: a's pulls wait for b
            push, grads, pull = _step(rng, 300)
            with pytest.raises(WaitTimeout, match="table 'emb'"):
                await a.push_pull_rows("emb", push, grads, pull, timeout_s=0.2)
            oracle.push(push, grads)
            assert (await watch.status()).tables[0].pushes == 1  # the push stands
            push, grads, pull = _step(rng, 300)
            call = asyncio.ensure_future(a.push_pull_rows("emb", push, grads, pull, timeout_s=30))
            oracle.push(push, grads)

            async def applied() -> bool:
                return (await watch.status()).tables[0].pushes == 2

            await eventually(applied, what="the second push applied while its pull waits")
            assert not call.done()
            await b.clock()
            got = await asyncio.wait_for(call, 30)
            assert got.tobytes() == oracle.pull(pull).tobytes()
            assert (await watch.pull_rows("emb", everything)).tobytes() == oracle.w.tobytes()
