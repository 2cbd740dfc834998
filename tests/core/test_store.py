"""Unit tests of paramserver.core.store.ParameterStore.

Expected values are computed here independently (closed forms such as ``p - lr * g``); refused
requests are checked to leave every value, state array and counter bit-for-bit unchanged.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import grpc
import ml_dtypes
import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paramserver.core.optimizers import UpdateRule
from paramserver.core.store import SUPPORTED_DTYPES, Entry, ParameterStore
from paramserver.errors import (
    DimensionMismatch,
    InvalidArgument,
    KeyConflict,
    KeyNotFound,
    NonFiniteGradient,
)

Array = npt.NDArray[Any]
BF16 = np.dtype(ml_dtypes.bfloat16)
FLOAT_DTYPES = [np.dtype(np.float16), BF16, np.dtype(np.float32), np.dtype(np.float64)]
INT_DTYPES = [np.dtype(np.int32), np.dtype(np.int64)]
SHAPES: list[tuple[int, ...]] = [(), (0,), (1,), (5,), (2, 3), (3, 0, 2)]
SGD = UpdateRule("sgd", lr=0.5)


def _frozen(store: ParameterStore) -> dict[str, Any]:
    """Everything observable about a store, as bytes, for bit-exact before/after comparisons."""
    tensors, meta = store.state_dict()
    return {
        "tensors": {k: (v.dtype.str, v.shape, v.tobytes()) for k, v in tensors.items()},
        "meta": json.dumps(meta, sort_keys=True),
    }


def _populated() -> ParameterStore:
    store = ParameterStore()
    store.init("w", np.arange(6, dtype=np.float32).reshape(2, 3), UpdateRule("adam", lr=0.1))
    store.init("b", np.ones(3, dtype=BF16), UpdateRule("sgd", lr=0.1, momentum=0.9))
    store.init("n", np.array([1, 2], dtype=np.int64), UpdateRule("add"))
    store.init("s", np.array(2.0), UpdateRule("adagrad"))
    return store


# -- init ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_init_copies_and_first_writer_wins(dtype: np.dtype[Any], shape: tuple[int, ...]) -> None:
    store = ParameterStore()
    rule = UpdateRule("assign")
    first = np.arange(math.prod(shape)).reshape(shape).astype(dtype)
    expected = first.copy()
    assert store.init("k", first, rule) is True
    entry = store.get("k")
    assert not np.shares_memory(entry.value, first)
    if first.size:
        first[...] = 7  # the caller's array is never aliased
    np.testing.assert_array_equal(entry.value, expected)
    assert entry.value.dtype == dtype and entry.value.shape == shape
    assert entry.value.flags.c_contiguous and entry.value.flags.writeable

    second = np.full(shape, 9, dtype=dtype)
    assert store.init("k", second, UpdateRule("add")) is False
    assert store.get("k") is entry and entry.rule == rule
    np.testing.assert_array_equal(entry.value, expected)


@pytest.mark.parametrize(
    ("value", "declared"),
    [
        (np.ones((4, 4), np.float32), "float32 (4, 4)"),  # another shape
        (np.ones(3, np.float64), "float64 (3,)"),  # another dtype
        (np.ones((4, 4), np.float64), "float64 (4, 4)"),  # both
    ],
)
def test_init_of_existing_key_with_other_shape_or_dtype_is_refused_naming_both(
    value: np.ndarray, declared: str
) -> None:
    store = ParameterStore()
    assert store.init("k", np.zeros(3, np.float32), SGD)
    with pytest.raises(KeyConflict) as info:
        store.init("k", value, UpdateRule("adam"))
    assert "float32 (3,)" in info.value.message and declared in info.value.message
    assert info.value.code == grpc.StatusCode.ALREADY_EXISTS
    with pytest.raises(KeyConflict):  # all or nothing: the new key "n" is not created either
        store.init_many({"n": np.zeros(2, np.float32), "k": value}, SGD)
    assert "n" not in store
    entry = store.get("k")
    assert entry.value.shape == (3,) and entry.value.dtype == np.float32
    assert entry.rule == SGD and entry.state == {}


def test_init_of_existing_key_with_the_same_declaration_keeps_the_first_value_and_rule() -> None:
    store = ParameterStore()
    assert store.init("k", np.zeros(3, np.float32), SGD)
    assert not store.init("k", np.ones(3, np.float32), UpdateRule("adam"))
    np.testing.assert_array_equal(store.get("k").value, np.zeros(3, np.float32))
    assert store.get("k").rule == SGD


def test_init_copies_non_contiguous_input() -> None:
    store = ParameterStore()
    base = np.arange(12.0).reshape(3, 4)
    store.init("t", base.T, SGD)
    value = store.get("t").value
    assert value.flags.c_contiguous
    np.testing.assert_array_equal(value, base.T)


@pytest.mark.parametrize(
    ("key", "value", "rule", "fragment"),
    [
        ("", np.zeros(2), SGD, "non-empty"),
        (3, np.zeros(2), SGD, "non-empty string"),
        ("k", [1.0, 2.0], SGD, "'k' must be a numpy array"),
        (
            "k",
            np.zeros(2, np.complex64),
            UpdateRule("assign"),
            "'k' has unsupported dtype complex64",
        ),
        ("k", np.zeros(2, np.uint8), UpdateRule("assign"), "'k' has unsupported dtype uint8"),
        ("k", np.zeros(2, np.bool_), UpdateRule("assign"), "'k' has unsupported dtype bool"),
        ("k", np.zeros(2, np.int16), UpdateRule("add"), "'k' has unsupported dtype int16"),
        ("k", np.zeros(2, np.int32), SGD, "key 'k': update rule 'sgd' needs a floating-point"),
        ("k", np.zeros(2, np.int64), UpdateRule("adam"), "'adam' needs a floating-point"),
        ("k", np.zeros(2), "sgd", "must be an UpdateRule"),
    ],
)
def test_init_validation(key: Any, value: Any, rule: Any, fragment: str) -> None:
    store = ParameterStore()
    with pytest.raises(InvalidArgument) as info:
        store.init(key, value, rule)
    assert fragment in str(info.value)
    assert info.value.code.name == "INVALID_ARGUMENT"
    assert len(store) == 0


def test_init_validates_even_when_the_key_exists() -> None:
    store = ParameterStore()
    store.init("k", np.zeros(2), SGD)
    with pytest.raises(InvalidArgument, match="unsupported dtype"):
        store.init("k", np.zeros(2, np.complex128), SGD)


def test_init_many_is_all_or_nothing() -> None:
    store = ParameterStore()
    store.init("old", np.zeros(2), SGD)
    items: dict[str, Array] = {"a": np.ones(2), "old": np.ones(2), "c": np.ones((), np.float16)}
    assert store.init_many(items, SGD) == {"a": True, "old": False, "c": True}
    np.testing.assert_array_equal(store.get("old").value, [0.0, 0.0])

    bad: dict[str, Array] = {"x": np.ones(2), "y": np.ones(2, np.int32), "z": np.ones(2)}
    with pytest.raises(InvalidArgument, match="'y'"):
        store.init_many(bad, SGD)
    assert store.keys() == ["old", "a", "c"]
    assert "x" not in store and "z" not in store


# -- lookup -------------------------------------------------------------------------------------


def test_get_contains_keys_len() -> None:
    store = _populated()
    assert len(store) == 4 and store.keys() == ["w", "b", "n", "s"]
    assert "w" in store and "zz" not in store and 3 not in store
    entry = store.get("w")
    assert isinstance(entry, Entry) and entry.key == "w" and entry.updates == 0
    with pytest.raises(KeyNotFound, match="'missing'") as info:
        store.get("missing")
    assert info.value.code.name == "NOT_FOUND"
    keys = store.keys()
    keys.append("x")
    assert len(store) == 4


# -- gradient validation ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [*FLOAT_DTYPES, *INT_DTYPES], ids=str)
def test_validate_gradient_mismatches_name_key_and_both_sides(dtype: np.dtype[Any]) -> None:
    store = ParameterStore()
    store.init("layer/0", np.zeros((2, 3), dtype), UpdateRule("assign"))
    other = np.dtype(np.float32) if dtype != np.float32 else np.dtype(np.float64)

    with pytest.raises(DimensionMismatch) as info:
        store.validate_gradient("layer/0", np.zeros((3, 2), dtype))
    assert "'layer/0'" in str(info.value) and "(3, 2)" in str(info.value)
    assert "(2, 3)" in str(info.value) and info.value.code.name == "INVALID_ARGUMENT"

    with pytest.raises(DimensionMismatch) as info:
        store.validate_gradient("layer/0", np.zeros((2, 3), other))
    assert "'layer/0'" in str(info.value)
    assert f"dtype {other}" in str(info.value) and f"expected {dtype}" in str(info.value)

    with pytest.raises(DimensionMismatch) as info:
        store.validate_gradient("layer/0", np.zeros(4, other))
    assert "(4,)" in str(info.value) and str(other) in str(info.value)

    with pytest.raises(KeyNotFound, match="'layer/1'"):
        store.validate_gradient("layer/1", np.zeros((2, 3), dtype))
    with pytest.raises(InvalidArgument, match="numpy array"):
        store.validate_gradient("layer/0", [[0.0] * 3] * 2)  # type: ignore[arg-type]
    store.validate_gradient("layer/0", np.zeros((2, 3), dtype))


_finfo: Callable[[Any], Any] = ml_dtypes.finfo  # untyped; accepts every float dtype


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize(
    "bad",
    [[np.nan], [np.inf], [-np.inf], [np.nan, np.inf, -np.inf], [np.nan] * 5],
    ids=["nan", "inf", "-inf", "mixed", "5nan"],
)
def test_non_finite_gradient_counted_and_refused(dtype: np.dtype[Any], bad: list[float]) -> None:
    store = ParameterStore()
    store.init("emb", np.zeros(12, dtype), SGD)
    grad = np.ones(12, dtype)
    grad[3 : 3 + len(bad)] = np.array(bad).astype(dtype)
    with pytest.raises(NonFiniteGradient) as info:
        store.validate_gradient("emb", grad)
    assert f"'emb' has {len(bad)} non-finite value(s)" in str(info.value)
    assert info.value.code.name == "INVALID_ARGUMENT"
    with pytest.raises(NonFiniteGradient, match=f"{len(bad)} non-finite"):
        store.apply("emb", grad)
    assert store.get("emb").updates == 0 and not store.get("emb").value.astype(np.float64).any()
    store.validate_gradient("emb", grad, allow_non_finite=True)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_negative_zero_subnormals_and_extremes_are_finite(dtype: np.dtype[Any]) -> None:
    info = _finfo(dtype)
    values = [-0.0, float(info.smallest_subnormal), -float(info.smallest_subnormal)]
    values += [float(info.max)] * 3 + [float(info.min)]  # the sum overflows; every term is finite
    store = ParameterStore()
    store.init("k", np.zeros(len(values), dtype), UpdateRule("assign"))
    grad = np.array(values).astype(dtype)
    store.validate_gradient("k", grad)
    store.apply("k", grad)
    assert store.get("k").value.tobytes() == grad.tobytes()


def test_float64_aggregate_accepted_by_apply_only_for_floating_keys() -> None:
    store = ParameterStore()
    store.init("f", np.ones(3, BF16), SGD)
    store.init("i", np.ones(3, np.int32), UpdateRule("add"))
    aggregate = np.full(3, 0.25)
    with pytest.raises(DimensionMismatch, match="dtype float64"):
        store.validate_gradient("f", aggregate)
    store.apply("f", aggregate)
    assert store.get("f").value.dtype == BF16
    np.testing.assert_array_equal(store.get("f").value, np.full(3, 0.875, BF16))
    with pytest.raises(DimensionMismatch, match=r"'i'.*dtype float64 \(expected int32\)"):
        store.apply("i", aggregate)
    with pytest.raises(NonFiniteGradient, match="1 non-finite"):
        store.apply("f", np.array([0.0, np.nan, 0.0]))


# -- apply --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.dtype(np.float64)], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_apply_is_in_place_and_counts(dtype: np.dtype[Any], shape: tuple[int, ...]) -> None:
    store = ParameterStore()
    p0 = np.asarray(np.arange(math.prod(shape)).reshape(shape) / 4, dtype=dtype)
    store.init("k", p0, SGD)
    value = store.get("k").value
    pointer = value.__array_interface__["data"][0]
    g = np.full(shape, 0.5, dtype)
    for _ in range(3):
        store.apply("k", g)
    entry = store.get("k")
    assert entry.value is value and value.__array_interface__["data"][0] == pointer
    assert entry.updates == 3
    np.testing.assert_array_equal(value, p0 - dtype.type(3 * 0.25))


def test_numpy_scalars_count_as_0d_arrays() -> None:
    store = ParameterStore()
    assert store.init("x", np.float32(2.0), UpdateRule("sgd", lr=0.25))
    value = store.get("x").value
    assert isinstance(value, np.ndarray) and value.shape == () and value.dtype == np.float32
    store.apply("x", np.float32(4.0))
    store.apply_many({"x": np.mean(np.array([1.0, 3.0]))})  # a float64 aggregate scalar
    assert float(value) == 2.0 - 1.0 - 0.5 and store.get("x").updates == 2
    with pytest.raises(NonFiniteGradient, match="'x' has 1 non-finite"):
        store.validate_gradient("x", np.float32("nan"))


def test_apply_many_applies_each_rule() -> None:
    store = _populated()
    store.apply_many(
        {
            "w": np.ones((2, 3), np.float32),
            "b": np.ones(3, BF16),
            "n": np.array([10, -20], np.int64),
            "s": np.array(3.0),
        }
    )
    # Adam, first step: m_hat = g, v_hat = g^2 -> p - lr * g / (|g| + eps).
    np.testing.assert_allclose(
        store.get("w").value, np.arange(6).reshape(2, 3) - 0.1 / (1 + 1e-8), rtol=1e-6
    )
    np.testing.assert_array_equal(store.get("b").value, np.full(3, 0.8984375, BF16))  # 1 - 0.1
    np.testing.assert_array_equal(store.get("n").value, [11, -18])
    # Adagrad, first step: p - lr * g / (|g| + eps).
    np.testing.assert_allclose(store.get("s").value, 2.0 - 0.01 * 3 / (3 + 1e-10), rtol=1e-15)
    assert [store.get(k).updates for k in store.keys()] == [1, 1, 1, 1]


GOOD = {
    "w": np.ones((2, 3), np.float32),
    "b": np.ones(3, BF16),
    "n": np.array([1, 1], np.int64),
    "s": np.array(1.0),
}


@pytest.mark.parametrize(
    ("bad_key", "bad_grad", "error", "fragment"),
    [
        ("s", np.ones(1), DimensionMismatch, "'s' has shape (1,)"),
        ("n", np.ones(2, np.int32), DimensionMismatch, "'n' has dtype int32"),
        ("b", np.ones(3, np.float16), DimensionMismatch, "'b' has dtype float16"),
        ("w", np.full((2, 3), np.nan, np.float32), NonFiniteGradient, "'w' has 6 non-finite"),
        ("b", np.array([1, np.inf, 1]).astype(BF16), NonFiniteGradient, "'b' has 1 non-finite"),
        ("ghost", np.ones(2), KeyNotFound, "'ghost'"),
        ("s", 1.0, InvalidArgument, "numpy array"),
    ],
)
@pytest.mark.parametrize("position", ["first", "middle", "last"])
def test_refused_apply_many_changes_nothing(
    bad_key: str, bad_grad: Any, error: type[Exception], fragment: str, position: str
) -> None:
    store = _populated()
    store.apply_many(GOOD)  # so the optimizer states are non-trivial
    before = _frozen(store)
    grads = {k: v for k, v in GOOD.items() if k != bad_key}
    items = list(grads.items())
    index = {"first": 0, "middle": len(items) // 2, "last": len(items)}[position]
    items.insert(index, (bad_key, bad_grad))
    with pytest.raises(error) as info:
        store.apply_many(dict(items))
    assert fragment in str(info.value)
    assert _frozen(store) == before


def test_apply_many_allow_non_finite_propagates() -> None:
    store = ParameterStore()
    store.init("a", np.zeros(2), UpdateRule("add"))
    store.apply_many({"a": np.array([np.inf, 1.0])}, allow_non_finite=True)
    np.testing.assert_array_equal(store.get("a").value, [np.inf, 1.0])
    store.apply("a", np.array([np.nan, 1.0]), allow_non_finite=True)
    assert np.isnan(store.get("a").value[0]) and store.get("a").updates == 2


@settings(max_examples=30, deadline=None)
@given(
    plan=st.lists(
        st.lists(
            st.tuples(
                st.sampled_from(["a", "b", "c", "ghost"]),
                st.sampled_from(["ok", "nan", "shape"]),
                st.floats(-4, 4, allow_nan=False),
            ),
            min_size=1,
            max_size=4,
            unique_by=lambda t: t[0],
        ),
        max_size=6,
    )
)
def test_apply_many_matches_an_all_or_nothing_model(
    plan: list[list[tuple[str, str, float]]],
) -> None:
    store = ParameterStore()
    model: dict[str, Array] = {}
    for key in ("a", "b", "c"):
        store.init(key, np.zeros(2), UpdateRule("add"))
        model[key] = np.zeros(2)
    for batch in plan:
        grads = {}
        valid = True
        for key, kind, x in batch:
            if kind == "ok":
                grads[key] = np.full(2, x)
            elif kind == "nan":
                grads[key] = np.array([x, np.nan])
            else:
                grads[key] = np.full(3, x)
            valid = valid and key in model and kind == "ok"
        if valid:
            store.apply_many(grads)
            for key, g in grads.items():
                model[key] = model[key] + g
        else:
            with pytest.raises((InvalidArgument, KeyNotFound)):
                store.apply_many(grads)
        for key, expected in model.items():
            np.testing.assert_array_equal(store.get(key).value, expected)


# -- snapshots ----------------------------------------------------------------------------------


def test_snapshot_copies() -> None:
    store = _populated()
    snap = store.snapshot()
    assert list(snap) == ["w", "b", "n", "s"]
    for key, array in snap.items():
        assert not np.shares_memory(array, store.get(key).value)
        np.testing.assert_array_equal(array, store.get(key).value)
    snap["w"][...] = 100
    assert store.get("w").value.max() == 5
    assert list(store.snapshot(["s", "n"])) == ["s", "n"]
    assert store.snapshot([]) == {}
    with pytest.raises(KeyNotFound, match="'zz'"):
        store.snapshot(["w", "zz"])


# -- state_dict ---------------------------------------------------------------------------------


def test_state_dict_layout() -> None:
    store = _populated()
    store.init("a/b", np.zeros(0, np.float16), UpdateRule("adamw"))
    store.apply_many(GOOD)
    tensors, meta = store.state_dict()
    assert set(tensors) == {
        "param/w",
        "state/w/exp_avg",
        "state/w/exp_avg_sq",
        "state/w/step",
        "param/b",
        "state/b/momentum_buffer",
        "param/n",
        "param/s",
        "state/s/sum_sq",
        "param/a/b",
        "state/a/b/exp_avg",
        "state/a/b/exp_avg_sq",
        "state/a/b/step",
    }
    assert tensors["state/w/step"].shape == () and int(tensors["state/w/step"]) == 1
    assert tensors["state/b/momentum_buffer"].dtype == np.float32
    assert meta["b"] == {
        "rule": UpdateRule("sgd", lr=0.1, momentum=0.9).to_dict(),
        "dtype": "bfloat16",
        "shape": [3],
        "updates": 1,
    }
    assert meta["a/b"] == {
        "rule": UpdateRule("adamw").to_dict(),
        "dtype": "float16",
        "shape": [0],
        "updates": 0,
    }
    json.dumps(meta)
    kept = store.get("w").value.copy()
    tensors["param/w"][...] = -1  # copies: the store is unaffected
    np.testing.assert_array_equal(store.get("w").value, kept)


@pytest.mark.parametrize("rounds", [0, 1, 4])
def test_state_dict_round_trip_is_exact_and_continues_identically(rounds: int) -> None:
    store = _populated()
    store.init("scalar", np.array(1.5, np.float16), UpdateRule("adamw", weight_decay=0.1))
    store.init("empty", np.zeros((0, 3)), UpdateRule("adam"))
    store.init("i32", np.array([7], np.int32), UpdateRule("assign"))
    rng = np.random.default_rng(rounds)

    def grads() -> dict[str, Array]:
        out: dict[str, Array] = {}
        for key in store.keys():
            value = store.get(key).value
            if value.dtype.kind == "i":
                out[key] = rng.integers(-5, 5, value.shape).astype(value.dtype)
            else:
                out[key] = rng.standard_normal(value.shape).astype(value.dtype)
        return out

    for _ in range(rounds):
        store.apply_many(grads())
    tensors, meta = store.state_dict()
    restored = ParameterStore.from_state_dict(tensors, json.loads(json.dumps(meta)))
    assert _frozen(restored) == _frozen(store)
    assert restored.keys() == store.keys()
    for key in store.keys():
        assert restored.get(key).rule == store.get(key).rule
        assert not np.shares_memory(restored.get(key).value, tensors[f"param/{key}"])
    for _ in range(2):
        step = grads()
        store.apply_many(step)
        restored.apply_many(step)
    assert _frozen(restored) == _frozen(store)


def test_from_state_dict_ignores_foreign_tensors_and_accepts_read_only_input() -> None:
    store = _populated()
    tensors, meta = store.state_dict()
    for array in tensors.values():
        array.flags.writeable = False
    tensors["clock/worker-1"] = np.array(3)
    restored = ParameterStore.from_state_dict(tensors, meta)
    restored.apply("s", np.array(1.0))
    assert restored.get("s").updates == 1


def _corrupt(mutate: Any) -> tuple[dict[str, Array], dict[str, Any]]:
    tensors, meta = _populated().state_dict()
    meta_json: dict[str, Any] = json.loads(json.dumps(meta))
    mutate(tensors, meta_json)
    return tensors, meta_json


@pytest.mark.parametrize(
    ("mutate", "fragment"),
    [
        (lambda t, m: t.pop("param/w"), "key 'w' lacks tensor 'param/w'"),
        (lambda t, m: t.pop("state/w/step"), "lacks tensor 'state/w/step'"),
        (lambda t, m: t.update({"param/w": np.zeros((2, 3))}), "'param/w' is float64[2, 3]"),
        (lambda t, m: t.update({"param/s": np.zeros(1)}), "'param/s' is float64[1]"),
        (lambda t, m: t.update({"state/b/exp_avg": np.zeros(3, np.float32)}), "state/b/exp_avg"),
        (lambda t, m: t.update({"param/ghost": np.zeros(1)}), "no declared key: ['param/ghost']"),
        (lambda t, m: m["w"].update(dtype="complex64"), "metadata of key 'w' is malformed"),
        (lambda t, m: m["w"].pop("updates"), "metadata of key 'w' is malformed"),
        (lambda t, m: m["w"].update(updates=-1), "negative"),
        (lambda t, m: m.update(w=[1, 2]), "metadata of key 'w' is not a mapping"),
        (lambda t, m: m["w"]["rule"].update(kind="rmsprop"), "rule of key 'w'"),
        (lambda t, m: m["n"]["rule"].update(kind="sgd"), "floating-point"),
    ],
)
def test_from_state_dict_refuses_corrupt_checkpoints(mutate: Any, fragment: str) -> None:
    tensors, meta = _corrupt(mutate)
    with pytest.raises(InvalidArgument) as info:
        ParameterStore.from_state_dict(tensors, meta)
    assert fragment in str(info.value)
