"""Framing of the local link (4-byte little-endian length + one protobuf message): any split of
the byte stream into chunks gives back the messages, in order."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paramserver.api.v1 import parameter_server_pb2 as pb
from paramserver.errors import MalformedStream
from paramserver.protocol.link import FrameReader

pytestmark = pytest.mark.timeout(60)


def _message(seq: int, payload: bytes) -> pb.SessionRequest:
    return pb.SessionRequest(
        seq=seq,
        push=pb.SessionPush(
            header=pb.PushHeader(worker_id="w", request_id=seq),
            slots=pb.SlotBatch(
                keys=[f"k{seq}"], ndims=[1], dims=[len(payload)], offsets=[0], data=payload
            ),
        ),
    )


def _framed(msg: pb.SessionRequest) -> bytes:
    body = msg.SerializeToString()
    return len(body).to_bytes(4, "little") + body


@settings(max_examples=200, deadline=None)
@given(
    payloads=st.lists(st.binary(max_size=300), min_size=1, max_size=8),
    cuts=st.lists(st.integers(min_value=0, max_value=4000), max_size=12),
)
def test_any_chunking_gives_the_messages_back_in_order(
    payloads: list[bytes], cuts: list[int]
) -> None:
    sent = [_message(i + 1, p) for i, p in enumerate(payloads)]
    stream = b"".join(_framed(m) for m in sent)
    bounds = sorted({0, len(stream), *(c for c in cuts if c < len(stream))})
    reader = FrameReader(pb.SessionRequest, 1 << 20)
    got: list[pb.SessionRequest] = []
    for a, b in itertools.pairwise(bounds):
        got.extend(reader.feed(stream[a:b]))
    assert got == sent


def test_a_frame_over_the_limit_is_refused_before_its_bytes_arrive() -> None:
    reader = FrameReader(pb.SessionRequest, 100)
    with pytest.raises(MalformedStream, match="101 bytes exceeds the limit of 100"):
        reader.feed((101).to_bytes(4, "little") + b"\x00" * 10)


def test_bytes_that_are_not_a_message_are_malformed() -> None:
    reader = FrameReader(pb.SessionRequest, 100)
    with pytest.raises(MalformedStream, match="not a valid message"):
        reader.feed(b"\x03\x00\x00\x00\xff\xff\xff")
