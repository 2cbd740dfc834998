"""Half-precision overflow is refused, never stored as Inf (issue 19, item 2)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from paramserver.core.optimizers import UpdateRule
from paramserver.core.store import ParameterStore
from paramserver.errors import InvalidArgument, ValueOutOfRange

BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.mark.parametrize(
    ("dtype", "start", "grad", "rule"),
    [
        (np.float16, 60000.0, 10000.0, UpdateRule("add")),
        (np.float16, 60000.0, -20000.0, UpdateRule("sgd", lr=1.0)),
        (np.float16, 60000.0, -20000.0, UpdateRule("sgd", lr=1.0, momentum=0.9)),
        (BF16, 3.0e38, 1.0e38, UpdateRule("add")),
        (BF16, 3.0e38, -1.0e38, UpdateRule("sgd", lr=1.0)),
    ],
)
def test_an_update_overflowing_the_storage_dtype_is_refused_whole(
    dtype: np.dtype, start: float, grad: float, rule: UpdateRule
) -> None:
    store = ParameterStore()
    store.init("w", np.full(3, start, dtype), rule)
    store.init("other", np.zeros(2, dtype), UpdateRule("add"))
    before = store.snapshot()
    state_before = {k: v.copy() for k, v in store.get("w").state.items()}
    g = np.array([0.0, grad, 0.0], dtype)
    with pytest.raises(ValueOutOfRange, match=r"'w'.*outside the range of") as info:
        store.apply_many({"other": np.ones(2, dtype), "w": g})
    assert isinstance(info.value, InvalidArgument)
    limit = float(ml_dtypes.finfo(dtype).max)
    assert f"{limit:g}" in info.value.message
    after = store.snapshot()
    for key in before:  # nothing applied, to either key, bit for bit
        assert after[key].tobytes() == before[key].tobytes()
    for name, value in store.get("w").state.items():
        assert value.tobytes() == state_before[name].tobytes()
    assert store.get("w").updates == 0


def test_an_aggregate_in_float32_overflowing_float16_is_refused() -> None:
    """A BSP ``sum`` aggregate arrives in float32 (finite: 80000) for a float16 key."""
    store = ParameterStore()
    store.init("w", np.zeros(2, np.float16), UpdateRule("add"))
    with pytest.raises(ValueOutOfRange):
        store.apply("w", np.array([80000.0, 1.0], np.float32))
    assert np.all(store.get("w").value == 0)
    store.init("a", np.zeros(2, np.float16), UpdateRule("assign"))
    with pytest.raises(ValueOutOfRange):
        store.apply("a", np.array([70000.0, 1.0], np.float32))


def test_in_range_half_updates_still_apply_and_existing_inf_is_not_blamed() -> None:
    store = ParameterStore()
    store.init("w", np.array([60000.0, np.inf], np.float16), UpdateRule("add"))
    store.apply("w", np.array([5000.0, 1.0], np.float16))  # 65000 rounds to 64992 < 65504
    np.testing.assert_array_equal(store.get("w").value, np.array([64992.0, np.inf], np.float16))
    big = np.zeros(300_000, np.float16)  # several blocks, overflow in the last one
    store.init("big", big, UpdateRule("add"))
    g = np.zeros_like(big)
    g[-1] = 60000
    store.apply("big", g)
    with pytest.raises(ValueOutOfRange, match="1 element"):
        store.apply("big", g)
    assert store.get("big").value[-1] == 60000
