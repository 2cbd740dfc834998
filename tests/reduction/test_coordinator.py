"""Unit tests of the reduction service's pure state (:class:`ReductionCoordinator`) and its
configuration (``paramserver serve --mode reduce``). No sockets, no event loop; time is passed
in. Expected values are worked out by hand in each test."""

from __future__ import annotations

import numpy as np
import pytest

from paramserver.cli.main import build_parser
from paramserver.core.aggregation import (
    Asynchronous,
    FederatedAverage,
    GossipAverage,
    Synchronous,
)
from paramserver.errors import (
    AlreadyExists,
    DimensionMismatch,
    FailedPrecondition,
    InvalidArgument,
    StaleUpdate,
    WorkerNotFound,
)
from paramserver.reduction.reduce_service import (
    ReductionCoordinator,
    Ticket,
    strategy_from_config,
)
from paramserver.server.config import ServerConfig


def test_mode_and_strategy_from_the_environment() -> None:
    env = {
        "PARAMSERVER_MODE": "reduce",
        "PARAMSERVER_REDUCE_STRATEGY": "federated_average",
        "PARAMSERVER_MIN_UPDATES": "3",
    }
    cfg = ServerConfig.from_sources({}, env)
    assert (cfg.mode, cfg.reduce_strategy, cfg.min_updates) == ("reduce", "federated_average", 3)
    assert strategy_from_config(cfg) == FederatedAverage(3)
    assert ServerConfig.from_sources({}, {}).mode == "ps"


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"replicas_to_aggregate": 2}, Synchronous(2)),
        (
            {
                "reduce_strategy": "asynchronous",
                "staleness_threshold": 4,
                "scale_by_staleness": True,
            },
            Asynchronous(4, scale_by_staleness=True),
        ),
        ({"reduce_strategy": "gossip", "fanout": 3}, GossipAverage(3)),
    ],
)
def test_strategy_from_config(changes: dict[str, object], expected: object) -> None:
    assert strategy_from_config(ServerConfig(mode="reduce", **changes)) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "changes",
    [
        {"mode": "allreduce"},
        {"reduce_strategy": "ring"},
        {"min_updates": 0},
        {"fanout": 0},
        {"replicas_to_aggregate": 0},
        {"staleness_threshold": -1},
    ],
)
def test_invalid_reduce_config(changes: dict[str, object]) -> None:
    with pytest.raises(InvalidArgument):
        ServerConfig(**changes)  # type: ignore[arg-type]


def test_serve_flags() -> None:
    args = build_parser().parse_args(
        ["serve", "--mode", "reduce", "--reduce-strategy", "gossip", "--fanout", "3"]
    )
    assert (args.mode, args.reduce_strategy, args.fanout) == ("reduce", "gossip", 3)


def _two_workers(coordinator: ReductionCoordinator) -> tuple[str, str]:
    a = coordinator.register("a", 0.0).worker_id
    b = coordinator.register("b", 0.0).worker_id
    return a, b


def test_synchronous_step_closes_when_every_layer_has_every_worker() -> None:
    co = ReductionCoordinator(Synchronous())
    a, b = _two_workers(co)
    ta = co.submit(a, 0, 1, {"x": np.array([1.0, 2.0]), "y": np.array(4.0)}, 1, 0.1)
    assert co.outcome(ta) is None and co.waiting_for(ta) == [b]
    tb = co.submit(b, 0, 1, {"x": np.array([3.0, 6.0]), "y": np.array(0.0)}, 1, 0.2)
    for ticket in (ta, tb):
        outcome = co.outcome(ticket)
        assert outcome is not None and (outcome.step, outcome.next_step) == (0, 1)
        np.testing.assert_array_equal(outcome.aggregates["x"].gradient, [2.0, 4.0])
        np.testing.assert_array_equal(outcome.aggregates["y"].gradient, 2.0)
        co.release(ticket)
    assert co.current_step == 1 and co.open_layers() == []
    with pytest.raises(StaleUpdate, match="stale step 0"):
        co.submit(a, 0, 2, {"x": np.zeros(2)}, 1, 0.3)
    with pytest.raises(DimensionMismatch, match="'x'"):
        co.submit(a, 1, 3, {"x": np.zeros(3)}, 1, 0.3)


def test_backup_workers_late_worker_gets_the_step_aggregate() -> None:
    """Synchronous(replicas_to_aggregate=2), 3 workers: the first 2 make step 0; the third,
    late, is answered with that aggregate and its gradient is dropped (counted)."""
    co = ReductionCoordinator(Synchronous(replicas_to_aggregate=2))
    a, b = _two_workers(co)
    c = co.register("c", 0.0).worker_id
    co.submit(a, 0, 1, {"x": np.array([2.0])}, 1, 0.0)
    co.submit(b, 0, 1, {"x": np.array([4.0])}, 1, 0.0)
    assert co.current_step == 1
    late = co.outcome(co.submit(c, 0, 1, {"x": np.array([100.0])}, 1, 0.0))
    assert late is not None and (late.step, late.next_step) == (0, 1)
    np.testing.assert_array_equal(late.aggregates["x"].gradient, [3.0])
    assert late.aggregates["x"].worker_ids == (a, b)
    assert co.optimizer.dropped_updates == 1
    with pytest.raises(DimensionMismatch, match="'x'"):
        co.submit(c, 0, 2, {"x": np.zeros(2)}, 1, 0.0)


def test_lapsed_lease_evicts_and_the_quorum_shrinks() -> None:
    co = ReductionCoordinator(Synchronous(), lease_s=1.0)
    a, b = _two_workers(co)
    ticket = co.submit(a, 0, 1, {"x": np.array([5.0])}, 1, 0.5)
    assert co.expire(1.0) == []  # b seen at 0.0: exactly 1 s old stays
    assert co.expire(1.2) == [b]  # b: 1.2 s > 1 s; a seen at 0.5 stays
    assert co.evicted_workers == 1 and not co.is_active(b)
    outcome = co.outcome(ticket)
    assert outcome is not None and outcome.aggregates["x"].contributing_workers == 1
    np.testing.assert_array_equal(outcome.aggregates["x"].gradient, [5.0])
    with pytest.raises(WorkerNotFound):
        co.heartbeat(b, 1.3)


def test_leaving_sole_contributor_of_a_layer_lets_the_step_close() -> None:
    co = ReductionCoordinator(Synchronous())
    a, b = _two_workers(co)
    ta = co.submit(a, 0, 1, {"x": np.array([1.0])}, 1, 0.0)
    co.submit(b, 0, 1, {"x": np.array([3.0]), "y": np.array([7.0])}, 1, 0.0)
    assert [layer for layer, _, _ in co.open_layers()] == ["y"]
    assert co.current_step == 0  # y still waits for a
    co.leave(b)  # b's pending y is dropped; nobody waits on y any more
    assert co.current_step == 1
    outcome = co.outcome(ta)
    assert outcome is not None
    np.testing.assert_array_equal(outcome.aggregates["x"].gradient, [2.0])


def test_asynchronous_aggregates_on_arrival_with_staleness_scaling() -> None:
    co = ReductionCoordinator(Asynchronous(1, scale_by_staleness=True))
    a, b = _two_workers(co)
    first = co.outcome(co.submit(a, 0, 1, {"x": np.array([4.0])}, 1, 0.0))
    assert first is not None and (first.step, first.next_step) == (0, 1)
    late = co.outcome(co.submit(b, 0, 1, {"x": np.array([4.0])}, 1, 0.0))  # staleness 1
    assert late is not None and late.step == 1
    np.testing.assert_array_equal(late.aggregates["x"].gradient, [2.0])  # 4 / (1 + 1)
    with pytest.raises(StaleUpdate, match="threshold is 1"):
        co.submit(a, 0, 2, {"x": np.array([4.0])}, 1, 0.0)  # staleness 2
    with pytest.raises(StaleUpdate, match="future"):
        co.submit(a, 9, 3, {"x": np.array([4.0])}, 1, 0.0)


def test_retry_resumes_and_a_new_request_for_the_step_is_a_duplicate() -> None:
    co = ReductionCoordinator(Synchronous())
    a, b = _two_workers(co)
    t1 = co.submit(a, 0, 42, {"x": np.array([1.0])}, 1, 0.0)
    co.release(t1)  # e.g. the wait timed out
    t2 = co.submit(a, 0, 42, {"x": np.array([100.0])}, 1, 0.0)  # resumed, not re-submitted
    assert t2 == Ticket(a, 0, ("x",), 42)
    with pytest.raises(StaleUpdate, match="duplicate"):
        co.submit(a, 0, 43, {"x": np.array([1.0])}, 1, 0.0)
    co.submit(b, 0, 1, {"x": np.array([3.0])}, 1, 0.0)
    outcome = co.outcome(t2)
    assert outcome is not None
    np.testing.assert_array_equal(outcome.aggregates["x"].gradient, [2.0])


def test_closed_steps_are_retained_for_a_while_then_pruned() -> None:
    co = ReductionCoordinator(Asynchronous(10), retain_steps=2)
    a, b = _two_workers(co)
    co.release(co.submit(a, 0, 7, {"x": np.array([1.0])}, 1, 0.0))  # step 0 closes
    for step in (1, 2, 3):
        co.release(co.submit(b, step, step, {"x": np.array([2.0])}, 1, 0.0))
    assert co.current_step == 4  # steps 0 and 1 are older than 4 - 2: pruned
    with pytest.raises(StaleUpdate, match="no longer kept"):
        co.submit(a, 0, 7, {"x": np.array([1.0])}, 1, 0.0)  # a retry of a's reduce
    resumed = co.outcome(co.submit(b, 3, 3, {"x": np.array([2.0])}, 1, 0.0))
    assert resumed is not None and resumed.step == 3


def test_membership_names_nonces_and_fencing() -> None:
    co = ReductionCoordinator(Synchronous())
    first = co.register("w", 0.0, client_nonce="n1")
    assert co.register("w", 0.1, client_nonce="n1") == first  # retried register
    with pytest.raises(AlreadyExists, match="'w'"):
        co.register("w", 0.2, client_nonce="n2")
    second = co.register("w", 0.3, replace=True, client_nonce="n2")
    assert second.worker_id != first.worker_id and not co.is_active(first.worker_id)
    with pytest.raises(InvalidArgument):
        co.register("", 0.0)
    with pytest.raises(FailedPrecondition, match="gossip"):
        co.peers(second.worker_id, 0.4)


def test_gossip_directory_and_no_reduce() -> None:
    co = ReductionCoordinator(GossipAverage(2))
    with pytest.raises(InvalidArgument, match="gossip_address"):
        co.register("a", 0.0)
    a = co.register("a", 0.0, gossip_address="127.0.0.1:1001").worker_id
    b = co.register("b", 0.0, gossip_address="127.0.0.1:1002").worker_id
    assert [(r.worker_id, r.gossip_address) for r in co.peers(a, 0.1)] == [(b, "127.0.0.1:1002")]
    with pytest.raises(InvalidArgument, match="push-sum"):
        co.submit(a, 0, 1, {"x": np.zeros(1)}, 1, 0.1)
