"""Unit tests of paramserver.core.optimizers.

Expected values come from closed forms and from numpy references written here from the PyTorch
``torch.optim`` documentation formulas (SGD, Adam, AdamW, Adagrad pages), never from the code under
test; where ``torch`` is importable the rules are also compared with ``torch.optim`` itself.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Sequence
from typing import Any

import ml_dtypes
import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from paramserver.api.v1 import parameter_server_pb2 as ps_pb2
from paramserver.core.optimizers import (
    RULE_KINDS,
    UpdateRule,
    apply_update,
    init_state,
)
from paramserver.errors import DimensionMismatch, InvalidArgument

Array = npt.NDArray[Any]
BF16 = np.dtype(ml_dtypes.bfloat16)
_finfo: Callable[[Any], Any] = ml_dtypes.finfo  # untyped; accepts every float dtype
HALF_DTYPES = [np.dtype(np.float16), BF16]
FLOAT_DTYPES = [*HALF_DTYPES, np.dtype(np.float32), np.dtype(np.float64)]
INT_DTYPES = [np.dtype(np.int32), np.dtype(np.int64)]
SHAPES: list[tuple[int, ...]] = [(), (0,), (1,), (7,), (3, 4), (2, 0, 3), (2, 3, 2)]
STEPS = 5


# -- references (float64, from the torch.optim documentation pseudo-code) -------------------------


def ref_sgd(
    p: Array,
    grads: Sequence[Array],
    *,
    lr: float,
    momentum: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
) -> Array:
    """torch.optim.SGD, dampening 0: the first buffer is the gradient itself."""
    p = p.copy()
    buf: Array | None = None
    for grad in grads:
        g = grad + weight_decay * p
        if momentum:
            buf = g.copy() if buf is None else momentum * buf + g
            g = g + momentum * buf if nesterov else buf
        p = p - lr * g
    return p


def ref_adam(
    p: Array,
    grads: Sequence[Array],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
) -> Array:
    """Kingma & Ba 2015 Algorithm 1 with PyTorch's weight decay (L2, or decoupled for AdamW)."""
    p = p.copy()
    m = np.zeros_like(p)
    v = np.zeros_like(p)
    for t, grad in enumerate(grads, start=1):
        if decoupled:
            p = p - lr * weight_decay * p
            g = grad
        else:
            g = grad + weight_decay * p
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g**2
        m_hat = m / (1 - beta1**t)
        v_hat = v / (1 - beta2**t)
        p = p - lr * m_hat / (np.sqrt(v_hat) + eps)
    return p


def ref_adagrad(
    p: Array, grads: Sequence[Array], *, lr: float, eps: float, weight_decay: float
) -> Array:
    """Duchi et al. 2011 diagonal Adagrad as in torch.optim.Adagrad (lr_decay 0, init acc 0)."""
    p = p.copy()
    s = np.zeros_like(p)
    for grad in grads:
        g = grad + weight_decay * p
        s = s + g * g
        p = p - lr * g / (np.sqrt(s) + eps)
    return p


def reference(rule: UpdateRule, p: Array, grads: Sequence[Array]) -> Array:
    if rule.kind == "assign":
        return grads[-1].copy() if grads else p.copy()
    if rule.kind == "add":
        return p + sum(grads, np.zeros_like(p))
    if rule.kind == "sgd":
        return ref_sgd(
            p,
            grads,
            lr=rule.lr,
            momentum=rule.momentum,
            nesterov=rule.nesterov,
            weight_decay=rule.weight_decay,
        )
    if rule.kind in ("adam", "adamw"):
        return ref_adam(
            p,
            grads,
            lr=rule.lr,
            beta1=rule.beta1,
            beta2=rule.beta2,
            eps=rule.eps,
            weight_decay=rule.weight_decay,
            decoupled=rule.kind == "adamw",
        )
    assert rule.kind == "adagrad"
    return ref_adagrad(p, grads, lr=rule.lr, eps=rule.eps, weight_decay=rule.weight_decay)


RULES = [
    UpdateRule("assign"),
    UpdateRule("add"),
    UpdateRule("sgd", lr=0.1),
    UpdateRule("sgd", lr=0.05, weight_decay=0.1),
    UpdateRule("sgd", lr=0.1, momentum=0.9),
    UpdateRule("sgd", lr=0.1, momentum=0.5, weight_decay=0.01),
    UpdateRule("sgd", lr=0.1, momentum=0.9, nesterov=True),
    UpdateRule("sgd", lr=0.02, momentum=0.8, nesterov=True, weight_decay=0.05),
    UpdateRule("sgd", lr=0.0),
    UpdateRule("adam"),
    UpdateRule("adam", lr=0.01, beta1=0.8, beta2=0.99, eps=1e-6),
    UpdateRule("adam", lr=0.01, weight_decay=0.1),
    UpdateRule("adam", lr=0.1, beta1=0.0, beta2=0.0),
    UpdateRule("adamw"),
    UpdateRule("adamw", lr=0.01, weight_decay=0.5, beta1=0.5, beta2=0.9),
    UpdateRule("adamw", lr=0.01, weight_decay=0.0),
    UpdateRule("adagrad"),
    UpdateRule("adagrad", lr=0.1, eps=1e-3),
    UpdateRule("adagrad", lr=0.5, weight_decay=0.2),
]
OPTIMIZER_RULES = [r for r in RULES if r.kind not in ("assign", "add")]


def rule_id(rule: UpdateRule) -> str:
    fields = [f"{k}={v}" for k, v in rule.to_dict().items() if k != "kind"]
    return f"{rule.kind}[{','.join(fields)}]"


def random_case(shape: tuple[int, ...], seed: int, steps: int = STEPS) -> tuple[Array, list[Array]]:
    rng = np.random.default_rng(seed)
    p = rng.standard_normal(shape)
    grads = [rng.standard_normal(shape) for _ in range(steps)]
    return p, grads


def run(rule: UpdateRule, p0: Array, grads: Sequence[Array]) -> tuple[Array, dict[str, Array]]:
    param = p0.copy()
    state = init_state(rule, param)
    for g in grads:
        apply_update(rule, param, g, state)
    return param, state


# -- UpdateRule -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "lr", "weight_decay", "eps"),
    [
        ("assign", 0.01, 0.0, 1e-8),
        ("add", 0.01, 0.0, 1e-8),
        ("sgd", 0.01, 0.0, 1e-8),
        ("adam", 1e-3, 0.0, 1e-8),
        ("adamw", 1e-3, 1e-2, 1e-8),
        ("adagrad", 0.01, 0.0, 1e-10),
    ],
)
def test_defaults_per_kind(kind: str, lr: float, weight_decay: float, eps: float) -> None:
    rule = UpdateRule(kind)
    assert (rule.lr, rule.weight_decay, rule.eps) == (lr, weight_decay, eps)
    assert (rule.momentum, rule.nesterov, rule.beta1, rule.beta2) == (0.0, False, 0.9, 0.999)


def test_default_kind_is_sgd_and_explicit_values_win() -> None:
    assert UpdateRule() == UpdateRule("sgd", lr=0.01)
    rule = UpdateRule("sgd", lr=0.1)
    assert rule.lr == 0.1 and rule.kind == "sgd"
    assert UpdateRule("adamw", weight_decay=0.0).weight_decay == 0.0
    assert UpdateRule("adagrad", eps=1e-6).eps == 1e-6
    assert UpdateRule("sgd", lr=1).lr == 1.0 and isinstance(UpdateRule("sgd", lr=1).lr, float)


def test_rule_is_frozen_hashable_and_replaceable() -> None:
    rule = UpdateRule("adam", lr=0.1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        rule.lr = 0.2  # type: ignore[misc]
    assert len({rule, UpdateRule("adam", lr=0.1)}) == 1
    assert dataclasses.replace(rule, lr=0.2) == UpdateRule("adam", lr=0.2)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"kind": "rmsprop"}, "unknown update rule kind 'rmsprop'"),
        ({"kind": ["sgd"]}, "unknown update rule kind ['sgd']"),
        ({"kind": "sgd", "lr": -0.1}, "lr must be >= 0"),
        ({"kind": "sgd", "lr": math.inf}, "lr must be finite"),
        ({"kind": "sgd", "lr": math.nan}, "lr must be finite"),
        ({"kind": "sgd", "lr": "0.1"}, "lr must be a real number"),
        ({"kind": "sgd", "lr": True}, "lr must be a real number"),
        ({"kind": "sgd", "momentum": 1.0}, "momentum must be in [0, 1)"),
        ({"kind": "sgd", "momentum": -0.1}, "momentum must be in [0, 1)"),
        ({"kind": "sgd", "nesterov": True}, "nesterov requires momentum > 0"),
        ({"kind": "sgd", "nesterov": 1}, "nesterov must be a bool"),
        ({"kind": "adam", "momentum": 0.9}, "momentum applies to 'sgd' only"),
        ({"kind": "adagrad", "nesterov": True}, "nesterov applies to 'sgd' only"),
        ({"kind": "sgd", "weight_decay": -1e-3}, "weight_decay must be >= 0"),
        ({"kind": "assign", "weight_decay": 0.1}, "weight_decay does not apply"),
        ({"kind": "add", "weight_decay": 0.1}, "weight_decay does not apply"),
        ({"kind": "adam", "beta1": 1.0}, "beta1 must be in [0, 1)"),
        ({"kind": "adam", "beta2": -0.5}, "beta2 must be in [0, 1)"),
        ({"kind": "adam", "eps": 0.0}, "eps must be > 0"),
        ({"kind": "adagrad", "eps": -1e-10}, "eps must be > 0"),
    ],
)
def test_rule_validation(kwargs: dict[str, Any], fragment: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        UpdateRule(**kwargs)
    assert fragment in str(info.value)
    assert info.value.code.name == "INVALID_ARGUMENT"


@pytest.mark.parametrize("rule", RULES, ids=rule_id)
def test_proto_round_trip(rule: UpdateRule) -> None:
    msg = rule.to_proto()
    assert isinstance(msg, ps_pb2.UpdateRule)
    wire = ps_pb2.UpdateRule.FromString(msg.SerializeToString())
    assert UpdateRule.from_proto(wire) == rule


@pytest.mark.parametrize(
    ("enum", "kind"),
    [
        (ps_pb2.RULE_KIND_ASSIGN, "assign"),
        (ps_pb2.RULE_KIND_ADD, "add"),
        (ps_pb2.RULE_KIND_SGD, "sgd"),
        (ps_pb2.RULE_KIND_ADAM, "adam"),
        (ps_pb2.RULE_KIND_ADAMW, "adamw"),
        (ps_pb2.RULE_KIND_ADAGRAD, "adagrad"),
    ],
)
def test_from_proto_unset_fields_take_kind_defaults(enum: ps_pb2.RuleKind, kind: str) -> None:
    rule = UpdateRule.from_proto(ps_pb2.UpdateRule(kind=enum))
    assert rule == UpdateRule(kind)


def test_from_proto_set_fields_override_and_explicit_zero_is_kept() -> None:
    msg = ps_pb2.UpdateRule(
        kind=ps_pb2.RULE_KIND_ADAMW, lr=0.5, weight_decay=0.0, beta1=0.0, eps=1e-3
    )
    assert UpdateRule.from_proto(msg) == UpdateRule(
        "adamw", lr=0.5, weight_decay=0.0, beta1=0.0, eps=1e-3
    )
    sgd = ps_pb2.UpdateRule(kind=ps_pb2.RULE_KIND_SGD, momentum=0.9, nesterov=True)
    assert UpdateRule.from_proto(sgd) == UpdateRule("sgd", momentum=0.9, nesterov=True)


def test_from_proto_refuses_unspecified_and_bad_values() -> None:
    with pytest.raises(InvalidArgument, match="RULE_KIND_UNSPECIFIED"):
        UpdateRule.from_proto(ps_pb2.UpdateRule())
    with pytest.raises(InvalidArgument, match="lr must be >= 0"):
        UpdateRule.from_proto(ps_pb2.UpdateRule(kind=ps_pb2.RULE_KIND_SGD, lr=-1.0))
    unknown = ps_pb2.UpdateRule()
    unknown.ParseFromString(b"\x08\x63")  # kind = 99, an enum value from a newer peer
    with pytest.raises(InvalidArgument, match="99"):
        UpdateRule.from_proto(unknown)


@pytest.mark.parametrize("rule", RULES, ids=rule_id)
def test_dict_round_trip_through_json(rule: UpdateRule) -> None:
    d = json.loads(json.dumps(rule.to_dict()))
    assert UpdateRule.from_dict(d) == rule


def test_from_dict_defaults_and_errors() -> None:
    assert UpdateRule.from_dict({"kind": "adamw"}) == UpdateRule("adamw")
    assert UpdateRule.from_dict({"kind": "sgd", "lr": 1}) == UpdateRule("sgd", lr=1.0)
    with pytest.raises(InvalidArgument, match="unknown fields"):
        UpdateRule.from_dict({"kind": "sgd", "learning_rate": 0.1})
    with pytest.raises(InvalidArgument, match="kind must be a string"):
        UpdateRule.from_dict({"lr": 0.1})
    with pytest.raises(InvalidArgument, match="nesterov must be a bool"):
        UpdateRule.from_dict({"kind": "sgd", "momentum": 0.9, "nesterov": "yes"})
    with pytest.raises(InvalidArgument, match="must be a mapping"):
        UpdateRule.from_dict([("kind", "sgd")])  # type: ignore[arg-type]


# -- init_state -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize(
    ("rule", "names"),
    [
        (UpdateRule("assign"), set()),
        (UpdateRule("add"), set()),
        (UpdateRule("sgd"), set()),
        (UpdateRule("sgd", momentum=0.9), {"momentum_buffer"}),
        (UpdateRule("adam"), {"exp_avg", "exp_avg_sq", "step"}),
        (UpdateRule("adamw"), {"exp_avg", "exp_avg_sq", "step"}),
        (UpdateRule("adagrad"), {"sum_sq"}),
    ],
    ids=lambda x: x.kind if isinstance(x, UpdateRule) else None,
)
@pytest.mark.parametrize("shape", [(), (0,), (3, 2)], ids=str)
def test_init_state_names_dtypes_and_zeros(
    dtype: np.dtype[Any], rule: UpdateRule, names: set[str], shape: tuple[int, ...]
) -> None:
    param = np.ones(shape, dtype=dtype)
    state = init_state(rule, param)
    assert set(state) == names
    compute = np.float64 if dtype == np.float64 else np.float32
    for name, array in state.items():
        if name == "step":
            assert array.shape == () and array.dtype == np.int64 and int(array) == 0
        else:
            assert array.shape == shape and array.dtype == compute
            assert not array.any()
            assert not np.shares_memory(array, param)


@pytest.mark.parametrize("dtype", INT_DTYPES, ids=str)
@pytest.mark.parametrize("kind", RULE_KINDS)
def test_int_params_take_only_assign_and_add(dtype: np.dtype[Any], kind: str) -> None:
    param = np.arange(4, dtype=dtype)
    if kind in ("assign", "add"):
        assert init_state(UpdateRule(kind), param) == {}
    else:
        with pytest.raises(InvalidArgument, match=f"{kind}.*floating-point.*{dtype}"):
            init_state(UpdateRule(kind), param)


# -- closed forms ---------------------------------------------------------------------------------


def _closed_form(rule: UpdateRule, p0: float, g: float, n: int) -> float:
    """The parameter after n steps with a constant scalar gradient g and weight_decay 0/AdamW."""
    lr, mu = rule.lr, rule.momentum
    if rule.kind == "sgd":
        # buf_k = g (1 - mu^k) / (1 - mu); Nesterov's direction is g + mu * buf_k.
        total = 0.0
        for k in range(1, n + 1):
            buf = g * (1 - mu**k) / (1 - mu)
            total += g + mu * buf if rule.nesterov else buf
        return p0 - lr * total
    if rule.kind == "adam":
        # Bias correction makes m_hat = g and v_hat = g^2 at every step.
        return p0 - n * lr * g / (abs(g) + rule.eps)
    if rule.kind == "adamw":
        a = 1 - lr * rule.weight_decay
        c = lr * g / (abs(g) + rule.eps)
        return a**n * p0 - c * (1 - a**n) / (1 - a) if a != 1 else p0 - n * c
    if rule.kind == "adagrad":
        return p0 - lr * sum(g / (math.sqrt(k) * abs(g) + rule.eps) for k in range(1, n + 1))
    if rule.kind == "add":
        return p0 + n * g
    return g


@pytest.mark.parametrize(
    "rule",
    [
        UpdateRule("assign"),
        UpdateRule("add"),
        UpdateRule("sgd", lr=0.1),
        UpdateRule("sgd", lr=0.1, momentum=0.9),
        UpdateRule("sgd", lr=0.1, momentum=0.5, nesterov=True),
        UpdateRule("adam", lr=0.01),
        UpdateRule("adam", lr=0.3, beta1=0.5, beta2=0.75, eps=1e-3),
        UpdateRule("adamw", lr=0.01, weight_decay=0.1),
        UpdateRule("adamw", lr=0.01, weight_decay=0.0),
        UpdateRule("adagrad", lr=0.1),
        UpdateRule("adagrad", lr=0.1, eps=0.5),
    ],
    ids=rule_id,
)
@pytest.mark.parametrize("g", [0.5, -2.0, 3e-3])
@pytest.mark.parametrize("n", [1, 2, 7])
def test_closed_form_constant_gradient(rule: UpdateRule, g: float, n: int) -> None:
    p0 = np.array([1.5, -0.25, 0.0])
    param, _ = run(rule, p0, [np.full(3, g)] * n)
    expected = [_closed_form(rule, float(x), g, n) for x in p0]
    np.testing.assert_allclose(param, expected, rtol=1e-12, atol=1e-14)


def test_sgd_first_step_buffer_is_the_gradient() -> None:
    rule = UpdateRule("sgd", lr=0.5, momentum=0.9, weight_decay=0.1)
    param = np.array([2.0, -4.0])
    state = init_state(rule, param)
    apply_update(rule, param, np.array([1.0, 1.0]), state)
    # g = 1 + 0.1 * p = [1.2, 0.6]; buf = g; p = p - 0.5 * g.
    np.testing.assert_array_equal(state["momentum_buffer"], [1.2, 0.6])
    np.testing.assert_allclose(param, [2.0 - 0.6, -4.0 - 0.3], rtol=1e-15)


def test_adamw_decays_before_the_adam_step_and_adam_uses_l2() -> None:
    p0, g = np.array([10.0]), np.array([0.0])
    # A zero gradient leaves m = v = 0, so only the weight decay moves the parameter.
    adamw, _ = run(UpdateRule("adamw", lr=0.1, weight_decay=0.5), p0, [g])
    np.testing.assert_allclose(adamw, [10.0 * (1 - 0.05)], rtol=1e-15)
    # Adam's L2 term enters the moments: g' = 0.5 * 10 = 5 -> first step moves by lr*5/(5+eps).
    adam, _ = run(UpdateRule("adam", lr=0.1, weight_decay=0.5), p0, [g])
    np.testing.assert_allclose(adam, [10.0 - 0.1 * 5 / (5 + 1e-8)], rtol=1e-15)


# -- multi-step references (float64, 1e-12) -------------------------------------------------------


@pytest.mark.parametrize("rule", RULES, ids=rule_id)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_reference_float64(rule: UpdateRule, shape: tuple[int, ...]) -> None:
    p0, grads = random_case(shape, seed=len(shape) + 31 * RULES.index(rule))
    param, state = run(rule, p0, grads)
    assert param.dtype == np.float64 and param.shape == shape
    np.testing.assert_allclose(param, reference(rule, p0, grads), rtol=1e-12, atol=1e-13)
    if "step" in state:
        assert int(state["step"]) == STEPS


@pytest.mark.parametrize("rule", RULES, ids=rule_id)
@pytest.mark.parametrize("grad_dtype", [np.float32, np.float64], ids=["f32", "f64-aggregate"])
def test_float32_param_matches_reference(rule: UpdateRule, grad_dtype: type) -> None:
    p64, g64 = random_case((5, 3), seed=7)
    p0 = p64.astype(np.float32)
    grads: list[Array] = [g.astype(grad_dtype) for g in g64]
    param, state = run(rule, p0, grads)
    assert param.dtype == np.float32
    assert all(a.dtype in (np.float32, np.int64) for a in state.values())
    # The float64 reference starts from the same float32-rounded values.
    expected = reference(
        rule, p0.astype(np.float64), [g.astype(np.float32).astype(np.float64) for g in grads]
    )
    np.testing.assert_allclose(param, expected, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("rule", RULES, ids=rule_id)
def test_grad_is_never_modified(rule: UpdateRule) -> None:
    p0, grads = random_case((4,), seed=3)
    kept = [g.copy() for g in grads]
    run(rule, p0, grads)
    for g, k in zip(grads, kept, strict=True):
        np.testing.assert_array_equal(g, k)


# -- in place -------------------------------------------------------------------------------------


def _pointer(a: Array) -> int:
    data: tuple[int, bool] = a.__array_interface__["data"]
    return data[0]


@pytest.mark.parametrize("rule", RULES, ids=rule_id)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (6,), (2, 3)], ids=str)
def test_updates_param_and_state_in_place(
    rule: UpdateRule, dtype: np.dtype[Any], shape: tuple[int, ...]
) -> None:
    param = np.full(shape, 0.75, dtype=dtype)
    state = init_state(rule, param)
    ids = (id(param), {k: id(v) for k, v in state.items()})
    pointers = (_pointer(param), {k: _pointer(v) for k, v in state.items()})
    for grad_dtype in (dtype, np.dtype(np.float64)):
        apply_update(rule, param, np.full(shape, 0.5, dtype=grad_dtype), state)
    assert (id(param), {k: id(v) for k, v in state.items()}) == ids
    assert (_pointer(param), {k: _pointer(v) for k, v in state.items()}) == pointers
    assert param.dtype == dtype and param.shape == shape


def test_non_contiguous_param_view_is_updated_in_place() -> None:
    base = np.zeros((4, 6))
    view = base[:, ::2]
    rule = UpdateRule("sgd", lr=0.5, momentum=0.5)
    state = init_state(rule, view)
    apply_update(rule, view, np.ones(view.shape), state)
    np.testing.assert_array_equal(base[:, ::2], -0.5)
    np.testing.assert_array_equal(base[:, 1::2], 0.0)


# -- half precision -------------------------------------------------------------------------------


def ref_sgd_float32(rule: UpdateRule, p0: Array, grads: Sequence[Array]) -> Array:
    """SGD evaluated in float32 and rounded to p0.dtype after every step (one rounding each)."""
    p = p0.copy()
    buf: Array | None = None
    for grad in grads:
        p32 = p.astype(np.float32)
        g = grad.astype(np.float32) + np.float32(rule.weight_decay) * p32
        if rule.momentum:
            mu = np.float32(rule.momentum)
            buf = g.copy() if buf is None else mu * buf + g
            g = g + mu * buf if rule.nesterov else buf
        p = (p32 - np.float32(rule.lr) * g).astype(p0.dtype)
    return p


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("rule", [r for r in OPTIMIZER_RULES if r.kind == "sgd"], ids=rule_id)
@pytest.mark.parametrize("grad_dtype", ["param", "float64"])
def test_half_sgd_is_computed_in_float32_and_rounded_once(
    dtype: np.dtype[Any], rule: UpdateRule, grad_dtype: str
) -> None:
    p64, g64 = random_case((33,), seed=11)
    p0 = p64.astype(dtype)
    grads = [g.astype(dtype if grad_dtype == "param" else np.float64) for g in g64]
    param, state = run(rule, p0, grads)
    assert param.dtype == dtype
    assert all(v.dtype == np.float32 for v in state.values())
    np.testing.assert_array_equal(
        param.astype(np.float32), ref_sgd_float32(rule, p0, grads).astype(np.float32)
    )


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("rule", RULES, ids=rule_id)
def test_half_param_with_float64_aggregate_stays_half(
    dtype: np.dtype[Any], rule: UpdateRule
) -> None:
    p64, g64 = random_case((40,), seed=5)
    p0 = p64.astype(dtype)
    param = p0.copy()
    state = init_state(rule, param)
    for g in g64:
        apply_update(rule, param, g, state)
        assert param.dtype == dtype
    for name, array in state.items():
        assert array.dtype == (np.int64 if name == "step" else np.float32), name
    expected = reference(rule, p0.astype(np.float64), g64)
    # Each step rounds once to the half dtype (at most half an ulp of a value bounded by `bound`)
    # and float32 arithmetic adds far less, so STEPS ulps of the bound cover the drift twice over.
    bound = float(np.abs(p0.astype(np.float64)).max() + STEPS * np.abs(np.stack(g64)).max())
    ulp = float(_finfo(dtype).eps)
    np.testing.assert_allclose(param.astype(np.float64), expected, rtol=0, atol=STEPS * ulp * bound)


def test_half_assign_and_add_round_float64_once() -> None:
    param = np.zeros(3, dtype=BF16)
    g = np.array([1.0 / 3.0, 1e-3, -2.5])
    apply_update(UpdateRule("assign"), param, g, {})
    np.testing.assert_array_equal(param, g.astype(BF16))
    apply_update(UpdateRule("add"), param, g, {})
    np.testing.assert_array_equal(param, (g.astype(BF16).astype(np.float64) + g).astype(BF16))


# -- assign / add ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [*FLOAT_DTYPES, *INT_DTYPES], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_assign_and_add_exact(dtype: np.dtype[Any], shape: tuple[int, ...]) -> None:
    n = math.prod(shape)
    p = np.arange(n).reshape(shape).astype(dtype)
    g = (np.arange(n).reshape(shape) * 2 - 3).astype(dtype)
    add = p.copy()
    apply_update(UpdateRule("add"), add, g, {})
    apply_update(UpdateRule("add"), add, g, {})
    np.testing.assert_array_equal(add, (np.arange(n).reshape(shape) * 5 - 6).astype(dtype))
    assign = p.copy()
    apply_update(UpdateRule("assign"), assign, g, {})
    np.testing.assert_array_equal(assign, g)
    assert assign.dtype == add.dtype == dtype


def test_assign_copies_nan_payloads_and_negative_zero() -> None:
    param = np.zeros(3)
    g = np.array([-0.0, np.nan, np.inf])
    apply_update(UpdateRule("assign"), param, g, {})
    assert np.signbit(param[0]) and np.isnan(param[1]) and param[2] == np.inf


# -- argument errors ------------------------------------------------------------------------------


@pytest.mark.parametrize("rule", RULES, ids=rule_id)
def test_shape_and_dtype_mismatch(rule: UpdateRule) -> None:
    param = np.zeros((2, 3), dtype=np.float32)
    state = init_state(rule, param)
    with pytest.raises(DimensionMismatch, match=r"\(3, 2\).*\(2, 3\)"):
        apply_update(rule, param, np.zeros((3, 2), dtype=np.float32), state)
    with pytest.raises(DimensionMismatch, match=r"float16.*float32"):
        apply_update(rule, param, np.zeros((2, 3), dtype=np.float16), state)
    np.testing.assert_array_equal(param, 0.0)


def test_int_param_refuses_float_aggregate() -> None:
    with pytest.raises(DimensionMismatch, match=r"float64.*int32"):
        apply_update(UpdateRule("add"), np.zeros(2, np.int32), np.zeros(2), {})


def test_state_that_does_not_fit_is_refused() -> None:
    param = np.zeros(3)
    with pytest.raises(InvalidArgument, match="must hold"):
        apply_update(UpdateRule("adam"), param, np.ones(3), {})
    bad = init_state(UpdateRule("adam"), np.zeros(3, dtype=np.float32))
    with pytest.raises(InvalidArgument, match="exp_avg"):
        apply_update(UpdateRule("adam"), param, np.ones(3), bad)
    with pytest.raises(InvalidArgument, match="floating-point"):
        apply_update(UpdateRule("sgd"), np.zeros(3, np.int64), np.ones(3, np.int64), {})


# -- property -------------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    values=hnp.arrays(
        np.float64,
        hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4),
        elements=st.floats(-1e3, 1e3),
    ),
    lr=st.floats(0.0, 10.0),
)
def test_plain_sgd_is_one_fused_step(values: Array, lr: float) -> None:
    param = values.copy()
    grad = values[::-1].copy() if values.ndim else values.copy()
    apply_update(UpdateRule("sgd", lr=lr), param, grad, {})
    np.testing.assert_array_equal(param, values - lr * grad)


# -- torch ----------------------------------------------------------------------------------------


def _torch_optimizer(rule: UpdateRule) -> Callable[[Any], Any]:
    torch = pytest.importorskip("torch")

    def make(params: Any) -> Any:
        if rule.kind == "sgd":
            return torch.optim.SGD(
                params,
                lr=rule.lr,
                momentum=rule.momentum,
                nesterov=rule.nesterov,
                weight_decay=rule.weight_decay,
            )
        if rule.kind in ("adam", "adamw"):
            cls = torch.optim.Adam if rule.kind == "adam" else torch.optim.AdamW
            return cls(
                params,
                lr=rule.lr,
                betas=(rule.beta1, rule.beta2),
                eps=rule.eps,
                weight_decay=rule.weight_decay,
            )
        return torch.optim.Adagrad(params, lr=rule.lr, eps=rule.eps, weight_decay=rule.weight_decay)

    return make


@pytest.mark.parametrize("rule", OPTIMIZER_RULES, ids=rule_id)
def test_matches_torch_optim(rule: UpdateRule) -> None:
    torch = pytest.importorskip("torch")
    make = _torch_optimizer(rule)
    p0, grads = random_case((4, 5), seed=17)
    param, _ = run(rule, p0, grads)
    tp = torch.nn.Parameter(torch.tensor(p0, dtype=torch.float64))
    opt = make([tp])
    for g in grads:
        tp.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
    np.testing.assert_allclose(param, tp.detach().numpy(), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("size", [1, 7, 4096, (1 << 17) + 3])
def test_plain_sgd_many_small_keys_path_is_bit_identical(dtype: type, size: int) -> None:
    # Plain sgd (no momentum, no weight decay) on a key of at most one block takes a short
    # path; the result must equal the rule's formula evaluated in the key's dtype bit for bit
    # (scratch = g * lr; p -= scratch), as the blocked path computes it.
    rng = np.random.default_rng(size)
    rule = UpdateRule("sgd", lr=0.0123)
    p = rng.standard_normal(size).astype(dtype)
    g = rng.standard_normal(size).astype(dtype)
    want = p - np.multiply(g, rule.lr, dtype=dtype)
    got = p.copy()
    apply_update(rule, got, g, init_state(rule, got))
    assert got.tobytes() == want.tobytes()


def test_plain_sgd_short_path_still_checks_the_shape() -> None:
    rule = UpdateRule("sgd", lr=0.1)
    p = np.zeros(4, np.float32)
    with pytest.raises(DimensionMismatch):
        apply_update(rule, p, np.ones(5, np.float32), {})
    np.testing.assert_array_equal(p, np.zeros(4, np.float32))


def test_every_wire_rule_kind_has_exactly_one_registry_entry() -> None:
    """One entry per dense rule (fields, defaults, state, proto value, step): the wire's
    RuleKind values (UNSPECIFIED aside) map one to one onto the registry, and every kind that
    keeps state has a step kernel, so no kind can reach an apply without one."""
    from paramserver.api.v1 import parameter_server_pb2 as ps_pb2
    from paramserver.core.optimizers import RULES

    wire = {v.number for v in ps_pb2.RuleKind.DESCRIPTOR.values if v.number != 0}
    assert {r.proto for r in RULES.values()} == wire
    assert len({r.proto for r in RULES.values()}) == len(RULES)
    for rule in RULES.values():
        assert (rule.step is None) == (rule.state == ()), rule.name
        assert UpdateRule(rule.name).kind == rule.name
        assert UpdateRule.from_proto(UpdateRule(rule.name).to_proto()) == UpdateRule(rule.name)
