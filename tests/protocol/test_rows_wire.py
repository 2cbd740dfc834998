"""The row streams' chunk messages against protobuf itself: the bytes
:func:`~paramserver.protocol.rows_wire.chunk_messages` writes are what the generated classes
serialize for ``chunk=RowsChunk(...)`` (byte for byte) in every row stream message type, and
what :func:`~paramserver.protocol.wire.rows_deserializer` reads in place from any generated
chunk message are the same fields; anything else goes to protobuf."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from paramserver.api.v1 import tables_pb2 as tpb
from paramserver.protocol import rows_wire, wire

pytestmark = pytest.mark.timeout(60)

#: Every row stream message type whose body may be a chunk (requests and replies).
CONTAINERS = [
    tpb.PullRowsRequest,
    tpb.PullRowsResponse,
    tpb.PushRowsRequest,
    tpb.PushPullRowsRequest,
    tpb.PushPullRowsResponse,
    tpb.PullRowsManyRequest,
    tpb.PullRowsManyResponse,
    tpb.PushRowsManyRequest,
]


def _expected(
    ids: np.ndarray | None, rows: np.ndarray | None, versions: np.ndarray | None, k: int
) -> list[tpb.RowsChunk]:
    """The chunks of ``k`` ids each, built field by field with the generated class."""
    n = next(a.shape[0] for a in (ids, rows, versions) if a is not None)
    out = []
    for start in range(0, n, k):
        chunk = tpb.RowsChunk()
        if ids is not None:
            chunk.ids = ids[start : start + k].astype("<i8").tobytes()
        if rows is not None:
            chunk.rows = rows[start : start + k].tobytes()
        if versions is not None:
            chunk.versions = versions[start : start + k].astype("<i8").tobytes()
        out.append(chunk)
    return out


@settings(max_examples=120, deadline=None)
@given(
    n=st.integers(min_value=1, max_value=700),
    dim=st.integers(min_value=1, max_value=9),
    dtype=st.sampled_from(["float32", "float16", "bfloat16"]),
    what=st.sampled_from(["ids", "rows", "ids+rows", "ids+versions", "rows+versions"]),
    chunk_bytes=st.integers(min_value=1, max_value=4000),
    container=st.sampled_from(CONTAINERS),
)
def test_written_chunks_are_the_generated_messages(
    n: int, dim: int, dtype: str, what: str, chunk_bytes: int, container: type
) -> None:
    rng = np.random.default_rng(n * 31 + dim)
    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    ids = rng.integers(0, 2**62, n).astype(np.int64) if "ids" in what else None
    rows = rng.standard_normal((n, dim)).astype(np_dtype) if "rows" in what else None
    versions = rng.integers(-1, 2**40, n).astype(np.int64) if "versions" in what else None
    ours = list(rows_wire.chunk_messages(ids, rows, chunk_bytes=chunk_bytes, versions=versions))
    row_bytes = (0 if rows is None else dim * np_dtype.itemsize) + (
        8 if versions is not None else 0
    )
    k = rows_wire.rows_per_chunk(row_bytes, chunk_bytes)
    theirs = _expected(ids, rows, versions, k)
    assert len(ours) == len(theirs) == -(-n // k)
    read = wire.rows_deserializer(container)
    for raw, chunk in zip(ours, theirs, strict=True):
        msg = container(chunk=chunk)
        assert raw == msg.SerializeToString()  # canonical: byte for byte protobuf's own
        assert container.FromString(raw) == msg
        back = read(raw)
        assert isinstance(back, wire.RawRowsMessage) and back.WhichOneof("body") == "chunk"
        got = back.chunk
        assert (bytes(got.ids), bytes(got.rows), bytes(got.versions)) == (
            chunk.ids,
            chunk.rows,
            chunk.versions,
        )


def test_a_received_chunk_stream_reassembles_the_rows() -> None:
    """Chunks read in place feed a RowsReceiver as parsed messages do: the same arrays."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 10**9, 1000).astype(np.int64)
    rows = rng.standard_normal((1000, 16)).astype(np.float32)
    read = wire.rows_deserializer(tpb.PushRowsRequest)
    ours = rows_wire.RowsReceiver("t", 1000, 16, np.dtype(np.float32))
    theirs = rows_wire.RowsReceiver("t", 1000, 16, np.dtype(np.float32))
    for raw in rows_wire.chunk_messages(ids, rows, chunk_bytes=7000):
        ours.feed(read(raw).chunk)
        theirs.feed(tpb.PushRowsRequest.FromString(raw).chunk)
    for a, b, want in zip(ours.finish(), theirs.finish(), (ids, rows), strict=True):
        np.testing.assert_array_equal(a, want)
        np.testing.assert_array_equal(b, want)


def test_headers_infos_and_unusual_encodings_go_to_protobuf() -> None:
    push = wire.rows_deserializer(tpb.PushRowsRequest)
    header = tpb.PushRowsRequest(header=tpb.RowsHeader(table="emb", worker_id="w", num_ids=3))
    assert push(header.SerializeToString()) == header
    pull = wire.rows_deserializer(tpb.PullRowsResponse)
    info = tpb.PullRowsResponse(info=tpb.PullRowsInfo(dim=4, num_ids=2))
    assert pull(info.SerializeToString()) == info
    assert push(b"") == tpb.PushRowsRequest()
    chunk = tpb.PushRowsRequest(chunk=tpb.RowsChunk(ids=b"\x01" * 8)).SerializeToString()
    # an unknown field inside the chunk: protobuf parses it (kept as an unknown field)
    unknown = b"\x12" + bytes([chunk[1] + 2]) + chunk[2:] + b"\x20\x01"  # field 4 varint
    parsed = push(unknown)
    assert isinstance(parsed, tpb.PushRowsRequest) and parsed.chunk.ids == b"\x01" * 8
    # a repeated field: protobuf's rule (the last one wins), not ours
    twice = b"\x12\x14" + b"\x0a\x08" + b"\x01" * 8 + b"\x0a\x08" + b"\x02" * 8
    parsed = push(twice)
    assert isinstance(parsed, tpb.PushRowsRequest) and parsed.chunk.ids == b"\x02" * 8


@pytest.mark.parametrize(
    "raw",
    [
        b"\x12\x05\x0a\x09abc",  # ids longer than the chunk
        b"\x12\x03\x12\x05ab",  # truncated rows
        b"\x12\x02\x0a\xff",  # truncated varint
    ],
)
def test_truncated_chunks_are_a_decode_error(raw: bytes) -> None:
    with pytest.raises(DecodeError):
        wire.rows_deserializer(tpb.PushRowsRequest)(raw)
