"""Unit tests of the pure consistency core: ClusterState and ServerCore, no sockets, no loop.

docs/semantics.md "Clocks and consistency", "Membership" and "Idempotence"; the pure-core halves of
cases/ssp-bound.md and cases/bsp-dead-worker.md. Time is always passed in as ``now``. Expected
values are derived by hand (closed forms in comments) or by the small independent model in
:class:`ConsistencyMachine`; never copied from the code's output.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from paramserver.core.consistency import ClusterState, Consistency, DeathPolicy
from paramserver.core.optimizers import UpdateRule
from paramserver.core.shard import ServerCore
from paramserver.errors import (
    AlreadyExists,
    InvalidArgument,
    StaleUpdate,
    WorkerNotFound,
)
from paramserver.server.config import ServerConfig

pytestmark = pytest.mark.timeout(60)

LEASE_S = 2.0
POLICIES = ("shrink", "fail_fast", "wait")


def cluster(
    consistency: str = "ssp", s: int = 0, policy: str = "shrink", lease_s: float = LEASE_S
) -> ClusterState:
    return ClusterState(
        Consistency(consistency), staleness=s, lease_s=lease_s, death_policy=DeathPolicy(policy)
    )


def make_core(**config: Any) -> ServerCore:
    config.setdefault("lease_ms", int(LEASE_S * 1000))
    return ServerCore(ServerConfig(**config))


def advance(cs: ClusterState, worker_id: str, n: int) -> None:
    """End ``n`` iterations of one worker."""
    for _ in range(n):
        cs.clock(worker_id, cs.workers[worker_id].clock)


def core_clock(core: ServerCore, worker_id: str) -> int:
    return core.clock(worker_id, core.cluster.workers[worker_id].clock)


# ------------------------------------------------------------------------------ config checks


def test_cluster_state_refuses_bad_arguments() -> None:
    with pytest.raises(InvalidArgument, match="staleness"):
        cluster("ssp", s=-1)
    with pytest.raises(InvalidArgument, match="lease"):
        cluster(lease_s=0.0)
    with pytest.raises(InvalidArgument, match="non-empty"):
        cluster().register("", 0.0)


def test_bsp_is_staleness_zero_whatever_was_asked() -> None:
    assert cluster("bsp", s=3).staleness == 0
    assert cluster("ssp", s=3).staleness == 3


# ------------------------------------------------------------------------------ registration


@pytest.mark.parametrize("consistency", ["bsp", "ssp", "asp"])
def test_first_worker_starts_at_zero(consistency: str) -> None:
    rec, fenced = cluster(consistency).register("A", 0.0)
    assert (rec.clock, rec.live, fenced) == (0, True, [])


@pytest.mark.parametrize("clocks", [(0,), (3,), (2, 5), (5, 2), (4, 4, 7), (1, 6, 6), (9, 8, 9)])
@pytest.mark.parametrize("consistency", ["ssp", "asp"])
def test_late_joiner_starts_at_live_minimum_not_zero(
    consistency: str, clocks: tuple[int, ...]
) -> None:
    """cases/ssp-bound.md: a worker that joins late starts at the current minimum clock."""
    cs = cluster(consistency, s=1)
    ids = [cs.register(f"w{i}", 0.0)[0].worker_id for i in range(len(clocks))]
    for wid, c in zip(ids, clocks, strict=True):
        advance(cs, wid, c)
    late, _ = cs.register("late", 1.0)
    assert late.clock == min(clocks)


@pytest.mark.parametrize("clocks", [(0, 0), (3, 1), (2, 2, 5)])
def test_bsp_late_joiner_starts_at_open_step(clocks: tuple[int, ...]) -> None:
    """Under BSP the live minimum is the open step: the joiner takes part in that step."""
    core = make_core(consistency="bsp")
    ids = [core.register(f"w{i}", 0.0).worker_id for i in range(len(clocks))]
    for wid, c in zip(ids, clocks, strict=True):
        for _ in range(c):
            core_clock(core, wid)
    late = core.register("late", 1.0)
    assert late.clock == min(clocks) == core.bsp_step


def test_joiner_after_everyone_left_starts_at_last_minimum() -> None:
    """A at 5, B at 3: B leaves (minimum now 5), A leaves (nobody live): C starts at 5, not 0."""
    cs = cluster("ssp", s=2)
    a = cs.register("A", 0.0)[0].worker_id
    b = cs.register("B", 0.0)[0].worker_id
    advance(cs, a, 5)
    advance(cs, b, 3)
    cs.leave(b)
    cs.leave(a)
    assert cs.live_workers() == []
    assert cs.register("C", 1.0)[0].clock == 5


def test_joiner_after_everyone_was_evicted_starts_at_last_minimum() -> None:
    cs = cluster("ssp", s=2)
    a = cs.register("A", 0.0)[0].worker_id
    advance(cs, a, 4)
    assert [ch.worker.worker_id for ch in cs.expire(LEASE_S)] == [a]
    assert cs.register("B", 3.0)[0].clock == 4


@pytest.mark.parametrize("consistency", ["bsp", "ssp", "asp"])
def test_core_joiner_after_everyone_left_starts_at_last_minimum(consistency: str) -> None:
    core = make_core(consistency=consistency, staleness=1)
    a = core.register("A", 0.0).worker_id
    b = core.register("B", 0.0).worker_id
    for _ in range(3):
        core_clock(core, a)
        core_clock(core, b)
    core.leave(a)
    core.leave(b)
    assert core.register("C", 1.0).clock == 3


def test_same_name_twice_is_already_exists_and_changes_nothing() -> None:
    cs = cluster()
    a, _ = cs.register("A", 0.0, client_nonce="n1")
    epoch, incarnations = cs.epoch, cs.incarnations
    for nonce in ("", "n2"):
        with pytest.raises(AlreadyExists, match="'A'") as err:
            cs.register("A", 1.0, client_nonce=nonce)
        assert err.value.code is grpc.StatusCode.ALREADY_EXISTS
    assert (cs.epoch, cs.incarnations) == (epoch, incarnations)
    assert [w.worker_id for w in cs.live_workers()] == [a.worker_id]


def test_name_is_free_again_after_leave() -> None:
    cs = cluster()
    a, _ = cs.register("A", 0.0)
    cs.leave(a.worker_id)
    again, fenced = cs.register("A", 1.0)
    assert again.worker_id != a.worker_id
    assert fenced == []
    with pytest.raises(WorkerNotFound):
        cs.heartbeat(a.worker_id, 1.0)


@pytest.mark.parametrize(
    ("old_clock", "other_clock", "expected"),
    [
        (3, 1, 3),  # resumes at its own clock, never back to the minimum of the others
        (3, 3, 3),
        (1, 4, 1),  # the others are ahead: it still continues its predecessor's iterations
        (0, 0, 0),
    ],
)
def test_replace_fences_the_old_incarnation(
    old_clock: int, other_clock: int, expected: int
) -> None:
    cs = cluster("ssp", s=5)
    old, _ = cs.register("A", 0.0)
    b, _ = cs.register("B", 0.0)
    advance(cs, old.worker_id, old_clock)
    advance(cs, b.worker_id, other_clock)
    epoch = cs.epoch
    new, fenced = cs.register("A", 1.0, replace=True)
    assert new.worker_id != old.worker_id
    assert [(ch.worker.worker_id, ch.why) for ch in fenced] == [(old.worker_id, "fenced")]
    assert new.clock == expected
    assert not old.live and new.live
    assert cs.epoch > epoch
    assert sorted(w.name for w in cs.live_workers()) == ["A", "B"]
    for call in (
        lambda: cs.heartbeat(old.worker_id, 1.0),
        lambda: cs.clock(old.worker_id, old.clock),
        lambda: cs.check_pull(old.worker_id),
        lambda: cs.leave(old.worker_id),
    ):
        with pytest.raises(WorkerNotFound, match="no longer a member"):
            call()


def test_register_retry_with_same_nonce_is_idempotent() -> None:
    cs = cluster(lease_s=2.0)
    a, _ = cs.register("A", 10.0, client_nonce="n1")
    epoch, incarnations = cs.epoch, cs.incarnations
    again, fenced = cs.register("A", 11.0, client_nonce="n1")
    assert again.worker_id == a.worker_id
    assert fenced == []
    assert (cs.epoch, cs.incarnations) == (epoch, incarnations)
    assert again.lease_expiry_s == 13.0  # the retry renewed the lease: 11 + 2
    assert cs.expire(12.5) == []
    # After a leave the same nonce does not resurrect the departed registration.
    cs.leave(a.worker_id)
    fresh, _ = cs.register("A", 14.0, client_nonce="n1")
    assert fresh.worker_id != a.worker_id


def test_core_register_retry_with_same_nonce_keeps_one_member() -> None:
    core = make_core(consistency="bsp")
    first = core.register("A", 0.0, client_nonce="n")
    assert core.register("A", 0.5, client_nonce="n").worker_id == first.worker_id
    assert len(core.cluster.live_workers()) == 1


# ------------------------------------------------------------------------------ leases


@pytest.mark.parametrize(
    ("heartbeat_at", "expire_at", "evicted"),
    [
        (None, 11.875, False),
        (None, 12.0, True),  # registered at 10, lease 2 s: lapses at exactly 12
        (None, 99.0, True),
        (11.0, 12.0, False),
        (11.0, 12.875, False),
        (11.0, 13.0, True),
        (11.5, 13.25, False),
        (11.5, 13.5, True),
    ],
)
def test_lease_lapses_at_expiry(
    heartbeat_at: float | None, expire_at: float, evicted: bool
) -> None:
    cs = cluster()
    a, _ = cs.register("A", 10.0)
    if heartbeat_at is not None:
        cs.heartbeat(a.worker_id, heartbeat_at)
    changes = cs.expire(expire_at)
    assert [(ch.worker.worker_id, ch.why) for ch in changes] == (
        [(a.worker_id, "evicted")] if evicted else []
    )
    assert a.live is not evicted


def test_evicted_worker_is_refused_and_may_register_again() -> None:
    cs = cluster("ssp", s=1)
    a, _ = cs.register("A", 0.0)
    b, _ = cs.register("B", 0.0)
    c, _ = cs.register("C", 0.0)
    advance(cs, a.worker_id, 4)
    advance(cs, c.worker_id, 2)
    cs.heartbeat(a.worker_id, 1.5)
    epoch = cs.epoch
    changes = cs.expire(2.0)  # B and C lapse together
    assert sorted(ch.worker.name for ch in changes) == ["B", "C"]
    epoch_after = cs.epoch
    assert epoch_after > epoch
    assert cs.expire(2.0) == []
    assert cs.epoch == epoch_after
    for call in (
        lambda: cs.heartbeat(b.worker_id, 2.0),
        lambda: cs.clock(b.worker_id, 0),
        lambda: cs.check_pull(b.worker_id),
        lambda: cs.leave(b.worker_id),
    ):
        with pytest.raises(WorkerNotFound) as err:
            call()
        assert err.value.code is grpc.StatusCode.FAILED_PRECONDITION
    # The minimum is over live workers only (A at 4), and a returning B starts there.
    assert cs.min_clock() == 4
    assert cs.register("B", 2.5)[0].clock == 4


# ------------------------------------------------------------------------------ clocks


def test_clock_is_idempotent_and_refuses_the_future() -> None:
    cs = cluster("ssp", s=3)
    a = cs.register("A", 0.0)[0].worker_id
    assert cs.clock(a, 0) == 1
    assert cs.clock(a, 0) == 1  # a retried end of iteration 0
    assert cs.clock(a, 1) == 2
    assert cs.clock(a, 0) == 2
    with pytest.raises(StaleUpdate, match="clock 5"):
        cs.clock(a, 5)
    assert cs.workers[a].clock == 2
    with pytest.raises(WorkerNotFound, match="unknown"):
        cs.clock("ghost#9", 0)


# ------------------------------------------------------------------------------ pull admission

MODES = [("bsp", 0), ("ssp", 0), ("ssp", 1), ("ssp", 2), ("ssp", 3), ("asp", 0)]


@pytest.mark.parametrize("other", range(6))
@pytest.mark.parametrize("mine", range(6))
@pytest.mark.parametrize("mode", MODES, ids=[f"{c}{s}" for c, s in MODES])
def test_pull_admission_grid(mode: tuple[str, int], mine: int, other: int) -> None:
    """SSP(s): a pull at clock c is admitted iff every live clock >= c - s; BSP: s = 0; ASP:
    always (cases/ssp-bound.md invariant)."""
    consistency, s = mode
    cs = cluster(consistency, s=s)
    a = cs.register("A", 0.0)[0].worker_id
    b = cs.register("B", 0.0)[0].worker_id
    advance(cs, a, mine)
    advance(cs, b, other)
    adm = cs.check_pull(a)
    expected = consistency == "asp" or other >= mine - s
    assert adm.admitted is expected
    assert not adm.aborted
    if not expected:
        assert adm.waiting_for == ("B",)
        assert "B" in adm.reason


def test_waiting_names_every_worker_behind_in_order() -> None:
    cs = cluster("ssp", s=2)
    ids = {n: cs.register(n, 0.0)[0].worker_id for n in ("D", "A", "C", "B")}
    for name, c in {"A": 4, "B": 0, "C": 1, "D": 4}.items():
        advance(cs, ids[name], c)
    adm = cs.check_pull(ids["A"])  # needs clock >= 4 - 2 = 2
    assert (adm.admitted, adm.waiting_for) == (False, ("B", "C"))


def test_observer_read_is_always_admitted() -> None:
    cs = cluster("bsp")
    a = cs.register("A", 0.0)[0].worker_id
    cs.register("B", 0.0)
    advance(cs, a, 3)
    assert not cs.check_pull(a).admitted
    assert cs.check_pull("").admitted


@pytest.mark.parametrize("consistency", ["bsp", "ssp", "asp"])
def test_pull_by_unknown_worker_is_refused(consistency: str) -> None:
    with pytest.raises(WorkerNotFound):
        cluster(consistency).check_pull("ghost#1")


# ------------------------------------------------------------------------------ BSP steps


def test_bsp_step_is_applied_once_when_every_live_worker_clocked() -> None:
    core = make_core(consistency="bsp", aggregation="mean")
    core.init({"w": np.array([1.0, 2.0, 3.0, 4.0])}, UpdateRule("sgd", lr=0.5))
    a, b, c = (core.register(n, 0.0).worker_id for n in "ABC")
    grads = {
        a: np.array([1.0, 2.0, 3.0, 4.0]),
        b: np.array([3.0, 3.0, 3.0, 3.0]),
        c: np.array([-1.0, 0.0, 6.0, 2.0]),
    }
    for i, (wid, g) in enumerate(grads.items()):
        assert core.push(wid, 100 + i, 0, {"w": g}, 0.1).queued
    core_clock(core, a)
    core_clock(core, b)
    np.testing.assert_array_equal(core.store.get("w").value, [1.0, 2.0, 3.0, 4.0])
    assert core.bsp_step == 0
    assert core.check_pull(a).waiting_for == ("C",)
    core_clock(core, c)
    # mean = [3, 5, 12, 9] / 3 = [1, 5/3, 4, 3]; w = w0 - 0.5 * mean
    np.testing.assert_allclose(
        core.store.get("w").value, [0.5, 2.0 - 5.0 / 6.0, 1.0, 2.5], rtol=0, atol=1e-15
    )
    assert core.bsp_step == 1
    assert core.applied_updates == 3
    assert core.check_pull(a).admitted


def test_bsp_push_for_a_step_that_is_not_open_or_twice_is_refused() -> None:
    core = make_core(consistency="bsp", aggregation="sum")
    core.init({"w": np.zeros(2)}, UpdateRule("add"))
    a = core.register("A", 0.0).worker_id
    b = core.register("B", 0.0).worker_id
    assert core.push(a, 1, 0, {"w": np.array([1.0, 0.0])}, 0.0).queued
    assert core.push(a, 1, 0, {"w": np.array([1.0, 0.0])}, 0.0).duplicate  # a retry
    with pytest.raises(StaleUpdate, match="duplicate"):
        core.push(a, 2, 0, {"w": np.array([100.0, 0.0])}, 0.0)
    core_clock(core, a)
    with pytest.raises(StaleUpdate, match="step 1"):  # A is at clock 1, step 0 is open
        core.push(a, 3, 1, {"w": np.array([1000.0, 0.0])}, 0.0)
    with pytest.raises(StaleUpdate, match="clock 0"):  # stale clock in the header
        core.push(a, 4, 0, {"w": np.array([1000.0, 0.0])}, 0.0)
    core.push(b, 1, 0, {"w": np.array([0.0, 2.0])}, 0.0)
    core_clock(core, b)
    np.testing.assert_array_equal(core.store.get("w").value, [1.0, 2.0])
    assert (core.applied_updates, core.duplicate_pushes, core.rejected_pushes) == (2, 1, 3)


@pytest.mark.parametrize("consistency", ["ssp", "asp"])
def test_ssp_and_asp_apply_each_push_on_arrival(consistency: str) -> None:
    core = make_core(consistency=consistency, staleness=1)
    core.init({"w": np.zeros(3)}, UpdateRule("add"))
    a = core.register("A", 0.0).worker_id
    core.push(a, 1, 0, {"w": np.array([1.0, 2.0, 3.0])}, 0.0)
    np.testing.assert_array_equal(core.store.get("w").value, [1.0, 2.0, 3.0])
    with pytest.raises(StaleUpdate, match="clock 4"):
        core.push(a, 2, 4, {"w": np.ones(3)}, 0.0)
    assert core.applied_updates == 1


# ------------------------------------------------------------------------------ death policies


def _step1_with_c_silent(policy: str, c_pushed: bool) -> tuple[ServerCore, list[str]]:
    """cases/bsp-dead-worker.md on the pure core: float32 w (4,), SGD lr 1, mean, lease 2 s.

    Step 0: A, B, C push 1, 2, 3 and clock: w = -2. Step 1: A pushes 2, B pushes 4 and both
    clock; C (optionally pushing 30) sends nothing more. A and B renewed their lease at 1.5.
    """
    core = make_core(consistency="bsp", aggregation="mean", death_policy=policy)
    core.init({"w": np.zeros(4, np.float32)}, UpdateRule("sgd", lr=1.0))
    ids = [core.register(n, 0.0).worker_id for n in "ABC"]
    for i, wid in enumerate(ids):
        core.push(wid, 10, 0, {"w": np.full(4, i + 1, np.float32)}, 0.5)
    for wid in ids:
        core_clock(core, wid)
    np.testing.assert_array_equal(core.store.get("w").value, np.full(4, -2.0, np.float32))
    a, b, c = ids
    core.push(a, 11, 1, {"w": np.full(4, 2.0, np.float32)}, 1.0)
    core.push(b, 11, 1, {"w": np.full(4, 4.0, np.float32)}, 1.0)
    if c_pushed:
        core.push(c, 11, 1, {"w": np.full(4, 30.0, np.float32)}, 1.0)
    core_clock(core, a)
    core_clock(core, b)
    core.heartbeat(a, 1.5)
    core.heartbeat(b, 1.5)
    assert core.check_pull(a).waiting_for == ("C",)
    assert core.expire(1.875) == []
    return core, ids


@pytest.mark.parametrize("c_pushed", [False, True])
def test_shrink_completes_the_step_with_the_survivors(c_pushed: bool) -> None:
    """cases/bsp-dead-worker.md (default policy): the step completes with A and B, / 2."""
    core, (a, b, c) = _step1_with_c_silent("shrink", c_pushed)
    assert [ch.worker.worker_id for ch in core.expire(2.0)] == [c]
    # Mean of A's and B's gradients only: (2 + 4) / 2 = 3, so w = -2 - 3 = -5.
    np.testing.assert_array_equal(core.store.get("w").value, np.full(4, -5.0, np.float32))
    assert core.check_pull(a).admitted and core.check_pull(b).admitted
    assert len(core.cluster.live_workers()) == 2
    assert core.bsp_step == 2
    assert core.applied_updates == 3 + 2


@pytest.mark.parametrize("c_pushed", [False, True])
def test_fail_fast_aborts_the_step_naming_the_dead_worker(c_pushed: bool) -> None:
    """cases/bsp-dead-worker.md (strict policy): A's and B's reads are ABORTED naming C."""
    core, (a, b, c) = _step1_with_c_silent("fail_fast", c_pushed)
    assert [ch.worker.worker_id for ch in core.expire(2.0)] == [c]
    for wid in (a, b):
        adm = core.check_pull(wid)
        assert adm.aborted and not adm.admitted
        assert "'C'" in adm.reason
    np.testing.assert_array_equal(core.store.get("w").value, np.full(4, -2.0, np.float32))
    # The survivors go on: step 2 with A and B closes normally, w = -2 - (1 + 3) / 2 = -4.
    core.push(a, 12, 2, {"w": np.full(4, 1.0, np.float32)}, 2.1)
    core.push(b, 12, 2, {"w": np.full(4, 3.0, np.float32)}, 2.1)
    core_clock(core, a)
    core_clock(core, b)
    np.testing.assert_array_equal(core.store.get("w").value, np.full(4, -4.0, np.float32))
    assert core.check_pull(a).admitted


@pytest.mark.parametrize("c_pushed", [False, True])
def test_wait_holds_the_step_until_the_worker_returns(c_pushed: bool) -> None:
    core, (a, b, c) = _step1_with_c_silent("wait", c_pushed)
    assert [ch.worker.worker_id for ch in core.expire(2.0)] == [c]
    assert len(core.cluster.live_workers()) == 2
    assert core.check_pull(a).waiting_for == core.check_pull(b).waiting_for == ("C",)
    np.testing.assert_array_equal(core.store.get("w").value, np.full(4, -2.0, np.float32))
    back = core.register("C", 2.5)
    # C's successor continues C's iterations: it takes C's clock (1, the open step), whatever
    # C had queued for step 1 leaves it (the successor redoes the step), and the step waits
    # for the successor's push: (2 + 4 + 6) / 3 = 4 -> w = -6, counted once.
    assert back.clock == 1
    np.testing.assert_array_equal(core.store.get("w").value, np.full(4, -2.0, np.float32))
    assert core.check_pull(a).waiting_for == ("C",)
    with pytest.raises(WorkerNotFound):
        core.heartbeat(c, 2.5)
    applied = core.applied_updates
    core.push(back.worker_id, 1, 1, {"w": np.full(4, 6.0, np.float32)}, 2.5)
    core_clock(core, back.worker_id)
    np.testing.assert_array_equal(core.store.get("w").value, np.full(4, -6.0, np.float32))
    assert core.check_pull(a).admitted
    assert core.applied_updates == applied + 3


def test_wait_takeover_that_redoes_the_step_counts_the_worker_once() -> None:
    """C pushes step 0 and dies before anyone clocks; its successor redoes step 0 and pushes
    the same gradient again: the mean is over 3 contributions, not 4."""
    core = make_core(consistency="bsp", aggregation="mean", death_policy="wait")
    core.init({"w": np.zeros(1)}, UpdateRule("sgd", lr=1.0))
    a, b, c = (core.register(n, 0.0).worker_id for n in "ABC")
    for i, wid in enumerate((a, b, c)):
        core.push(wid, 1, 0, {"w": np.array([float(i + 1)])}, 0.0)
    core.heartbeat(a, 1.5)
    core.heartbeat(b, 1.5)
    core.expire(2.0)
    back = core.register("C", 2.5)
    assert back.clock == 0
    core.push(back.worker_id, 2, 0, {"w": np.array([3.0])}, 2.5)
    for wid in (a, b, back.worker_id):
        core_clock(core, wid)
    # (1 + 2 + 3) / 3 = 2
    np.testing.assert_array_equal(core.store.get("w").value, [-2.0])
    assert core.applied_updates == 3


@pytest.mark.parametrize("policy", POLICIES)
def test_clean_leave_releases_the_step_at_once_under_every_policy(policy: str) -> None:
    """cases/bsp-dead-worker.md (clean leave): no lease is sat out, whatever the policy."""
    core, (a, b, c) = _step1_with_c_silent(policy, c_pushed=False)
    change = core.leave(c)
    assert change.why == "left"
    np.testing.assert_array_equal(core.store.get("w").value, np.full(4, -5.0, np.float32))
    assert core.check_pull(a).admitted and core.check_pull(b).admitted


# ------------------------------------------------------------------------------ state machine

NAMES = ("A", "B", "C", "D")
MAX_REGISTRATIONS = 16  # one slot of the probe key per registration
MAX_CLOCK = 40  # 2**clock stays exact in float64
CONFIGS = [
    (consistency, s, policy)
    for consistency, s in [("bsp", 0), ("ssp", 0), ("ssp", 1), ("ssp", 2), ("ssp", 3), ("asp", 0)]
    for policy in POLICIES
]


@dataclass
class ModelWorker:
    worker_id: str
    name: str
    slot: int
    clock: int
    expiry_s: float
    live: bool = True
    lost: bool = False
    pushed: set[int] = field(default_factory=set)


class ConsistencyMachine(RuleBasedStateMachine):
    """Random register / clock / push / leave / heartbeat / expire / pull-check sequences on the
    pure ServerCore, against an independent model of docs/semantics.md.

    The probe key ``v`` (float64, rule ``add``, BSP aggregation ``sum``) has one element per
    registration; registration k pushes ``2**clock`` into element k, so the value decodes
    bitwise into exactly which (worker, clock) terms it holds (cases/ssp-bound.md freshness).
    """

    def __init__(self) -> None:
        super().__init__()
        self.core: ServerCore | None = None

    @initialize(cfg=st.sampled_from(CONFIGS))
    def setup(self, cfg: tuple[str, int, str]) -> None:
        consistency, s, policy = cfg
        self.consistency, self.s, self.policy = consistency, s, policy
        self.core = make_core(
            consistency=consistency, staleness=s, death_policy=policy, aggregation="sum"
        )
        self.core.init({"v": np.zeros(MAX_REGISTRATIONS)}, UpdateRule("add"))
        self.now = 0.0
        self.workers: dict[str, ModelWorker] = {}
        self.floor = 0
        self.aborted: set[int] = set()
        self.request_id = 0
        self.last_push: tuple[str, int, dict[str, np.ndarray]] | None = None

    # -- model ---------------------------------------------------------------------------------

    def holding(self) -> list[ModelWorker]:
        return [w for w in self.workers.values() if w.live or w.lost]

    def live(self) -> list[ModelWorker]:
        return [w for w in self.workers.values() if w.live]

    def model_min(self) -> int:
        holding = self.holding()
        return min(w.clock for w in holding) if holding else self.floor

    def settle(self) -> None:
        self.floor = max(self.floor, self.model_min())

    def pick(self, data: st.DataObject) -> ModelWorker:
        """Mostly a live worker; sometimes any registration (departed ones are refused)."""
        live = sorted(w.worker_id for w in self.live())
        if live and data.draw(st.integers(0, 4), label="live?") > 0:
            return self.workers[data.draw(st.sampled_from(live), label="worker")]
        return self.workers[data.draw(st.sampled_from(sorted(self.workers)), label="worker")]

    @property
    def c(self) -> ServerCore:
        assert self.core is not None
        return self.core

    # -- rules ---------------------------------------------------------------------------------

    @precondition(lambda self: self.core is not None and len(self.workers) < MAX_REGISTRATIONS)
    @rule(name=st.sampled_from(NAMES), replace=st.sampled_from([False, False, False, True]))
    def register(self, name: str, replace: bool) -> None:
        same = [w for w in self.workers.values() if w.name == name and (w.live or w.lost)]
        if any(w.live for w in same) and not replace:
            with pytest.raises(AlreadyExists):
                self.c.register(name, self.now, replace=replace)
            return
        holding = self.holding()  # the predecessors among them: a successor takes its clock
        base = min(w.clock for w in holding) if holding else self.floor
        for w in same:  # fenced (live) or taken over (lost under `wait`)
            event("fenced" if w.live else "lost worker taken over")
            w.live = w.lost = False
        start = max([base] + [w.clock for w in same])
        rec = self.c.register(name, self.now, replace=replace)
        assert rec.clock == start
        self.workers[rec.worker_id] = ModelWorker(
            rec.worker_id, name, len(self.workers), start, self.now + LEASE_S
        )
        self.settle()

    @precondition(lambda self: self.core is not None and self.workers)
    @rule(data=st.data(), n=st.integers(1, 3))
    def clock(self, data: st.DataObject, n: int) -> None:
        w = self.pick(data)
        if not w.live:
            with pytest.raises(WorkerNotFound):
                self.c.clock(w.worker_id, w.clock)
            return
        for _ in range(min(n, MAX_CLOCK - w.clock)):
            assert self.c.clock(w.worker_id, w.clock) == w.clock + 1
            w.clock += 1
            self.settle()
        if w.clock >= 2:  # a retried end of an earlier iteration changes nothing
            assert self.c.clock(w.worker_id, w.clock - 2) == w.clock

    @precondition(lambda self: self.core is not None and self.workers)
    @rule(data=st.data())
    def push(self, data: st.DataObject) -> None:
        w = self.pick(data)
        grad = np.zeros(MAX_REGISTRATIONS)
        grad[w.slot] = 2.0**w.clock
        self.request_id += 1
        rid = self.request_id
        if not w.live:
            with pytest.raises(WorkerNotFound):
                self.c.push(w.worker_id, rid, w.clock, {"v": grad}, self.now)
            return
        if self.consistency != "bsp" and w.clock in w.pushed:
            return  # SSP/ASP accept several pushes per clock; one keeps the bits distinct
        accepted = w.clock not in w.pushed and (
            self.consistency != "bsp" or w.clock == self.c.bsp_step
        )
        if not accepted:
            with pytest.raises(StaleUpdate):
                self.c.push(w.worker_id, rid, w.clock, {"v": grad}, self.now)
            return
        result = self.c.push(w.worker_id, rid, w.clock, {"v": grad}, self.now)
        assert not result.duplicate
        assert result.queued is (self.consistency == "bsp")
        w.pushed.add(w.clock)
        self.last_push = (w.worker_id, rid, {"v": grad})

    @precondition(lambda self: self.core is not None and self.last_push is not None)
    @rule()
    def retry_last_push(self) -> None:
        assert self.last_push is not None
        wid, rid, grads = self.last_push
        before = self.c.store.get("v").value.copy()
        w = self.workers[wid]
        if not w.live:
            with pytest.raises(WorkerNotFound):
                self.c.push(wid, rid, w.clock, grads, self.now)
        else:
            assert self.c.push(wid, rid, w.clock, grads, self.now).duplicate
        np.testing.assert_array_equal(self.c.store.get("v").value, before)

    @precondition(lambda self: self.core is not None and self.workers)
    @rule(data=st.data())
    def leave(self, data: st.DataObject) -> None:
        w = self.pick(data)
        if not w.live:
            with pytest.raises(WorkerNotFound):
                self.c.leave(w.worker_id)
            return
        assert self.c.leave(w.worker_id).why == "left"
        w.live = False
        self.settle()

    @precondition(lambda self: self.core is not None and self.workers)
    @rule(data=st.data())
    def heartbeat(self, data: st.DataObject) -> None:
        w = self.pick(data)
        if not w.live:
            with pytest.raises(WorkerNotFound):
                self.c.heartbeat(w.worker_id, self.now)
            return
        self.c.heartbeat(w.worker_id, self.now)
        w.expiry_s = self.now + LEASE_S

    @precondition(lambda self: self.core is not None)
    @rule(dt=st.sampled_from([0.25, 0.5, 1.0, 2.0, 3.0]))
    def advance_time(self, dt: float) -> None:
        """Time passes and the lease reaper runs."""
        self.now += dt
        self.expire()

    def expire(self) -> None:
        dead = [w for w in self.live() if w.expiry_s <= self.now]
        for w in dead:
            w.live = False
            w.lost = self.policy == "wait" and self.consistency != "asp"
            if self.policy == "fail_fast" and self.consistency != "asp":
                self.aborted.add(w.clock)
        changes = self.c.expire(self.now)
        assert sorted(ch.worker.worker_id for ch in changes) == sorted(w.worker_id for w in dead)
        self.settle()

    @precondition(lambda self: self.core is not None and any(w.live for w in self.workers.values()))
    @rule(data=st.data())
    def kill_one(self, data: st.DataObject) -> None:
        """One worker goes silent (SIGKILL): the others heartbeat, a lease passes, expire."""
        victim = data.draw(
            st.sampled_from(sorted(w.worker_id for w in self.live())), label="victim"
        )
        for w in self.live():
            if w.worker_id != victim:
                self.c.heartbeat(w.worker_id, self.now + LEASE_S / 2)
                w.expiry_s = self.now + LEASE_S / 2 + LEASE_S
        self.now += LEASE_S
        self.expire()

    @invariant()
    def pulls_are_admitted_by_the_rule(self) -> None:
        """Every registration's pull, checked after every step (check_pull has no effects)."""
        if self.core is None:
            return
        for w in self.workers.values():
            if not w.live:
                with pytest.raises(WorkerNotFound):
                    self.c.check_pull(w.worker_id)
                continue
            adm = self.c.check_pull(w.worker_id)
            live_min = min(q.clock for q in self.live())
            # The invariant of cases/ssp-bound.md, independent of the model below.
            if adm.admitted and self.consistency != "asp":
                assert live_min >= w.clock - self.s
            # The exact rule: ASP always; fail_fast refuses a read that needs an aborted step;
            # otherwise admitted iff every live (and, under `wait`, lost) clock >= c - s.
            need = w.clock - self.s
            if self.consistency == "asp":
                assert adm.admitted
            elif need - 1 in self.aborted:
                assert adm.aborted and not adm.admitted
                event("pull aborted")
            else:
                behind = sorted(q.name for q in self.holding() if q.clock < need)
                assert adm.admitted is (not behind)
                assert list(adm.waiting_for) == behind
                event(f"pull {'admitted' if adm.admitted else 'waiting'}")
            if adm.admitted:
                self.check_fresh(w.clock)
        assert self.c.check_pull("").admitted  # an observer read never waits

    def check_fresh(self, c: int) -> None:
        """An admitted read at clock c holds every term of clocks <= c - s - 1 of every live
        worker (BSP: except of a step aborted under fail_fast)."""
        terms = self.decode()
        for q in self.live():
            for t in q.pushed:
                if t <= c - self.s - 1 and not (self.consistency == "bsp" and t in self.aborted):
                    assert t in terms[q.slot], (q.name, t, c)

    def decode(self) -> list[set[int]]:
        value = self.c.store.get("v").value
        out = []
        for x in value:
            n = int(x)
            assert n == x and n >= 0
            out.append({bit for bit in range(MAX_CLOCK + 1) if n >> bit & 1})
        return out

    # -- invariants ----------------------------------------------------------------------------

    @invariant()
    def value_holds_only_pushed_terms(self) -> None:
        if self.core is None:
            return
        terms = self.decode()
        by_slot = {w.slot: w.pushed for w in self.workers.values()}
        for slot, bits in enumerate(terms):
            pushed = by_slot.get(slot, set())
            assert bits <= pushed
            if self.consistency == "bsp":
                assert all(t < self.c.bsp_step for t in bits)  # only closed steps are applied
            else:
                assert bits == pushed  # SSP/ASP apply on arrival

    @invariant()
    def minimum_and_membership_match_the_model(self) -> None:
        if self.core is None:
            return
        assert self.c.min_clock() == self.model_min()
        assert len(self.c.cluster.live_workers()) == len(self.live())
        if self.consistency == "bsp" and self.holding():
            assert self.c.bsp_step == self.model_min()


ConsistencyMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestConsistencyMachine = ConsistencyMachine.TestCase
