"""Server-side update rules: how a pushed gradient changes a key's value.

A key is declared with one :class:`UpdateRule` (docs/semantics.md). Its optimizer state (from
:func:`init_state`) lives beside the key and :func:`apply_update` changes the parameter and the
state in place with numpy, block by block (:data:`BLOCK_ELEMENTS`) with the calling thread's
block-sized :class:`Workspace` (:func:`thread_workspace`), so a push allocates nothing of the
parameter's size and the scratch is bounded by threads, not keys.

Rules and their sources (the optimizer semantics match ``torch.optim`` exactly, as documented at
https://pytorch.org/docs/stable/optim.html; each function names its page):

- ``assign``: ``w = g`` (the seed's behaviour).
- ``add``: ``w += g``.
- ``sgd``: ``torch.optim.SGD`` with ``dampening=0`` (momentum and Nesterov momentum after
  Sutskever et al., ICML 2013; L2 ``weight_decay`` added to the gradient).
- ``adam``: ``torch.optim.Adam`` (Kingma & Ba, "Adam: A Method for Stochastic Optimization",
  ICLR 2015), L2 ``weight_decay`` added to the gradient, bias-corrected moments, ``amsgrad=False``.
- ``adamw``: ``torch.optim.AdamW`` (Loshchilov & Hutter, "Decoupled Weight Decay Regularization",
  ICLR 2019): ``w *= 1 - lr * weight_decay`` first, then the Adam step without L2.
- ``adagrad``: ``torch.optim.Adagrad`` (Duchi et al., "Adaptive Subgradient Methods for Online
  Learning and Stochastic Optimization", JMLR 2011) with ``lr_decay=0`` and
  ``initial_accumulator_value=0``; ``eps`` is added after the square root.

Precision: state and arithmetic use the *compute dtype*, float32 for float16, bfloat16 and
float32 parameters and float64 for float64 parameters. A half-precision parameter is widened to
float32 once, updated there and rounded back once. The gradient may be the parameter's dtype or
float64 (an aggregate of several pushes); it is cast to the compute dtype before use. Integer
parameters take only ``assign`` and ``add``, which use numpy's in-place ufuncs (computed at the
promoted dtype, rounded once into the parameter). Deviation from PyTorch: PyTorch keeps the state of
a half-precision parameter in the parameter's dtype; here it is float32.
"""

from __future__ import annotations

import math
import numbers
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal, TypeAlias

import ml_dtypes
import numpy as np
import numpy.typing as npt

from paramserver.api.v1 import parameter_server_pb2 as ps_pb2
from paramserver.core.storage_range import HALF_DTYPES, overflow_mask, range_refusal, storage_range
from paramserver.errors import DimensionMismatch, InvalidArgument

__all__ = [
    "BLOCK_ELEMENTS",
    "FLOAT_DTYPES",
    "HALF_DTYPES",
    "RULE_KINDS",
    "Array",
    "UpdateRule",
    "Workspace",
    "apply_update",
    "compute_dtype",
    "init_state",
    "overflow_mask",
    "overflowing_elements",
    "range_refusal",
    "storage_range",
    "thread_workspace",
]

Array: TypeAlias = npt.NDArray[Any]

FLOAT_DTYPES: Final[tuple[np.dtype[np.generic], ...]] = (
    np.dtype(np.float16),
    np.dtype(ml_dtypes.bfloat16),
    np.dtype(np.float32),
    np.dtype(np.float64),
)

# Defaults shared by every kind (PyTorch's, except SGD's lr); a kind overrides some.
_BASE_DEFAULTS: Final[dict[str, float]] = {
    "lr": 0.01,
    "momentum": 0.0,
    "weight_decay": 0.0,
    "beta1": 0.9,
    "beta2": 0.999,
    "eps": 1e-8,
}
_FIELDS: Final = ("kind", "lr", "momentum", "nesterov", "weight_decay", "beta1", "beta2", "eps")


def _real(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgument(f"update rule {name} must be a real number, got {value!r}")
    result = float(value)
    if not math.isfinite(result):
        raise InvalidArgument(f"update rule {name} must be finite, got {result}")
    return result


@dataclass(frozen=True, init=False)
class UpdateRule:
    """The server-side update rule of one key (immutable, hashable).

    Arguments left as ``None`` take the kind's default: ``lr`` 0.01 (``adam``/``adamw`` 0.001),
    ``momentum`` 0, ``weight_decay`` 0 (``adamw`` 0.01), ``beta1`` 0.9, ``beta2`` 0.999, ``eps``
    1e-8 (``adagrad`` 1e-10). Attributes always hold the resolved floats. ``lr`` is ignored by
    ``assign`` and ``add``; the betas by every kind but ``adam``/``adamw``.

    Attributes:
        kind: One of :data:`RULE_KINDS`.
        lr: Learning rate (dimensionless), finite and ``>= 0``.
        momentum: SGD momentum in ``[0, 1)``; only ``sgd`` may set it non-zero.
        nesterov: SGD Nesterov momentum; needs ``momentum > 0``.
        weight_decay: L2 coefficient ``>= 0`` (decoupled for ``adamw``); must be zero for
            ``assign``/``add``.
        beta1: Adam first-moment decay in ``[0, 1)``.
        beta2: Adam second-moment decay in ``[0, 1)``.
        eps: Denominator epsilon (``adam``/``adamw``/``adagrad``), finite and ``> 0``.

    Raises:
        InvalidArgument: (INVALID_ARGUMENT) unknown kind or a value out of range.
    """

    kind: str
    lr: float
    momentum: float
    nesterov: bool
    weight_decay: float
    beta1: float
    beta2: float
    eps: float

    def __init__(
        self,
        kind: str = "sgd",
        lr: float | None = None,
        momentum: float | None = None,
        nesterov: bool = False,
        weight_decay: float | None = None,
        beta1: float | None = None,
        beta2: float | None = None,
        eps: float | None = None,
    ) -> None:
        if not isinstance(kind, str) or kind not in RULES:
            raise InvalidArgument(
                f"unknown update rule kind {kind!r}; expected one of {', '.join(RULE_KINDS)}"
            )
        if not isinstance(nesterov, bool):
            raise InvalidArgument(f"update rule nesterov must be a bool, got {nesterov!r}")
        defaults = {**_BASE_DEFAULTS, **RULES[kind].defaults}
        given = {
            "lr": lr,
            "momentum": momentum,
            "weight_decay": weight_decay,
            "beta1": beta1,
            "beta2": beta2,
            "eps": eps,
        }
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "nesterov", nesterov)
        for name, value in given.items():
            object.__setattr__(self, name, _real(name, defaults[name] if value is None else value))
        self._validate()

    def _validate(self) -> None:
        rule = f"update rule {self.kind!r}"
        if self.lr < 0:
            raise InvalidArgument(f"{rule}: lr must be >= 0, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise InvalidArgument(f"{rule}: momentum must be in [0, 1), got {self.momentum}")
        if self.momentum != 0 and self.kind != "sgd":
            raise InvalidArgument(f"{rule}: momentum applies to 'sgd' only, got {self.momentum}")
        if self.nesterov and self.kind != "sgd":
            raise InvalidArgument(f"{rule}: nesterov applies to 'sgd' only")
        if self.nesterov and self.momentum <= 0:
            raise InvalidArgument(f"{rule}: nesterov requires momentum > 0")
        if self.weight_decay < 0:
            raise InvalidArgument(f"{rule}: weight_decay must be >= 0, got {self.weight_decay}")
        if self.weight_decay != 0 and self.kind in ("assign", "add"):
            raise InvalidArgument(f"{rule}: weight_decay does not apply, got {self.weight_decay}")
        for name in ("beta1", "beta2"):
            beta: float = getattr(self, name)
            if not 0 <= beta < 1:
                raise InvalidArgument(f"{rule}: {name} must be in [0, 1), got {beta}")
        if self.eps <= 0:
            raise InvalidArgument(f"{rule}: eps must be > 0, got {self.eps}")

    def to_proto(self) -> ps_pb2.UpdateRule:
        """Encode as the wire message, every field set explicitly (round-trips exactly)."""
        return ps_pb2.UpdateRule(
            kind=RULES[self.kind].proto,
            lr=self.lr,
            momentum=self.momentum,
            nesterov=self.nesterov,
            weight_decay=self.weight_decay,
            beta1=self.beta1,
            beta2=self.beta2,
            eps=self.eps,
        )

    @classmethod
    def from_proto(cls, msg: ps_pb2.UpdateRule) -> UpdateRule:
        """Decode the wire message; unset optional fields take the kind's defaults.

        Raises:
            InvalidArgument: (INVALID_ARGUMENT) ``RULE_KIND_UNSPECIFIED``, an unknown enum value,
                or a value out of range.
        """
        kind_value = int(msg.kind)
        if kind_value == ps_pb2.RULE_KIND_UNSPECIFIED:
            raise InvalidArgument("update rule kind is RULE_KIND_UNSPECIFIED; set it explicitly")
        entry = _BY_PROTO.get(kind_value)
        kind = None if entry is None else entry.name
        if kind is None:
            raise InvalidArgument(f"unknown update rule kind enum value {kind_value}")

        def opt(
            name: Literal["lr", "momentum", "weight_decay", "beta1", "beta2", "eps"],
        ) -> float | None:
            return float(getattr(msg, name)) if msg.HasField(name) else None

        return cls(
            kind,
            lr=opt("lr"),
            momentum=opt("momentum"),
            nesterov=bool(msg.nesterov),
            weight_decay=opt("weight_decay"),
            beta1=opt("beta1"),
            beta2=opt("beta2"),
            eps=opt("eps"),
        )

    def to_dict(self) -> dict[str, object]:
        """A JSON-able dict of every field (for checkpoint manifests)."""
        return {name: getattr(self, name) for name in _FIELDS}

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> UpdateRule:
        """Inverse of :meth:`to_dict`; missing fields other than ``kind`` take the defaults.

        Raises:
            InvalidArgument: (INVALID_ARGUMENT) not a mapping, no or unknown ``kind``, unknown
                fields, wrong types or values out of range.
        """
        if not isinstance(d, Mapping):
            raise InvalidArgument(f"update rule must be a mapping, got {type(d).__name__}")
        unknown = sorted(set(d) - set(_FIELDS))
        if unknown:
            raise InvalidArgument(f"update rule has unknown fields {unknown}")
        kind = d.get("kind")
        if not isinstance(kind, str):
            raise InvalidArgument(f"update rule kind must be a string, got {kind!r}")
        nesterov = d.get("nesterov", False)
        if not isinstance(nesterov, bool):
            raise InvalidArgument(f"update rule nesterov must be a bool, got {nesterov!r}")
        numbers_: dict[str, float | None] = {}
        for name in ("lr", "momentum", "weight_decay", "beta1", "beta2", "eps"):
            value = d.get(name)
            numbers_[name] = None if value is None else _real(name, value)
        return cls(kind, nesterov=nesterov, **numbers_)


def compute_dtype(rule: UpdateRule, dtype: np.dtype[np.generic]) -> np.dtype[np.generic] | None:
    """The dtype in which ``rule`` computes for a parameter of ``dtype``.

    Args:
        rule: The key's rule.
        dtype: The parameter's dtype.

    Returns:
        float32 for float16/bfloat16/float32, float64 for float64; ``None`` for ``assign``/``add``
        (no state; numpy's in-place casting applies).

    Raises:
        InvalidArgument: (INVALID_ARGUMENT) an optimizer rule on a non-floating dtype.
    """
    if RULES[rule.kind].step is None:
        return None
    if dtype not in FLOAT_DTYPES:
        raise InvalidArgument(
            f"update rule {rule.kind!r} needs a floating-point parameter, got dtype {dtype}; "
            "integer keys take 'assign' or 'add'"
        )
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


def init_state(rule: UpdateRule, param: Array) -> dict[str, Array]:
    """Fresh optimizer state for ``param`` under ``rule``.

    Args:
        rule: The key's rule.
        param: The parameter, any shape, dtype float16/bfloat16/float32/float64 (int32/int64 for
            ``assign``/``add`` only).

    Returns:
        ``sgd`` with momentum: ``{"momentum_buffer"}``; ``adam``/``adamw``:
        ``{"exp_avg", "exp_avg_sq", "step"}``; ``adagrad``: ``{"sum_sq"}``; otherwise ``{}``.
        Arrays are zeros of ``param.shape`` in the compute dtype (float32, or float64 for a float64
        parameter); ``step`` is a 0-d int64 zero.

    Raises:
        InvalidArgument: (INVALID_ARGUMENT) an optimizer rule on a non-floating parameter.
    """
    return {
        name: np.zeros(shape, dtype=dtype)
        for name, (dtype, shape) in _state_spec(rule, param).items()
    }


def _state_spec(
    rule: UpdateRule, param: Array
) -> dict[str, tuple[np.dtype[np.generic], tuple[int, ...]]]:
    """Name -> (dtype, shape) of the state :func:`init_state` creates, without allocating it."""
    dtype = compute_dtype(rule, param.dtype)
    if dtype is None or (rule.kind == "sgd" and rule.momentum == 0):
        return {}
    return {
        name: (np.dtype(np.int64), ()) if name == "step" else (dtype, param.shape)
        for name in RULES[rule.kind].state
    }


def _check(rule: UpdateRule, param: Array, grad: Array, state: Mapping[str, Array]) -> None:
    if grad.shape != param.shape:
        raise DimensionMismatch(f"gradient shape {grad.shape} != parameter shape {param.shape}")
    if grad.dtype != param.dtype and not (
        grad.dtype in (np.float32, np.float64) and param.dtype in FLOAT_DTYPES
    ):
        raise DimensionMismatch(
            f"gradient dtype {grad.dtype} does not match parameter dtype {param.dtype}"
        )
    expected = _state_spec(rule, param)
    if set(state) != set(expected):
        raise InvalidArgument(
            f"optimizer state of rule {rule.kind!r} must hold {sorted(expected)}, "
            f"got {sorted(state)}"
        )
    for name, (dtype, shape) in expected.items():
        have = state[name]
        if have.shape != shape or have.dtype != dtype:
            raise InvalidArgument(
                f"optimizer state {name!r} must be {dtype}{list(shape)}, "
                f"got {have.dtype}{list(have.shape)}"
            )


#: Elements per block of the blocked update (128 Ki: 512 KiB of float32 per operand, within a
#: core's L2 cache on current x86 parts). Measured (benchmarks/apply_throughput.py's
#: ``store.apply`` column, 16e6 float32): sgd 8.9 ms at 32 Ki, 6.5 ms here; adam 31.9 -> 28.9 ms.
BLOCK_ELEMENTS: Final = 1 << 17

_THREAD = threading.local()


def thread_workspace(dtype: np.dtype[np.generic]) -> Workspace:
    """The calling thread's workspace of ``dtype`` (:data:`BLOCK_ELEMENTS` per buffer, at most
    four buffers: created on first use, reused by every key's update on this thread).

    Per thread, not per key: updates on one thread run one at a time, and the event loop plus
    the offload pool are a handful of threads, so the scratch stays a few MiB however many keys
    a shard holds (per key it was up to four blocks for each key of a block or more).
    """
    spaces: dict[np.dtype[np.generic], Workspace] | None = getattr(_THREAD, "spaces", None)
    if spaces is None:
        spaces = _THREAD.spaces = {}
    space = spaces.get(dtype)
    if space is None:
        space = spaces[dtype] = Workspace(dtype, BLOCK_ELEMENTS)
    return space


class Workspace:
    """Block-sized scratch buffers of updates, allocated once and reused.

    The update runs block by block over the flat parameter, so its temporaries are at most a few
    arrays of :data:`BLOCK_ELEMENTS` elements, never of the parameter's size. Not thread-safe:
    one update at a time (see :func:`thread_workspace`).

    Args:
        dtype: Compute dtype of the key (float32 or float64).
        size: Elements per buffer, ``min(BLOCK_ELEMENTS, param.size)``.
    """

    __slots__ = ("buffers", "dtype", "size")

    def __init__(self, dtype: np.dtype[np.generic], size: int) -> None:
        self.dtype = dtype
        self.size = size
        self.buffers: list[Array] = []

    def take(self, count: int) -> list[Array]:
        """``count`` distinct flat buffers of ``size`` elements (grown on first need)."""
        while len(self.buffers) < count:
            self.buffers.append(np.empty(self.size, dtype=self.dtype))
        return self.buffers[:count]


# Each kernel updates one block in place. ``p`` is the parameter block in the compute dtype,
# ``g`` the gradient block (read only), ``st`` the state blocks, ``s`` two scratch blocks of
# the block's shape, ``t`` the step count (Adam).
# Element by element they perform exactly the operations of the whole-array formulas in their
# docstrings, so the blocked result is bit-identical to the unblocked one.
_Kernel: TypeAlias = Callable[[UpdateRule, Array, Array, dict[str, Array], list[Array], int], None]


def _l2(p: Array, g: Array, weight_decay: float, out: Array) -> Array:
    """``out = p * weight_decay + g`` (PyTorch's ``grad.add(param, alpha=weight_decay)``)."""
    np.multiply(p, weight_decay, out=out)
    out += g
    return out


def _sgd(
    rule: UpdateRule, p: Array, g: Array, st: dict[str, Array], s: list[Array], t: int
) -> None:
    """``torch.optim.SGD`` (dampening 0, maximize False); see its documentation page.

    With lr, mu = momentum, wd = weight_decay and b the momentum buffer::

        g = g + wd * p
        b = mu * b + g                      (b = g on the first step)
        d = g + mu * b if nesterov else b   (d = g without momentum)
        p = p - lr * d

    The zero-initialised buffer gives ``b = mu * 0 + g = g`` on the first step (up to the sign of
    a zero), as PyTorch's ``torch.clone(grad)`` does.
    """
    scratch = s[0]
    if rule.weight_decay != 0:
        g = _l2(p, g, rule.weight_decay, s[1])
    direction = g
    if rule.momentum != 0:
        buf = st["momentum_buffer"]
        buf *= rule.momentum
        buf += g
        if rule.nesterov:
            direction = np.multiply(buf, rule.momentum, out=scratch)
            direction += g
        else:
            direction = buf
    np.multiply(direction, rule.lr, out=scratch)
    p -= scratch


def _adam(
    rule: UpdateRule, p: Array, g: Array, st: dict[str, Array], s: list[Array], t: int
) -> None:
    """``torch.optim.Adam`` / ``torch.optim.AdamW`` (amsgrad False); Kingma & Ba 2015.

    With t the step count after increment, m = exp_avg, v = exp_avg_sq::

        p = p * (1 - lr * wd)                       (adamw: decoupled, Loshchilov & Hutter 2019)
        g = g + wd * p                              (adam: L2)
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        denom = sqrt(v) / sqrt(1 - beta2**t) + eps
        p = p - lr / (1 - beta1**t) * m / denom

    which is PyTorch's ``denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)`` form.
    """
    if rule.kind == "adamw":
        p *= 1.0 - rule.lr * rule.weight_decay
    elif rule.weight_decay != 0:
        g = _l2(p, g, rule.weight_decay, s[1])
    exp_avg, exp_avg_sq = st["exp_avg"], st["exp_avg_sq"]
    scratch = np.multiply(g, 1.0 - rule.beta1, out=s[0])
    exp_avg *= rule.beta1
    exp_avg += scratch
    np.multiply(g, g, out=scratch)
    scratch *= 1.0 - rule.beta2
    exp_avg_sq *= rule.beta2
    exp_avg_sq += scratch
    step_size = rule.lr / (1.0 - rule.beta1**t)
    bias_correction2_sqrt = math.sqrt(1.0 - rule.beta2**t)
    np.sqrt(exp_avg_sq, out=scratch)
    scratch /= bias_correction2_sqrt
    scratch += rule.eps
    np.divide(exp_avg, scratch, out=scratch)
    scratch *= step_size
    p -= scratch


def _adagrad(
    rule: UpdateRule, p: Array, g: Array, st: dict[str, Array], s: list[Array], t: int
) -> None:
    """``torch.optim.Adagrad`` (lr_decay 0, initial_accumulator_value 0); Duchi et al. 2011.

    With s = sum_sq::

        g = g + wd * p
        s = s + g * g
        p = p - lr * g / (sqrt(s) + eps)
    """
    if rule.weight_decay != 0:
        g = _l2(p, g, rule.weight_decay, s[1])
    sum_sq = st["sum_sq"]
    scratch = np.multiply(g, g, out=s[0])
    sum_sq += scratch
    np.sqrt(sum_sq, out=scratch)
    scratch += rule.eps
    np.divide(g, scratch, out=scratch)
    scratch *= rule.lr
    p -= scratch


@dataclass(frozen=True)
class RuleKind:
    """One dense update rule: everything about it in one registry entry (:data:`RULES`).

    Attributes:
        name: The kind's name (``UpdateRule.kind``).
        proto: Its wire value (``RuleKind`` of parameter_server.proto).
        defaults: Its overrides of the shared defaults (lr, momentum, weight_decay, betas, eps).
        state: Names of the optimizer state it keeps beside the key (``step`` is a 0-d int64
            count; the others the parameter's shape in the compute dtype). ``sgd`` keeps its
            ``momentum_buffer`` only when momentum > 0.
        step: Its update kernel on blocks of the compute dtype; None for ``assign`` / ``add``,
            which numpy applies directly in the parameter's own dtype (integers included).
        source: Where its formula comes from.
    """

    name: str
    proto: ps_pb2.RuleKind.ValueType
    defaults: Mapping[str, float]
    state: tuple[str, ...]
    step: _Kernel | None
    source: str


#: Every dense update rule, by kind. A new rule is one entry here.
RULES: Final[dict[str, RuleKind]] = {
    r.name: r
    for r in (
        RuleKind("assign", ps_pb2.RULE_KIND_ASSIGN, {}, (), None, "w = g"),
        RuleKind("add", ps_pb2.RULE_KIND_ADD, {}, (), None, "w += g"),
        RuleKind("sgd", ps_pb2.RULE_KIND_SGD, {}, ("momentum_buffer",), _sgd, "torch.optim.SGD"),
        RuleKind(
            "adam",
            ps_pb2.RULE_KIND_ADAM,
            {"lr": 1e-3},
            ("exp_avg", "exp_avg_sq", "step"),
            _adam,
            "Kingma & Ba 2015; torch.optim.Adam",
        ),
        RuleKind(
            "adamw",
            ps_pb2.RULE_KIND_ADAMW,
            {"lr": 1e-3, "weight_decay": 1e-2},
            ("exp_avg", "exp_avg_sq", "step"),
            _adam,
            "Loshchilov & Hutter 2019; torch.optim.AdamW",
        ),
        RuleKind(
            "adagrad",
            ps_pb2.RULE_KIND_ADAGRAD,
            {"eps": 1e-10},
            ("sum_sq",),
            _adagrad,
            "Duchi et al. 2011; torch.optim.Adagrad",
        ),
    )
}
#: The kinds' names, in registry order.
RULE_KINDS: Final = tuple(RULES)
_BY_PROTO: Final[dict[int, RuleKind]] = {r.proto: r for r in RULES.values()}


def _kernel(rule: UpdateRule) -> _Kernel:
    step = RULES[rule.kind].step
    assert step is not None, f"{rule.kind} has no step kernel"
    return step


#: Parameter dtypes that are their own compute dtype (no cast in the update).
_PLAIN_DTYPES: Final = (np.dtype(np.float32), np.dtype(np.float64))


def _flat(a: Array) -> Array | None:
    """A flat view of a C-contiguous array (None if it is not one)."""
    return a.reshape(-1) if a.flags.c_contiguous else None


def apply_update(
    rule: UpdateRule,
    param: Array,
    grad: Array,
    state: dict[str, Array],
    workspace: Workspace | None = None,
) -> None:
    """Apply one gradient to ``param`` and ``state`` in place.

    ``param`` keeps its object and buffer. The update runs over blocks of
    :data:`BLOCK_ELEMENTS` elements of the flat arrays, so its temporaries are block-sized
    (taken from ``workspace``, by default the calling thread's), never parameter-sized: no
    per-push allocation of the parameter's size. ``grad`` is never modified. The result is
    bit-identical to evaluating the rule's formula on whole arrays (every operation is
    elementwise). A non-contiguous ``param`` (a strided view) is updated in one whole-array
    block with temporaries of its size.

    Args:
        rule: The key's rule.
        param: The parameter, any shape; float16/bfloat16/float32/float64, or int32/int64 for
            ``assign``/``add``. Updated in place.
        grad: Same shape as ``param``; dtype ``param.dtype``, or float32/float64 (an aggregate)
            for a floating ``param``.
        state: From :func:`init_state` for ``(rule, param)``; updated in place.
        workspace: Scratch in the compute dtype; None (or one of another dtype) takes the
            calling thread's (:func:`thread_workspace`).

    Raises:
        DimensionMismatch: (INVALID_ARGUMENT) ``grad`` shape or dtype disagrees with ``param``.
        InvalidArgument: (INVALID_ARGUMENT) ``state`` does not fit ``rule`` and ``param``, or an
            optimizer rule on an integer parameter.
    """
    if (
        rule.kind == "sgd"
        and not state
        and rule.momentum == 0
        and rule.weight_decay == 0
        and grad.dtype == param.dtype
        and param.dtype in _PLAIN_DTYPES
        and grad.shape == param.shape
        and 0 < param.size <= BLOCK_ELEMENTS
        and param.flags.c_contiguous
        and grad.flags.c_contiguous
    ):
        # The common case of a model's many small keys, without the general path's per-key
        # bookkeeping: one block, same arithmetic (scratch = g * lr; p -= scratch), so the
        # result is bit-identical to the blocked loop below.
        if workspace is None or workspace.dtype != param.dtype or workspace.size < param.size:
            workspace = thread_workspace(param.dtype)
        if workspace.size >= param.size:
            scratch = workspace.take(1)[0][: param.size]
            flat = param.reshape(-1)
            np.multiply(grad.reshape(-1), rule.lr, out=scratch)
            flat -= scratch
            return
    _check(rule, param, grad, state)
    if rule.kind == "assign":
        np.copyto(param, grad, casting="same_kind")
        return
    if rule.kind == "add":
        flat_p, flat_g = _flat(param), _flat(grad)
        if grad.dtype == param.dtype or flat_p is None or flat_g is None:
            np.add(param, grad, out=param, casting="same_kind")
            return
        # Mixed dtypes (an aggregate): numpy would buffer a whole-size cast copy; go by blocks.
        for start in range(0, flat_p.size, BLOCK_ELEMENTS):
            block = flat_p[start : start + BLOCK_ELEMENTS]
            np.add(block, flat_g[start : start + BLOCK_ELEMENTS], out=block, casting="same_kind")
        return
    dtype = compute_dtype(rule, param.dtype)
    assert dtype is not None
    t = 0
    if "step" in state:
        step_count = state["step"]
        np.add(step_count, 1, out=step_count)
        t = int(step_count)
    if param.size == 0:
        return
    flat_p = _flat(param)
    flat_g = _flat(grad)
    flat_state = {name: _flat(a) for name, a in state.items() if name != "step"}
    if flat_p is None or flat_g is None or any(a is None for a in flat_state.values()):
        _apply_whole(rule, param, grad, state, dtype, t)
        return
    if workspace is None or workspace.dtype != dtype or workspace.size < 1:
        workspace = thread_workspace(dtype)
    half = param.dtype != dtype
    cast_g = grad.dtype != dtype
    buffers = workspace.take(2 + half + cast_g)
    kernel = _kernel(rule)
    n = flat_p.size
    size = workspace.size
    for start in range(0, n, size):
        stop = min(start + size, n)
        width = stop - start
        s = [buffers[0][:width], buffers[1][:width]]
        extra = 2
        if half:
            p = buffers[extra][:width]
            extra += 1
            np.copyto(p, flat_p[start:stop], casting="unsafe")
        else:
            p = flat_p[start:stop]
        if cast_g:
            g = buffers[extra][:width]
            np.copyto(g, flat_g[start:stop], casting="unsafe")
        else:
            g = flat_g[start:stop]
        st = {name: a[start:stop] for name, a in flat_state.items() if a is not None}
        kernel(rule, p, g, st, s, t)
        if half:
            np.copyto(flat_p[start:stop], p, casting="unsafe")


def _apply_whole(
    rule: UpdateRule,
    param: Array,
    grad: Array,
    state: dict[str, Array],
    dtype: np.dtype[np.generic],
    t: int,
) -> None:
    """The update on whole (possibly strided) arrays, with temporaries of ``param``'s shape."""
    work = param if param.dtype == dtype else param.astype(dtype)
    g = grad if grad.dtype == dtype else grad.astype(dtype)
    s = [np.empty(param.shape, dtype=dtype), np.empty(param.shape, dtype=dtype)]
    st = {name: a for name, a in state.items() if name != "step"}
    _kernel(rule)(rule, work, g, st, s, t)
    if work is not param:
        np.copyto(param, work, casting="unsafe")


# ------------------------------------------------------------------ storage range (overflow)
# The dense keys' check; what an overflow is: paramserver.core.storage_range.
_HALF_STORAGE = HALF_DTYPES


#: Elements the range check computes at a time (its temporaries stay near 100 KiB).
RANGE_CHECK_ELEMENTS: Final = 4096


def overflowing_elements(
    rule: UpdateRule, param: Array, grad: Array, state: Mapping[str, Array]
) -> int:
    """Elements that :func:`apply_update` would turn non-finite although the parameter element
    and the gradient element are finite: a result outside the storage dtype's range.

    Nothing is modified: the update is computed on copies, :data:`RANGE_CHECK_ELEMENTS` at a
    time (temporaries of a few times that, so a push allocates nothing of the key's size).
    Checked where the arithmetic is wider than the storage, which is where a finite result can
    overflow on the final cast: float16/bfloat16 parameters under every rule
    (the rules compute in float32), and ``assign``/``add`` of an aggregate wider than the
    parameter (float64 into float32). Same-dtype float32/float64 arithmetic is not checked.

    Args:
        rule, param, grad, state: As for :func:`apply_update`.

    Returns:
        The number of such elements (0: the update stays in range).
    """
    if param.dtype not in FLOAT_DTYPES or param.size == 0:
        return 0
    half = param.dtype in _HALF_STORAGE
    if not half and (
        grad.dtype.itemsize <= param.dtype.itemsize or rule.kind not in ("assign", "add")
    ):
        return 0
    flat_p = param.reshape(-1)
    flat_g = grad.reshape(-1)
    names = [name for name in state if name != "step"]
    flat_state = {name: state[name].reshape(-1) for name in names}
    t = int(state["step"]) + 1 if "step" in state else 0
    work = np.dtype(np.float64) if grad.dtype == np.float64 else np.dtype(np.float32)
    bad = 0
    with np.errstate(over="ignore", invalid="ignore"):
        for start in range(0, flat_p.size, RANGE_CHECK_ELEMENTS):
            stop = min(start + RANGE_CHECK_ELEMENTS, flat_p.size)
            p0 = flat_p[start:stop]
            g = flat_g[start:stop]
            if rule.kind == "assign":
                out = g.astype(work)
            elif rule.kind == "add":
                out = p0.astype(work) + g.astype(work)
            else:
                out = p0.astype(np.float32)
                st = {name: a[start:stop].copy() for name, a in flat_state.items()}
                scratch = [np.empty_like(out), np.empty_like(out)]
                _kernel(rule)(rule, out, g.astype(np.float32), st, scratch, t)
            inputs_finite = np.isfinite(p0) & np.isfinite(g)
            bad += int(np.count_nonzero(overflow_mask(out, param.dtype, inputs_finite)))
    return bad
