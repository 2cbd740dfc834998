"""Case non-finite-gradient.md on the pure core: NaN/Inf gradients are refused whole, finite ones
(however large, tiny or negative-zero) are not. Oracles are float64 closed forms."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest

from paramserver.core.optimizers import UpdateRule
from paramserver.core.shard import ServerCore
from paramserver.errors import InvalidArgument, NonFiniteGradient
from paramserver.server.config import ServerConfig

pytestmark = pytest.mark.timeout(30)

DTYPES = [np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)]
N = 1000


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bsp_step_completes_with_the_finite_gradients(dtype: np.dtype[Any]) -> None:
    """Case non-finite-gradient.md: three BSP workers; W2's gradient has NaN at 17 and +Inf at
    18 and is refused (key, worker, count 2); after all clock, w == 1 - 0.5 * (g1 + g3) / 2."""
    core = ServerCore(ServerConfig(consistency="bsp", aggregation="mean"))
    core.init({"w": np.ones(N, dtype)}, UpdateRule("sgd", lr=0.5))
    w1, w2, w3 = (core.register(f"W{i}", 0.0).worker_id for i in (1, 2, 3))
    g1 = np.full(N, 0.25, dtype)
    g3 = np.full(N, -0.75, dtype)
    bad = np.full(N, 0.5, dtype)
    bad[17], bad[18] = np.nan, np.inf
    core.push(w1, 1, 0, {"w": g1}, 0.0)
    with pytest.raises(NonFiniteGradient) as info:
        core.push(w2, 1, 0, {"w": bad}, 0.0)
    for part in ("'w'", repr(w2), "2 non-finite"):
        assert part in info.value.message
    core.push(w3, 1, 0, {"w": g3}, 0.0)
    for wid in (w1, w2, w3):
        core.clock(wid, 0)
    expected = np.full(N, 1 - 0.5 * (0.25 - 0.75) / 2, np.float64).astype(dtype)
    assert core.store.get("w").value.tobytes() == expected.tobytes()
    assert (core.applied_updates, core.rejected_pushes) == (2, 1)


@pytest.mark.parametrize("consistency", ["asp", "ssp", "bsp"])
def test_multi_key_push_with_one_non_finite_key_applies_nothing(consistency: str) -> None:
    """Case non-finite-gradient.md: a push of two keys where only the second holds -Inf is
    refused whole: the first key is not updated either (nothing half-applied)."""
    core = ServerCore(ServerConfig(consistency=consistency, staleness=1))
    core.init({"a": np.zeros(3, np.float32), "b": np.zeros(3, np.float32)}, UpdateRule("add"))
    wid = core.register("W1", 0.0).worker_id
    bad = np.array([1.0, -np.inf, 2.0], np.float32)
    with pytest.raises(NonFiniteGradient, match=r"'b'.*1 non-finite"):
        core.push(wid, 1, 0, {"a": np.ones(3, np.float32), "b": bad}, 0.0)
    core.clock(wid, 0)
    assert core.store.get("a").value.tobytes() == np.zeros(3, np.float32).tobytes()
    assert core.store.get("a").updates == core.store.get("b").updates == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_count_names_every_non_finite_value(dtype: np.dtype[Any]) -> None:
    """Case non-finite-gradient.md: the message counts NaN, +Inf and -Inf alike (5 + 2 + 1)."""
    core = ServerCore(ServerConfig(consistency="asp"))
    core.init({"w": np.zeros(64, dtype)}, UpdateRule("add"))
    wid = core.register("W1", 0.0).worker_id
    g = np.zeros(64, dtype)
    g[:5] = np.nan
    g[10:12] = np.inf
    g[20] = -np.inf
    with pytest.raises(InvalidArgument, match="8 non-finite"):
        core.push(wid, 1, 0, {"w": g}, 0.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_finite_extremes_are_accepted(dtype: np.dtype[Any]) -> None:
    """Case non-finite-gradient.md: -0.0, subnormals and values at the dtype's max (whose sum
    overflows any accumulator) are finite and accepted; ``assign`` stores them bit for bit."""
    info = ml_dtypes.finfo(dtype)
    g = np.full(N, info.max, dtype)
    g[0] = -0.0
    g[1] = info.smallest_subnormal
    g[2] = -info.smallest_subnormal
    g[3] = -info.max
    core = ServerCore(ServerConfig(consistency="asp"))
    core.init({"w": np.ones(N, dtype)}, UpdateRule("assign"))
    wid = core.register("W1", 0.0).worker_id
    assert not core.push(wid, 1, 0, {"w": g}, 0.0).duplicate
    assert core.store.get("w").value.tobytes() == g.tobytes()
