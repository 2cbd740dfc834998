"""Unit tests of push-sum gossip averaging (:mod:`paramserver.core.push_sum`, issue #3).

Source of the algorithm: Kempe, Dobra and Gehrke, FOCS 2003. Expected values are the numpy mean
of the initial values; the round bounds were measured over 2000 seeds (fanout 1: at most 48
rounds to 1e-6, fanout 2: at most 27) and carry a margin.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from paramserver.core.aggregation import DistributedOptimizer, GossipAverage
from paramserver.core.push_sum import GossipRound, PushSumMessage, PushSumNode
from paramserver.errors import InvalidArgument, WorkerNotFound

TOLERANCE = 1e-6
ROUND_BOUND = {1: 60, 2: 40}


def initial_values() -> dict[str, npt.NDArray[np.float64]]:
    """8 workers with distinct vector values (shape (3,))."""
    return {f"w{i}": np.array([float(i), 1.0 - 3.0 * i, float(i * i)]) for i in range(8)}


def max_error(nodes: dict[str, PushSumNode], target: npt.NDArray[np.float64]) -> float:
    return max(float(np.max(np.abs(n.estimate() - target))) for n in nodes.values())


def totals(nodes: dict[str, PushSumNode]) -> tuple[npt.NDArray[np.float64], float]:
    return sum((n.s for n in nodes.values()), np.zeros(3)), sum(n.w for n in nodes.values())


@pytest.mark.parametrize("fanout", [1, 2])
@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
def test_eight_workers_reach_the_mean_in_bounded_rounds(fanout: int, seed: int) -> None:
    values = initial_values()
    target = np.stack(list(values.values())).mean(axis=0)  # [3.5, -9.5, 17.5]
    nodes = {k: PushSumNode(k, v) for k, v in values.items()}
    gossip = GossipRound(fanout, seed)
    rounds = 0
    while max_error(nodes, target) >= TOLERANCE:
        gossip.run(nodes)
        rounds += 1
        assert rounds <= ROUND_BOUND[fanout], f"no convergence in {ROUND_BOUND[fanout]} rounds"
    assert gossip.rounds == rounds
    # Mass is conserved: sum s = sum of values, sum w = 8.
    s_total, w_total = totals(nodes)
    np.testing.assert_allclose(s_total, np.stack(list(values.values())).sum(axis=0), atol=1e-9)
    assert w_total == pytest.approx(8.0, abs=1e-12)


@pytest.mark.parametrize("fanout", [1, 2])
@pytest.mark.parametrize("seed", [0, 7, 11])
def test_worker_leaving_mid_way_hands_over_its_mass(fanout: int, seed: int) -> None:
    """A leaver hands (s, w) to a live peer: the 7 others still converge to the mean of all 8."""
    values = initial_values()
    target = np.stack(list(values.values())).mean(axis=0)
    strategy = GossipAverage(fanout=fanout)
    opt = DistributedOptimizer(strategy)
    for k in values:
        opt.register_worker(k, now=0.0)
    nodes = {k: PushSumNode(k, v) for k, v in values.items()}
    gossip = GossipRound(strategy.fanout, seed)
    for _ in range(5):
        gossip.run(nodes, directory=opt.peers_of)
    handover = gossip.leave(nodes, "w3", directory=opt.peers_of)
    assert opt.deregister_worker("w3")
    assert handover is not None and handover.sender == "w3" and handover.receiver != "w3"
    assert sorted(nodes) == opt.active_workers() and len(nodes) == 7
    s_total, w_total = totals(nodes)
    np.testing.assert_allclose(s_total, 8 * target, atol=1e-9)
    assert w_total == pytest.approx(8.0, abs=1e-12)
    rounds = 0
    while max_error(nodes, target) >= TOLERANCE:
        gossip.run(nodes, directory=opt.peers_of)
        rounds += 1
        assert rounds <= ROUND_BOUND[fanout]


def test_undeliverable_share_returns_to_its_sender() -> None:
    nodes = {"a": PushSumNode("a", [2.0]), "b": PushSumNode("b", [4.0])}
    gossip = GossipRound(fanout=1, seed=0)

    def stale_directory(node_id: str) -> list[str]:
        return ["ghost"]  # a peer that has already gone

    messages = gossip.run(nodes, directory=stale_directory)
    assert [m.receiver for m in messages] == ["ghost", "ghost"]
    # Each node kept half and took the other half back: nothing changed.
    np.testing.assert_array_equal(nodes["a"].estimate(), [2.0])
    assert nodes["a"].w == 1.0 and nodes["b"].w == 1.0


def test_push_splits_into_equal_shares() -> None:
    """k = min(fanout, peers); (s, w) split into k + 1 equal shares, one kept."""
    node = PushSumNode("a", [6.0, -3.0])
    rng = np.random.default_rng(0)
    messages = node.push(["b", "c", "a", "b"], fanout=5, rng=rng)  # self and repeats ignored
    assert sorted(m.receiver for m in messages) == ["b", "c"]
    for m in messages:
        np.testing.assert_array_equal(m.s, [2.0, -1.0])
        assert m.w == pytest.approx(1 / 3)
        assert m.round_index == 0
        with pytest.raises(ValueError):
            m.s[0] = 0.0  # shares in flight are read-only
    np.testing.assert_array_equal(node.s, [2.0, -1.0])
    np.testing.assert_array_equal(node.estimate(), [6.0, -3.0])  # s / w is unchanged
    assert node.push([], fanout=1, rng=rng) == []  # alone: keeps everything
    assert node.rounds == 2


def test_weighted_initial_mass() -> None:
    # Push-sum with weights computes sum(w_i v_i) / sum(w_i).
    nodes = {"a": PushSumNode("a", 1.0, weight=3.0), "b": PushSumNode("b", 5.0, weight=1.0)}
    gossip = GossipRound(fanout=1, seed=3)
    for _ in range(40):
        gossip.run(nodes)
    for n in nodes.values():
        assert float(n.estimate()) == pytest.approx((3 * 1 + 1 * 5) / 4, abs=1e-9)


def test_same_seed_same_run() -> None:
    def run(seed: int) -> list[tuple[str, str]]:
        nodes = {k: PushSumNode(k, v) for k, v in initial_values().items()}
        gossip = GossipRound(2, seed)
        return [(m.sender, m.receiver) for _ in range(3) for m in gossip.run(nodes)]

    assert run(5) == run(5)
    assert run(5) != run(6)


def test_node_errors() -> None:
    with pytest.raises(InvalidArgument):
        PushSumNode("", 1.0)
    with pytest.raises(InvalidArgument):
        PushSumNode("a", 1.0, weight=0.0)
    with pytest.raises(InvalidArgument):
        PushSumNode("a", [np.nan])
    with pytest.raises(InvalidArgument):
        GossipRound(fanout=0)
    a, b = PushSumNode("a", [1.0]), PushSumNode("b", [1.0, 2.0])
    rng = np.random.default_rng(0)
    with pytest.raises(InvalidArgument):
        a.push(["b"], fanout=0, rng=rng)
    (to_b,) = a.push(["b"], fanout=1, rng=rng)
    with pytest.raises(InvalidArgument, match="addressed to"):
        a.receive(to_b)
    with pytest.raises(InvalidArgument, match="shape"):
        b.receive(to_b)
    with pytest.raises(InvalidArgument, match="reclaim"):
        b.reclaim(to_b)
    # The last node leaving has nobody to hand over to.
    assert a.leave([], rng) is None
    for action in (a.estimate, lambda: a.push(["b"], 1, rng), lambda: a.leave(["b"], rng)):
        with pytest.raises(InvalidArgument, match="has left"):
            action()
    c = PushSumNode("c", [3.0])
    gone = c.leave(["a"], rng)
    assert gone is not None
    with pytest.raises(InvalidArgument, match="has left"):
        a.receive(gone)
    with pytest.raises(InvalidArgument, match="not in the group"):
        GossipRound(1).leave({}, "x")


def test_directory_from_the_optimizer() -> None:
    opt = DistributedOptimizer(GossipAverage(fanout=2))
    for k in ("a", "b", "c"):
        opt.register_worker(k)
    assert opt.peers_of("a") == ["b", "c"]
    opt.evict_worker("c")
    assert opt.peers_of("a") == ["b"]
    with pytest.raises(WorkerNotFound):
        opt.peers_of("c")


@settings(max_examples=40, deadline=None)
@given(
    values=st.lists(
        hnp.arrays(np.float64, (2,), elements=st.floats(-1e3, 1e3)), min_size=1, max_size=10
    ),
    fanout=st.integers(min_value=1, max_value=4),
    seed=st.integers(min_value=0, max_value=2**32 - 1),
    rounds=st.integers(min_value=0, max_value=15),
    leaver=st.integers(min_value=0, max_value=9),
)
def test_property_push_sum_conserves_mass(
    values: list[npt.NDArray[np.float64]], fanout: int, seed: int, rounds: int, leaver: int
) -> None:
    nodes = {f"n{i}": PushSumNode(f"n{i}", v) for i, v in enumerate(values)}
    expected_s = np.stack(values).sum(axis=0)
    gossip = GossipRound(fanout, seed)
    messages: list[PushSumMessage] = []
    for r in range(rounds):
        messages = gossip.run(nodes)
        if r == rounds // 2 and len(nodes) > 1 and f"n{leaver}" in nodes:
            gossip.leave(nodes, f"n{leaver}")
    s_total = sum((n.s for n in nodes.values()), np.zeros(2))
    w_total = sum(n.w for n in nodes.values())
    np.testing.assert_allclose(s_total, expected_s, rtol=1e-9, atol=1e-8)
    assert w_total == pytest.approx(len(values), rel=1e-12)
    assert all(n.w > 0 for n in nodes.values())
    assert all(m.receiver != m.sender for m in messages)


def test_scalar_values_stay_arrays() -> None:
    node = PushSumNode("a", 4.0)
    (message,) = node.push(["b"], fanout=1, rng=np.random.default_rng(0))
    assert isinstance(node.s, np.ndarray) and node.s.shape == ()
    assert isinstance(message.s, np.ndarray) and not message.s.flags.writeable
    assert isinstance(node.estimate(), np.ndarray) and float(node.estimate()) == 4.0
