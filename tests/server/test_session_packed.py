"""The Session's inline carrier: every request's and answer's bytes in one ``SlotBatch.data``
(one key or many, the only inline encoding), against real servers on 127.0.0.1.

Expected values come from numpy: every key uses the ``add`` rule (w += g) from known initial
values, so each pulled value is ``init + sum(g)`` computed by numpy in the key's dtype (one
rounding per element on both sides, so equality is exact). What went over the wire is read off
the Session messages themselves.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import grpc
import ml_dtypes
import numpy as np
import pytest

from paramserver.api.v1 import parameter_server_pb2 as pb
from paramserver.api.v1 import parameter_server_pb2_grpc as pb_grpc
from paramserver.api.v1 import tensor_pb2
from paramserver.errors import NonFiniteGradient
from paramserver.protocol import shm
from paramserver.protocol.session_frames import pack_slot_batch, slot_batch_entries
from paramserver.worker_client import UpdateRule, WorkerClient
from paramserver.worker_client.transport.session_stream import SessionTransport
from tests.harness import address_of, running_server
from tests.harness.raw_stubs import random_values, slot_batch

pytestmark = pytest.mark.timeout(60)

ADD = UpdateRule("add")
F32 = np.dtype(np.float32)

#: Shapes and dtypes of one request: a scalar, empty tensors, odd sizes (padding between
#: slots), every wire dtype.
LAYOUT: list[tuple[np.dtype[Any], tuple[int, ...]]] = [
    (F32, ()),
    (F32, (0,)),
    (np.dtype(np.float16), (3, 5)),
    (np.dtype(ml_dtypes.bfloat16), (7,)),
    (np.dtype(np.float64), (2, 3, 2)),
    (np.dtype(np.int32), (11,)),
    (np.dtype(np.int64), (1, 0, 4)),
    (F32, (257,)),
]


@asynccontextmanager
async def _recording(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[list[Any]]:
    """Every (request, response) pair any SessionTransport exchanges from now on."""
    seen: list[Any] = []
    original = SessionTransport._roundtrip

    async def roundtrip(self: SessionTransport, req: pb.SessionRequest) -> pb.SessionResponse:
        resp = await original(self, req)
        seen.append((req, resp))
        return resp

    monkeypatch.setattr(SessionTransport, "_roundtrip", roundtrip)
    yield seen


def _push_of(req: pb.SessionRequest) -> pb.SessionPush | None:
    which = req.WhichOneof("body")
    if which == "push":
        return req.push
    if which == "push_pull":
        return req.push_pull.push
    return None


def _pulled_of(resp: pb.SessionResponse) -> pb.SessionPulled | None:
    which = resp.WhichOneof("body")
    if which == "pull":
        return resp.pull
    if which == "push_pull":
        return resp.push_pull.pull
    return None


@pytest.mark.parametrize(
    ("server_shm", "client_shm"),
    [(False, True), (False, False), (True, True)],
    ids=["server-off", "both-off", "same-host-small"],
)
async def test_many_small_keys_travel_packed_and_match_numpy(
    monkeypatch: pytest.MonkeyPatch, server_shm: bool, client_shm: bool
) -> None:
    # On the network path, and on the same host while a request is small enough to go inline
    # (here ~3 KiB in all), a request of many keys is one packed inline batch each way.
    rng = np.random.default_rng(11)
    keys = [f"k{i}" for i in range(len(LAYOUT))]
    init = {k: random_values(rng, d, s) for k, (d, s) in zip(keys, LAYOUT, strict=True)}
    async with running_server(consistency="asp", shared_memory=server_shm) as daemon:
        async with (
            _recording(monkeypatch) as seen,
            WorkerClient(address_of(daemon), "w0", heartbeat=False, shared_memory=client_shm) as ps,
        ):
            await ps.init(init, rule=ADD)
            want = {k: v.copy() for k, v in init.items()}
            for step in range(3):
                grads = {
                    k: random_values(rng, d, s) for k, (d, s) in zip(keys, LAYOUT, strict=True)
                }
                # one gradient not C-contiguous (a transposed view): packed as its values
                grads["k2"] = random_values(rng, LAYOUT[2][0], (5, 3)).T
                for k in keys:
                    want[k] = want[k] + grads[k]
                got = await ps.push_pull(grads) if step else await _push_then_pull(ps, grads)
                for k in keys:
                    assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
                    np.testing.assert_array_equal(got[k], want[k], err_msg=k)
                    assert got[k].flags.writeable
            fp = ps.fastpath
            assert fp is not None and not fp.shm_active
            assert fp.on_local_link is server_shm  # (same host: on the local-link socket)
        pushes = [p for p in (_push_of(r) for r, _ in seen) if p is not None]
        pulls = [p for p in (_pulled_of(r) for _, r in seen) if p is not None]
        # every many-key push and pull (the init's read-back too) went as one inline batch
        assert len(pushes) == 3 and len(pulls) >= 3
        for push in pushes:
            assert push.slots.HasField("data") and list(push.slots.keys) == keys
            assert len(push.slots.data) >= sum(init[k].nbytes for k in keys)
        for pulled in pulls:
            assert pulled.slots.HasField("data") and list(pulled.slots.keys) == keys
            assert pulled.slots.data


@pytest.mark.parametrize(
    ("server_shm", "n", "inline"),
    [(False, 5, True), (False, 100_000, True), (True, 5, True), (True, 100_000, False)],
    ids=["net-small", "net-mid", "same-host-small", "same-host-large"],
)
async def test_one_key_takes_the_one_encoding_of_its_carrier(
    monkeypatch: pytest.MonkeyPatch, server_shm: bool, n: int, inline: bool
) -> None:
    # A single key is a one-slot batch like many keys: inline (data set, the slot at offset 0)
    # or in the shared-memory regions (data unset), each way; values match numpy.
    rng = np.random.default_rng(4)
    init = rng.standard_normal(n).astype(F32)
    async with running_server(consistency="asp", shared_memory=server_shm) as daemon:
        async with (
            _recording(monkeypatch) as seen,
            WorkerClient(address_of(daemon), "w0", heartbeat=False) as ps,
        ):
            await ps.init({"w": init}, rule=ADD)
            g1, g2 = (rng.standard_normal(n).astype(F32) for _ in range(2))
            await ps.push({"w": g1})
            got1 = await ps.pull(["w"])
            got2 = await ps.push_pull({"w": g2})
            assert ps.fastpath is not None and ps.fastpath.shm_active is not inline
        np.testing.assert_array_equal(got1["w"], init + g1)
        np.testing.assert_array_equal(got2["w"], init + g1 + g2)
        pushes = [p for p in (_push_of(r) for r, _ in seen) if p is not None]
        pulls = [p for p in (_pulled_of(r) for _, r in seen) if p is not None]
        assert len(pushes) == 2 and len(pulls) >= 2
        # (the init's read-back, before any segment was offered, may come inline)
        for batch in [p.slots for p in pushes] + [p.slots for p in pulls[-2:]]:
            assert list(batch.keys) == ["w"] and list(batch.offsets) == [0]
            assert list(batch.dims) == [n] and batch.dtypes[0] == tensor_pb2.DTYPE_FLOAT32
            assert batch.HasField("data") is inline
            if inline:
                assert len(batch.data) == shm.align_up(4 * n)


def test_the_session_messages_have_one_encoding_and_no_flags() -> None:
    # Pushed and pulled tensors travel only as a SlotBatch; the open negotiates no encoding.
    fields = {
        m.DESCRIPTOR.name: set(m.DESCRIPTOR.fields_by_name)
        for m in (pb.SessionOpen, pb.SessionOpened, pb.SessionPush, pb.SessionPulled)
    }
    assert fields["SessionOpen"] == {"worker_id", "shm", "want_local_link", "local_ticket"}
    assert fields["SessionOpened"] == {"shm", "max_inline_bytes", "local_link"}
    assert fields["SessionPush"] == {"header", "slots"}
    assert fields["SessionPulled"] == {"info", "needed_bytes", "slots"}
    assert not hasattr(pb, "SessionTensor")


async def _push_then_pull(ps: WorkerClient, grads: dict[str, np.ndarray]) -> dict[str, Any]:
    await ps.push(grads)
    return await ps.pull(list(grads))


async def test_bsp_queued_packed_gradients_survive_the_next_packed_push() -> None:
    """BSP queues a step's gradients until the step closes; a worker's next packed push (other
    keys, same step) reuses the session's receive buffer, so what was queued must be a copy."""
    async with running_server(consistency="bsp", lease_ms=60_000, shared_memory=False) as daemon:
        addr = address_of(daemon)
        async with (
            WorkerClient(addr, "w0", heartbeat=False) as w0,
            WorkerClient(addr, "w1", heartbeat=False) as w1,
        ):
            zeros = np.zeros(33, np.float32)
            await w0.init({k: zeros for k in ("a", "b", "c", "d")}, rule=ADD)
            ab = [{"a": np.full(33, 1.0, F32), "b": np.full(33, 2.0, F32)} for _ in range(2)]
            cd = [{"c": np.full(33, 10.0, F32), "d": np.full(33, 20.0, F32)} for _ in range(2)]
            ab[1] = {k: v * 3 for k, v in ab[1].items()}
            cd[1] = {k: v * 3 for k, v in cd[1].items()}
            for ps, first, second in zip((w0, w1), ab, cd, strict=True):
                await ps.push(first)
                await ps.push(second)  # same size: the same receive buffer, overwritten
                assert ps.fastpath is not None and not ps.fastpath.shm_active
            await asyncio.gather(w0.clock(), w1.clock())
            got = await w0.pull(["a", "b", "c", "d"])
            for k, base in (("a", 1.0), ("b", 2.0), ("c", 10.0), ("d", 20.0)):
                np.testing.assert_array_equal(got[k], np.full(33, (base + 3 * base) / 2, F32))


async def _raw_open(stub: Any) -> tuple[Any, pb.SessionOpened]:
    call = stub.Session()
    await call.write(pb.SessionRequest(seq=1, open=pb.SessionOpen()))
    return call, (await call.read()).opened


def _batch(entries: list[tuple[str, np.ndarray]], data: bytes | None = None) -> pb.SlotBatch:
    batch = pb.SlotBatch()
    pack_slot_batch(batch, [k for k, _ in entries], [v for _, v in entries])
    if data is not None:
        batch.data = data
    return batch


async def test_bad_packed_batches_apply_nothing_and_the_stream_keeps_serving() -> None:
    # A packed batch with a slot past its bytes, arrays that disagree, or a NaN in one key is
    # refused with its status code, applies none of its keys, and the stream keeps serving; a
    # good one then applies every key exactly once.
    a0 = np.arange(6, dtype=np.float32).reshape(2, 3)
    b0 = np.linspace(-1, 1, 9, dtype=np.float32)
    async with running_server(consistency="asp", shared_memory=False) as daemon:
        async with WorkerClient(address_of(daemon), "w0", heartbeat=False) as ps:
            await ps.init({"a": np.zeros((2, 3), F32), "b": np.zeros(9, F32)}, rule=ADD)
        async with grpc.aio.insecure_channel(address_of(daemon)) as channel:
            stub = pb_grpc.ParameterServerStub(channel)
            reg = await stub.Register(pb.RegisterRequest(worker_name="raw"))
            call, _opened = await _raw_open(stub)
            good = _batch([("a", a0), ("b", b0)])
            b_end = shm.align_up(a0.nbytes) + b0.nbytes  # (then padding to the boundary)
            short = _batch([("a", a0), ("b", b0)], data=good.data[: b_end - 4])
            disagree = _batch([("a", a0), ("b", b0)])
            disagree.ndims.append(1)
            nan_b = b0.copy()
            nan_b[4] = np.nan
            with_nan = _batch([("a", a0), ("b", nan_b)])
            refusals = [
                (short, grpc.StatusCode.INVALID_ARGUMENT, "InvalidArgument"),
                (disagree, grpc.StatusCode.INVALID_ARGUMENT, "MalformedStream"),
                (with_nan, grpc.StatusCode.INVALID_ARGUMENT, NonFiniteGradient.__name__),
            ]
            for i, (batch, code, cls) in enumerate(refusals):
                push = pb.SessionPush(
                    header=pb.PushHeader(worker_id=reg.worker_id, request_id=i, clock=0),
                    slots=batch,
                )
                await call.write(pb.SessionRequest(seq=10 + i, push=push))
                resp = await call.read()
                assert resp.WhichOneof("body") == "error", resp
                assert resp.error.code == code.value[0], resp.error
                assert resp.error.error_class == cls, resp.error
            push = pb.SessionPush(
                header=pb.PushHeader(worker_id=reg.worker_id, request_id=99, clock=0), slots=good
            )
            both = pb.SessionPushPull(
                push=push, pull=pb.PullRequest(worker_id=reg.worker_id, keys=["a", "b"])
            )
            await call.write(pb.SessionRequest(seq=20, push_pull=both))
            resp = await call.read()
            assert resp.WhichOneof("body") == "push_pull", resp
            pulled = resp.push_pull.pull
            assert pulled.slots.HasField("data") and pulled.slots.data
            entries = slot_batch_entries(pulled.slots)
            data = pulled.slots.data
            got = {
                key: np.frombuffer(data, dtype, int(np.prod(shape)), offset).reshape(shape)
                for key, dtype, shape, offset, _n in entries
            }
            # the refused batches left nothing: exactly the good push, once
            np.testing.assert_array_equal(got["a"], a0)
            np.testing.assert_array_equal(got["b"], b0)
            # padding between the slots is zero
            end_a = a0.nbytes
            assert data[end_a : shm.align_up(end_a)] == bytes(shm.align_up(end_a) - end_a)
            call.cancel()


async def test_hostile_shapes_and_trailing_bytes_are_invalid_argument_naming_the_key() -> None:
    # Shapes no numpy array can have (70 dimensions; a zero-size shape whose other dimensions
    # multiply past any size), and an inline batch with bytes after its last slot:
    # INVALID_ARGUMENT naming what was wrong, nothing applied, the stream serving. An inline
    # batch of empty tensors only (its data set, but empty) is applied.
    async with running_server(consistency="asp", shared_memory=False) as daemon:
        async with WorkerClient(address_of(daemon), "w0", heartbeat=False) as ps:
            await ps.init({"a": np.zeros(4, F32), "z": np.zeros((0, 3), F32)}, rule=ADD)
        async with grpc.aio.insecure_channel(address_of(daemon)) as channel:
            stub = pb_grpc.ParameterServerStub(channel)
            reg = await stub.Register(pb.RegisterRequest(worker_name="raw"))
            call, _opened = await _raw_open(stub)
            four = np.ones(4, F32).tobytes()
            rank70 = (1,) * 70
            huge_zero = (0, 2**62, 2**62)
            pushes = [
                (pb.SessionPush(slots=slot_batch([("a", F32, rank70, 0)], four)), "70 dimensions"),
                (
                    pb.SessionPush(slots=slot_batch([("a", F32, huge_zero, 0)], four)),
                    "larger than any array",
                ),
                (
                    pb.SessionPush(slots=slot_batch([("a", F32, (4,), 0)], four + bytes(64))),
                    "slots end at 64",
                ),
            ]
            for i, (push, words) in enumerate(pushes):
                push.header.CopyFrom(pb.PushHeader(worker_id=reg.worker_id, request_id=i, clock=0))
                await call.write(pb.SessionRequest(seq=10 + i, push=push))
                resp = await call.read()
                assert resp.WhichOneof("body") == "error", resp
                assert resp.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0], resp.error
                assert words in resp.error.message, resp.error.message
                if i < 2:
                    assert "'a'" in resp.error.message, resp.error.message
            empty = pb.SessionPush(
                header=pb.PushHeader(worker_id=reg.worker_id, request_id=50, clock=0),
                slots=slot_batch([("z", F32, (0, 3), 0)], b""),
            )
            await call.write(pb.SessionRequest(seq=30, push=empty))
            resp = await call.read()
            assert resp.WhichOneof("body") == "push", resp
            assert resp.push.applied_updates == 1
            await call.write(pb.SessionRequest(seq=31, pull=pb.PullRequest(keys=["a"])))
            pulled = (await call.read()).pull
            np.testing.assert_array_equal(np.frombuffer(pulled.slots.data, F32, 4), [0] * 4)
            call.cancel()
