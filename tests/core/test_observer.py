"""Unit tests of what the pure core reports to its observer: staleness, drops, barrier waits.

Time is passed in; expected values are closed forms written out in the comments.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paramserver.core.optimizers import UpdateRule
from paramserver.core.shard import ServerCore
from paramserver.errors import InvalidArgument, StaleUpdate
from paramserver.server.config import ServerConfig
from paramserver.server.observability.hooks import BucketCounts, ShardObservations

pytestmark = pytest.mark.timeout(60)


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def observed_core(consistency: str, **config: object) -> tuple[ServerCore, ShardObservations]:
    core = ServerCore(ServerConfig(consistency=consistency, **config))  # type: ignore[arg-type]
    now = FakeClock()
    obs = ShardObservations(now, bsp=consistency == "bsp")
    core.observer = obs
    core.init({"w": np.zeros(2)}, UpdateRule("add"))
    return core, obs


def test_bsp_barrier_wait_and_lag_closed_form() -> None:
    """Three workers end step 0 at t = 0, 1, 3 s: the step closes at 3 s, so the waits are
    3, 2, 0 s and the lags (after the first finisher) 0, 1, 3 s."""
    core, obs = observed_core("bsp")
    assert isinstance(obs.now, FakeClock)
    ids = [core.register(n, 0.0).worker_id for n in ("a", "b", "c")]
    for wid in ids:
        core.push(wid, 1, 0, {"w": np.ones(2)}, 0.0)
    for wid, t in zip(ids, (0.0, 1.0, 3.0), strict=True):
        obs.now.t = t
        core.clock(wid, 0)
    assert core.bsp_step == 1
    got = {n: (b.wait_s, b.lag_s, b.steps) for n, b in obs.barrier.items()}
    assert got == {"a": (3.0, 0.0, 1), "b": (2.0, 1.0, 1), "c": (0.0, 3.0, 1)}
    assert [n for n, _ in obs.straggler_ranking()] == ["c", "b", "a"]
    # The aggregate counts its three contributors, each at staleness 0.
    assert core.applied_updates == 3
    assert obs.staleness_clocks.counts[0] == 3 and obs.staleness_clocks.count == 3


def test_drop_reasons_are_counted_once_each() -> None:
    core, obs = observed_core("asp", max_staleness=1)
    wid = core.register("a", 0.0).worker_id
    core.push(wid, 1, 0, {"w": np.ones(2)}, 0.0, base_version=0)  # applied (version 1)
    core.push(wid, 1, 0, {"w": np.ones(2)}, 0.0, base_version=0)  # duplicate
    core.push(wid, 2, 0, {"w": np.ones(2)}, 0.0, base_version=0)  # applied: 1 - 0 <= 1
    core.push(wid, 3, 0, {"w": np.ones(2)}, 0.0, base_version=0)  # stale: 2 - 0 > 1
    with pytest.raises(InvalidArgument):
        core.push(wid, 4, 0, {"w": np.array([np.inf, 0.0])}, 0.0)
    with pytest.raises(InvalidArgument):
        core.push(wid, 5, 0, {"w": np.ones(3)}, 0.0)
    with pytest.raises(StaleUpdate):
        core.push(wid, 6, 5, {"w": np.ones(2)}, 0.0)  # ahead of its clock
    nonzero = {k: v for k, v in obs.dropped_by_reason.items() if v}
    assert nonzero == {"duplicate": 1, "stale": 1, "non_finite": 1, "invalid": 1, "stale_step": 1}
    assert core.applied_updates == 2 == obs.staleness_versions.count
    assert obs.staleness_versions.total == 0 + 1


@settings(max_examples=60, deadline=None)
@given(
    s=st.integers(0, 3),
    schedule=st.lists(st.tuples(st.integers(0, 2), st.booleans()), min_size=1, max_size=60),
)
def test_ssp_staleness_never_exceeds_the_bound(s: int, schedule: list[tuple[int, bool]]) -> None:
    """Workers push only at clocks where a pull is admitted (they read before computing); then
    every applied gradient's staleness in clocks is <= s (Ho et al. 2013)."""
    core, obs = observed_core("ssp", staleness=s)
    ids = [core.register(n, 0.0).worker_id for n in ("a", "b", "c")]
    request = 0
    for who, clock_after in schedule:
        wid = ids[who]
        if not core.check_pull(wid).admitted:
            continue
        request += 1
        core.push(wid, request, core.cluster.workers[wid].clock, {"w": np.ones(2)}, 0.0)
        if clock_after:
            core.clock(wid, core.cluster.workers[wid].clock)
    hist = obs.staleness_clocks
    assert hist.count == core.applied_updates
    worst = max((b for b, n in zip(hist.bounds, hist.counts, strict=False) if n), default=0)
    assert worst <= s and hist.counts[-1] == 0


def test_bucket_counts_cumulative() -> None:
    h = BucketCounts((0, 1, 4))
    for v in (0, 0, 1, 3, 9):
        h.observe(v)
    assert h.cumulative() == [("0.0", 2), ("1.0", 3), ("4.0", 4), ("+Inf", 5)]
    assert h.total == 13 and h.count == 5
