"""The wire contract spoken from the .proto files alone: plain generated stubs, frames built and
read by hand. Nothing from paramserver's client, codec or server packages is imported, so the
tests built on this module check what a worker written in another language would see.

Frame rules, as the proto comments state them: metadata (key, dtype, shape, size_bytes) in frame
0 only, raw little-endian C-order bytes, at most 1 MiB of data per frame, ``last`` on the final
frame, ``chunk_index`` counting from 0 and ``offset_bytes`` the running byte offset.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Iterator
from typing import Any

import grpc
import ml_dtypes
import numpy as np

from paramserver.api.v1 import parameter_server_pb2 as pb
from paramserver.api.v1 import parameter_server_pb2_grpc as pb_grpc
from paramserver.api.v1 import tables_pb2 as tbl
from paramserver.api.v1 import tensor_pb2 as tpb

#: The largest ``data`` of one frame the proto allows (1 MiB).
CHUNK_BYTES = 1 << 20

DTYPES: dict[int, np.dtype[Any]] = {
    tpb.DTYPE_FLOAT16: np.dtype("<f2"),
    tpb.DTYPE_BFLOAT16: np.dtype(ml_dtypes.bfloat16),
    tpb.DTYPE_FLOAT32: np.dtype("<f4"),
    tpb.DTYPE_FLOAT64: np.dtype("<f8"),
    tpb.DTYPE_INT32: np.dtype("<i4"),
    tpb.DTYPE_INT64: np.dtype("<i8"),
}
_CODES = {dt: code for code, dt in DTYPES.items()}


def dtype_code(array: np.ndarray) -> int:
    return _CODES[np.dtype(array.dtype).newbyteorder("<")]


def frames(
    key: str, array: np.ndarray, *, chunk_bytes: int = CHUNK_BYTES, dtype: int | None = None
) -> list[tpb.TensorFrame]:
    """The frames of one tensor (a zero-size tensor is one empty frame)."""
    data = np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
    header = tpb.TensorHeader(
        key=key,
        dtype=dtype_code(array) if dtype is None else dtype,
        shape=list(array.shape),
        size_bytes=len(data),
    )
    out = []
    offset = 0
    index = 0
    while True:
        piece = data[offset : offset + chunk_bytes]
        frame = tpb.TensorFrame(chunk_index=index, offset_bytes=offset, data=piece)
        if index == 0:
            frame.header.CopyFrom(header)
        offset += len(piece)
        index += 1
        frame.last = offset >= len(data)
        out.append(frame)
        if frame.last:
            return out


def read_tensors(frames_in: Iterable[tpb.TensorFrame]) -> dict[str, np.ndarray]:
    """Reassemble tensors from frames, checking the frame rules (AssertionError otherwise)."""
    out: dict[str, np.ndarray] = {}
    header: tpb.TensorHeader | None = None
    parts: list[bytes] = []
    expect_index = 0
    offset = 0
    for frame in frames_in:
        assert frame.chunk_index == expect_index, (frame.chunk_index, expect_index)
        assert frame.offset_bytes == offset
        assert len(frame.data) <= CHUNK_BYTES, len(frame.data)
        if expect_index == 0:
            assert frame.HasField("header"), "frame 0 must carry the header"
            header = frame.header
        else:
            assert not frame.HasField("header"), "only frame 0 carries the header"
        parts.append(frame.data)
        offset += len(frame.data)
        expect_index += 1
        if frame.last:
            assert header is not None
            raw = b"".join(parts)
            assert len(raw) == header.size_bytes
            dt = DTYPES[header.dtype]
            out[header.key] = np.frombuffer(raw, dtype=dt).reshape(tuple(header.shape)).copy()
            header, parts, expect_index, offset = None, [], 0, 0
    assert header is None and not parts, "stream ended inside a tensor"
    return out


def trailer_class(err: grpc.aio.AioRpcError) -> str | None:
    """The ``paramserver-error-class`` trailer of a refused call."""
    for key, value in err.trailing_metadata() or ():
        if key == "paramserver-error-class":
            return str(value)
    return None


class ProtoWorker:
    """A worker that speaks only the protos (plain stubs over one channel)."""

    def __init__(self, channel: grpc.aio.Channel, name: str | None = None) -> None:
        self.stub = pb_grpc.ParameterServerStub(channel)
        self.name = name if name is not None else f"proto-{secrets.token_hex(4)}"
        self.worker_id = ""
        self.clock = 0
        self.request_id = 0

    async def register(self, **fields: Any) -> pb.RegisterResponse:
        resp = await self.stub.Register(
            pb.RegisterRequest(worker_name=self.name, **fields), timeout=10
        )
        self.worker_id, self.clock = resp.worker_id, resp.clock
        return resp

    async def init(
        self, tensors: dict[str, np.ndarray], rule: pb.UpdateRule | None = None
    ) -> pb.InitResponse:
        def stream() -> Iterator[pb.InitRequest]:
            header = pb.InitHeader(worker_id=self.worker_id)
            if rule is not None:
                header.rule.CopyFrom(rule)
            yield pb.InitRequest(header=header)
            for key, value in tensors.items():
                for f in frames(key, value):
                    yield pb.InitRequest(frame=f)

        return await self.stub.Init(stream(), timeout=10)

    async def push(
        self,
        grads: dict[str, np.ndarray],
        *,
        request_id: int | None = None,
        frames_by_key: dict[str, list[tpb.TensorFrame]] | None = None,
        **header_fields: Any,
    ) -> pb.PushResponse:
        if request_id is None:
            self.request_id += 1
            request_id = self.request_id
        fields = {"worker_id": self.worker_id, "clock": self.clock, **header_fields}

        def stream() -> Iterator[pb.PushRequest]:
            yield pb.PushRequest(header=pb.PushHeader(request_id=request_id, **fields))
            for key, value in grads.items():
                for f in (frames_by_key or {}).get(key) or frames(key, value):
                    yield pb.PushRequest(frame=f)

        return await self.stub.Push(stream(), timeout=10)

    async def pull(
        self, keys: list[str] | None = None, *, timeout_ms: int = 0, observer: bool = False
    ) -> tuple[pb.PullInfo, dict[str, np.ndarray]]:
        call = self.stub.Pull(
            pb.PullRequest(
                worker_id="" if observer else self.worker_id,
                keys=keys or [],
                timeout_ms=timeout_ms,
            ),
            timeout=30,
        )
        info: pb.PullInfo | None = None
        got: list[tpb.TensorFrame] = []
        async for msg in call:
            if msg.WhichOneof("body") == "info":
                assert info is None, "PullInfo must come first and once"
                info = msg.info
            else:
                assert info is not None, "PullInfo must come before the frames"
                got.append(msg.frame)
        assert info is not None
        return info, read_tensors(got)

    async def end_clock(self) -> pb.ClockResponse:
        resp = await self.stub.Clock(
            pb.ClockRequest(worker_id=self.worker_id, clock=self.clock), timeout=10
        )
        self.clock = resp.clock
        return resp


# ----------------------------------------------------------------------------- tables
#: Row storage dtypes of a table on the wire, and the unsigned type of their bit patterns.
ROW_BITS: dict[int, np.dtype[Any]] = {
    tpb.DTYPE_FLOAT32: np.dtype("<u4"),
    tpb.DTYPE_FLOAT16: np.dtype("<u2"),
    tpb.DTYPE_BFLOAT16: np.dtype("<u2"),
}


def row_chunks(
    ids: Iterable[int], rows: np.ndarray | None = None, *, per_chunk: int = 4096
) -> list[tbl.RowsChunk]:
    """``RowsChunk`` messages of ``per_chunk`` ids (little-endian int64 bytes) and, for a push,
    their rows (raw little-endian C-order bytes)."""
    ids_le = np.asarray(list(ids), dtype="<i8")
    out = []
    for start in range(0, ids_le.shape[0], per_chunk):
        chunk = tbl.RowsChunk(ids=ids_le[start : start + per_chunk].tobytes())
        if rows is not None:
            part = np.ascontiguousarray(rows[start : start + per_chunk])
            chunk.rows = part.astype(part.dtype.newbyteorder("<"), copy=False).tobytes()
        out.append(chunk)
    return out


class ProtoTables:
    """Table calls spoken from tables.proto alone (plain stubs over one channel)."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.stub = pb_grpc.ParameterServerStub(channel)

    async def init_table(self, spec: tbl.TableSpec) -> tbl.InitTableResponse:
        return await self.stub.InitTable(tbl.InitTableRequest(spec=spec), timeout=10)

    async def pull_rows(
        self, header: tbl.RowsHeader, chunks: list[tbl.RowsChunk]
    ) -> tuple[tbl.PullRowsInfo, np.ndarray]:
        """The reply's info and the rows' bit patterns (num_ids, dim) as unsigned integers,
        checking the reply's frame rules (AssertionError otherwise)."""

        def requests() -> Iterator[tbl.PullRowsRequest]:
            yield tbl.PullRowsRequest(header=header)
            for chunk in chunks:
                yield tbl.PullRowsRequest(chunk=chunk)

        info: tbl.PullRowsInfo | None = None
        data: list[bytes] = []
        async for msg in self.stub.PullRows(requests(), timeout=30):
            if msg.WhichOneof("body") == "info":
                assert info is None, "PullRowsInfo must come first and once"
                info = msg.info
            else:
                assert info is not None, "PullRowsInfo must come before the rows"
                assert not msg.chunk.ids, "reply chunks carry rows only"
                data.append(msg.chunk.rows)
        assert info is not None
        bits = np.frombuffer(b"".join(data), ROW_BITS[info.dtype])
        return info, bits.reshape(int(info.num_ids), int(info.dim))

    async def push_rows(
        self, header: tbl.RowsHeader, chunks: list[tbl.RowsChunk]
    ) -> tbl.PushRowsResponse:
        def requests() -> Iterator[tbl.PushRowsRequest]:
            yield tbl.PushRowsRequest(header=header)
            for chunk in chunks:
                yield tbl.PushRowsRequest(chunk=chunk)

        return await self.stub.PushRows(requests(), timeout=30)

    async def push_pull_rows(
        self,
        header: tbl.PushPullRowsHeader,
        push: list[tbl.RowsChunk],
        pull: list[tbl.RowsChunk],
    ) -> tuple[tbl.PushPullRowsInfo, np.ndarray]:
        """A PushPullRows call (the header, the push's chunks, then the pull's): the reply's
        info and the pulled rows' bit patterns (num_ids, dim), checking the reply's frame
        rules (AssertionError otherwise)."""

        def requests() -> Iterator[tbl.PushPullRowsRequest]:
            yield tbl.PushPullRowsRequest(header=header)
            for chunk in [*push, *pull]:
                yield tbl.PushPullRowsRequest(chunk=chunk)

        info: tbl.PushPullRowsInfo | None = None
        data: list[bytes] = []
        async for msg in self.stub.PushPullRows(requests(), timeout=30):
            if msg.WhichOneof("body") == "info":
                assert info is None, "PushPullRowsInfo must come first and once"
                info = msg.info
            else:
                assert info is not None, "PushPullRowsInfo must come before the rows"
                assert not msg.chunk.ids, "reply chunks carry rows only"
                data.append(msg.chunk.rows)
        assert info is not None
        pulled = info.pulled
        bits = np.frombuffer(b"".join(data), ROW_BITS[pulled.dtype])
        return info, bits.reshape(int(pulled.num_ids), int(pulled.dim))
