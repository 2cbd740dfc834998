"""``headed_stream.read_headed_stream``: the reader of the reduction and push-sum streams (one head
message plus tensor frames) against hand-built message sequences."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import numpy as np
import pytest

from paramserver.api.v1 import reduction_pb2 as rpb
from paramserver.errors import InvalidArgument, MalformedStream
from paramserver.protocol import headed_stream, tensor

pytestmark = pytest.mark.timeout(30)


async def _stream(msgs: Sequence[Any]) -> AsyncIterator[Any]:
    for m in msgs:
        yield m


def _read(msgs: Sequence[Any], **kw: Any) -> tuple[Any, dict[str, np.ndarray]]:
    kw.setdefault("head", "header")
    kw.setdefault("what", "reduce stream")
    return asyncio.run(headed_stream.read_headed_stream(_stream(msgs), **kw))


def _frames(key: str, value: np.ndarray) -> list[Any]:
    return [rpb.ReduceRequest(frame=f) for f in tensor.encode_frames(key, value, 16)]


HEAD = rpb.ReduceRequest(header=rpb.ReduceHeader(worker_id="w-1", step=3))


def test_head_then_tensors_in_several_frames() -> None:
    a = np.arange(10, dtype=np.float32)
    b = np.array(2.5)
    head, got = _read([HEAD, *_frames("a", a), *_frames("b", b)])
    assert head.worker_id == "w-1" and head.step == 3
    np.testing.assert_array_equal(got["a"], a)
    assert got["b"].shape == () and float(got["b"]) == 2.5


def test_head_may_come_last_when_allowed() -> None:
    a = np.ones(3, np.float64)
    msgs = [*_frames("a", a), HEAD]
    head, got = _read(msgs, head_first=False)
    assert head.step == 3 and got["a"].tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(MalformedStream, match="must start with its header"):
        _read(msgs)


@pytest.mark.parametrize(
    ("msgs", "match"),
    [
        ([], "ended without its header"),
        ([HEAD, HEAD], "second header"),
        ([HEAD, rpb.ReduceRequest()], "neither header nor frame"),
        (
            [HEAD, *_frames("a", np.zeros(2)), *_frames("a", np.zeros(2))],
            "'a' appears twice",
        ),
    ],
)
def test_malformed_streams_are_refused(msgs: list[Any], match: str) -> None:
    with pytest.raises(MalformedStream, match=match):
        _read(msgs)


def test_a_tensor_over_the_limit_is_refused_at_its_header() -> None:
    with pytest.raises(InvalidArgument, match="size_bytes 800 exceeds max_tensor_bytes 64"):
        _read([HEAD, *_frames("a", np.zeros(100, np.float64))], max_tensor_bytes=64)
