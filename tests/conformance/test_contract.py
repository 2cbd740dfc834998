"""Conformance suite: what a worker written from the .proto files alone can rely on.

Only plain generated stubs and hand-built frames (:mod:`conformance.protowire`); the server is
a separate process (see ``conftest.py`` for running another implementation). Expected values
are closed forms or numpy re-implementations of the documented rules (torch.optim's formulas),
never the product's own code.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import ml_dtypes
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from paramserver.api.v1 import parameter_server_pb2 as pb
from paramserver.api.v1 import tensor_pb2 as tpb

from .conftest import DEFAULT_LEASE_MS, ServerUnderTest
from .protowire import CHUNK_BYTES, ProtoWorker, frames, trailer_class

pytestmark = pytest.mark.timeout(120)


def _key(prefix: str = "k") -> str:
    return f"{prefix}-{secrets.token_hex(4)}"


async def _refused(call: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value


def _expect(err: grpc.aio.AioRpcError, code: grpc.StatusCode, cls: str | None) -> None:
    assert err.code() == code, (err.code(), err.details())
    assert trailer_class(err) == cls, (trailer_class(err), err.details())


@pytest.fixture
async def channel(asp_server: ServerUnderTest) -> Any:
    async with grpc.aio.insecure_channel(asp_server.address) as ch:
        yield ch


# ----------------------------------------------------------------------------- membership
@pytest.mark.parametrize("fresh_server", [("asp", 0, None)], indirect=True)
async def test_register_returns_an_id_the_default_lease_and_clock_zero(
    fresh_server: ServerUnderTest,
) -> None:
    async with grpc.aio.insecure_channel(fresh_server.address) as channel:
        w = ProtoWorker(channel)
        resp = await w.register()
        assert resp.worker_id and resp.lease_ms == DEFAULT_LEASE_MS and resp.clock == 0
        assert resp.view.consistency == pb.CONSISTENCY_ASP
        hb = await w.stub.Heartbeat(pb.HeartbeatRequest(worker_id=w.worker_id), timeout=5)
        assert hb.lease_ms == DEFAULT_LEASE_MS


async def test_a_live_name_is_already_exists_replace_fences_and_a_nonce_retry_is_idempotent(
    channel: Any,
) -> None:
    name = _key("worker")
    first = ProtoWorker(channel, name)
    await first.register(client_nonce="n1")
    again = await first.stub.Register(
        pb.RegisterRequest(worker_name=name, client_nonce="n1"), timeout=5
    )
    assert again.worker_id == first.worker_id  # the same client's retry
    _expect(
        await _refused(ProtoWorker(channel, name).register(client_nonce="n2")),
        grpc.StatusCode.ALREADY_EXISTS,
        "AlreadyExists",
    )
    second = ProtoWorker(channel, name)
    await second.register(replace=True)
    assert second.worker_id != first.worker_id
    err = await _refused(
        first.stub.Heartbeat(pb.HeartbeatRequest(worker_id=first.worker_id), timeout=5)
    )
    _expect(err, grpc.StatusCode.FAILED_PRECONDITION, "WorkerNotFound")


@pytest.mark.parametrize(
    "name",
    ["", "n" * 257, "\u00e9" * 129],  # empty; 257 bytes; 258 bytes of UTF-8 in 129 chars
)
async def test_worker_names_must_be_1_to_256_bytes(channel: Any, name: str) -> None:
    err = await _refused(ProtoWorker(channel, name).register())
    _expect(err, grpc.StatusCode.INVALID_ARGUMENT, "InvalidArgument")
    assert len(err.details() or "") < 1024  # the name is shortened in the message


async def test_a_256_byte_name_is_accepted(channel: Any) -> None:
    await ProtoWorker(channel, "x" * 250 + secrets.token_hex(3)).register()


async def test_invalid_utf8_in_a_string_field_is_invalid_argument(channel: Any) -> None:
    good = pb.RegisterRequest(worker_name="ab").SerializeToString()
    bad = good.replace(b"ab", b"\xff\xfe")
    call = channel.unary_unary(
        "/paramserver.api.v1.ParameterServer/Register",
        request_serializer=lambda b: b,
        response_deserializer=pb.RegisterResponse.FromString,
    )
    _expect(
        await _refused(call(bad, timeout=5)), grpc.StatusCode.INVALID_ARGUMENT, "MalformedStream"
    )


@pytest.mark.parametrize("rpc", ["Push", "Clock", "Heartbeat", "Leave"])
async def test_an_empty_worker_id_is_invalid_argument_on_every_call(channel: Any, rpc: str) -> None:
    w = ProtoWorker(channel)
    key = _key()
    await w.init({key: np.zeros(2, np.float32)})
    calls: dict[str, Callable[[], Any]] = {
        "Push": lambda: w.push({key: np.ones(2, np.float32)}),
        "Clock": lambda: w.stub.Clock(pb.ClockRequest(worker_id="", clock=0), timeout=5),
        "Heartbeat": lambda: w.stub.Heartbeat(pb.HeartbeatRequest(worker_id=""), timeout=5),
        "Leave": lambda: w.stub.Leave(pb.LeaveRequest(worker_id=""), timeout=5),
    }
    _expect(await _refused(calls[rpc]()), grpc.StatusCode.INVALID_ARGUMENT, "InvalidArgument")


async def test_an_unknown_worker_id_is_failed_precondition(channel: Any) -> None:
    w = ProtoWorker(channel)
    w.worker_id = "nobody#1"
    key = _key()
    await w.init({key: np.zeros(2, np.float32)})
    for call in (w.push({key: np.ones(2, np.float32)}), w.end_clock(), w.pull([key])):
        _expect(await _refused(call), grpc.StatusCode.FAILED_PRECONDITION, "WorkerNotFound")


async def test_init_needs_no_registration(channel: Any) -> None:
    w = ProtoWorker(channel)
    w.worker_id = "not-registered#9"  # informational only
    key = _key()
    resp = await w.init({key: np.arange(3, dtype=np.float32)})
    assert [(k.key, k.created) for k in resp.keys] == [(key, True)]


# ----------------------------------------------------------------------------- init
async def test_init_first_writer_wins_and_a_conflicting_declaration_is_refused(
    channel: Any,
) -> None:
    w = ProtoWorker(channel)
    key, other = _key(), _key()
    assert (await w.init({key: np.arange(3, dtype=np.float32)})).keys[0].created
    resp = await w.init({key: np.full(3, 9, np.float32)})
    assert not resp.keys[0].created
    _, values = await w.pull([key], observer=True)
    np.testing.assert_array_equal(values[key], np.arange(3, dtype=np.float32))
    for conflicting in (np.zeros(4, np.float32), np.zeros(3, np.float64)):
        err = await _refused(w.init({other: np.zeros(1, np.float32), key: conflicting}))
        _expect(err, grpc.StatusCode.ALREADY_EXISTS, "KeyConflict")
        assert "float32 (3,)" in (err.details() or "")
    _expect(  # all or nothing: the other key of the refused init was not created
        await _refused(w.pull([other], observer=True)), grpc.StatusCode.NOT_FOUND, "KeyNotFound"
    )


def _special(dtype: np.dtype[Any]) -> np.ndarray:
    if dtype.kind == "i":
        info = np.iinfo(dtype)
        return np.array([info.min, -1, 0, 1, info.max], dtype)
    bits = {2: np.uint16, 4: np.uint32, 8: np.uint64}[dtype.itemsize]
    values = np.array([0.0, -0.0, 1.5, -2.25, np.inf, -np.inf], dtype)
    nan_payload = np.array([np.nan], dtype).view(bits) | 1  # a NaN with a payload bit
    return np.concatenate([values, nan_payload.view(dtype)])


@pytest.mark.parametrize(
    "dtype",
    [np.float16, ml_dtypes.bfloat16, np.float32, np.float64, np.int32, np.int64],
    ids=["float16", "bfloat16", "float32", "float64", "int32", "int64"],
)
@pytest.mark.parametrize("shape", [(), (0,), (2, 0, 3), (7,)])
async def test_every_dtype_and_shape_round_trips_bit_exactly(
    channel: Any, dtype: Any, shape: tuple[int, ...]
) -> None:
    w = ProtoWorker(channel)
    key = _key()
    dt = np.dtype(dtype)
    special = _special(dt)
    value = np.resize(special, shape) if shape != (7,) else special[:7].copy()
    rule = pb.UpdateRule(kind=pb.RULE_KIND_ASSIGN)
    await w.init({key: value}, rule)
    _, got = await w.pull([key], observer=True)
    assert got[key].dtype == dt and got[key].shape == value.shape
    assert got[key].tobytes() == value.tobytes()


async def test_init_without_a_rule_is_sgd_with_lr_0_01(channel: Any) -> None:
    w = ProtoWorker(channel)
    await w.register()
    key = _key()
    await w.init({key: np.zeros(4, np.float64)})
    g = np.array([1.0, -2.0, 0.5, 100.0])
    await w.push({key: g})
    _, got = await w.pull([key])
    np.testing.assert_array_equal(got[key], -0.01 * g)


# ----------------------------------------------------------------------------- rules
def _sgd(lr: float, momentum: float, nesterov: bool, wd: float) -> Callable[..., Any]:
    def step(w: np.ndarray, g: np.ndarray, state: dict[str, Any], t: int) -> np.ndarray:
        d = g + wd * w
        if momentum:
            buf = d.copy() if t == 1 else momentum * state["buf"] + d
            state["buf"] = buf
            d = d + momentum * buf if nesterov else buf
        return w - lr * d

    return step


def _adam(lr: float, b1: float, b2: float, eps: float, wd: float, decoupled: bool) -> Any:
    def step(w: np.ndarray, g: np.ndarray, state: dict[str, Any], t: int) -> np.ndarray:
        if decoupled:
            w = w * (1 - lr * wd)
        else:
            g = g + wd * w
        m = b1 * state.get("m", 0.0) + (1 - b1) * g
        v = b2 * state.get("v", 0.0) + (1 - b2) * g * g
        state["m"], state["v"] = m, v
        m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
        return w - lr * m_hat / (np.sqrt(v_hat) + eps)

    return step


def _adagrad(lr: float, eps: float, wd: float) -> Callable[..., Any]:
    def step(w: np.ndarray, g: np.ndarray, state: dict[str, Any], t: int) -> np.ndarray:
        g = g + wd * w
        state["sum"] = state.get("sum", 0.0) + g * g
        return w - lr * g / (np.sqrt(state["sum"]) + eps)

    return step


RULES: dict[str, tuple[pb.UpdateRule, Callable[..., Any]]] = {
    "assign": (pb.UpdateRule(kind=pb.RULE_KIND_ASSIGN), lambda w, g, s, t: g.copy()),
    "add": (pb.UpdateRule(kind=pb.RULE_KIND_ADD), lambda w, g, s, t: w + g),
    "sgd": (pb.UpdateRule(kind=pb.RULE_KIND_SGD, lr=0.1), _sgd(0.1, 0.0, False, 0.0)),
    "sgd_momentum_wd": (
        pb.UpdateRule(kind=pb.RULE_KIND_SGD, lr=0.1, momentum=0.9, weight_decay=0.01),
        _sgd(0.1, 0.9, False, 0.01),
    ),
    "sgd_nesterov": (
        pb.UpdateRule(kind=pb.RULE_KIND_SGD, lr=0.05, momentum=0.5, nesterov=True),
        _sgd(0.05, 0.5, True, 0.0),
    ),
    "adam_defaults": (
        pb.UpdateRule(kind=pb.RULE_KIND_ADAM),
        _adam(1e-3, 0.9, 0.999, 1e-8, 0, False),
    ),
    "adam_l2": (
        pb.UpdateRule(kind=pb.RULE_KIND_ADAM, lr=0.01, beta1=0.8, beta2=0.99, weight_decay=0.1),
        _adam(0.01, 0.8, 0.99, 1e-8, 0.1, False),
    ),
    "adamw_defaults": (
        pb.UpdateRule(kind=pb.RULE_KIND_ADAMW),
        _adam(1e-3, 0.9, 0.999, 1e-8, 1e-2, True),
    ),
    "adagrad_defaults": (pb.UpdateRule(kind=pb.RULE_KIND_ADAGRAD), _adagrad(0.01, 1e-10, 0.0)),
    "adagrad_wd": (
        pb.UpdateRule(kind=pb.RULE_KIND_ADAGRAD, lr=0.5, eps=1e-6, weight_decay=0.2),
        _adagrad(0.5, 1e-6, 0.2),
    ),
}


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("rule", sorted(RULES))
async def test_every_rule_matches_its_documented_formula(
    channel: Any, rule: str, dtype: Any
) -> None:
    """Four pushes of varied gradients; float64 keys agree to 1e-12, float32 keys to 1e-5
    (the server computes float32 keys in float32)."""
    spec, oracle = RULES[rule]
    w = ProtoWorker(channel)
    await w.register()
    key = _key(rule)
    rng = np.random.default_rng(7)
    value = rng.standard_normal((3, 5)).astype(dtype)
    await w.init({key: value}, spec)
    expected = value.astype(np.float64)
    state: dict[str, Any] = {}
    for t in range(1, 5):
        g = rng.standard_normal((3, 5)).astype(dtype)
        await w.push({key: g})
        expected = oracle(expected, g.astype(np.float64), state, t)
    _, got = await w.pull([key])
    assert got[key].dtype == np.dtype(dtype)
    tol = 1e-12 if dtype == np.float64 else 1e-5
    np.testing.assert_allclose(got[key], expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.float16, ml_dtypes.bfloat16], ids=str)
async def test_add_and_assign_are_exact_on_integer_and_half_keys(channel: Any, dtype: Any) -> None:
    w = ProtoWorker(channel)
    await w.register()
    add_key, assign_key = _key("add"), _key("assign")
    start = np.array([1, -2, 3, 0], dtype)
    await w.init({add_key: start}, pb.UpdateRule(kind=pb.RULE_KIND_ADD))
    await w.init({assign_key: start}, pb.UpdateRule(kind=pb.RULE_KIND_ASSIGN))
    for g in (np.array([1, 1, -1, 2], dtype), np.array([4, -8, 16, 1], dtype)):
        await w.push({add_key: g, assign_key: g})
    _, got = await w.pull([add_key, assign_key])
    np.testing.assert_array_equal(got[add_key], np.array([6, -9, 18, 3], dtype))
    np.testing.assert_array_equal(got[assign_key], np.array([4, -8, 16, 1], dtype))


# ----------------------------------------------------------------------------- exactly once
async def test_a_retried_push_is_applied_once_and_a_new_registration_numbers_afresh(
    channel: Any,
) -> None:
    name, key = _key("w"), _key()
    w = ProtoWorker(channel, name)
    await w.register()
    await w.init({key: np.zeros(2, np.float32)}, pb.UpdateRule(kind=pb.RULE_KIND_ADD))
    one = np.ones(2, np.float32)
    assert not (await w.push({key: one}, request_id=1)).duplicate
    assert (await w.push({key: one}, request_id=1)).duplicate
    await w.stub.Leave(pb.LeaveRequest(worker_id=w.worker_id), timeout=5)
    restarted = ProtoWorker(channel, name)  # the same worker name, a new process
    await restarted.register()
    assert not (await restarted.push({key: one}, request_id=1)).duplicate
    _, got = await restarted.pull([key])
    np.testing.assert_array_equal(got[key], 2 * one)


async def test_resume_worker_id_keeps_a_retry_across_registrations_exactly_once(
    channel: Any,
) -> None:
    name, key = _key("w"), _key()
    w = ProtoWorker(channel, name)
    await w.register()
    await w.init({key: np.zeros(2, np.float32)}, pb.UpdateRule(kind=pb.RULE_KIND_ADD))
    one = np.ones(2, np.float32)
    await w.push({key: one}, request_id=41)
    old = w.worker_id
    await w.register(replace=True, resume_worker_id=old)
    assert w.worker_id != old
    assert (await w.push({key: one}, request_id=41)).duplicate
    _, got = await w.pull([key])
    np.testing.assert_array_equal(got[key], one)


# ----------------------------------------------------------------------------- chunking
async def test_a_large_tensor_travels_in_frames_of_at_most_1_mib_each_way(channel: Any) -> None:
    w = ProtoWorker(channel)
    await w.register()
    key = _key()
    n = (5 * CHUNK_BYTES) // 2 // 4 + 3  # 2.5 MiB of float32, not a multiple of the chunk
    value = np.arange(n, dtype=np.float32)
    assert len(frames(key, value)) == 3
    await w.init({key: value}, pb.UpdateRule(kind=pb.RULE_KIND_ADD))
    await w.push({key: np.ones(n, np.float32)})
    _, got = await w.pull([key])  # read_tensors checks every frame rule on the way back
    np.testing.assert_array_equal(got[key], value + 1)


def _frame_cases(key: str) -> Iterator[tuple[str, list[tpb.TensorFrame]]]:
    good = frames(key, np.zeros(600, np.float32), chunk_bytes=1024)  # 3 frames
    no_header = [tpb.TensorFrame(chunk_index=0, data=good[0].data)]
    yield "no header", no_header
    yield "out of order", [good[0], good[2], good[1]]
    yield (
        "offset gap",
        [good[0], tpb.TensorFrame(chunk_index=1, offset_bytes=2048, data=good[1].data), good[2]],
    )
    yield "second header", [good[0], good[0]]
    yield "missing last", good[:2]
    short = tpb.TensorFrame()
    short.CopyFrom(good[0])
    short.header.size_bytes = 8
    yield "size mismatch", [short, *good[1:]]


@pytest.mark.parametrize("case", [c for c, _ in _frame_cases("x")])
async def test_a_broken_frame_sequence_is_invalid_argument_and_applies_nothing(
    channel: Any, case: str
) -> None:
    w = ProtoWorker(channel)
    await w.register()
    key = _key()
    await w.init({key: np.zeros(600, np.float32)}, pb.UpdateRule(kind=pb.RULE_KIND_ADD))
    broken = dict(_frame_cases(key))[case]
    err = await _refused(w.push({key: np.zeros(1)}, frames_by_key={key: broken}))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert trailer_class(err) in {"MalformedStream", "DimensionMismatch", "InvalidArgument"}
    _, got = await w.pull([key])
    np.testing.assert_array_equal(got[key], np.zeros(600, np.float32))


async def test_a_message_over_the_4_mib_receive_limit_is_resource_exhausted_without_trailer(
    channel: Any,
) -> None:
    w = ProtoWorker(channel)
    await w.register()
    key = _key()
    n = (5 << 20) // 4
    await w.init({key: np.zeros(n, np.float32)}, pb.UpdateRule(kind=pb.RULE_KIND_ADD))
    one_frame = frames(key, np.ones(n, np.float32), chunk_bytes=5 << 20)
    err = await _refused(w.push({key: np.zeros(1)}, frames_by_key={key: one_frame}))
    _expect(err, grpc.StatusCode.RESOURCE_EXHAUSTED, None)  # gRPC's own: permanent


# ----------------------------------------------------------------------------- error codes
async def test_gradient_errors_each_have_their_code_and_class(channel: Any) -> None:
    w = ProtoWorker(channel)
    await w.register()
    key = _key()
    await w.init({key: np.zeros(4, np.float32)}, pb.UpdateRule(kind=pb.RULE_KIND_ADD))
    cases = [
        ({_key("unknown"): np.ones(4, np.float32)}, grpc.StatusCode.NOT_FOUND, "KeyNotFound"),
        ({key: np.ones(4, np.float64)}, grpc.StatusCode.INVALID_ARGUMENT, "DTypeMismatch"),
        ({key: np.ones(5, np.float32)}, grpc.StatusCode.INVALID_ARGUMENT, "DimensionMismatch"),
        (
            {key: np.array([1, np.nan, 1, 1], np.float32)},
            grpc.StatusCode.INVALID_ARGUMENT,
            "NonFiniteGradient",
        ),
    ]
    for grads, code, cls in cases:
        err = await _refused(w.push(grads))
        _expect(err, code, cls)
    err = await _refused(w.push({key: np.ones(4, np.float64)}))
    assert "float64" in (err.details() or "") and "float32" in (err.details() or "")
    _, got = await w.pull([key])
    np.testing.assert_array_equal(got[key], np.zeros(4, np.float32))  # nothing applied


async def test_keys_must_be_1_to_1024_bytes_and_a_huge_one_is_refused_as_such(
    channel: Any,
) -> None:
    w = ProtoWorker(channel)
    await w.register()
    ok = "k" * 1016 + secrets.token_hex(4)
    assert (await w.init({ok: np.zeros(1, np.float32)})).keys[0].created
    for key in ("k" * 1025, "k" * (1 << 20)):
        err = await _refused(w.init({key: np.zeros(1, np.float32)}))
        _expect(err, grpc.StatusCode.INVALID_ARGUMENT, "MalformedStream")
        err = await _refused(w.pull([key]))
        _expect(err, grpc.StatusCode.INVALID_ARGUMENT, "InvalidArgument")
        assert len(err.details() or "") < 4096


async def test_a_clock_ahead_of_the_worker_is_stale_update(channel: Any) -> None:
    w = ProtoWorker(channel)
    await w.register()
    err = await _refused(w.stub.Clock(pb.ClockRequest(worker_id=w.worker_id, clock=5), timeout=5))
    _expect(err, grpc.StatusCode.FAILED_PRECONDITION, "StaleUpdate")
    assert (await w.end_clock()).clock == 1
    assert (
        await w.stub.Clock(pb.ClockRequest(worker_id=w.worker_id, clock=0), timeout=5)
    ).clock == 1


async def test_health_and_reflection_v1(channel: Any) -> None:
    from grpc_reflection.v1alpha import reflection_pb2 as rpb

    health = health_pb2_grpc.HealthStub(channel)
    resp = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING
    call = channel.stream_stream(
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
        request_serializer=rpb.ServerReflectionRequest.SerializeToString,
        response_deserializer=rpb.ServerReflectionResponse.FromString,
    )(iter([rpb.ServerReflectionRequest(list_services="")]), timeout=10)
    names = {s.name for r in [r async for r in call] for s in r.list_services_response.service}
    assert "paramserver.api.v1.ParameterServer" in names


# ----------------------------------------------------------------------------- consistency
@pytest.mark.parametrize("fresh_server", [("ssp", 1)], indirect=True)
async def test_ssp_pull_waits_for_the_slowest_within_the_bound_and_times_out_naming_it(
    fresh_server: ServerUnderTest,
) -> None:
    async with grpc.aio.insecure_channel(fresh_server.address) as ch:
        fast, slow = ProtoWorker(ch, "fast"), ProtoWorker(ch, "slow")
        await fast.register()
        await slow.register()
        await fast.init({"w": np.zeros(2, np.float32)})
        await fast.pull(["w"])  # clock 0, min 0: admitted
        await fast.end_clock()  # 1 - 0 <= s = 1: admitted
        await fast.pull(["w"])
        await fast.end_clock()  # clock 2 - min 0 > 1: must wait for "slow"
        err = await _refused(fast.pull(["w"], timeout_ms=300))
        _expect(err, grpc.StatusCode.DEADLINE_EXCEEDED, "WaitTimeout")
        assert "slow" in (err.details() or "")
        waiting = fast.pull(["w"], timeout_ms=30_000)
        await slow.end_clock()  # min clock 1: 2 - 1 <= 1, the wait ends
        info, _ = await waiting
        assert info.view.min_clock == 1


@pytest.mark.parametrize("fresh_server", [("bsp", 0)], indirect=True)
async def test_bsp_applies_the_mean_of_one_push_per_worker_once_per_step(
    fresh_server: ServerUnderTest,
) -> None:
    async with grpc.aio.insecure_channel(fresh_server.address) as ch:
        a, b = ProtoWorker(ch, "a"), ProtoWorker(ch, "b")
        await a.register()
        await b.register()
        sgd = pb.UpdateRule(kind=pb.RULE_KIND_SGD, lr=0.5)
        await a.init({"w": np.zeros(2, np.float64)}, sgd)
        await a.push({"w": np.array([1.0, 3.0])})
        # A second push of the same key in the same step is refused.
        err = await _refused(a.push({"w": np.array([1.0, 3.0])}))
        _expect(err, grpc.StatusCode.FAILED_PRECONDITION, "StaleUpdate")
        await b.push({"w": np.array([3.0, 5.0])})
        await a.end_clock()
        waiting = a.pull(["w"], timeout_ms=30_000)  # step 0 closes when b clocks too
        await b.end_clock()
        _, got = await waiting
        np.testing.assert_array_equal(got["w"], -0.5 * np.array([2.0, 4.0]))
