"""Tensor frames on the Push and Pull streams, and row chunks on the row streams, without
protobuf copies of their payload.

A frame message (``PushRequest`` / ``PullResponse`` whose ``body`` is a ``TensorFrame``) is
almost all payload: up to ~1 MiB of tensor bytes behind a few bytes of fields. Through the
generated protobuf classes that payload is copied four times per hop: into a ``bytes`` for the
field, into the message, out by ``SerializeToString``; and on the far side into the parsed
message, out again by the ``data`` getter, then into the tensor. Here the sender writes the wire
bytes itself (one copy of the payload, joined behind the encoded fields) and the receiver reads
the fields in place and hands the payload on as a ``memoryview`` of the received message (one
copy, into the tensor). The encoding is protobuf's own (field numbers, varints,
length-delimited fields of ``tensor.proto``), so either end may still use the generated classes:
a message this module does not recognise as a plain frame is parsed by protobuf.

Used as the gRPC (de)serializers of ``ParameterServer.Push`` (requests) and
``ParameterServer.Pull`` (responses), on both ends. The row streams (``PullRows``,
``PushRows``, ``PushPullRows``, ``PullRowsMany``, ``PushRowsMany``, requests and responses)
carry their ids and rows the same way: each of their messages is a header or info (field 1,
protobuf's business) or a ``RowsChunk`` (field 2: ids, rows, versions), which
:func:`row_chunk_message` writes and :func:`rows_deserializer` reads in place.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NoReturn, TypeVar

from google.protobuf.message import DecodeError, Message

from paramserver.api.v1 import tensor_pb2
from paramserver.errors import MalformedStream

__all__ = [
    "RawFrame",
    "RawFrameMessage",
    "RawRowsChunk",
    "RawRowsMessage",
    "Undecodable",
    "deserializer",
    "frame_messages",
    "row_chunk_message",
    "rows_deserializer",
    "serialize",
    "tolerant",
]

_M = TypeVar("_M", bound=Message)
_T = TypeVar("_T")

# Wire types and tags (field_number << 3 | wire_type) of the fields used here.
_VARINT, _LEN = 0, 2
_BODY_FRAME_TAG = (2 << 3) | _LEN  # PushRequest.frame = 2, PullResponse.frame = 2
_HEADER_TAG = (1 << 3) | _LEN
_CHUNK_INDEX_TAG = (2 << 3) | _VARINT
_OFFSET_TAG = (3 << 3) | _VARINT
_DATA_TAG = (4 << 3) | _LEN
_LAST_TAG = (5 << 3) | _VARINT
# RowsChunk: ids = 1, rows = 2, versions = 3 (the body's chunk is field 2, as a frame's is).
_ROWS_CHUNK_TAGS = ((1 << 3) | _LEN, (2 << 3) | _LEN, (3 << 3) | _LEN)


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _read_varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise DecodeError("truncated or overlong varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


class RawFrame:
    """A ``TensorFrame`` read in place: what :class:`paramserver.protocol.tensor.TensorAssembler`
    reads.

    ``data`` is a read-only ``memoryview`` of the received message (bytes, at most ~1 MiB).
    """

    __slots__ = ("chunk_index", "data", "header", "last", "offset_bytes")

    def __init__(self) -> None:
        self.header: tensor_pb2.TensorHeader | None = None
        self.chunk_index = 0
        self.offset_bytes = 0
        self.data: memoryview | bytes = b""
        self.last = False

    def HasField(self, name: str) -> bool:
        if name != "header":
            raise ValueError(f"RawFrame has no optional field {name!r}")
        return self.header is not None


class RawFrameMessage:
    """A Push request or Pull response whose ``body`` is a frame (``WhichOneof`` answers
    ``"frame"``, ``.frame`` is the :class:`RawFrame`)."""

    __slots__ = ("frame", "nbytes")

    def __init__(self, frame: RawFrame, nbytes: int) -> None:
        self.frame = frame
        self.nbytes = nbytes

    def WhichOneof(self, name: str) -> str:
        if name != "body":
            raise ValueError(f"no oneof {name!r}")
        return "frame"

    def HasField(self, name: str) -> bool:
        return name == "frame"


def _parse_frame(view: memoryview, pos: int, end: int) -> RawFrame | None:
    """The frame fields in ``view[pos:end]``; None when something other than the known fields
    is there (the caller lets protobuf parse the whole message)."""
    frame = RawFrame()
    while pos < end:
        tag, pos = _read_varint(view, pos, end)
        if tag == _DATA_TAG or tag == _HEADER_TAG:
            n, pos = _read_varint(view, pos, end)
            if pos + n > end:
                raise DecodeError("truncated length-delimited field")
            if tag == _DATA_TAG:
                frame.data = view[pos : pos + n]
            elif frame.header is not None:
                return None  # a repeated header merges in protobuf: its business
            else:
                # upb parses any buffer; types-protobuf names only bytes.
                frame.header = tensor_pb2.TensorHeader.FromString(view[pos : pos + n])  # type: ignore[arg-type]
            pos += n
        elif tag == _CHUNK_INDEX_TAG:
            value, pos = _read_varint(view, pos, end)
            frame.chunk_index = value & 0xFFFFFFFF
        elif tag == _OFFSET_TAG:
            value, pos = _read_varint(view, pos, end)
            frame.offset_bytes = value & 0xFFFFFFFFFFFFFFFF  # uint64, as protobuf reads it
        elif tag == _LAST_TAG:
            value, pos = _read_varint(view, pos, end)
            frame.last = value != 0
        else:
            return None
    return frame


def deserializer(message_type: type[_M]) -> Callable[[bytes], Any]:
    """The request/response deserializer of a stream of ``message_type`` (``PushRequest`` or
    ``PullResponse``): plain frame messages come back as :class:`RawFrameMessage`, anything
    else as ``message_type`` parsed by protobuf.

    Raises (in the returned function):
        google.protobuf.message.DecodeError: bytes that are not a valid message.
    """

    def read(view: memoryview, pos: int, end: int) -> RawFrameMessage | None:
        frame = _parse_frame(view, pos, end)
        return None if frame is None else RawFrameMessage(frame, end)

    return _read_in_place(message_type, read)


def _read_in_place(
    message_type: type[_M], read: Callable[[memoryview, int, int], object | None]
) -> Callable[[bytes], Any]:
    """A deserializer of ``message_type`` whose messages made of its field 2 alone (a frame,
    a chunk) are read in place by ``read(view, start, end)`` of that field's bytes; anything
    else, or what ``read`` declines (None), is parsed by protobuf."""
    parse = message_type.FromString

    def deserialize(data: bytes) -> Any:  # _M, or what ``read`` stands in for one
        if not data or data[0] != _BODY_FRAME_TAG:
            return parse(data)
        view = memoryview(data)
        end = len(data)
        n, pos = _read_varint(view, 1, end)
        if pos + n != end:  # more than one field, or repeated: protobuf's business
            return parse(data)
        message = read(view, pos, end)
        return parse(data) if message is None else message

    return deserialize


class Undecodable:
    """Stands in for a request message whose bytes did not decode.

    gRPC answers a request its deserializer cannot decode with INTERNAL, which a client cannot
    tell from a server bug; :func:`tolerant` hands the handler this object instead, and any
    use of it (a field, ``WhichOneof``) raises :class:`~paramserver.errors.MalformedStream`,
    which the handler's error mapping answers with INVALID_ARGUMENT.
    """

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __getattr__(self, name: str) -> NoReturn:
        if name.startswith("__"):  # protocol probes (hasattr(x, "__aiter__")) stay probes
            raise AttributeError(name)
        raise MalformedStream(f"request message does not decode: {self.reason}")


def tolerant(
    deserialize: Callable[[bytes], _T] | None,
) -> Callable[[bytes], _T | Undecodable] | None:
    """``deserialize`` returning :class:`Undecodable` instead of raising ``DecodeError``."""
    if deserialize is None:
        return None
    inner = deserialize

    def decode(data: bytes) -> _T | Undecodable:
        try:
            return inner(data)
        except DecodeError as exc:
            return Undecodable(str(exc))

    return decode


def serialize(message: Message | bytes) -> bytes:
    """The serializer of a stream that carries both generated messages and wire bytes from
    :func:`frame_messages`."""
    if isinstance(message, bytes):
        return message
    return message.SerializeToString()


def frame_messages(
    header: tensor_pb2.TensorHeader, payload: memoryview, chunk_bytes: int, n_chunks: int
) -> Iterator[bytes]:
    """The wire bytes of a tensor's frame messages (``body`` field 2 = ``TensorFrame``), as
    protobuf would encode ``PushRequest(frame=...)`` / ``PullResponse(frame=...)``; the
    header goes on frame 0, ``last`` on the final one. ``payload`` is the tensor's bytes."""
    size_bytes = len(payload)
    header_field = b""
    if n_chunks:
        raw_header = header.SerializeToString()
        header_field = bytes((_HEADER_TAG,)) + _varint(len(raw_header)) + raw_header
    for index in range(n_chunks):
        start = index * chunk_bytes
        end = min(start + chunk_bytes, size_bytes)
        n = end - start
        fields = bytearray(header_field if index == 0 else b"")
        if index:
            fields.append(_CHUNK_INDEX_TAG)
            fields += _varint(index)
        if start:
            fields.append(_OFFSET_TAG)
            fields += _varint(start)
        if n:
            fields.append(_DATA_TAG)
            fields += _varint(n)
        tail = b"\x28\x01" if index == n_chunks - 1 else b""
        body_len = len(fields) + n + len(tail)
        prefix = bytes((_BODY_FRAME_TAG,)) + _varint(body_len) + fields
        yield b"".join((prefix, payload[start:end], tail))


class RawRowsChunk:
    """A ``RowsChunk`` read in place: ``ids``, ``rows`` and ``versions`` are read-only
    ``memoryview`` s of the received message (``b""`` where the field is absent), what
    :class:`paramserver.protocol.rows_wire.RowsReceiver` reads."""

    __slots__ = ("ids", "rows", "versions")

    def __init__(self) -> None:
        self.ids: memoryview | bytes = b""
        self.rows: memoryview | bytes = b""
        self.versions: memoryview | bytes = b""


class RawRowsMessage:
    """A row stream message whose ``body`` is a chunk (``WhichOneof`` answers ``"chunk"``,
    ``.chunk`` is the :class:`RawRowsChunk`)."""

    __slots__ = ("chunk", "nbytes")

    def __init__(self, chunk: RawRowsChunk, nbytes: int) -> None:
        self.chunk = chunk
        self.nbytes = nbytes

    def WhichOneof(self, name: str) -> str:
        if name != "body":
            raise ValueError(f"no oneof {name!r}")
        return "chunk"

    def HasField(self, name: str) -> bool:
        return name == "chunk"


def _parse_rows_chunk(view: memoryview, pos: int, end: int) -> RawRowsChunk | None:
    """The ``RowsChunk`` fields in ``view[pos:end]``; None when a field repeats or another
    field is there (the caller lets protobuf parse the whole message)."""
    chunk = RawRowsChunk()
    seen = 0
    ids_tag, rows_tag, _ = _ROWS_CHUNK_TAGS
    while pos < end:
        tag, pos = _read_varint(view, pos, end)
        if tag not in _ROWS_CHUNK_TAGS:
            return None
        bit = 1 << (tag >> 3)
        if seen & bit:
            return None  # protobuf keeps the last of a repeated scalar field: its business
        seen |= bit
        n, pos = _read_varint(view, pos, end)
        if pos + n > end:
            raise DecodeError("truncated length-delimited field")
        value = view[pos : pos + n]
        if tag == ids_tag:
            chunk.ids = value
        elif tag == rows_tag:
            chunk.rows = value
        else:
            chunk.versions = value
        pos += n
    return chunk


def rows_deserializer(message_type: type[_M]) -> Callable[[bytes], Any]:
    """The request/response deserializer of a row stream of ``message_type`` (e.g.
    ``PushRowsRequest``, ``PullRowsResponse``): chunk messages come back as
    :class:`RawRowsMessage` (their ids and rows views of the received bytes), anything else
    (headers, infos) as ``message_type`` parsed by protobuf.

    Raises (in the returned function):
        google.protobuf.message.DecodeError: bytes that are not a valid message.
    """

    def read(view: memoryview, pos: int, end: int) -> RawRowsMessage | None:
        chunk = _parse_rows_chunk(view, pos, end)
        return None if chunk is None else RawRowsMessage(chunk, end)

    return _read_in_place(message_type, read)


def row_chunk_message(
    ids: memoryview | None, rows: memoryview | None, versions: memoryview | None
) -> bytes:
    """The wire bytes of a row stream message whose body is ``RowsChunk(ids, rows,
    versions)`` (byte views; None or empty: the field is absent, as protobuf omits an empty
    bytes field), exactly as protobuf encodes it; the payloads are copied once."""
    parts: list[bytes | memoryview] = [b""]
    size = 0
    for tag, value in zip(_ROWS_CHUNK_TAGS, (ids, rows, versions), strict=True):
        if value is None or not value.nbytes:
            continue
        head = bytes((tag,)) + _varint(value.nbytes)
        parts += (head, value)
        size += len(head) + value.nbytes
    parts[0] = bytes((_BODY_FRAME_TAG,)) + _varint(size)
    return b"".join(parts)
