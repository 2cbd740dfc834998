"""The storage range of half-precision values: the one definition of an overflowing update.

A float16 or bfloat16 value is stored narrower than it is computed (float32), so an update of
finite inputs can round to a non-finite stored value. :func:`overflow_mask` says where, for
dense keys (:func:`paramserver.core.optimizers.overflowing_elements`) and embedding-table rows
alike, and :func:`range_refusal` is the one refusal (VALUE_OUT_OF_RANGE) both raise.
"""

from __future__ import annotations

from typing import Final

import ml_dtypes
import numpy as np
import numpy.typing as npt

from paramserver.errors import ValueOutOfRange

__all__ = ["HALF_DTYPES", "overflow_mask", "range_refusal", "storage_range"]

#: float16 and bfloat16: stored narrower than they are computed (range-checked updates).
HALF_DTYPES: Final[tuple[np.dtype[np.generic], ...]] = (
    np.dtype(np.float16),
    np.dtype(ml_dtypes.bfloat16),
)


def storage_range(dtype: np.dtype[np.generic]) -> float:
    """Largest finite magnitude of a floating storage ``dtype`` (65504 for float16)."""
    return float(ml_dtypes.finfo(dtype).max)  # type: ignore[no-untyped-call]


def overflow_mask(
    result: npt.NDArray[np.generic],
    dtype: np.dtype[np.generic],
    inputs_finite: npt.NDArray[np.bool_],
) -> npt.NDArray[np.bool_]:
    """Where storing an update's ``result`` as ``dtype`` would give a non-finite element although
    the update's inputs were finite: the one definition of an overflowing update, for dense keys
    (:func:`~paramserver.core.optimizers.overflowing_elements`) and embedding-table rows
    alike.

    Args:
        result: The updated values, computed wider than the storage (float32 or float64), any
            shape.
        dtype: The storage dtype.
        inputs_finite: bool, ``result``'s shape: the parameter element (and gradient element)
            the result was computed from were finite (an element already non-finite is not
            blamed on the update).

    Returns:
        bool array of ``result``'s shape.
    """
    with np.errstate(over="ignore", invalid="ignore"):
        stored = result.astype(dtype)
    out: npt.NDArray[np.bool_] = inputs_finite & ~np.isfinite(stored)
    return out


def range_refusal(
    subject: str, rule_kind: str, bad: int, dtype: np.dtype[np.generic], detail: str = ""
) -> ValueOutOfRange:
    """The refusal of an update that would put ``bad`` elements outside ``dtype``'s range.

    The message names ``subject`` (the key, or the table), the rule, the count and the range,
    then ``detail`` (where the first such element is), and says that nothing was applied.
    """
    limit = storage_range(dtype)
    return ValueOutOfRange(
        f"{subject} (rule {rule_kind!r}) would put {bad} element(s) outside the range of "
        f"{dtype} [-{limit:g}, {limit:g}]{detail}; nothing applied"
    )
