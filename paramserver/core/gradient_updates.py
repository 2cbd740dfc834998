"""The units of aggregation: a worker's :class:`GradientUpdate` in, an :class:`AggregatedGradient`
out, and the numerics that reduce the one into the other.

:class:`~paramserver.core.aggregation.DistributedOptimizer` decides which updates form a
quorum; this module says what an update must be (its dtype, step and weight are checked when
it is made) and how a quorum's gradients become one: accumulated in float64 (float32 when every
input is float16 or bfloat16), the division done once at the end (:func:`reduce_gradients`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final, TypeAlias

import ml_dtypes
import numpy as np
import numpy.typing as npt

from paramserver.errors import DimensionMismatch, InvalidArgument

__all__ = [
    "FLOAT_DTYPES",
    "AggregatedGradient",
    "Array",
    "GradientUpdate",
    "accumulation_dtype",
    "reduce_gradients",
]

Array: TypeAlias = npt.NDArray[np.generic]

_BFLOAT16: Final[np.dtype[np.generic]] = np.dtype(ml_dtypes.bfloat16)
_HALF_DTYPES: Final[frozenset[np.dtype[np.generic]]] = frozenset({np.dtype(np.float16), _BFLOAT16})
FLOAT_DTYPES: Final[frozenset[np.dtype[np.generic]]] = _HALF_DTYPES | {
    np.dtype(np.float32),
    np.dtype(np.float64),
}
_SUPPORTED_DTYPES: Final[frozenset[np.dtype[np.generic]]] = FLOAT_DTYPES | {
    np.dtype(np.int32),
    np.dtype(np.int64),
}


@dataclass(frozen=True, eq=False)
class GradientUpdate:
    """One worker's gradient for one layer, computed from the parameters of one step.

    The array is not copied: do not mutate it after submitting it.

    Attributes:
        worker_id: Registered worker id.
        layer_id: Layer (parameter key) the gradient belongs to.
        gradient: Gradient, any shape (``()`` and zero-size included); dtype float16, bfloat16
            (``ml_dtypes``), float32, float64, int32 or int64.
        step: Step (parameter version) the gradient was computed from; ``>= 0``.
        timestamp: Worker-side creation time in seconds; informational only.
        num_samples: Examples behind the gradient; the weight under ``weighted_mean`` and
            federated averaging. ``>= 1``.

    Raises:
        InvalidArgument: (INVALID_ARGUMENT) a non-array gradient, an unsupported dtype, an
            empty id, a negative step or ``num_samples < 1``.
    """

    worker_id: str
    layer_id: str
    gradient: Array
    step: int
    timestamp: float
    num_samples: int = 1

    def __post_init__(self) -> None:
        if not self.worker_id or not self.layer_id:
            raise InvalidArgument(
                f"gradient update needs a worker id and a layer id, "
                f"got worker {self.worker_id!r}, layer {self.layer_id!r}"
            )
        source = f"gradient from worker {self.worker_id!r} for layer {self.layer_id!r}"
        if not isinstance(self.gradient, np.ndarray):
            raise InvalidArgument(
                f"{source} must be a numpy.ndarray, got {type(self.gradient).__name__}"
            )
        if self.gradient.dtype not in _SUPPORTED_DTYPES:
            raise InvalidArgument(
                f"{source} has unsupported dtype {self.gradient.dtype}; supported: "
                f"{', '.join(sorted(str(d) for d in _SUPPORTED_DTYPES))}"
            )
        if not _is_int_at_least(self.step, 0):
            raise InvalidArgument(f"{source} has invalid step {self.step!r} (must be an int >= 0)")
        if not _is_int_at_least(self.num_samples, 1):
            raise InvalidArgument(
                f"{source} at step {self.step} has num_samples {self.num_samples!r}; it must be "
                "an int >= 1"
            )


def _is_int_at_least(value: object, minimum: int) -> bool:
    """Whether ``value`` is a Python or numpy integer (not a bool) of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        return False
    return bool(value >= minimum)


@dataclass(frozen=True, eq=False)
class AggregatedGradient:
    """The reduction of one layer's updates for one step.

    Attributes:
        layer_id: Layer the aggregate belongs to.
        gradient: Read-only aggregate, the layer's shape, in the accumulation dtype (float64, or
            float32 when every input was float16/bfloat16); the caller casts to the key's dtype.
        step: Step the aggregate belongs to (the optimizer's ``current_step`` when made).
        contributing_workers: Distinct workers whose updates are in the aggregate.
        total_samples: Sum of the contributing updates' ``num_samples``.
        worker_ids: Contributing workers, in order of arrival, each once.
    """

    layer_id: str
    gradient: Array
    step: int
    contributing_workers: int
    total_samples: int
    worker_ids: tuple[str, ...]


def accumulation_dtype(dtypes: Iterable[np.dtype[np.generic]]) -> np.dtype[np.generic]:
    """Dtype gradients of the given dtypes are accumulated (and returned) in.

    Args:
        dtypes: Input gradient dtypes.

    Returns:
        float32 when every input is float16 or bfloat16 (and there is at least one), else
        float64.
    """
    seen = list(dtypes)
    if seen and all(d in _HALF_DTYPES for d in seen):
        return np.dtype(np.float32)
    return np.dtype(np.float64)


def reduce_gradients(
    layer_id: str,
    gradients: Sequence[Array],
    factors: Sequence[float] | None,
    denominator: float,
) -> Array:
    """``sum_k factors[k] * gradients[k] / denominator``, accumulated without per-element loops.

    The division happens once, at the end. All gradients must share one shape.
    """
    shape = gradients[0].shape
    for g in gradients[1:]:
        if g.shape != shape:
            raise DimensionMismatch(
                f"layer {layer_id!r}: cannot aggregate gradients of shapes {shape} and {g.shape}"
            )
    acc_dtype = accumulation_dtype(g.dtype for g in gradients)
    acc = np.zeros(shape, dtype=acc_dtype)
    scratch = np.empty(shape, dtype=acc_dtype) if factors is not None else None
    for k, g in enumerate(gradients):
        if factors is None or scratch is None:
            np.add(acc, g, out=acc, dtype=acc_dtype, casting="unsafe")
        else:
            np.multiply(g, factors[k], out=scratch, dtype=acc_dtype, casting="unsafe")
            np.add(acc, scratch, out=acc)
    if denominator != 1:
        np.divide(acc, denominator, out=acc)
    return acc
