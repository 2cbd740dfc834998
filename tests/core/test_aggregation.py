"""Unit tests of :mod:`paramserver.core.aggregation` (issue #3, docs/semantics.md "Aggregation").

Expected values are derived by hand (closed forms in comments) or computed with numpy in the
test; never copied from the code's output.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from paramserver.core.aggregation import (
    AggregatedGradient,
    Asynchronous,
    DistributedOptimizer,
    FederatedAverage,
    GossipAverage,
    GradientUpdate,
    OptimizerStats,
    Synchronous,
    accumulation_dtype,
)
from paramserver.errors import (
    DimensionMismatch,
    FailedPrecondition,
    InvalidArgument,
    NonFiniteGradient,
    StaleUpdate,
    WorkerNotFound,
)

BF16 = np.dtype(ml_dtypes.bfloat16)


def upd(
    worker: str,
    values: Any,
    *,
    layer: str = "g",
    step: int = 0,
    n: int = 1,
    dtype: npt.DTypeLike = np.float32,
) -> GradientUpdate:
    return GradientUpdate(
        worker_id=worker,
        layer_id=layer,
        gradient=np.asarray(values, dtype=dtype),
        step=step,
        timestamp=0.0,
        num_samples=n,
    )


def optimizer(strategy: Any = None, method: str = "mean", workers: int = 3) -> DistributedOptimizer:
    opt = DistributedOptimizer(strategy if strategy is not None else Synchronous(), method)
    for i in range(1, workers + 1):
        assert opt.register_worker(f"W{i}", now=0.0)
    return opt


# ----------------------------------------------------------------------------- membership


def test_register_and_deregister_answers() -> None:
    opt = DistributedOptimizer(Synchronous())
    assert opt.register_worker("a") is True
    assert opt.register_worker("a") is False  # already present
    assert opt.register_worker("b") is True
    assert (opt.worker_count(), opt.active_worker_count()) == (2, 2)
    assert opt.deregister_worker("a") is True
    assert opt.deregister_worker("a") is False  # already inactive
    assert opt.deregister_worker("nobody") is False  # unknown
    assert opt.active_workers() == ["b"]
    assert (opt.worker_count(), opt.active_worker_count()) == (2, 1)
    assert opt.register_worker("a") is True  # re-activation
    assert opt.active_workers() == ["a", "b"]
    assert opt.evict_worker("a") is True
    assert opt.evict_worker("a") is False
    assert (opt.worker_count(), opt.active_worker_count()) == (1, 1)
    with pytest.raises(InvalidArgument):
        opt.register_worker("")


def test_worker_is_seen_at_registration_time_not_zero() -> None:
    opt = DistributedOptimizer(Synchronous())
    opt.register_worker("late", now=1000.0)
    # 0.5 s after registering: younger than 1 s, stays (time 0 would make it 1000 s old).
    assert opt.evict_stale_workers(max_age_ms=1000.0, now=1000.5) == 0
    assert opt.evict_stale_workers(max_age_ms=1000.0, now=1001.5) == 1
    assert opt.worker_count() == 0


def test_evict_stale_workers_edges_and_heartbeats() -> None:
    opt = DistributedOptimizer(Synchronous())
    opt.register_worker("a", now=0.0)
    opt.register_worker("b", now=0.0)
    opt.register_worker("c", now=0.0)
    opt.deregister_worker("c")  # departed workers are evicted too once stale
    opt.touch("b", now=1.5)
    # At t=2.0 with max age 2000 ms: a and c are exactly 2 s old -> stay (not *more* than).
    assert opt.evict_stale_workers(max_age_ms=2000.0, now=2.0) == 0
    # At t=2.5: a and c are 2.5 s old -> evicted; b is 1.0 s old -> stays.
    assert opt.evict_stale_workers(max_age_ms=2000.0, now=2.5) == 2
    assert opt.active_workers() == ["b"]
    assert opt.worker_count() == 1
    # A push is a sign of life too.
    opt.submit_update(upd("b", [1.0]), now=4.0)
    assert opt.evict_stale_workers(max_age_ms=2000.0, now=5.5) == 0
    assert opt.evict_stale_workers(max_age_ms=2000.0, now=6.5) == 1


def test_touch_unknown_or_departed_worker_is_refused() -> None:
    opt = optimizer(workers=1)
    with pytest.raises(WorkerNotFound, match="'ghost'"):
        opt.touch("ghost", now=1.0)
    opt.deregister_worker("W1")
    with pytest.raises(WorkerNotFound, match="'W1'"):
        opt.touch("W1", now=1.0)


# ----------------------------------------------------------------------------- submit: errors


def test_submit_error_order_worker_then_step_then_shape() -> None:
    opt = optimizer(workers=2)
    opt.submit_update(upd("W1", [1.0, 1.0]), now=0.0)  # fixes the width at (2,)
    opt.advance_step()  # current step 1
    # Unknown worker, stale step and wrong shape at once -> WorkerNotFound first.
    with pytest.raises(WorkerNotFound, match="'ghost'"):
        opt.submit_update(upd("ghost", [1.0, 2.0, 3.0], step=0), now=0.0)
    # Known worker, stale step and wrong shape -> StaleUpdate.
    with pytest.raises(StaleUpdate, match="step 0"):
        opt.submit_update(upd("W2", [1.0, 2.0, 3.0], step=0), now=0.0)
    # Known worker, right step, wrong shape -> DimensionMismatch.
    with pytest.raises(DimensionMismatch):
        opt.submit_update(upd("W2", [1.0, 2.0, 3.0], step=1), now=0.0)
    # Departed worker -> WorkerNotFound.
    opt.deregister_worker("W2")
    with pytest.raises(WorkerNotFound, match="deregistered"):
        opt.submit_update(upd("W2", [1.0, 2.0], step=1), now=0.0)


def test_error_classes_carry_their_status_codes() -> None:
    assert issubclass(WorkerNotFound, FailedPrecondition)
    assert issubclass(StaleUpdate, FailedPrecondition)
    assert issubclass(DimensionMismatch, InvalidArgument)


def test_duplicate_from_same_worker_same_step_is_refused() -> None:
    opt = optimizer()
    opt.submit_update(upd("W1", [1.0]), now=0.0)
    with pytest.raises(StaleUpdate, match=r"duplicate.*'W1'.*'g'"):
        opt.submit_update(upd("W1", [5.0]), now=0.0)
    assert opt.pending_updates_for("g") == 1
    assert opt.dropped_updates == 0  # a protocol error, not a dropped gradient
    # The same worker may contribute to another layer in the same step.
    opt.submit_update(upd("W1", [1.0], layer="h"), now=0.0)
    assert opt.pending_updates_for("h") == 1


@pytest.mark.parametrize("strategy", [Synchronous(), FederatedAverage(min_updates=2)])
def test_wrong_step_is_refused(strategy: Any) -> None:
    opt = optimizer(strategy)
    opt.advance_step()
    opt.advance_step()  # current step 2
    with pytest.raises(StaleUpdate, match=r"'W1'.*'g'.*1.*current \w+ is 2"):
        opt.submit_update(upd("W1", [1.0], step=1), now=0.0)
    assert opt.dropped_updates == 1  # a stale gradient is dropped and counted
    with pytest.raises(StaleUpdate, match=r"future.*3"):
        opt.submit_update(upd("W1", [1.0], step=3), now=0.0)
    assert opt.dropped_updates == 1  # a future step is a protocol error
    opt.submit_update(upd("W1", [1.0], step=2), now=0.0)
    assert opt.pending_updates_for("g") == 1


def test_ragged_widths_are_refused_naming_layer_and_both_shapes() -> None:
    opt = optimizer()
    opt.submit_update(upd("W1", [1.0, 2.0], layer="fc1"), now=0.0)
    with pytest.raises(DimensionMismatch) as info:
        opt.submit_update(upd("W2", [1.0, 2.0, 3.0], layer="fc1"), now=0.0)
    message = str(info.value)
    assert "'fc1'" in message and "(3,)" in message and "(2,)" in message and "'W2'" in message
    assert opt.pending_updates_for("fc1") == 1
    # Shapes stay fixed across steps.
    opt.advance_step()
    with pytest.raises(DimensionMismatch):
        opt.submit_update(upd("W2", [[1.0, 2.0]], layer="fc1", step=1), now=0.0)


def test_declared_layer_fixes_its_shape_up_front() -> None:
    opt = optimizer()
    opt.declare_layer("conv", (3, 0, 4))
    opt.declare_layer("conv", (3, 0, 4))  # same shape: no-op
    with pytest.raises(DimensionMismatch, match=r"'conv'.*\(3, 0, 4\).*\(3, 0, 5\)"):
        opt.declare_layer("conv", (3, 0, 5))
    with pytest.raises(DimensionMismatch, match=r"'conv'.*\(3, 0, 5\).*\(3, 0, 4\)"):
        opt.submit_update(upd("W1", np.zeros((3, 0, 5)), layer="conv"), now=0.0)
    opt.submit_update(upd("W1", np.zeros((3, 0, 4)), layer="conv"), now=0.0)
    with pytest.raises(InvalidArgument):
        opt.declare_layer("bad", (2, -1))


def test_non_finite_gradient_is_refused_naming_worker_layer_and_count() -> None:
    """cases/non-finite-gradient.md: the NaN/Inf push is refused; the step completes without it."""
    opt = optimizer()
    grads = [np.ones(1000, np.float32) for _ in range(3)]
    grads[1][17] = np.nan
    grads[1][18] = np.inf
    opt.submit_update(upd("W1", grads[0], layer="w"), now=0.0)
    with pytest.raises(NonFiniteGradient, match=r"'W2'.*'w'.* 2 non-finite"):
        opt.submit_update(upd("W2", grads[1], layer="w"), now=0.0)
    opt.submit_update(upd("W3", grads[2], layer="w"), now=0.0)
    result = opt.close_step()["w"]
    assert result.contributing_workers == 2
    assert np.isfinite(result.gradient).all()
    for dtype in (np.float16, BF16):
        bad = np.array([0.0, -0.0, np.nan], dtype=dtype)
        with pytest.raises(NonFiniteGradient, match="1 non-finite"):
            opt.submit_update(upd("W1", bad, layer=f"x{np.dtype(dtype).name}", step=1), now=0.0)
    # -0.0 and subnormals are fine.
    ok = np.array([-0.0, np.finfo(np.float32).smallest_subnormal], np.float32)
    opt.submit_update(upd("W1", ok, layer="sub", step=1), now=0.0)
    lax = DistributedOptimizer(Synchronous(), reject_non_finite=False)
    lax.register_worker("a")
    lax.submit_update(upd("a", [np.nan]), now=0.0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_samples": 0}, "num_samples"),
        ({"num_samples": -3}, "num_samples"),
        ({"step": -1}, "step"),
        ({"worker_id": ""}, "worker"),
        ({"gradient": [1.0, 2.0]}, "ndarray"),
        ({"gradient": np.array(["a"])}, "dtype"),
        ({"gradient": np.array([1 + 2j])}, "dtype"),
    ],
)
def test_gradient_update_validation(kwargs: dict[str, Any], match: str) -> None:
    base: dict[str, Any] = {
        "worker_id": "W1",
        "layer_id": "g",
        "gradient": np.zeros(2, np.float32),
        "step": 0,
        "timestamp": 0.0,
        "num_samples": 1,
    }
    with pytest.raises(InvalidArgument, match=match):
        GradientUpdate(**(base | kwargs))


@pytest.mark.parametrize(
    "make",
    [
        lambda: Synchronous(replicas_to_aggregate=0),
        lambda: Asynchronous(staleness_threshold=-1),
        lambda: FederatedAverage(min_updates=0),
        lambda: GossipAverage(fanout=0),
        lambda: DistributedOptimizer(Synchronous(), method="median"),
    ],
)
def test_bad_configuration_is_refused(make: Any) -> None:
    with pytest.raises(InvalidArgument):
        make()


# ----------------------------------------------------------------------------- the denominator


@pytest.mark.parametrize(
    ("method", "expected"),
    [("mean", 13.0 / 3.0), ("sum", 13.0), ("weighted_mean", (1 * 1 + 2 * 1 + 10 * 8) / 10)],
)
def test_denominator_case(method: str, expected: float) -> None:
    """cases/aggregation-denominator.md: mean 13/3, sum 13, weighted mean 8.3."""
    opt = optimizer(method=method)
    opt.submit_update(upd("W1", [1.0, 1.0], n=1), now=0.0)
    opt.submit_update(upd("W2", [2.0, 2.0], n=1), now=0.0)
    assert opt.try_aggregate("g") is None  # W3 still missing
    opt.submit_update(upd("W3", [10.0, 10.0], n=8), now=0.0)
    result = opt.try_aggregate("g")
    assert result is not None
    assert result.gradient.dtype == np.float64  # accumulation dtype for float32 inputs
    np.testing.assert_array_equal(result.gradient, [expected, expected])  # divided once
    assert (result.contributing_workers, result.total_samples) == (3, 10)
    assert result.worker_ids == ("W1", "W2", "W3")
    assert result.step == 0
    # One division: casting to the key's float32 is the correctly rounded quotient.
    assert result.gradient.astype(np.float32)[0] == np.float32(expected)


@pytest.mark.parametrize("how", ["evicted", "stale", "deregistered"])
def test_denominator_case_worker_leaves_open_step(how: str) -> None:
    """cases/aggregation-denominator.md: W3 evicted or rejected before the step -> mean 1.5."""
    opt = optimizer(method="mean")
    if how == "stale":
        opt.advance_step()
    step = opt.current_step
    opt.submit_update(upd("W1", [1.0, 1.0], step=step), now=0.0)
    opt.submit_update(upd("W2", [2.0, 2.0], step=step), now=0.0)
    if how == "stale":
        with pytest.raises(StaleUpdate):
            opt.submit_update(upd("W3", [10.0, 10.0], n=8, step=step - 1), now=0.0)
        assert opt.try_aggregate("g") is None  # W3 is still live: the quorum waits for it
        result = opt.close_step()["g"]
    else:
        opt.submit_update(upd("W3", [10.0, 10.0], n=8, step=step), now=0.0)
        dropped_before = opt.dropped_updates
        if how == "evicted":
            assert opt.evict_worker("W3")
            assert opt.dropped_updates == dropped_before + 1
            assert opt.pending_updates_for("g") == 2
        else:
            assert opt.deregister_worker("W3")
        # The quorum is re-evaluated: 2 of 2 live workers have contributed.
        got = opt.try_aggregate("g")
        assert got is not None
        result = got
        if how == "deregistered":
            assert opt.dropped_updates == dropped_before + 1  # W3's queued update
    np.testing.assert_array_equal(result.gradient, [1.5, 1.5])
    assert result.contributing_workers == 2
    assert result.worker_ids == ("W1", "W2")


def test_eviction_during_open_step_completes_the_quorum() -> None:
    opt = optimizer(workers=4)
    for w in ("W1", "W2", "W3"):
        opt.submit_update(upd(w, [3.0]), now=0.0)
    assert opt.try_aggregate("g") is None
    assert opt.waiting_for("g") == ["W4"]
    assert opt.evict_worker("W4")
    assert opt.dropped_updates == 0  # W4 had nothing pending
    result = opt.try_aggregate("g")
    assert result is not None
    np.testing.assert_array_equal(result.gradient, [3.0])
    # Evicted then re-registered in the same step: a new member, it may contribute afresh.
    opt2 = optimizer(workers=2)
    opt2.submit_update(upd("W1", [1.0]), now=0.0)
    opt2.submit_update(upd("W2", [3.0], layer="h"), now=0.0)
    opt2.evict_worker("W1")
    assert opt2.dropped_updates == 1
    assert opt2.register_worker("W1", now=1.0)
    opt2.submit_update(upd("W1", [5.0]), now=1.0)
    opt2.submit_update(upd("W2", [7.0]), now=1.0)
    got = opt2.try_aggregate("g")
    assert got is not None
    np.testing.assert_array_equal(got.gradient, [6.0])


# ----------------------------------------------------------------------------- synchronous


def test_per_layer_independence() -> None:
    opt = optimizer(workers=2)
    opt.submit_update(upd("W1", [1.0, 2.0], layer="a"), now=0.0)
    opt.submit_update(upd("W2", [3.0, 4.0], layer="a"), now=0.0)
    opt.submit_update(upd("W1", [[1.0]], layer="b"), now=0.0)
    assert (opt.pending_updates_for("a"), opt.pending_updates_for("b")) == (2, 1)
    assert opt.try_aggregate("b") is None
    result_a = opt.try_aggregate("a")
    assert result_a is not None
    np.testing.assert_array_equal(result_a.gradient, [2.0, 3.0])
    assert (opt.pending_updates_for("a"), opt.pending_updates_for("b")) == (0, 1)
    assert opt.last_aggregated("a") is result_a
    assert opt.last_aggregated("b") is None
    assert opt.last_aggregated("unknown") is None
    assert opt.try_aggregate("unknown") is None
    assert opt.pending_updates_for("unknown") == 0
    opt.submit_update(upd("W2", [[5.0]], layer="b"), now=0.0)
    result_b = opt.try_aggregate("b")
    assert result_b is not None
    np.testing.assert_array_equal(result_b.gradient, [[3.0]])
    assert opt.try_aggregate("a") is None  # queue cleared; nothing pending
    assert opt.last_aggregated("a") is result_a  # kept


def test_aggregate_is_read_only_and_late_update_after_aggregation_is_stale() -> None:
    opt = optimizer(workers=1)
    opt.submit_update(upd("W1", [1.0]), now=0.0)
    result = opt.try_aggregate("g")
    assert isinstance(result, AggregatedGradient)
    with pytest.raises(ValueError):
        result.gradient[0] = 7.0
    # A worker joining after the layer was aggregated for this step is too late for it.
    opt.register_worker("W9", now=1.0)
    with pytest.raises(StaleUpdate, match=r"late.*'W9'.*'g'"):
        opt.submit_update(upd("W9", [1.0]), now=1.0)
    assert opt.dropped_updates == 1
    with pytest.raises(StaleUpdate, match="duplicate"):
        opt.submit_update(upd("W1", [1.0]), now=1.0)


def test_backup_workers_first_n_of_m() -> None:
    """TensorFlow SyncReplicasOptimizer(replicas_to_aggregate=2, total_num_replicas=3)."""
    opt = optimizer(Synchronous(replicas_to_aggregate=2), workers=3)
    opt.submit_update(upd("W2", [4.0]), now=0.0)
    assert opt.try_aggregate("g") is None
    opt.submit_update(upd("W3", [8.0]), now=0.0)
    result = opt.try_aggregate("g")
    assert result is not None
    np.testing.assert_array_equal(result.gradient, [6.0])  # (4 + 8) / 2
    assert result.worker_ids == ("W2", "W3")
    with pytest.raises(StaleUpdate, match=r"late.*'W1'"):
        opt.submit_update(upd("W1", [100.0]), now=0.0)
    assert opt.dropped_updates == 1
    opt.advance_step()
    # More than N arrived before anyone asked: the first N are used, the rest dropped.
    for w, v in (("W1", 1.0), ("W3", 3.0), ("W2", 5.0)):
        opt.submit_update(upd(w, [v], step=1), now=0.0)
    result = opt.try_aggregate("g")
    assert result is not None
    np.testing.assert_array_equal(result.gradient, [2.0])  # (1 + 3) / 2
    assert opt.dropped_updates == 2
    # The quorum shrinks with membership: 1 live worker < N = 2.
    opt.advance_step()
    opt.evict_worker("W1")
    opt.evict_worker("W2")
    opt.submit_update(upd("W3", [9.0], step=2), now=0.0)
    result = opt.try_aggregate("g")
    assert result is not None
    np.testing.assert_array_equal(result.gradient, [9.0])


def test_close_step_aggregates_what_arrived_then_advances() -> None:
    opt = optimizer(workers=3)
    opt.submit_update(upd("W1", [2.0], layer="a"), now=0.0)
    opt.submit_update(upd("W2", [4.0], layer="a"), now=0.0)
    opt.submit_update(upd("W3", [9.0], layer="b"), now=0.0)
    opt.submit_update(upd("W1", [1.0], layer="c"), now=0.0)
    opt.deregister_worker("W1")  # its updates for a and c are left out
    opt.declare_layer("d", (1,))  # no updates: omitted
    results = opt.close_step()
    assert sorted(results) == ["a", "b"]
    np.testing.assert_array_equal(results["a"].gradient, [4.0])
    np.testing.assert_array_equal(results["b"].gradient, [9.0])
    assert results["a"].step == 0 and results["a"].contributing_workers == 1
    assert opt.current_step == 1
    assert opt.dropped_updates == 2  # W1's updates for a and c
    assert opt.pending_updates_for("c") == 0
    assert opt.stats().total_aggregations == 2
    assert opt.close_step() == {}
    assert opt.current_step == 2


def test_advance_step_counts_discarded_updates() -> None:
    opt = optimizer(workers=3)
    opt.submit_update(upd("W1", [1.0]), now=0.0)
    opt.submit_update(upd("W2", [1.0], layer="h"), now=0.0)
    opt.advance_step()
    assert (opt.current_step, opt.dropped_updates) == (1, 2)
    assert opt.pending_updates_for("g") == 0
    opt.submit_update(upd("W1", [1.0], step=1), now=0.0)  # a new step: not a duplicate


def test_stats() -> None:
    opt = optimizer(workers=3)
    opt.deregister_worker("W3")
    opt.submit_update(upd("W1", [1.0], layer="a"), now=0.0)
    opt.submit_update(upd("W1", [1.0], layer="b"), now=0.0)
    opt.submit_update(upd("W2", [1.0], layer="b"), now=0.0)
    assert opt.stats() == OptimizerStats(
        total_workers=3,
        active_workers=2,
        current_step=0,
        total_aggregations=0,
        dropped_updates=0,
        pending_layers=2,
    )
    assert opt.try_aggregate("b") is not None
    opt.advance_step()
    assert opt.stats() == OptimizerStats(
        total_workers=3,
        active_workers=2,
        current_step=1,
        total_aggregations=1,
        dropped_updates=1,
        pending_layers=0,
    )


# ----------------------------------------------------------------------------- batches


def test_submit_updates_is_all_or_nothing() -> None:
    opt = optimizer(workers=3)
    good = [upd("W1", [1.0, 1.0]), upd("W2", [2.0, 2.0])]
    with pytest.raises(DimensionMismatch):
        opt.submit_updates([*good, upd("W3", [3.0, 3.0, 3.0])], now=0.0)
    assert opt.pending_updates_for("g") == 0
    with pytest.raises(WorkerNotFound):
        opt.submit_updates([*good, upd("ghost", [3.0, 3.0])], now=0.0)
    assert opt.pending_updates_for("g") == 0
    # Duplicates within one batch.
    with pytest.raises(StaleUpdate, match="duplicate"):
        opt.submit_updates([*good, upd("W1", [3.0, 3.0])], now=0.0)
    assert opt.pending_updates_for("g") == 0
    # A refused batch fixes no width: a later batch of another width is fine.
    opt.submit_updates([upd("W1", [1.0]), upd("W1", [5.0, 5.0, 5.0], layer="h")], now=0.0)
    assert (opt.pending_updates_for("g"), opt.pending_updates_for("h")) == (1, 1)
    opt.submit_updates([upd("W2", [2.0]), upd("W3", [3.0])], now=0.0)
    result = opt.try_aggregate("g")
    assert result is not None
    np.testing.assert_array_equal(result.gradient, [2.0])
    opt.submit_updates([], now=0.0)


# ----------------------------------------------------------------------------- asynchronous


@pytest.mark.parametrize("threshold", [0, 1, 3])
def test_async_staleness_threshold_edges(threshold: int) -> None:
    opt = optimizer(Asynchronous(staleness_threshold=threshold), workers=1)
    for _ in range(5):
        opt.advance_step()  # current step 5
    opt.submit_update(upd("W1", [1.0], step=5 - threshold), now=0.0)  # exactly at: accepted
    assert (opt.pending_updates_for("g"), opt.dropped_updates) == (1, 0)
    with pytest.raises(StaleUpdate, match=rf"step {4 - threshold}.*{threshold + 1} steps behind"):
        opt.submit_update(upd("W1", [1.0], step=4 - threshold), now=0.0)
    assert (opt.pending_updates_for("g"), opt.dropped_updates) == (1, 1)
    with pytest.raises(StaleUpdate, match="future step 6"):
        opt.submit_update(upd("W1", [1.0], step=6), now=0.0)
    assert opt.dropped_updates == 1


def test_async_aggregates_on_arrival_and_allows_repeat_pushes() -> None:
    opt = optimizer(Asynchronous(staleness_threshold=2), workers=2)
    opt.submit_update(upd("W1", [2.0]), now=0.0)
    first = opt.try_aggregate("g")
    assert first is not None
    np.testing.assert_array_equal(first.gradient, [2.0])
    opt.submit_update(upd("W1", [4.0]), now=0.0)  # same worker, same step: fine in ASP
    opt.submit_update(upd("W1", [6.0]), now=0.0)
    second = opt.try_aggregate("g")
    assert second is not None
    np.testing.assert_array_equal(second.gradient, [5.0])
    assert (second.contributing_workers, second.total_samples) == (1, 2)
    assert opt.waiting_for("g") == []


def test_async_staleness_aware_scaling() -> None:
    """Zhang et al. 2016: each gradient scaled by 1 / (1 + staleness)."""
    opt = optimizer(Asynchronous(staleness_threshold=3, scale_by_staleness=True), workers=3)
    for _ in range(3):
        opt.advance_step()  # current step 3
    opt.submit_update(upd("W1", [6.0], step=3), now=0.0)  # staleness 0 -> 6
    opt.submit_update(upd("W2", [6.0], step=2), now=0.0)  # staleness 1 -> 3
    opt.submit_update(upd("W3", [6.0], step=0), now=0.0)  # staleness 3 -> 1.5
    result = opt.try_aggregate("g")
    assert result is not None
    np.testing.assert_allclose(result.gradient, [(6.0 + 3.0 + 1.5) / 3], rtol=0, atol=1e-15)


# ----------------------------------------------------------------------------- federated


def test_federated_average_weights_by_num_samples() -> None:
    """McMahan et al. 2017: w = sum n_k w_k / sum n_k."""
    opt = optimizer(FederatedAverage(min_updates=3), method="sum", workers=4)
    assert opt.method == "weighted_mean"  # forced
    grads = {
        "W1": (np.array([1.0, -2.0, 0.5]), 10),
        "W2": (np.array([3.0, 0.0, -1.5]), 30),
        "W3": (np.array([-4.0, 8.0, 2.0]), 60),
    }
    for w, (g, n) in grads.items():
        assert opt.try_aggregate("g") is None  # below min_updates
        opt.submit_update(upd(w, g, n=n, dtype=np.float64), now=0.0)
    result = opt.try_aggregate("g")
    assert result is not None
    stacked = np.stack([g for g, _ in grads.values()])
    weights = np.array([n for _, n in grads.values()], dtype=np.float64)
    expected = (stacked * weights[:, None]).sum(axis=0) / weights.sum()
    np.testing.assert_allclose(result.gradient, expected, rtol=1e-15)
    # Hand check of the first element: (10 + 90 - 240) / 100 = -1.4.
    assert result.gradient[0] == pytest.approx(-1.4, abs=1e-15)
    assert (result.contributing_workers, result.total_samples) == (3, 100)
    # One update per worker per round; the late fourth is refused for this round.
    with pytest.raises(StaleUpdate, match="duplicate"):
        opt.submit_update(upd("W1", [0.0, 0.0, 0.0]), now=0.0)
    with pytest.raises(StaleUpdate, match=r"late.*'W4'.*round"):
        opt.submit_update(upd("W4", [0.0, 0.0, 0.0]), now=0.0)


def test_weighted_mean_method_under_synchronous() -> None:
    opt = optimizer(method="weighted_mean", workers=2)
    opt.submit_update(upd("W1", [1.0], n=3), now=0.0)
    opt.submit_update(upd("W2", [5.0], n=1), now=0.0)
    result = opt.try_aggregate("g")
    assert result is not None
    np.testing.assert_array_equal(result.gradient, [2.0])  # (3 + 5) / 4


# ----------------------------------------------------------------------------- gossip strategy


def test_gossip_strategy_serves_the_peer_directory_only() -> None:
    opt = optimizer(GossipAverage(fanout=2), workers=3)
    assert opt.peers_of("W2") == ["W1", "W3"]
    opt.deregister_worker("W3")
    assert opt.peers_of("W2") == ["W1"]
    with pytest.raises(WorkerNotFound):
        opt.peers_of("W3")
    with pytest.raises(InvalidArgument, match="push-sum"):
        opt.submit_update(upd("W1", [1.0]), now=0.0)
    assert opt.try_aggregate("g") is None
    assert opt.waiting_for("g") == []


# ----------------------------------------------------------------------------- numerics


def test_half_precision_accumulates_in_float32() -> None:
    opt = optimizer(method="mean", workers=2)
    # 60000 + 60000 overflows float16 (max 65504); in float32 the mean is exactly 60000.
    opt.submit_update(upd("W1", [60000.0, 1.0], dtype=np.float16), now=0.0)
    opt.submit_update(upd("W2", [60000.0, 2.0], dtype=np.float16), now=0.0)
    result = opt.try_aggregate("g")
    assert result is not None
    assert result.gradient.dtype == np.float32
    np.testing.assert_array_equal(result.gradient, np.array([60000.0, 1.5], np.float32))
    # bfloat16 keeps 8 significant bits: 256 + 1 rounds back to 256 in bfloat16, not in float32.
    bf = [upd(w, [v], dtype=BF16) for w, v in (("a", 256.0), ("b", 1.0), ("c", 1.0))]
    out = DistributedOptimizer(Synchronous(), "sum").aggregate_gradients(bf)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, np.array([258.0], np.float32))


@pytest.mark.parametrize(
    ("dtypes", "expected"),
    [
        ((np.float16,), np.float32),
        ((BF16, np.float16), np.float32),
        ((np.float16, np.float32), np.float64),
        ((np.float32,), np.float64),
        ((np.float64,), np.float64),
        ((np.int32,), np.float64),
        ((np.int64, BF16), np.float64),
        ((), np.float64),
    ],
)
def test_accumulation_dtype(dtypes: tuple[Any, ...], expected: Any) -> None:
    assert accumulation_dtype(np.dtype(d) for d in dtypes) == np.dtype(expected)


def test_integer_gradients_average_in_float64() -> None:
    opt = DistributedOptimizer(Synchronous(), "mean")
    out = opt.aggregate_gradients(
        [upd("a", [1, 2], dtype=np.int32), upd("b", [2, 2], dtype=np.int32)]
    )
    assert out.dtype == np.float64
    np.testing.assert_array_equal(out, [1.5, 2.0])


@pytest.mark.filterwarnings("error")
def test_empty_input_gives_empty_without_warnings() -> None:
    """cases/empty-and-scalar-tensors.md: the mean over empty gradients is empty, no warnings."""
    for method in ("mean", "sum", "weighted_mean"):
        opt = DistributedOptimizer(Synchronous(), method)
        out = opt.aggregate_gradients([])
        assert out.shape == (0,) and out.size == 0
        zero = opt.aggregate_gradients(
            [upd("a", np.zeros((3, 0, 5))), upd("b", np.zeros((3, 0, 5)))]
        )
        assert zero.shape == (3, 0, 5)
        scalar = opt.aggregate_gradients([upd("a", np.float32(7.5)), upd("b", np.float32(2.5))])
        assert scalar.shape == ()
    opt = optimizer(workers=2)
    opt.submit_update(upd("W1", np.zeros((0,)), layer="e"), now=0.0)
    opt.submit_update(upd("W2", np.zeros((0,)), layer="e"), now=0.0)
    result = opt.try_aggregate("e")
    assert result is not None and result.gradient.shape == (0,)


def test_aggregate_gradients_refuses_ragged_input() -> None:
    opt = DistributedOptimizer(Synchronous())
    with pytest.raises(DimensionMismatch, match=r"'g'.*\(2,\).*\(3,\)"):
        opt.aggregate_gradients([upd("a", [1.0, 2.0]), upd("b", [1.0, 2.0, 3.0])])


# ----------------------------------------------------------------------------- properties

_finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4),
    count=st.integers(min_value=1, max_value=6),
)
def test_property_mean_sum_weighted_match_numpy(
    data: st.DataObject, shape: Any, count: int
) -> None:
    arrays = [data.draw(hnp.arrays(np.float64, shape, elements=_finite)) for _ in range(count)]
    samples = [data.draw(st.integers(min_value=1, max_value=1000)) for _ in range(count)]
    updates = [
        upd(f"w{i}", a, n=n, dtype=np.float64)
        for i, (a, n) in enumerate(zip(arrays, samples, strict=True))
    ]
    stacked = np.stack(arrays)
    refs = {
        "mean": stacked.mean(axis=0),
        "sum": stacked.sum(axis=0),
        "weighted_mean": np.average(stacked, axis=0, weights=np.array(samples, np.float64)),
    }
    for method, ref in refs.items():
        got = DistributedOptimizer(Synchronous(), method).aggregate_gradients(updates)
        assert got.shape == tuple(shape) and got.dtype == np.float64
        np.testing.assert_allclose(got, ref, rtol=1e-9, atol=1e-6)


@settings(max_examples=40, deadline=None)
@given(
    values=st.lists(
        hnp.arrays(np.float16, (3,), elements=st.floats(-100, 100, width=16)),
        min_size=1,
        max_size=8,
    )
)
def test_property_half_precision_mean_matches_float32_reference(
    values: list[npt.NDArray[np.float16]],
) -> None:
    updates = [upd(f"w{i}", v, dtype=np.float16) for i, v in enumerate(values)]
    got = DistributedOptimizer(Synchronous()).aggregate_gradients(updates)
    assert got.dtype == np.float32
    ref = np.stack([v.astype(np.float64) for v in values]).mean(axis=0)
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-5)


class SynchronousMachine(RuleBasedStateMachine):
    """Model-based check of Synchronous: aggregates equal the model's mean over live contributors.

    The model keeps, per layer, the accepted current-step values by worker, and applies the
    rules of docs/semantics.md independently of the implementation.
    """

    workers = Bundle("workers")
    LAYERS = ("a", "b")

    def __init__(self) -> None:
        super().__init__()
        self.opt = DistributedOptimizer(Synchronous(), "mean")
        self.active: set[str] = set()
        self.known: set[str] = set()
        self.pending: dict[str, dict[str, float]] = {k: {} for k in self.LAYERS}
        self.contributed: dict[str, set[str]] = {k: set() for k in self.LAYERS}
        self.aggregated: set[str] = set()
        self.dropped = 0

    @initialize(target=workers, names=st.just(("p", "q", "r", "s")))
    def start(self, names: tuple[str, ...]) -> Any:
        return multiple(*names)

    @rule(worker=workers)
    def register(self, worker: str) -> None:
        expected = worker not in self.active
        assert self.opt.register_worker(worker, now=0.0) is expected
        self.active.add(worker)
        self.known.add(worker)

    @rule(worker=workers)
    def deregister(self, worker: str) -> None:
        expected = worker in self.active
        assert self.opt.deregister_worker(worker) is expected
        self.active.discard(worker)

    @rule(worker=workers)
    def evict(self, worker: str) -> None:
        assert self.opt.evict_worker(worker) is (worker in self.known)
        self.known.discard(worker)
        self.active.discard(worker)
        for layer in self.LAYERS:
            if self.pending[layer].pop(worker, None) is not None:
                self.dropped += 1
            self.contributed[layer].discard(worker)

    @rule(worker=workers, layer=st.sampled_from(LAYERS), value=st.integers(-50, 50))
    def submit(self, worker: str, layer: str, value: int) -> None:
        update = upd(worker, [float(value)], layer=layer, step=self.opt.current_step)
        if worker not in self.active:
            with pytest.raises(WorkerNotFound):
                self.opt.submit_update(update, now=0.0)
        elif worker in self.contributed[layer]:
            with pytest.raises(StaleUpdate, match="duplicate"):
                self.opt.submit_update(update, now=0.0)
        elif layer in self.aggregated:
            with pytest.raises(StaleUpdate, match="late"):
                self.opt.submit_update(update, now=0.0)
            self.dropped += 1
        else:
            self.opt.submit_update(update, now=0.0)
            self.pending[layer][worker] = float(value)
            self.contributed[layer].add(worker)

    def _model_aggregate(self, layer: str) -> float | None:
        live = {w: v for w, v in self.pending[layer].items() if w in self.active}
        if not live:
            return None
        self.dropped += len(self.pending[layer]) - len(live)
        self.pending[layer] = {}
        self.aggregated.add(layer)
        return sum(live.values()) / len(live)

    @rule(layer=st.sampled_from(LAYERS))
    def try_aggregate(self, layer: str) -> None:
        live = [w for w in self.pending[layer] if w in self.active]
        ready = bool(live) and len(live) >= len(self.active)
        got = self.opt.try_aggregate(layer)
        if not ready:
            assert got is None
            return
        expected = self._model_aggregate(layer)
        assert got is not None and expected is not None
        assert got.contributing_workers == len(live)
        assert set(got.worker_ids) == set(live)
        np.testing.assert_allclose(got.gradient, [expected], rtol=1e-12)

    @precondition(lambda self: self.opt.current_step < 5)
    @rule()
    def close_step(self) -> None:
        got = self.opt.close_step()
        for layer in self.LAYERS:
            expected = self._model_aggregate(layer)
            if expected is None:
                assert layer not in got
            else:
                np.testing.assert_allclose(got[layer].gradient, [expected], rtol=1e-12)
        for layer in self.LAYERS:
            self.dropped += len(self.pending[layer])
            self.pending[layer] = {}
            self.contributed[layer] = set()
        self.aggregated = set()

    @invariant()
    def counters_agree(self) -> None:
        assert self.opt.active_workers() == sorted(self.active)
        assert self.opt.worker_count() == len(self.known)
        assert self.opt.dropped_updates == self.dropped
        for layer in self.LAYERS:
            assert self.opt.pending_updates_for(layer) == len(self.pending[layer])


SynchronousMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=30, deadline=None
)
test_synchronous_state_machine = SynchronousMachine.TestCase
