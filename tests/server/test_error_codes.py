"""Every refusal of docs/semantics.md "Errors" through the real gRPC client (raw stubs only where
the client itself prevents the bad input): the status code, the paramserver.errors class the client
funnel maps it to, the stored value unchanged afterwards (pulled and compared bit for bit), and
the server still serving (a good push right after is applied).

Key ``w``: float64 (4,) = [1, 2, 3, 4], rule ``add``, so a good push of ones gives [2, 3, 4, 5].
"""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Awaitable, Iterator
from contextlib import asynccontextmanager
from typing import Any

import grpc
import numpy as np
import pytest

from paramserver.api.v1 import parameter_server_pb2 as pb
from paramserver.api.v1 import parameter_server_pb2_grpc as pb_grpc
from paramserver.api.v1 import tensor_pb2
from paramserver.errors import (
    Aborted,
    AlreadyExists,
    DimensionMismatch,
    DTypeMismatch,
    InvalidArgument,
    KeyNotFound,
    MalformedStream,
    NonFiniteGradient,
    ParamServerError,
    StaleUpdate,
    WaitTimeout,
    WorkerNotFound,
    from_rpc_error,
)
from paramserver.worker_client import UpdateRule, WorkerClient, connect
from tests.harness import eventually, running_server

pytestmark = pytest.mark.timeout(30)

W0 = np.array([1.0, 2.0, 3.0, 4.0])
ONES = np.ones(4)
ADD = UpdateRule("add")


async def _open(address: str, name: str, **kwargs: Any) -> WorkerClient:
    client = connect(address, name, auto_reregister=False, **kwargs)
    await client.open()
    return client


@asynccontextmanager
async def _cluster(**config: Any) -> Any:
    """A server with ``w`` declared, worker ``A`` and a raw stub on its own channel."""
    config.setdefault("consistency", "asp")
    async with running_server(**config) as srv:
        a = await _open(srv.address, "A")
        channel = grpc.aio.insecure_channel(srv.address)
        try:
            await a.init({"w": W0}, ADD)
            yield srv, a, pb_grpc.ParameterServerStub(channel)
        finally:
            await a.close()
            await channel.close()


async def _refused(
    call: Awaitable[Any], cls: type[ParamServerError], code: grpc.StatusCode, *names: str
) -> ParamServerError:
    """``call`` fails with exactly ``cls`` carrying ``code``, raised from the RPC error; its
    message names each of ``names``."""
    with pytest.raises(cls) as err:
        await call
    exc = err.value
    assert type(exc) is cls, f"{type(exc).__name__}: {exc}"
    assert exc.code is code
    assert isinstance(exc.__cause__, grpc.aio.AioRpcError)
    assert exc.__cause__.code() is code
    for name in names:
        assert name in str(exc), f"{name!r} not in {exc}"
    return exc


async def _raw(call: Awaitable[Any]) -> Any:
    """A raw-stub call through the same funnel the client uses."""
    try:
        return await call
    except grpc.aio.AioRpcError as err:
        raise from_rpc_error(err) from err


async def _value(client: WorkerClient) -> np.ndarray:
    return (await client.pull(["w"], observer=True))["w"]


async def _unchanged_then_serving(client: WorkerClient, expected: np.ndarray = W0) -> None:
    """The stored value is bit-for-bit ``expected``; then a good push (+1) is applied."""
    np.testing.assert_array_equal(await _value(client), expected)
    await client.push({"w": ONES})
    np.testing.assert_array_equal(await _value(client), expected + 1)


def _frame(
    array: np.ndarray, *, key: str = "w", index: int = 0, last: bool = True, **header: Any
) -> tensor_pb2.TensorFrame:
    """One frame holding all of ``array`` (little-endian bytes), header fields overridable."""
    data = array.astype(array.dtype.newbyteorder("<")).tobytes()
    fields = {
        "key": key,
        "dtype": tensor_pb2.DTYPE_FLOAT64,
        "shape": list(array.shape),
        "size_bytes": len(data),
    }
    fields.update(header)
    frame = tensor_pb2.TensorFrame(chunk_index=index, offset_bytes=0, data=data, last=last)
    if index == 0:
        frame.header.CopyFrom(tensor_pb2.TensorHeader(**fields))
    return frame


# ------------------------------------------------------------------------------ NOT_FOUND


async def test_unknown_key_is_not_found_on_push_and_pull() -> None:
    async with _cluster() as (_, a, _stub):
        nf = grpc.StatusCode.NOT_FOUND
        await _refused(a.push({"nope": ONES}), KeyNotFound, nf, "'nope'")
        await _refused(a.pull(["nope"]), KeyNotFound, nf, "'nope'")
        await _refused(a.pull(["w", "nope"]), KeyNotFound, nf, "'nope'")
        # One unknown key refuses the whole push: `w` is not half-applied.
        await _refused(a.push({"w": ONES, "nope": ONES}), KeyNotFound, nf, "'nope'")
        await _unchanged_then_serving(a)


# ------------------------------------------------------------------------------ INVALID_ARGUMENT


async def test_wrong_dtype_is_invalid_argument() -> None:
    """A gradient of the key's shape in another dtype is named a dtype mismatch
    (``DTypeMismatch``, a ``DimensionMismatch``), naming both dtypes."""
    async with _cluster() as (_, a, _stub):
        await _refused(
            a.push({"w": ONES.astype(np.float32)}),
            DTypeMismatch,
            grpc.StatusCode.INVALID_ARGUMENT,
            "float32",
            "float64",
        )
        await _unchanged_then_serving(a)


@pytest.mark.parametrize("shape", [(3,), (4, 1), (), (0,)])
async def test_wrong_shape_is_invalid_argument_naming_both_shapes(shape: tuple[int, ...]) -> None:
    async with _cluster() as (_, a, _stub):
        await _refused(
            a.push({"w": np.ones(shape)}),
            DimensionMismatch,
            grpc.StatusCode.INVALID_ARGUMENT,
            str(shape),
            "(4,)",
        )
        await _unchanged_then_serving(a)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
async def test_non_finite_gradient_is_invalid_argument(bad: float) -> None:
    async with _cluster() as (_, a, _stub):
        await _refused(
            a.push({"w": np.array([1.0, bad, 1.0, 1.0])}),
            NonFiniteGradient,
            grpc.StatusCode.INVALID_ARGUMENT,
            "'w'",
        )
        await _unchanged_then_serving(a)


def _malformed_streams(worker_id: str, clock: int) -> Iterator[tuple[str, list[Any]]]:
    head = pb.PushRequest(
        header=pb.PushHeader(worker_id=worker_id, request_id=secrets.randbits(60), clock=clock)
    )
    good = _frame(ONES)
    half = ONES.tobytes()[:16]
    yield "no messages at all", []
    yield "frame before the header", [pb.PushRequest(frame=good), head]
    yield "header twice", [head, head, pb.PushRequest(frame=good)]
    yield (
        "first frame without tensor header",
        [
            head,
            pb.PushRequest(
                frame=tensor_pb2.TensorFrame(chunk_index=0, data=ONES.tobytes(), last=True)
            ),
        ],
    )
    yield (
        "chunk index skips",
        [
            head,
            pb.PushRequest(frame=_frame(ONES[:2], last=False, shape=[4], size_bytes=32)),
            pb.PushRequest(
                frame=tensor_pb2.TensorFrame(chunk_index=2, offset_bytes=16, data=half, last=True)
            ),
        ],
    )
    yield (
        "wrong offset",
        [
            head,
            pb.PushRequest(frame=_frame(ONES[:2], last=False, shape=[4], size_bytes=32)),
            pb.PushRequest(
                frame=tensor_pb2.TensorFrame(chunk_index=1, offset_bytes=8, data=half, last=True)
            ),
        ],
    )
    yield (
        "last frame short",
        [head, pb.PushRequest(frame=_frame(ONES[:2], shape=[4], size_bytes=32))],
    )
    yield (
        "data past size_bytes",
        [head, pb.PushRequest(frame=_frame(np.ones(5), shape=[4], size_bytes=32))],
    )
    yield (
        "size_bytes disagrees with shape",
        [head, pb.PushRequest(frame=_frame(ONES, size_bytes=24))],
    )
    yield "stream ends mid-tensor", [head, pb.PushRequest(frame=_frame(ONES, last=False))]
    yield "unknown dtype", [head, pb.PushRequest(frame=_frame(ONES, dtype=99))]
    yield "unspecified dtype", [head, pb.PushRequest(frame=_frame(ONES, dtype=0))]
    yield "empty key", [head, pb.PushRequest(frame=_frame(ONES, key=""))]
    yield "negative dimension", [head, pb.PushRequest(frame=_frame(ONES, shape=[-4]))]
    yield "key twice", [head, pb.PushRequest(frame=good), pb.PushRequest(frame=good)]


async def test_malformed_frames_are_invalid_argument() -> None:
    """Raw stubs (the client only sends well-formed frames): each broken stream is refused as
    MalformedStream / INVALID_ARGUMENT, nothing is applied, and the server serves on."""
    async with _cluster() as (_, a, stub):
        ia = grpc.StatusCode.INVALID_ARGUMENT
        for what, messages in _malformed_streams(a.worker_id, a.clock_value):
            try:
                await _refused(_raw(stub.Push(iter(messages), timeout=10)), MalformedStream, ia)
            except AssertionError as err:
                raise AssertionError(f"{what}: {err}") from err
            np.testing.assert_array_equal(await _value(a), W0, err_msg=what)
        # Init streams are read by the same code: a frame before the header is refused too.
        init = [
            pb.InitRequest(frame=_frame(np.zeros(4), key="fresh")),
            pb.InitRequest(header=pb.InitHeader(rule=ADD.to_proto())),
        ]
        await _refused(_raw(stub.Init(iter(init), timeout=10)), MalformedStream, ia, "header")
        assert [k.key for k in (await a.status()).keys] == ["w"]
        await _unchanged_then_serving(a)


@pytest.mark.parametrize(
    ("what", "rule"),
    [
        ("unspecified kind", pb.UpdateRule()),
        ("unknown kind", pb.UpdateRule(kind=99)),
        ("negative lr", pb.UpdateRule(kind=pb.RULE_KIND_SGD, lr=-1.0)),
        ("momentum >= 1", pb.UpdateRule(kind=pb.RULE_KIND_SGD, momentum=1.5)),
        ("NaN lr", pb.UpdateRule(kind=pb.RULE_KIND_ADAM, lr=float("nan"))),
        ("zero eps", pb.UpdateRule(kind=pb.RULE_KIND_ADAGRAD, eps=0.0)),
        ("weight decay on add", pb.UpdateRule(kind=pb.RULE_KIND_ADD, weight_decay=0.1)),
    ],
)
async def test_bad_update_rule_is_invalid_argument(what: str, rule: pb.UpdateRule) -> None:
    """Raw Init (the client's UpdateRule refuses these before sending): refused, no key is
    created, and re-declaring the existing key with a bad rule leaves its value and rule."""
    async with _cluster() as (_, a, stub):
        for key in ("fresh", "w"):
            messages = [
                pb.InitRequest(header=pb.InitHeader(rule=rule)),
                pb.InitRequest(frame=_frame(np.zeros(4), key=key)),
            ]
            call = _raw(stub.Init(iter(messages), timeout=10))
            await _refused(call, InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT, "rule")
        status = await a.status()
        assert [(k.key, k.rule) for k in status.keys] == [("w", pb.RULE_KIND_ADD)]
        await _unchanged_then_serving(a)


async def test_optimizer_rule_on_integer_key_is_invalid_argument() -> None:
    async with _cluster() as (_, a, _stub):
        await _refused(
            a.init({"ints": np.zeros(3, np.int64)}, UpdateRule("sgd", lr=0.1)),
            InvalidArgument,
            grpc.StatusCode.INVALID_ARGUMENT,
            "'ints'",
        )
        assert "ints" not in [k.key for k in (await a.status()).keys]
        await _unchanged_then_serving(a)


# ------------------------------------------------------------------------------ FAILED_PRECONDITION


async def test_unknown_worker_id_is_failed_precondition() -> None:
    async with _cluster() as (_, a, stub):
        fp = grpc.StatusCode.FAILED_PRECONDITION
        ghost = "ghost#999"
        push = [
            pb.PushRequest(header=pb.PushHeader(worker_id=ghost, request_id=1)),
            pb.PushRequest(frame=_frame(ONES)),
        ]
        await _refused(_raw(stub.Push(iter(push), timeout=10)), WorkerNotFound, fp, ghost)
        await _refused(
            _raw(stub.Pull(pb.PullRequest(worker_id=ghost, keys=["w"]), timeout=10).read()),
            WorkerNotFound,
            fp,
            ghost,
        )
        await _refused(
            _raw(stub.Clock(pb.ClockRequest(worker_id=ghost), timeout=10)), WorkerNotFound, fp
        )
        await _refused(
            _raw(stub.Heartbeat(pb.HeartbeatRequest(worker_id=ghost), timeout=10)),
            WorkerNotFound,
            fp,
        )
        await _refused(
            _raw(stub.Leave(pb.LeaveRequest(worker_id=ghost), timeout=10)), WorkerNotFound, fp
        )
        # Through the client: a worker that left is no longer a member.
        gone = await _open(a.address, "gone")
        await gone.leave()
        await _refused(gone.push({"w": ONES}), WorkerNotFound, fp, gone.worker_id)
        await _refused(gone.pull(["w"]), WorkerNotFound, fp)
        await _refused(gone.clock(), WorkerNotFound, fp)
        await gone.close()
        await _unchanged_then_serving(a)


async def test_evicted_worker_is_failed_precondition() -> None:
    """A client with heartbeats off loses its 1 s lease; everything it then sends as that
    worker is refused. The observer and the newcomer have no lease to lose."""
    async with running_server(consistency="asp", lease_ms=1000) as srv:
        channel = grpc.aio.insecure_channel(srv.address)
        stub = pb_grpc.ParameterServerStub(channel)
        e = await _open(srv.address, "E", heartbeat=False)
        try:
            await e.init({"w": W0}, ADD)

            async def evicted() -> bool:
                status = await stub.Status(pb.StatusRequest(), timeout=10)
                return not any(w.live for w in status.workers if w.worker_name == "E")

            await eventually(evicted, timeout_s=10.0, what="E evicted")
            fp = grpc.StatusCode.FAILED_PRECONDITION
            await _refused(e.push({"w": ONES}), WorkerNotFound, fp, e.worker_id)
            await _refused(e.pull(["w"]), WorkerNotFound, fp, e.worker_id)
            await _refused(e.clock(), WorkerNotFound, fp)
            await _refused(e.heartbeat(), WorkerNotFound, fp)
            np.testing.assert_array_equal(await _value(e), W0)
            fresh = await _open(srv.address, "F")
            try:
                await fresh.push({"w": ONES})
            finally:
                await fresh.close()
            np.testing.assert_array_equal(await _value(e), W0 + 1)
        finally:
            await e.close()
            await channel.close()


async def test_stale_future_and_duplicate_steps_are_failed_precondition() -> None:
    """BSP (sum): a second push in one step, a push for a step that is not open and a push or
    clock for a stale or future clock are refused; the step then closes with exactly the
    accepted pushes."""
    async with _cluster(consistency="bsp", aggregation="sum") as (srv, a, stub):
        b = await _open(srv.address, "B")
        try:
            fp = grpc.StatusCode.FAILED_PRECONDITION
            await a.push({"w": ONES})
            await _refused(a.push({"w": 100 * ONES}), StaleUpdate, fp, "duplicate")
            await a.clock()  # A at clock 1 while step 0 waits for B
            await _refused(a.push({"w": 100 * ONES}), StaleUpdate, fp, "step 0")
            for clock in (0, 7):  # stale and future clocks in the header
                push = [
                    pb.PushRequest(
                        header=pb.PushHeader(
                            worker_id=a.worker_id, request_id=9 + clock, clock=clock
                        )
                    ),
                    pb.PushRequest(frame=_frame(100 * ONES)),
                ]
                await _refused(_raw(stub.Push(iter(push), timeout=10)), StaleUpdate, fp)
            await _refused(
                _raw(stub.Clock(pb.ClockRequest(worker_id=a.worker_id, clock=5), timeout=10)),
                StaleUpdate,
                fp,
                "clock 5",
            )
            np.testing.assert_array_equal(await _value(a), W0)
            await b.push({"w": 2 * ONES})
            await b.clock()
            # Step 0 = A's first push + B's push: w0 + 1 + 2.
            np.testing.assert_array_equal((await a.pull(["w"], timeout_s=5.0))["w"], W0 + 3)
            status = await a.status()
            assert (status.applied_updates, status.rejected_pushes) == (2, 4)
        finally:
            await b.close()


@pytest.mark.parametrize("consistency", ["ssp", "asp"])
async def test_push_for_a_future_clock_is_failed_precondition(consistency: str) -> None:
    async with _cluster(consistency=consistency, staleness=1) as (_, a, _stub):
        a.clock_value = 3  # the client believes it is ahead of the server
        await _refused(a.push({"w": ONES}), StaleUpdate, grpc.StatusCode.FAILED_PRECONDITION)
        a.clock_value = 0
        await _unchanged_then_serving(a)


# ------------------------------------------------------------------------------ ABORTED


async def test_fail_fast_step_is_aborted_naming_the_dead_worker() -> None:
    async with _cluster(
        consistency="bsp", death_policy="fail_fast", lease_ms=1000, aggregation="sum"
    ) as (srv, a, _stub):
        b = await _open(srv.address, "B", heartbeat=False)
        try:
            await a.push({"w": ONES})
            await a.clock()
            exc = await _refused(
                a.pull(["w"], timeout_s=10.0), Aborted, grpc.StatusCode.ABORTED, "'B'"
            )
            assert "fail_fast" in str(exc)
            np.testing.assert_array_equal(await _value(a), W0)  # the step's push was dropped
            # The server serves on: step 1 with A alone closes when A clocks.
            await a.push({"w": 2 * ONES})
            await a.clock()
            np.testing.assert_array_equal((await a.pull(["w"], timeout_s=5.0))["w"], W0 + 2)
        finally:
            await b.close()


# ------------------------------------------------------------------------------ ALREADY_EXISTS


async def test_same_worker_name_twice_is_already_exists() -> None:
    async with _cluster() as (srv, a, _stub):
        twin = connect(srv.address, "A", auto_reregister=False)
        await _refused(twin.open(), AlreadyExists, grpc.StatusCode.ALREADY_EXISTS, "'A'")
        status = await a.status()
        assert [(w.worker_name, w.worker_id, w.live) for w in status.workers] == [
            ("A", a.worker_id, True)
        ]
        await _unchanged_then_serving(a)


# ------------------------------------------------------------------------------ DEADLINE_EXCEEDED


async def test_wait_past_its_deadline_names_the_workers_waited_for() -> None:
    async with _cluster(consistency="ssp", staleness=1) as (srv, a, _stub):
        b = await _open(srv.address, "B")
        c = await _open(srv.address, "C")
        d = await _open(srv.address, "D")
        try:
            for _ in range(3):
                await a.clock()
            await d.clock()
            await d.clock()  # A at 3 needs every clock >= 2: B and C (at 0) hold it back
            start = time.monotonic()
            exc = await _refused(
                a.pull(["w"], timeout_s=0.3), WaitTimeout, grpc.StatusCode.DEADLINE_EXCEEDED
            )
            elapsed = time.monotonic() - start
            assert 0.3 <= elapsed < 0.3 + 2.0, elapsed
            named = set(re.findall(r"\b[A-D]\b", str(exc)))
            assert {"B", "C"} <= named and "D" not in named, str(exc)
            np.testing.assert_array_equal(await _value(a), W0)
            await b.push({"w": ONES})  # SSP applies on arrival
            np.testing.assert_array_equal(await _value(a), W0 + 1)
        finally:
            for client in (b, c, d):
                await client.close()
