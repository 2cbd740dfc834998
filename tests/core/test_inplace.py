"""No parameter-sized allocation per push, and bit-identical blocked updates (issue 7).

Allocation is measured with :mod:`tracemalloc`, which sees numpy's data buffers. Expected values
come from a whole-array numpy oracle written here from the rules' formulas (torch.optim's order
of operations), compared bit for bit on arrays that span several blocks plus a partial one.
"""

from __future__ import annotations

import math
import threading
import tracemalloc
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from paramserver.api.v1 import parameter_server_pb2 as pb
from paramserver.api.v1 import tensor_pb2
from paramserver.core.optimizers import (
    BLOCK_ELEMENTS,
    UpdateRule,
    apply_update,
    init_state,
    thread_workspace,
)
from paramserver.core.store import ParameterStore, count_non_finite
from paramserver.errors import InvalidArgument
from paramserver.protocol import tensor

pytestmark = pytest.mark.timeout(60)

Array = np.ndarray[Any, Any]
KEY_BYTES = 4 << 20
BF16 = np.dtype(ml_dtypes.bfloat16)

RULES = [
    UpdateRule("assign"),
    UpdateRule("add"),
    UpdateRule("sgd", lr=0.1),
    UpdateRule("sgd", lr=0.1, weight_decay=0.01),
    UpdateRule("sgd", lr=0.1, momentum=0.9),
    UpdateRule("sgd", lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    UpdateRule("adam", lr=0.01),
    UpdateRule("adam", lr=0.01, weight_decay=0.1),
    UpdateRule("adamw", lr=0.01),
    UpdateRule("adagrad", lr=0.1),
    UpdateRule("adagrad", lr=0.1, weight_decay=0.1),
]


def _rid(rule: UpdateRule) -> str:
    extra = f"-m{rule.momentum}" if rule.momentum else ""
    extra += "-nesterov" if rule.nesterov else ""
    extra += f"-wd{rule.weight_decay}" if rule.weight_decay else ""
    return rule.kind + extra


def _peak_bytes(fn: Callable[[], object]) -> int:
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


# -- no per-push allocation of the parameter's size ----------------------------------------------


@pytest.mark.parametrize("rule", RULES, ids=_rid)
@pytest.mark.parametrize(
    ("dtype", "grad_dtype"),
    [(np.float32, np.float32), (np.float32, np.float64), (np.float16, np.float16), (BF16, BF16)],
    ids=["f32", "f32-f64aggregate", "f16", "bf16"],
)
def test_apply_allocates_no_parameter_sized_array(
    rule: UpdateRule, dtype: Any, grad_dtype: Any
) -> None:
    n = KEY_BYTES // np.dtype(dtype).itemsize
    store = ParameterStore()
    store.init("k", np.ones(n, dtype), rule)
    store.init("other", np.ones(n, dtype), rule)
    grad = np.full(n, 0.5, grad_dtype)
    # The thread's block workspace: at most four blocks of the compute dtype, made once (by
    # whichever update on this thread comes first) and shared by every key.
    workspace = _peak_bytes(lambda: store.apply("other", grad))
    assert workspace <= 4 * BLOCK_ELEMENTS * 4 + (64 << 10), workspace
    # Pushes then allocate nothing of the parameter's size: at most numpy's own small buffers.
    first = _peak_bytes(lambda: store.apply("k", grad))
    later = _peak_bytes(lambda: store.apply("k", grad))
    assert first < 256 << 10, first
    assert later < 256 << 10, later


def test_update_scratch_is_per_thread_not_per_key() -> None:
    rule = UpdateRule("adam", lr=0.01)
    store = ParameterStore()
    for i in range(20):
        store.init(f"k{i}", np.ones(BLOCK_ELEMENTS, np.float32), rule)
    grad = np.full(BLOCK_ELEMENTS, 0.5, np.float32)
    store.apply("k0", grad)  # this thread's workspace exists from here on
    # Twenty keys of a block each: per-key scratch would be 20 x 2 blocks (20 MiB).
    peak = _peak_bytes(lambda: [store.apply(f"k{i}", grad) for i in range(20)])
    assert peak < 256 << 10, peak
    seen: list[int] = []

    def other_thread() -> None:
        store.apply("k1", grad)
        seen.append(id(thread_workspace(np.dtype(np.float32))))

    worker = threading.Thread(target=other_thread)
    worker.start()
    worker.join(timeout=30)
    assert seen and seen[0] != id(thread_workspace(np.dtype(np.float32)))  # its own scratch


def test_non_finite_count_allocates_no_gradient_sized_temporary() -> None:
    grad = np.ones(KEY_BYTES // 4, np.float32)
    grad[[3, BLOCK_ELEMENTS + 1, grad.size - 1]] = [np.nan, np.inf, -np.inf]
    counts: list[int] = []
    peak = _peak_bytes(lambda: counts.append(count_non_finite(grad)))
    assert counts == [3]
    assert peak < KEY_BYTES // 8, peak  # a block of bools, not N of them
    # An overflowing sum of finite values is not mistaken for a non-finite gradient.
    big = np.full(KEY_BYTES // 4, 3e38, np.float32)
    assert count_non_finite(big) == 0


def test_store_takes_a_handed_over_array_and_copies_otherwise() -> None:
    store = ParameterStore()
    mine = np.zeros(8, np.float32)
    store.init("taken", mine, UpdateRule("add"), take=True)
    assert store.get("taken").value is mine
    store.init("copied", mine, UpdateRule("add"))
    assert store.get("copied").value is not mine
    strided = np.zeros(16, np.float32)[::2]
    store.init("strided", strided, UpdateRule("add"), take=True)
    assert store.get("strided").value.flags.c_contiguous
    assert not np.shares_memory(store.get("strided").value, strided)


# -- bit-identical to the whole-array formulas ----------------------------------------------------


def _oracle(rule: UpdateRule, p0: Array, grads: list[Array]) -> Array:
    """The rule on whole arrays, float32 compute, operation by operation as torch.optim."""
    p = p0.astype(np.float32)
    buf = m = v = s = None
    for t, grad in enumerate(grads, start=1):
        g = grad.astype(np.float32)
        if rule.kind in ("assign", "add"):
            raise AssertionError("not an optimizer rule")
        if rule.kind == "adamw":
            p *= 1.0 - rule.lr * rule.weight_decay
        elif rule.weight_decay:
            g = p * rule.weight_decay + g
        if rule.kind == "sgd":
            d = g
            if rule.momentum:
                buf = np.zeros_like(p) if buf is None else buf
                buf *= rule.momentum
                buf += g
                d = buf * rule.momentum + g if rule.nesterov else buf
            p -= d * rule.lr
        elif rule.kind in ("adam", "adamw"):
            m = np.zeros_like(p) if m is None else m
            v = np.zeros_like(p) if v is None else v
            m *= rule.beta1
            m += g * (1.0 - rule.beta1)
            v *= rule.beta2
            v += (g * g) * (1.0 - rule.beta2)
            denom = np.sqrt(v) / math.sqrt(1.0 - rule.beta2**t) + rule.eps
            p -= (m / denom) * (rule.lr / (1.0 - rule.beta1**t))
        else:
            s = np.zeros_like(p) if s is None else s
            s += g * g
            p -= (g / (np.sqrt(s) + rule.eps)) * rule.lr
        p = p.astype(p0.dtype).astype(np.float32)  # one rounding per step, as the store keeps it
    return p.astype(p0.dtype)


@pytest.mark.parametrize("rule", [r for r in RULES if r.kind not in ("assign", "add")], ids=_rid)
@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16], ids=["f32", "f16", "bf16"])
def test_blocked_update_is_bit_identical_to_whole_array_formula(
    rule: UpdateRule, dtype: Any
) -> None:
    rng = np.random.default_rng(7)
    n = 2 * BLOCK_ELEMENTS + 123  # two full blocks and a partial one
    p0 = rng.normal(size=n).astype(dtype)
    grads = [rng.normal(size=n).astype(dtype) for _ in range(3)]
    param = p0.copy()
    state = init_state(rule, param)
    for g in grads:
        apply_update(rule, param, g, state)
    expected = _oracle(rule, p0, grads)
    assert param.tobytes() == expected.tobytes()


# -- tensor framing -------------------------------------------------------------------------------


def test_assembler_writes_every_chunk_into_one_buffer_in_place() -> None:
    value = np.arange(KEY_BYTES // 4, dtype=np.float32)
    frames = list(tensor.encode_frames("k", value, chunk_bytes=1 << 20))
    assembler = tensor.TensorAssembler(max_tensor_bytes=KEY_BYTES)
    out: list[tuple[str, Array] | None] = []
    peak = _peak_bytes(lambda: out.extend(assembler.feed(f) for f in frames))
    done = out[-1]
    assert done is not None and all(o is None for o in out[:-1])
    array = done[1]
    np.testing.assert_array_equal(array, value)
    assert array.flags.writeable and array.flags.c_contiguous
    # One buffer of the tensor's size plus the chunk in flight (joining chunks would need
    # twice the tensor's size).
    assert peak < KEY_BYTES + 2 * (1 << 20), peak
    # the chunks were written into the returned array's own memory, not joined elsewhere
    assert array.base is None and array.flags.owndata and array.nbytes == KEY_BYTES


def test_assembler_refuses_an_oversized_header_before_allocating() -> None:
    header = tensor_pb2.TensorHeader(
        key="big", dtype=tensor_pb2.DTYPE_FLOAT32, shape=[16 << 20], size_bytes=64 << 20
    )
    assembler = tensor.TensorAssembler(max_tensor_bytes=1 << 20)
    errors: list[InvalidArgument] = []

    def feed() -> None:
        try:
            assembler.feed(tensor_pb2.TensorFrame(header=header, chunk_index=0))
        except InvalidArgument as exc:
            errors.append(exc)

    peak = _peak_bytes(feed)
    assert errors and "max_tensor_bytes" in errors[0].message and "'big'" in errors[0].message
    assert peak < 1 << 20, peak


@pytest.mark.parametrize(
    "value",
    [
        np.arange(300_000, dtype=np.float32),
        np.zeros((0, 3), np.float64),
        np.array(2.5, BF16),
        np.arange(10, dtype=np.int64).reshape(2, 5),
    ],
    ids=["multi-chunk", "zero-size", "scalar", "int64"],
)
def test_encode_messages_equals_wrapping_encode_frames(value: Array) -> None:
    built = list(tensor.encode_messages(pb.PullResponse, "k", value, chunk_bytes=1 << 18))
    wrapped = [pb.PullResponse(frame=f) for f in tensor.encode_frames("k", value, 1 << 18)]
    assert [m.SerializeToString() for m in built] == [m.SerializeToString() for m in wrapped]
    assert all(m.WhichOneof("body") == "frame" for m in built)
    decoded = tensor.decode_frames(m.frame for m in built)["k"]
    assert decoded.tobytes() == value.tobytes() and decoded.shape == value.shape
