"""Raw-stub helpers for the case tests: hand-built frames, an independent decoder, Status.

The encoder and decoder here are written from the wire format in ``tensor.proto`` (raw
little-endian C-order bytes, header in frame 0 only), not with :mod:`paramserver.protocol.tensor`,
so a
test that uses them checks the product's codec against an independent one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import grpc
import ml_dtypes
import numpy as np

from paramserver.api.v1 import parameter_server_pb2 as pb
from paramserver.api.v1 import parameter_server_pb2_grpc as pb_grpc
from paramserver.api.v1 import tensor_pb2
from paramserver.core.optimizers import UpdateRule

WIRE_DTYPES: dict[int, np.dtype[Any]] = {
    tensor_pb2.DTYPE_FLOAT16: np.dtype("<f2"),
    tensor_pb2.DTYPE_BFLOAT16: np.dtype(ml_dtypes.bfloat16),
    tensor_pb2.DTYPE_FLOAT32: np.dtype("<f4"),
    tensor_pb2.DTYPE_FLOAT64: np.dtype("<f8"),
    tensor_pb2.DTYPE_INT32: np.dtype("<i4"),
    tensor_pb2.DTYPE_INT64: np.dtype("<i8"),
}
_TO_WIRE = {dt: wire for wire, dt in WIRE_DTYPES.items()}


def frames(key: str, array: np.ndarray, chunk_bytes: int = 1 << 16) -> list[tensor_pb2.TensorFrame]:
    """Well-formed frames of one tensor: header in frame 0, ``chunk_bytes`` of data per frame."""
    payload = np.ascontiguousarray(array).tobytes()
    header = tensor_pb2.TensorHeader(
        key=key,
        dtype=_TO_WIRE[array.dtype],
        shape=list(array.shape),
        size_bytes=len(payload),
    )
    starts = list(range(0, len(payload), chunk_bytes)) or [0]
    out = []
    for index, start in enumerate(starts):
        frame = tensor_pb2.TensorFrame(
            chunk_index=index,
            offset_bytes=start,
            data=payload[start : start + chunk_bytes],
            last=index == len(starts) - 1,
        )
        if index == 0:
            frame.header.CopyFrom(header)
        out.append(frame)
    return out


def random_values(
    rng: np.random.Generator, dtype: np.dtype[Any], shape: tuple[int, ...]
) -> np.ndarray:
    """Random values of ``dtype`` and ``shape``: integers in [-1000, 1000) for an integer dtype,
    else standard normals rounded once from float32 into ``dtype``."""
    if dtype.kind == "i":
        return rng.integers(-1000, 1000, size=shape).astype(dtype)
    return rng.standard_normal(size=shape).astype(np.float32).astype(dtype)


def slot_batch(
    entries: Iterable[tuple[str, np.dtype[Any], tuple[int, ...], int]], data: bytes | None = None
) -> pb.SlotBatch:
    """A Session ``SlotBatch`` written field by field: one ``(key, dtype, shape, offset_bytes)``
    per slot; with ``data`` (even empty) the inline carrier, without it slots in shared memory."""
    batch = pb.SlotBatch() if data is None else pb.SlotBatch(data=data)
    for key, dtype, shape, offset in entries:
        batch.keys.append(key)
        batch.dtypes.append(_TO_WIRE[np.dtype(dtype)])
        batch.ndims.append(len(shape))
        batch.dims.extend(shape)
        batch.offsets.append(offset)
    return batch


def push_messages(
    worker_id: str,
    request_id: int,
    tensor_frames: Iterable[tensor_pb2.TensorFrame],
    *,
    clock: int = 0,
) -> list[pb.PushRequest]:
    """A Push stream: the header, then the given frames as they are (possibly malformed)."""
    header = pb.PushHeader(worker_id=worker_id, request_id=request_id, clock=clock)
    return [pb.PushRequest(header=header)] + [pb.PushRequest(frame=f) for f in tensor_frames]


def push_arrays(
    worker_id: str, request_id: int, arrays: dict[str, np.ndarray], *, clock: int = 0
) -> list[pb.PushRequest]:
    """A well-formed Push stream of several tensors."""
    all_frames = [f for key, a in arrays.items() for f in frames(key, a)]
    return push_messages(worker_id, request_id, all_frames, clock=clock)


async def register(stub: pb_grpc.ParameterServerStub, name: str) -> str:
    """Register ``name``; returns its worker id."""
    resp = await stub.Register(pb.RegisterRequest(worker_name=name), timeout=10)
    return str(resp.worker_id)


async def init(
    stub: pb_grpc.ParameterServerStub, arrays: dict[str, np.ndarray], rule: UpdateRule
) -> pb.InitResponse:
    msgs = [pb.InitRequest(header=pb.InitHeader(rule=rule.to_proto()))]
    msgs += [pb.InitRequest(frame=f) for key, a in arrays.items() for f in frames(key, a)]
    return await stub.Init(iter(msgs), timeout=30)


def decode(frame_list: Sequence[tensor_pb2.TensorFrame]) -> dict[str, np.ndarray]:
    """Independent decoder of well-formed frames (``numpy.frombuffer`` on the joined bytes)."""
    out: dict[str, np.ndarray] = {}
    current: tensor_pb2.TensorHeader | None = None
    parts: list[bytes] = []
    for frame in frame_list:
        if frame.HasField("header"):
            current, parts = frame.header, []
        assert current is not None
        parts.append(frame.data)
        if frame.last:
            dtype = WIRE_DTYPES[current.dtype]
            data = b"".join(parts)
            assert len(data) == current.size_bytes
            out[current.key] = np.frombuffer(data, dtype=dtype).reshape(tuple(current.shape))
            current = None
    return out


async def pull(
    stub: pb_grpc.ParameterServerStub, keys: Sequence[str] = (), worker_id: str = ""
) -> dict[str, np.ndarray]:
    """Pull (observer read when ``worker_id`` is empty), decoded independently."""
    call = stub.Pull(pb.PullRequest(worker_id=worker_id, keys=list(keys)), timeout=60)
    got = [resp.frame async for resp in call if resp.WhichOneof("body") == "frame"]
    return decode(got)


async def status(stub: pb_grpc.ParameterServerStub) -> pb.StatusResponse:
    return await stub.Status(pb.StatusRequest(), timeout=10)


def channel(address: str) -> grpc.aio.Channel:
    """A plain channel with default options (no message-size overrides)."""
    return grpc.aio.insecure_channel(address)
