"""Case empty-and-scalar-tensors.md on the pure core: aggregation, BSP steps and checkpoints of
zero-size and zero-dimensional tensors, with every warning turned into an error."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest

from paramserver.core.aggregation import DistributedOptimizer, GradientUpdate, Synchronous
from paramserver.core.optimizers import UpdateRule
from paramserver.core.shard import ServerCore
from paramserver.errors import DimensionMismatch
from paramserver.server.checkpoint import CheckpointManager
from paramserver.server.config import ServerConfig

pytestmark = pytest.mark.timeout(30)

SHAPES: list[tuple[int, ...]] = [(0,), (3, 0, 5), (), (1,)]


@pytest.mark.parametrize("method", ["mean", "sum", "weighted_mean"])
@pytest.mark.parametrize("shape", [(0,), (3, 0, 5)], ids=str)
def test_aggregate_of_empty_gradients_is_empty_without_warnings(
    shape: tuple[int, ...], method: str
) -> None:
    """Case empty-and-scalar-tensors.md: the mean (and sum, weighted mean) of three empty
    gradients is an empty array of the same shape, and numpy warns about nothing."""
    opt = DistributedOptimizer(Synchronous(), method=method)
    for w in ("a", "b", "c"):
        opt.register_worker(w)
    opt.declare_layer("k", shape)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.submit_updates(
            [GradientUpdate(w, "k", np.zeros(shape, np.float32), 0, 0.0, 2) for w in "abc"], 0.0
        )
        result = opt.close_step()["k"]
    assert result.gradient.shape == shape
    assert result.gradient.size == 0
    assert result.contributing_workers == 3


def test_bsp_step_over_all_four_keeps_shapes(tmp_path: Path) -> None:
    """Case empty-and-scalar-tensors.md: a BSP step (two workers, mean, add rule) over the four
    float32 keys keeps every shape and dtype; scalar 7.5 + mean(1, 2) == 9.0 with shape ();
    a checkpoint restored into a fresh core has the same four tensors bit for bit."""
    core = ServerCore(ServerConfig(consistency="bsp", aggregation="mean"))
    init = {
        "empty1": np.zeros((0,), np.float32),
        "empty3": np.zeros((3, 0, 5), np.float32),
        "scalar": np.array(7.5, np.float32),
        "one": np.zeros((1,), np.float32),
    }
    core.init(init, UpdateRule("add"))
    a = core.register("a", 0.0).worker_id
    b = core.register("b", 0.0).worker_id
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for wid, s, o in ((a, 1.0, 3.0), (b, 2.0, 5.0)):
            grads = {k: np.zeros_like(v) for k, v in init.items()}
            grads["scalar"] = np.array(s, np.float32)
            grads["one"] = np.array([o], np.float32)
            core.push(wid, 1, 0, grads, 0.0)
        core.clock(a, 0)
        core.clock(b, 0)
    values = {k: core.store.get(k).value for k in init}
    assert [values[k].shape for k in init] == SHAPES
    assert all(v.dtype == np.float32 for v in values.values())
    assert float(values["scalar"]) == 9.0
    np.testing.assert_array_equal(values["one"], [4.0])

    CheckpointManager(tmp_path).save(core)
    restored = ServerCore(ServerConfig(consistency="bsp"))
    CheckpointManager(tmp_path).restore_latest(restored)
    for key, value in values.items():
        again = restored.store.get(key).value
        assert (again.shape, again.dtype) == (value.shape, value.dtype)
        assert again.tobytes() == value.tobytes()


def test_shape_mismatch_with_zero_dimension_names_both_shapes() -> None:
    """Case empty-and-scalar-tensors.md: (3, 0, 5) for a (3, 0, 4) key is a DimensionMismatch
    naming the key and both shapes, though both hold zero elements."""
    core = ServerCore(ServerConfig(consistency="asp"))
    core.init({"k": np.zeros((3, 0, 4), np.float32)}, UpdateRule("add"))
    wid = core.register("a", 0.0).worker_id
    with pytest.raises(DimensionMismatch) as info:
        core.push(wid, 1, 0, {"k": np.zeros((3, 0, 5), np.float32)}, 0.0)
    for part in ("'k'", "(3, 0, 5)", "(3, 0, 4)"):
        assert part in info.value.message
    assert core.store.get("k").value.shape == (3, 0, 4)
    assert core.store.get("k").updates == 0
