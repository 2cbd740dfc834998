"""Request deadlines of the Session transport (:class:`SessionTransport`, one re-armed timer).

A fake stream stands in for the gRPC call: it answers at once, or never, as each test says.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import numpy as np
import pytest

from paramserver.api.v1 import parameter_server_pb2 as pb
from paramserver.worker_client.compression import WirePart
from paramserver.worker_client.transport.base import PushPayload
from paramserver.worker_client.transport.session_stream import SessionTransport

pytestmark = pytest.mark.timeout(30)

N = 8


class FakeCall:
    """A Session stream: answers every push at once unless ``hang`` is set (then never)."""

    def __init__(self) -> None:
        self.hang = False
        self.cancelled = False
        self._seq = 0

    async def write(self, req: pb.SessionRequest) -> None:
        self._seq = req.seq

    async def read(self) -> pb.SessionResponse:
        if self.hang:
            await asyncio.Event().wait()
        return pb.SessionResponse(seq=self._seq, push=pb.PushResponse(applied_updates=1))

    def cancel(self) -> None:
        self.cancelled = True


def _fastpath() -> tuple[SessionTransport, FakeCall]:
    fp = SessionTransport(lambda: None, shared_memory=False)
    call = FakeCall()
    fp._call = call  # opened
    return fp, call


def _header() -> pb.PushHeader:
    return pb.PushHeader(worker_id="w", request_id=1)


GRAD = {"k": np.ones(N, np.float32)}


def _push(deadline_s: float) -> PushPayload:
    return PushPayload.of(1, _header, {k: [WirePart(v)] for k, v in GRAD.items()}, deadline_s)


async def _push_expecting_deadline(fp: SessionTransport, deadline_s: float) -> float:
    t0 = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await fp.push(_push(deadline_s))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    return time.monotonic() - t0


async def test_many_quick_requests_then_a_hanging_one_expires_at_its_own_deadline() -> None:
    fp, call = _fastpath()
    for _ in range(100):  # long deadlines: the timer is armed once and stays
        resp = await fp.push(_push(30.0))
        assert resp.applied_updates == 1
    call.hang = True
    elapsed = await _push_expecting_deadline(fp, 0.2)
    assert 0.19 <= elapsed < 2.0
    assert call.cancelled and fp._call is None  # the stream was dropped
    fp.close()


async def test_timer_armed_for_a_finished_request_re_arms_for_the_one_in_flight() -> None:
    fp, call = _fastpath()
    await fp.push(_push(0.1))  # arms the timer at +0.1 s, finishes at once
    call.hang = True
    elapsed = await _push_expecting_deadline(fp, 0.4)  # the +0.1 s firing must not expire it
    assert 0.39 <= elapsed < 2.0
    fp.close()


async def test_an_outside_cancellation_stays_a_cancellation() -> None:
    fp, call = _fastpath()
    call.hang = True
    task = asyncio.ensure_future(fp.push(_push(30.0)))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    call.hang = False
    fp._call = call  # a fresh stream
    assert (await fp.push(_push(30.0))).applied_updates == 1
    fp.close()


async def test_no_stray_cancellation_after_a_request_that_finished_in_time() -> None:
    fp, _ = _fastpath()
    for _ in range(3):
        await fp.push(_push(0.05))
    await asyncio.sleep(0.2)  # the timer fires with nothing in flight
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
    fp.close()
