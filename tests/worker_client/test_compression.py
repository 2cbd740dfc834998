"""Wire compression: cast and top-k with error feedback (Stich et al. 2018), worker and server."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from paramserver.api.v1 import tensor_pb2
from paramserver.core.decompress import Encoded, decode
from paramserver.core.optimizers import UpdateRule
from paramserver.core.store import ParameterStore
from paramserver.errors import DimensionMismatch, InvalidArgument, KeyNotFound, MalformedStream
from paramserver.worker_client.compression import Cast, GradientCompressor, TopK


def _store(shape: tuple[int, ...] = (4, 5), dtype: object = np.float32) -> ParameterStore:
    store = ParameterStore()
    store.init("w", np.zeros(shape, dtype=dtype), UpdateRule("add"))
    return store


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cast_round_trip_equals_numpy_cast(dtype: str) -> None:
    grad = np.random.default_rng(0).normal(size=(4, 5)).astype(np.float32)
    (part,) = GradientCompressor({"w": Cast(dtype)}).encode("w", grad)
    assert part.role == tensor_pb2.TENSOR_ROLE_CAST
    wire = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    assert part.array.dtype == wire and part.array.nbytes == grad.nbytes // 2
    dense = decode(_store(), "w", Encoded(part.array))
    assert dense.dtype == np.float32
    np.testing.assert_array_equal(dense, grad.astype(wire).astype(np.float32))


def test_top_k_sends_the_largest_magnitudes() -> None:
    grad = np.array([[0.1, -5.0, 0.2, 3.0, -0.05], [4.0, 0.0, -0.3, 0.01, 2.5]], np.float32)
    idx_part, val_part = GradientCompressor({"w": TopK(0.3)}).encode("w", grad)
    assert idx_part.role == tensor_pb2.TENSOR_ROLE_SPARSE_INDICES
    assert val_part.role == tensor_pb2.TENSOR_ROLE_SPARSE_VALUES
    assert idx_part.dense_shape == (2, 5)
    # ceil(0.3 * 10) = 3 entries: |-5.0| at 1, |4.0| at 5, |3.0| at 3
    assert idx_part.array.tolist() == [1, 3, 5]
    assert val_part.array.tolist() == [-5.0, 3.0, 4.0]
    store = _store((2, 5))
    dense = decode(store, "w", Encoded(val_part.array, idx_part.array, (2, 5)))
    expected = np.zeros((2, 5), np.float32)
    expected.flat[[1, 3, 5]] = [-5.0, 3.0, 4.0]
    np.testing.assert_array_equal(dense, expected)


def test_error_feedback_loses_nothing() -> None:
    """Sum of what was sent over T pushes + final residual == sum of the gradients."""
    rng = np.random.default_rng(1)
    comp = GradientCompressor({"w": TopK(0.05)})
    grads = [rng.normal(size=(40,)) for _ in range(25)]
    sent = np.zeros(40)
    for g in grads:
        idx, vals = comp.encode("w", g)
        sent[idx.array] += vals.array
    np.testing.assert_allclose(sent + comp.residuals["w"], np.sum(grads, axis=0), atol=1e-12)
    assert comp.ratio == pytest.approx((2 * 8) / 8 * 0.05, rel=0.01)  # (index+value)/dense


def test_without_error_feedback_the_rest_is_dropped() -> None:
    comp = GradientCompressor({"w": TopK(0.5, error_feedback=False)})
    comp.encode("w", np.array([1.0, -3.0, 2.0, 0.5]))
    assert "w" not in comp.residuals


def test_callers_gradient_is_never_modified() -> None:
    grad = np.arange(10, dtype=np.float32)
    before = grad.copy()
    comp = GradientCompressor({"w": TopK(0.2)})
    comp.encode("w", grad)
    comp.encode("w", grad)
    np.testing.assert_array_equal(grad, before)


def test_scheme_covers_slices_of_a_sharded_key() -> None:
    comp = GradientCompressor({"emb": Cast("float16")})
    (part,) = comp.encode("emb@slice3/8", np.ones(4, np.float32))
    assert part.role == tensor_pb2.TENSOR_ROLE_CAST


@pytest.mark.parametrize(
    ("enc", "error", "fragment"),
    [
        (Encoded(np.ones(3, np.float32), np.array([0, 1, 20]), (4, 5)), InvalidArgument, "[0, 20)"),
        (Encoded(np.ones(3, np.float32), np.array([0, 1, -1]), (4, 5)), InvalidArgument, "indices"),
        (Encoded(np.ones(2, np.float32), np.array([0, 1, 2]), (4, 5)), MalformedStream, "values"),
        (Encoded(np.ones(2, np.float32), np.array([0, 1]), (4, 6)), DimensionMismatch, "(4, 6)"),
        (Encoded(np.ones((4, 6), np.float16)), DimensionMismatch, "(4, 6)"),
        (Encoded(np.ones((4, 5), np.int32)), InvalidArgument, "float"),
    ],
)
def test_decode_refuses_bad_input_naming_the_key(
    enc: Encoded, error: type[Exception], fragment: str
) -> None:
    with pytest.raises(error, match="'w'") as info:
        decode(_store(), "w", enc)
    assert fragment in str(info.value)


def test_decode_unknown_key() -> None:
    with pytest.raises(KeyNotFound):
        decode(_store(), "nope", Encoded(np.ones(3, np.float16)))


@pytest.mark.parametrize("bad", [0.0, 1.5, -0.1])
def test_top_k_ratio_validated(bad: float) -> None:
    with pytest.raises(InvalidArgument, match="ratio"):
        TopK(bad)


def test_compression_of_an_integer_gradient_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="float"):
        GradientCompressor({"c": Cast()}).encode("c", np.arange(3))


def test_encode_all_without_schemes_sends_every_key_dense_as_encode_would() -> None:
    from paramserver.worker_client.transport.base import PushPayload

    grads = {"a": np.arange(6, dtype=np.float32), "b": np.ones((2, 3), np.float64)}
    plain, per_key = GradientCompressor(), GradientCompressor()
    parts = plain.encode_all(grads)
    oracle = {k: per_key.encode(k, v) for k, v in grads.items()}
    assert list(parts) == list(oracle) and len(parts) == 2
    for key in grads:
        (got,), (want,) = parts[key], oracle[key]
        assert got.array is grads[key] and (got.role, got.dense_shape) == (want.role, ())
    assert (plain.sent_bytes, plain.dense_bytes) == (per_key.sent_bytes, per_key.dense_bytes)
    assert (plain.sent_bytes, plain.dense_bytes) == (24 + 48, 24 + 48)
    payload = PushPayload.of(1, lambda: None, parts, 1.0)  # type: ignore[arg-type,return-value]
    assert payload.dense is not None and dict(payload.dense) == grads


def test_encode_all_with_a_scheme_encodes_per_key() -> None:
    comp = GradientCompressor({"a": Cast("float16")})
    parts = comp.encode_all({"a": np.ones(4, np.float32), "b": np.ones(4, np.float32)})
    assert parts["a"][0].array.dtype == np.float16 and parts["b"][0].array.dtype == np.float32
