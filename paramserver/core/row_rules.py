"""The update rules of embedding tables: one registry entry a rule (:data:`ROW_RULES`).

Each :class:`RowRule` carries what a table does with its :class:`TableRule`: the optimizer
state a stored row keeps, the compiled float32 apply (:mod:`paramserver.core.row_kernels`) and
the same arithmetic in numpy (half-precision tables and the overflow check). The rules:
``sgd``; ``adagrad`` (element-wise, ``torch.optim.Adagrad``, Duchi et al., JMLR 2011);
``rowwise_adagrad`` (one accumulator per row, the mean of the squared gradient over the row, as
FBGEMM's ``EXACT_ROWWISE_ADAGRAD``); ``adam`` (lazy: only rows in a push advance their moments
and their own step count, as ``torch.optim.SparseAdam`` / TF LazyAdam). Optimizer state is
float32 whatever the storage dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Final

import numpy as np
import numpy.typing as npt

from paramserver.core.row_store import RowArena
from paramserver.protocol.table_spec import F32, TABLE_RULE_KINDS, TableRule

__all__ = ["ROW_RULES", "Fields", "Kernel", "RowRule"]

#: (shape per row, dtype, value of a new row) of each per-row field.
Fields = dict[str, tuple[tuple[int, ...], np.dtype[np.generic], float]]
#: The compiled kernels: the module :mod:`paramserver.core.row_kernels` (numba dispatchers).
Kernel = ModuleType
#: The float32 apply of a rule: kernels, the table's per-row fields, its chunk shift, the
#: coalesced rows' slots (m,) and their float32 gradients (m, dim).
KernelApply = Callable[
    [
        Kernel,
        Mapping[str, RowArena],
        int,
        npt.NDArray[np.int64],
        npt.NDArray[np.float32],
        TableRule,
    ],
    None,
]
#: The same arithmetic in numpy on gathered float32 rows, their gradients and their state.
StepApply = Callable[
    [npt.NDArray[np.float32], npt.NDArray[np.float32], dict[str, np.ndarray], TableRule], None
]


@dataclass(frozen=True)
class RowRule:
    """One table rule: everything about it in one registry entry (:data:`ROW_RULES`).

    Its declaration (kind name, defaults, proto value) is :class:`TableRule`; this entry holds
    what the table does with it.

    Attributes:
        name: The kind (``TableRule.kind``).
        state: The optimizer state a stored row keeps beside it, for a rule and a dim.
        kernel: The float32 apply: compiled kernels (``row_kernels``), the table's chunked
            store, its chunk shift, the coalesced rows' slots and gradients (m, dim) float32.
        step: The same arithmetic in numpy on gathered float32 rows ``w`` (m, dim) and their
            state, updated in place (half-precision tables and the overflow check).
        source: Where the rule comes from.
    """

    name: str
    state: Callable[[TableRule, int], Fields]
    kernel: KernelApply
    step: StepApply
    source: str


def _sgd_step(
    w: npt.NDArray[np.float32],
    g: npt.NDArray[np.float32],
    state: dict[str, np.ndarray],
    r: TableRule,
) -> None:
    w -= np.float32(r.lr) * g


def _adagrad_step(
    w: npt.NDArray[np.float32],
    g: npt.NDArray[np.float32],
    state: dict[str, np.ndarray],
    r: TableRule,
) -> None:
    acc = state["acc"]
    acc += g * g
    w -= np.float32(r.lr) * g / (np.sqrt(acc) + np.float32(r.eps))


def _rowwise_adagrad_step(
    w: npt.NDArray[np.float32],
    g: npt.NDArray[np.float32],
    state: dict[str, np.ndarray],
    r: TableRule,
) -> None:
    acc_row = state["acc"]
    acc_row += np.mean(g * g, axis=1, dtype=F32)
    w -= np.float32(r.lr) * g / (np.sqrt(acc_row) + np.float32(r.eps))[:, None]


def _adam_step(
    w: npt.NDArray[np.float32],
    g: npt.NDArray[np.float32],
    state: dict[str, np.ndarray],
    r: TableRule,
) -> None:
    """Lazy adam: torch.optim.SparseAdam's arithmetic, the step counted per row."""
    steps = state["steps"]
    steps += 1
    m = state["m"]
    v = state["v"]
    m += (g - m) * np.float32(1.0 - r.beta1)
    v += (g * g - v) * np.float32(1.0 - r.beta2)
    t = steps.astype(np.float64)
    step_size = (r.lr * np.sqrt(1.0 - r.beta2**t) / (1.0 - r.beta1**t)).astype(F32)
    w -= step_size[:, None] * (m / (np.sqrt(v) + np.float32(r.eps)))


def _accumulator_kernel(name: str) -> KernelApply:
    """The float32 apply of an adagrad kind: ``row_kernels.<name>`` over rows and ``acc``."""

    def kernel(
        k: Kernel,
        a: Mapping[str, RowArena],
        shift: int,
        where: npt.NDArray[np.int64],
        g: npt.NDArray[np.float32],
        r: TableRule,
    ) -> None:
        getattr(k, name)(
            a["rows"].addrs, a["acc"].addrs, shift, where, g, np.float32(r.lr), np.float32(r.eps)
        )

    return kernel


def _adam_kernel(
    k: Kernel,
    a: Mapping[str, RowArena],
    shift: int,
    where: npt.NDArray[np.int64],
    g: npt.NDArray[np.float32],
    r: TableRule,
) -> None:
    k.apply_adam(
        a["rows"].addrs,
        a["m"].addrs,
        a["v"].addrs,
        a["steps"].addrs,
        shift,
        where,
        g,
        float(r.lr),
        float(r.beta1),
        float(r.beta2),
        np.float32(r.eps),
    )


#: Every table rule, by kind; its keys are exactly :data:`TABLE_RULE_KINDS` (checked at import),
#: so a kind that passes validation always has an apply.
ROW_RULES: Final[dict[str, RowRule]] = {
    rule.name: rule
    for rule in (
        RowRule(
            "sgd",
            lambda r, d: {},
            lambda k, a, shift, where, g, r: k.apply_sgd(
                a["rows"].addrs, shift, where, g, np.float32(r.lr)
            ),
            _sgd_step,
            "plain SGD on the pushed rows",
        ),
        RowRule(
            "adagrad",
            lambda r, d: {"acc": ((d,), F32, r.initial_accumulator)},
            _accumulator_kernel("apply_adagrad"),
            _adagrad_step,
            "Duchi et al. 2011, element-wise",
        ),
        RowRule(
            "rowwise_adagrad",
            lambda r, d: {"acc": ((), F32, r.initial_accumulator)},
            _accumulator_kernel("apply_rowwise_adagrad"),
            _rowwise_adagrad_step,
            "row-wise adagrad: one accumulator per row (FBGEMM / TorchRec)",
        ),
        RowRule(
            "adam",
            lambda r, d: {
                "m": ((d,), F32, 0.0),
                "v": ((d,), F32, 0.0),
                "steps": ((), np.dtype(np.int64), 0.0),
            },
            _adam_kernel,
            _adam_step,
            "lazy adam: torch.optim.SparseAdam",
        ),
    )
}
if tuple(ROW_RULES) != tuple(TABLE_RULE_KINDS):  # pragma: no cover - a registry out of step
    raise ImportError(f"table rules {tuple(ROW_RULES)} != declared kinds {TABLE_RULE_KINDS}")
