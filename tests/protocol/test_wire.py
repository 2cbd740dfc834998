"""paramserver.protocol.wire against protobuf itself: the frame bytes it writes are what the
generated
classes parse, and what it reads from their bytes are the same fields."""

from __future__ import annotations

import numpy as np
import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from paramserver.api.v1 import parameter_server_pb2 as pb
from paramserver.api.v1 import tensor_pb2
from paramserver.protocol import tensor, wire

pytestmark = pytest.mark.timeout(60)

CONTAINERS = [pb.PushRequest, pb.PullResponse]


def _fields(frame: object) -> tuple[object, ...]:
    header = frame.header if frame.HasField("header") else None  # type: ignore[attr-defined]
    return (
        header,
        frame.chunk_index,  # type: ignore[attr-defined]
        frame.offset_bytes,  # type: ignore[attr-defined]
        bytes(frame.data),  # type: ignore[attr-defined]
        frame.last,  # type: ignore[attr-defined]
    )


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(min_value=0, max_value=3000),
    chunk=st.integers(min_value=1, max_value=1200),
    dtype=st.sampled_from(["float32", "float16", "int64", "int32"]),
    role=st.integers(min_value=0, max_value=3),
    container=st.sampled_from(CONTAINERS),
)
def test_written_frames_are_the_generated_messages(
    n: int, chunk: int, dtype: str, role: int, container: type
) -> None:
    arr = (np.arange(n) % 251).astype(dtype)
    ours = list(tensor.encode_frame_bytes("k", arr, chunk, role=role, dense_shape=(n, 1)))
    theirs = list(tensor.encode_messages(container, "k", arr, chunk, role=role, dense_shape=(n, 1)))
    assert len(ours) == len(theirs)
    for raw, msg in zip(ours, theirs, strict=True):
        assert container.FromString(raw) == msg  # protobuf reads our bytes as its own message
        assert raw == msg.SerializeToString()  # and the bytes are canonical
        back = wire.deserializer(container)(raw)
        assert isinstance(back, wire.RawFrameMessage) and back.WhichOneof("body") == "frame"
        assert _fields(back.frame) == _fields(msg.frame)


@settings(max_examples=150, deadline=None)
@given(
    with_header=st.booleans(),
    chunk_index=st.integers(min_value=0, max_value=2**32 - 1),
    offset=st.integers(min_value=0, max_value=2**64 - 1),
    data=st.binary(max_size=2000),
    last=st.booleans(),
)
def test_any_generated_frame_is_read_field_for_field(
    with_header: bool, chunk_index: int, offset: int, data: bytes, last: bool
) -> None:
    frame = tensor_pb2.TensorFrame(
        chunk_index=chunk_index, offset_bytes=offset, data=data, last=last
    )
    if with_header:
        frame.header.CopyFrom(tensor_pb2.TensorHeader(key="w", shape=[2, 3], size_bytes=24))
    for container in CONTAINERS:
        raw = container(frame=frame).SerializeToString()
        back = wire.deserializer(container)(raw)
        assert _fields(back.frame) == _fields(frame)


def test_other_bodies_and_unusual_encodings_go_to_protobuf() -> None:
    push = wire.deserializer(pb.PushRequest)
    header = pb.PushRequest(header=pb.PushHeader(worker_id="w", request_id=7))
    assert push(header.SerializeToString()) == header
    pull = wire.deserializer(pb.PullResponse)
    info = pb.PullResponse(info=pb.PullInfo(version=3))
    assert pull(info.SerializeToString()) == info
    assert push(b"") == pb.PushRequest()
    # an unknown field inside the frame: parsed by protobuf (kept as an unknown field)
    frame = pb.PushRequest(frame=tensor_pb2.TensorFrame(data=b"ab")).SerializeToString()
    unknown = b"\x12" + bytes([frame[1] + 2]) + frame[2:] + b"\x30\x01"  # field 6 varint
    parsed = push(unknown)
    assert isinstance(parsed, pb.PushRequest) and parsed.frame.data == b"ab"


@pytest.mark.parametrize(
    "raw",
    [
        b"\x12\x05\x22\x09abc",  # data longer than the frame
        b"\x12\x03\x22\x05ab",  # truncated data
        b"\x12\x02\x10\xff",  # truncated varint
    ],
)
def test_truncated_bytes_are_a_decode_error(raw: bytes) -> None:
    with pytest.raises(DecodeError):
        wire.deserializer(pb.PushRequest)(raw)
