"""Push-sum gossip over real gRPC on loopback (issue #3, ``GossipAverage``).

8 :class:`GossipWorker` s, each with its own push-sum endpoint on 127.0.0.1, find their peers
through a reduction server in gossip mode and average by push-sum (Kempe et al., FOCS 2003).
The target is the numpy mean of the initial values. Round bound: the in-process simulation
(tests/core/test_push_sum.py) needs at most 27 synchronous rounds at fanout 2 over 2000 seeds; the
network rounds overlap (a share may arrive mid-round), so the bound carries a wide margin.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
import numpy as np
import numpy.typing as npt
import pytest

from paramserver.api.v1 import reduction_pb2 as pb
from paramserver.api.v1 import reduction_pb2_grpc as pb_grpc
from paramserver.errors import FailedPrecondition, InvalidArgument
from paramserver.protocol import tensor
from paramserver.reduction.gossip_worker import GossipWorker
from tests.harness import running_server

TOLERANCE = 1e-6
FANOUT = 2
ROUND_BOUND = 60
WORKERS = 8

pytestmark = pytest.mark.timeout(30)


def initial_values() -> list[npt.NDArray[np.float64]]:
    """8 distinct vector values (shape (3,))."""
    return [np.array([float(i), 1.0 - 3.0 * i, float(i * i)]) for i in range(WORKERS)]


@asynccontextmanager
async def gossip_cluster(
    values: list[npt.NDArray[np.float64]],
) -> AsyncIterator[list[GossipWorker]]:
    async with running_server(mode="reduce", reduce_strategy="gossip", fanout=FANOUT) as srv:
        workers = [
            GossipWorker(srv.address, f"g{i}", v, seed=100 + i) for i, v in enumerate(values)
        ]
        try:
            for w in workers:
                await w.open()
            yield workers
        finally:
            for w in workers:
                await w.close()


def max_error(workers: list[GossipWorker], target: npt.NDArray[np.float64]) -> float:
    return max(float(np.max(np.abs(w.estimate() - target))) for w in workers)


async def rounds_until_converged(
    workers: list[GossipWorker], target: npt.NDArray[np.float64]
) -> int:
    """Run rounds (every worker concurrently) until every estimate is within TOLERANCE."""
    rounds = 0
    while max_error(workers, target) >= TOLERANCE:
        await asyncio.gather(*(w.run_round() for w in workers))
        rounds += 1
        assert rounds <= ROUND_BOUND, f"error {max_error(workers, target)} after {rounds} rounds"
    return rounds


def assert_mass_conserved(
    workers: list[GossipWorker], values: list[npt.NDArray[np.float64]]
) -> None:
    s_total = np.sum([w.node.s for w in workers if w.node is not None], axis=0)
    w_total = sum(w.node.w for w in workers if w.node is not None)
    np.testing.assert_allclose(s_total, np.sum(values, axis=0), rtol=0, atol=1e-9)
    assert w_total == pytest.approx(float(len(values)), abs=1e-12)


async def test_eight_workers_reach_the_mean_over_grpc() -> None:
    values = initial_values()
    target = np.mean(values, axis=0)  # [3.5, -9.5, 17.5]
    async with gossip_cluster(values) as workers:
        assert workers[0].client is not None
        status = await workers[0].client.status()
        assert sorted(w.gossip_address for w in status.workers) == sorted(
            w.endpoint for w in workers
        )
        assert all(a.startswith("127.0.0.1:") for a in (w.endpoint for w in workers))
        rounds = await rounds_until_converged(workers, target)
        assert 1 <= rounds <= ROUND_BOUND
        assert all(w.rounds == rounds for w in workers)
        assert sum(w.received_shares for w in workers) > 0
        assert_mass_conserved(workers, values)
        # The server only keeps the directory: a reduce is refused.
        with pytest.raises(InvalidArgument, match="push-sum"):
            await workers[0].client.reduce(0, {"g": np.zeros(3)}, timeout_s=5)


async def test_keeps_converging_when_one_worker_leaves_mid_way() -> None:
    """Worker 3 leaves after 4 rounds, concurrently with a round of the others: it hands its
    mass to a live peer, shares sent to it are taken back, and the 7 others still reach the
    mean of all 8 initial values."""
    values = initial_values()
    target = np.mean(values, axis=0)
    async with gossip_cluster(values) as workers:
        for _ in range(4):
            await asyncio.gather(*(w.run_round() for w in workers))
        leaver = workers[3]
        stay = [w for w in workers if w is not leaver]
        heir, *_ = await asyncio.gather(leaver.leave(), *(w.run_round() for w in stay))
        assert heir in {w.worker_id for w in stay}
        with pytest.raises(InvalidArgument, match="has left"):
            leaver.estimate()
        with pytest.raises(InvalidArgument, match="has left"):
            await leaver.run_round()
        assert stay[0].client is not None
        status = await stay[0].client.status()
        assert sorted(w.worker_id for w in status.workers) == sorted(w.worker_id for w in stay)
        assert_mass_conserved(stay, values)
        await rounds_until_converged(stay, target)
        assert_mass_conserved(stay, values)


async def test_gossip_worker_needs_a_gossip_server() -> None:
    async with running_server(mode="reduce") as srv:
        worker = GossipWorker(srv.address, "g", np.zeros(2))
        with pytest.raises(FailedPrecondition, match="not a gossip directory"):
            await worker.open()
        await worker.close()


def share_stream(
    sender: str, receiver: str, share_id: int, s: npt.NDArray[np.float64], w: float
) -> list[pb.PushShareRequest]:
    header = pb.PushShareHeader(sender_id=sender, receiver_id=receiver, share_id=share_id)
    frames = [*tensor.encode_frames("s", s), *tensor.encode_frames("w", np.float64(w))]
    return [pb.PushShareRequest(header=header), *(pb.PushShareRequest(frame=f) for f in frames)]


async def test_a_share_is_absorbed_once_and_refused_after_leave() -> None:
    """The PushSumPeer contract, with a raw stub: a retried (sender, share_id) is absorbed
    once; a node that has left refuses shares with FAILED_PRECONDITION (its sender takes the
    share back)."""
    values = initial_values()[:2]
    async with gossip_cluster(values) as (a, b):
        assert a.node is not None
        async with grpc.aio.insecure_channel(a.endpoint) as channel:
            stub = pb_grpc.PushSumPeerStub(channel)
            share = np.array([1.0, 2.0, 3.0])
            first = await stub.PushShare(iter(share_stream("x", a.worker_id, 7, share, 0.5)))
            again = await stub.PushShare(iter(share_stream("x", a.worker_id, 7, share, 0.5)))
            assert (first.duplicate, again.duplicate) == (False, True)
            np.testing.assert_array_equal(a.node.s, values[0] + share)
            assert a.node.w == 1.5 and a.received_shares == 1
            assert await a.leave() == b.worker_id
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.PushShare(iter(share_stream("x", a.worker_id, 8, share, 0.5)))
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "has left" in (info.value.details() or "")
        assert b.node is not None
        np.testing.assert_array_equal(b.node.s, values[0] + values[1] + share)
        assert b.node.w == 2.5
