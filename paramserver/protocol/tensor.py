"""Tensor codec: numpy arrays to and from streams of ``TensorFrame`` messages (docs/semantics.md).

Wire format (``protos/paramserver/api/v1/tensor.proto``), after hivemind's
``utils/streaming.py``: metadata travels in the first frame only, the payload is split into
chunks of at most :data:`DEFAULT_CHUNK_BYTES` so no message approaches gRPC's size limits.

::

    frame      header                                 chunk_index  offset_bytes  data
    0          {key, dtype, shape, size_bytes}        0            0             bytes [0, c)
    1          (unset)                                1            c             bytes [c, 2c)
    ...
    n-1        (unset)                                n-1          (n-1)*c       rest; last=true

(``c`` = ``chunk_bytes``, the chunk size in bytes.)

- ``data`` holds raw little-endian, C-order element bytes; never ``repeated float``.
- ``size_bytes == prod(shape) * itemsize``; shape ``()`` is a scalar (one element).
- A zero-size tensor (e.g. shape ``(0,)`` or ``(3, 0, 5)``) is exactly one frame: header,
  empty ``data``, ``last=true``.
- ``offset_bytes`` is a uint64, so tensors over 2 GiB (or 4 GiB) stream like any other.
- One stream may carry several tensors back to back; each starts again at ``chunk_index`` 0
  with a header.

Encoding slices a ``memoryview`` of the array's bytes and the receiver copies each chunk into a
buffer preallocated from the header, so neither side does per-element Python work. Round trips
are bit-exact for every supported dtype (NaN payloads, -0.0 and subnormals included): bytes are
only ever copied or byte-swapped, never converted through floating point.

Every violation of the format raises :class:`paramserver.errors.MalformedStream`
(INVALID_ARGUMENT) naming the tensor's key and what is wrong.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TypeAlias, TypeVar

import ml_dtypes
import numpy as np
import numpy.typing as npt

from paramserver.api.v1 import tensor_pb2
from paramserver.errors import InvalidArgument, MalformedStream, ResourceExhausted
from paramserver.protocol import wire
from paramserver.protocol.limits import MAX_KEY_BYTES, check_key, shown

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "MAX_NDIM",
    "SUPPORTED_DTYPES",
    "TensorAssembler",
    "array_limit_problem",
    "checked_nbytes",
    "decode_frames",
    "dtype_from_wire",
    "dtype_to_wire",
    "encode_frame_bytes",
    "encode_frames",
    "encode_messages",
    "normalize",
    "tensor_nbytes",
]

DEFAULT_CHUNK_BYTES: int = 1 << 20
"""Maximum payload bytes per frame (1 MiB)."""

_MAX_CHUNKS = 1 << 32  # chunk_index is a uint32

#: A ``tensor_pb2.DType`` wire value.
WireDType: TypeAlias = tensor_pb2.DType.ValueType
#: A ``tensor_pb2.TensorRole`` wire value.
TensorRole: TypeAlias = tensor_pb2.TensorRole.ValueType

_BFLOAT16: np.dtype[np.generic] = np.dtype(ml_dtypes.bfloat16)

# Wire value -> little-endian numpy dtype. bfloat16 (an ml_dtypes extension type) has no
# explicit byte order; it is native, which is little-endian on every supported host.
_WIRE_TABLE: tuple[tuple[WireDType, np.dtype[np.generic]], ...] = (
    (tensor_pb2.DTYPE_FLOAT16, np.dtype("<f2")),
    (tensor_pb2.DTYPE_BFLOAT16, _BFLOAT16),
    (tensor_pb2.DTYPE_FLOAT32, np.dtype("<f4")),
    (tensor_pb2.DTYPE_FLOAT64, np.dtype("<f8")),
    (tensor_pb2.DTYPE_INT32, np.dtype("<i4")),
    (tensor_pb2.DTYPE_INT64, np.dtype("<i8")),
)
_FROM_WIRE: dict[int, np.dtype[np.generic]] = {int(wire): dt for wire, dt in _WIRE_TABLE}
_TO_WIRE: dict[np.dtype[np.generic], WireDType] = {dt: wire for wire, dt in _WIRE_TABLE}

SUPPORTED_DTYPES: tuple[np.dtype[np.generic], ...] = tuple(_FROM_WIRE.values())
"""float16, bfloat16 (``ml_dtypes``), float32, float64, int32, int64, in wire-enum order."""


#: Most dimensions a numpy array may have (``numpy.core.multiarray.MAXDIMS``).
MAX_NDIM = 64
_MAX_ARRAY_BYTES = int(np.iinfo(np.intp).max)


def _key_label(key: str) -> str:
    return f"tensor {shown(key)!r}" if key else "tensor"


def _is_big_endian(dtype: np.dtype[np.generic]) -> bool:
    if dtype.byteorder == ">":
        return True
    return dtype.byteorder == "=" and sys.byteorder == "big" and dtype.kind in "fiu"


def _little_endian(dtype: np.dtype[np.generic]) -> np.dtype[np.generic]:
    """The little-endian twin of ``dtype`` (itself when already little-endian or byte-less)."""
    return dtype.newbyteorder("<") if _is_big_endian(dtype) else dtype


def _lookup_wire(dtype: np.dtype[np.generic]) -> WireDType | None:
    try:
        return _TO_WIRE.get(_little_endian(dtype))
    except TypeError:  # unhashable oddities
        return None


#: Supported dtypes :func:`normalize` returns a C-contiguous array of as is (little-endian or
#: byte-less): a caller may skip normalising such an array.
WIRE_READY_DTYPES: frozenset[np.dtype[np.generic]] = frozenset(
    dt for dt in _TO_WIRE if not _is_big_endian(dt)
)


def dtype_to_wire(dtype: npt.DTypeLike) -> WireDType:
    """Map a numpy dtype to its ``tensor_pb2.DType`` wire value.

    Args:
        dtype: A supported dtype (see :data:`SUPPORTED_DTYPES`), in either byte order.

    Returns:
        The ``tensor_pb2.DType`` enum value (never ``DTYPE_UNSPECIFIED``).

    Raises:
        InvalidArgument: (INVALID_ARGUMENT) the dtype is not supported.
    """
    if isinstance(dtype, np.dtype):  # fast path: a supported little-endian (or native) dtype
        known = _TO_WIRE.get(dtype)
        if known is not None:
            return known
    if dtype is None:
        raise InvalidArgument("dtype is None; expected one of: " + _supported_names())
    try:
        dt = np.dtype(dtype)
    except TypeError as err:
        raise InvalidArgument(f"not a dtype: {dtype!r} ({err})") from None
    wire = _lookup_wire(dt)
    if wire is None:
        raise InvalidArgument(f"unsupported dtype {dt}; supported: {_supported_names()}")
    return wire


def dtype_from_wire(value: int, key: str) -> np.dtype[np.generic]:
    """Map a ``tensor_pb2.DType`` wire value to its little-endian numpy dtype.

    Args:
        value: The wire enum value.
        key: Key of the tensor it describes, named in the error.

    Returns:
        The numpy dtype.

    Raises:
        InvalidArgument: (INVALID_ARGUMENT) ``value`` is ``DTYPE_UNSPECIFIED`` or unknown.
    """
    dt = _FROM_WIRE.get(value)
    if dt is None:
        if value == tensor_pb2.DTYPE_UNSPECIFIED:
            raise InvalidArgument(f"{_key_label(key)}: dtype is DTYPE_UNSPECIFIED")
        raise InvalidArgument(f"{_key_label(key)}: unknown wire dtype {value}")
    return dt


def _supported_names() -> str:
    return ", ".join(str(dt) for dt in SUPPORTED_DTYPES)


def array_limit_problem(shape: Sequence[int], itemsize: int) -> str | None:
    """Why numpy cannot hold an array of ``shape`` (non-negative dimensions) with items of
    ``itemsize`` bytes, or None when it can: numpy allows at most 64 dimensions, and the
    product of the non-zero ones (zero-size arrays too) times the itemsize must fit in a signed
    64-bit size. Checked before any ``reshape`` so a hostile header is refused by name
    (INVALID_ARGUMENT), not by numpy's ``ValueError``."""
    if len(shape) > MAX_NDIM:
        return f"shape has {len(shape)} dimensions (numpy allows {MAX_NDIM})"
    if math.prod(d for d in shape if d) * itemsize > _MAX_ARRAY_BYTES:
        return f"shape {tuple(shape)} is larger than any array can be"
    return None


def checked_nbytes(key: str, shape: tuple[int, ...], dtype: np.dtype[np.generic]) -> int:
    """:func:`tensor_nbytes` of a received tensor, refusing (INVALID_ARGUMENT, naming ``key``)
    a negative dimension or a shape no array can have (:func:`array_limit_problem`)."""
    if shape and min(shape) < 0:
        raise InvalidArgument(f"{_key_label(key)}: negative dimension in shape {shape}")
    problem = array_limit_problem(shape, dtype.itemsize)
    if problem is not None:
        raise InvalidArgument(f"{_key_label(key)}: {problem}")
    return math.prod(shape) * dtype.itemsize


def tensor_nbytes(shape: Sequence[int], dtype: npt.DTypeLike) -> int:
    """Payload size of a tensor, computed with Python integers (no overflow).

    Args:
        shape: Dimensions; ``()`` for a scalar.
        dtype: Element type.

    Returns:
        ``prod(shape) * itemsize`` in bytes.

    Raises:
        InvalidArgument: (INVALID_ARGUMENT) a dimension is negative.
    """
    dims = [int(d) for d in shape]
    if any(d < 0 for d in dims):
        raise InvalidArgument(f"negative dimension in shape {tuple(dims)}")
    return math.prod(dims) * np.dtype(dtype).itemsize


def normalize(array: np.ndarray | np.generic | float | int, key: str = "") -> np.ndarray:
    """Return ``array`` as a little-endian, C-contiguous ndarray of a supported dtype.

    Values, dtype (up to byte order) and shape are preserved bit for bit. The caller's array is
    never modified. It is returned as is when already little-endian and C-contiguous, so treat
    the result as read-only; otherwise the result is a fresh copy (a byte-swapped one for
    big-endian input).

    Args:
        array: An ndarray or numpy scalar of a supported dtype, or a Python ``float``
            (becomes float64, shape ``()``) or ``int`` (becomes int64, shape ``()``).
        key: Parameter key, named in errors.

    Returns:
        ndarray of a dtype in :data:`SUPPORTED_DTYPES`, same shape as ``array``.

    Raises:
        InvalidArgument: (INVALID_ARGUMENT) the dtype is unsupported (e.g. complex, bool,
            uint8, object), or a Python ``int`` does not fit in int64.
    """
    label = _key_label(key)
    if isinstance(array, np.ndarray):
        arr: np.ndarray = array.view(np.ndarray) if type(array) is not np.ndarray else array
    elif isinstance(array, bool):
        raise InvalidArgument(f"{label}: unsupported dtype bool; supported: {_supported_names()}")
    elif isinstance(array, int):
        try:
            arr = np.asarray(array, dtype=np.int64)
        except OverflowError:
            raise InvalidArgument(f"{label}: integer {array} does not fit in int64") from None
    elif isinstance(array, float):
        arr = np.asarray(array, dtype=np.float64)
    else:
        arr = np.asarray(array)
    dt = arr.dtype
    if _lookup_wire(dt) is None:
        raise InvalidArgument(f"{label}: unsupported dtype {dt}; supported: {_supported_names()}")
    if _is_big_endian(dt):
        # Swap through unsigned integers of the same width so no float conversion can touch
        # NaN payloads; astype(order="C") also makes the result contiguous.
        uint_be = np.dtype(f">u{dt.itemsize}")
        swapped = arr.view(uint_be).astype(np.dtype(f"<u{dt.itemsize}"), order="C")
        return swapped.view(_little_endian(dt))
    if not arr.flags.c_contiguous:
        return arr.copy(order="C")
    return arr


def _payload_view(array: np.ndarray) -> memoryview:
    """Flat byte view of a C-contiguous array (works for ml_dtypes types too)."""
    return array.reshape(-1).view(np.uint8).data


_M = TypeVar("_M")


def encode_frames(
    key: str,
    array: np.ndarray | np.generic | float | int,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    *,
    role: TensorRole = tensor_pb2.TENSOR_ROLE_UNSPECIFIED,
    dense_shape: tuple[int, ...] = (),
) -> Iterator[tensor_pb2.TensorFrame]:
    """Split one tensor into frames: header in frame 0, then chunks of raw bytes.

    Arguments are validated and the array normalized (see :func:`normalize`) when this is
    called; frames are then produced lazily, one ``bytes`` copy of at most ``chunk_bytes`` per
    frame. The array must not be modified until the iterator is exhausted.

    Args:
        key: Parameter key, non-empty.
        array: Tensor of any shape (including ``()`` and zero-size) and a supported dtype, or
            anything else :func:`normalize` accepts (numpy or Python scalars).
        chunk_bytes: Maximum payload bytes per frame, > 0. Default 1 MiB.
        role: ``TensorRole`` of a compressed gradient (default dense); see tensor.proto.
        dense_shape: With ``TENSOR_ROLE_SPARSE_INDICES``: the dense gradient's shape.

    Returns:
        Iterator of ``TensorFrame``: ``chunk_index`` 0..n-1, ``offset_bytes`` increasing by the
        chunk sizes, ``last`` on frame n-1. A zero-size tensor is exactly one frame.

    Raises:
        InvalidArgument: (INVALID_ARGUMENT) empty key, unsupported dtype, ``chunk_bytes <= 0``,
            or more than 2**32 chunks.
    """
    header, payload, n_chunks = _prepare(key, array, chunk_bytes, role, dense_shape)
    return _frames(header, payload, chunk_bytes, n_chunks)


def encode_frame_bytes(
    key: str,
    array: np.ndarray | np.generic | float | int,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    *,
    role: TensorRole = tensor_pb2.TENSOR_ROLE_UNSPECIFIED,
    dense_shape: tuple[int, ...] = (),
) -> Iterator[bytes]:
    """:func:`encode_frames` as the wire bytes of ``PushRequest(frame=...)`` /
    ``PullResponse(frame=...)`` messages (:func:`paramserver.protocol.wire.frame_messages`): the
    payload copied once, straight out of the array. Send them on a stream whose serializer is
    :func:`paramserver.protocol.wire.serialize`. Same arguments and validation as
    :func:`encode_frames`.

    Raises:
        InvalidArgument: (INVALID_ARGUMENT) as :func:`encode_frames`.
    """
    header, payload, n_chunks = _prepare(key, array, chunk_bytes, role, dense_shape)
    return wire.frame_messages(header, payload, chunk_bytes, n_chunks)


def encode_messages(
    message_type: Callable[[], _M],
    key: str,
    array: np.ndarray | np.generic | float | int,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    *,
    field: str = "frame",
    role: TensorRole = tensor_pb2.TENSOR_ROLE_UNSPECIFIED,
    dense_shape: tuple[int, ...] = (),
) -> Iterator[_M]:
    """:func:`encode_frames`, each frame built in place inside a container message.

    ``PullResponse(frame=frame)`` copies a finished frame into the container (a protobuf merge
    of the whole payload); this fills ``message_type().frame`` directly, so each chunk's bytes
    are copied once out of the array and once into the message. Same arguments, validation and
    frames as :func:`encode_frames`.

    Args:
        message_type: The container message class, e.g. ``PullResponse``.
        field: The container's ``TensorFrame`` field.

    Returns:
        Iterator of ``message_type`` instances, one per frame.

    Raises:
        InvalidArgument: (INVALID_ARGUMENT) as :func:`encode_frames`.
    """
    header, payload, n_chunks = _prepare(key, array, chunk_bytes, role, dense_shape)
    return _messages(message_type, field, header, payload, chunk_bytes, n_chunks)


def _prepare(
    key: str,
    array: np.ndarray | np.generic | float | int,
    chunk_bytes: int,
    role: TensorRole,
    dense_shape: tuple[int, ...],
) -> tuple[tensor_pb2.TensorHeader, memoryview, int]:
    if not isinstance(key, str) or not key:
        raise InvalidArgument(f"tensor key must be a non-empty string, got {key!r}")
    if chunk_bytes <= 0:
        raise InvalidArgument(f"{_key_label(key)}: chunk_bytes must be > 0, got {chunk_bytes}")
    arr = normalize(array, key)
    size_bytes = arr.nbytes
    n_chunks = max(1, -(-size_bytes // chunk_bytes))
    if n_chunks > _MAX_CHUNKS:
        raise InvalidArgument(
            f"{_key_label(key)}: {size_bytes} bytes in {chunk_bytes}-byte chunks needs "
            f"{n_chunks} frames, more than chunk_index (uint32) allows"
        )
    header = tensor_pb2.TensorHeader(
        key=key,
        dtype=_TO_WIRE[_little_endian(arr.dtype)],
        shape=[int(d) for d in arr.shape],
        size_bytes=size_bytes,
        role=role,
        dense_shape=[int(d) for d in dense_shape],
    )
    return header, _payload_view(arr), n_chunks


def _frames(
    header: tensor_pb2.TensorHeader, payload: memoryview, chunk_bytes: int, n_chunks: int
) -> Iterator[tensor_pb2.TensorFrame]:
    size_bytes = len(payload)
    for index in range(n_chunks):
        start = index * chunk_bytes
        end = min(start + chunk_bytes, size_bytes)
        frame = tensor_pb2.TensorFrame(
            chunk_index=index,
            offset_bytes=start,
            data=bytes(payload[start:end]),
            last=index == n_chunks - 1,
        )
        if index == 0:
            frame.header.CopyFrom(header)
        yield frame


def _messages(
    message_type: Callable[[], _M],
    field: str,
    header: tensor_pb2.TensorHeader,
    payload: memoryview,
    chunk_bytes: int,
    n_chunks: int,
) -> Iterator[_M]:
    size_bytes = len(payload)
    for index in range(n_chunks):
        start = index * chunk_bytes
        end = min(start + chunk_bytes, size_bytes)
        msg = message_type()
        frame = getattr(msg, field)
        if index == 0:
            frame.header.CopyFrom(header)
        frame.chunk_index = index
        frame.offset_bytes = start
        frame.data = bytes(payload[start:end])  # upb takes bytes only
        frame.last = index == n_chunks - 1
        yield msg


class _Pending:
    """The tensor currently being assembled."""

    __slots__ = ("buffer", "header", "key", "next_index", "received_bytes", "result")

    def __init__(
        self,
        key: str,
        result: np.ndarray,
        header: tensor_pb2.TensorHeader | None = None,
    ) -> None:
        self.key = key
        self.header = header
        self.result = result  # the array returned, of the header's dtype and shape
        self.buffer = result.reshape(-1).view(np.uint8)  # its bytes, (size_bytes,)
        self.next_index = 0
        self.received_bytes = 0


class TensorAssembler:
    """Incremental receiver for a stream that carries several tensors one after another.

    Feed frames in arrival order; each completed tensor is returned by :meth:`feed`. Call
    :meth:`finish` when the stream ends. After an error the in-progress tensor is dropped and
    the assembler should be discarded along with its stream.

    Args:
        max_tensor_bytes: Largest ``size_bytes`` accepted for one tensor, or ``None`` for no
            limit. Checked at the header, before anything is allocated.
        allocate: ``(key, dtype, shape) -> array`` giving the uninitialised C-contiguous array
            a tensor is received into (e.g. :meth:`PullBuffers.empty
            <paramserver.worker_client.pull_buffers.PullBuffers.empty>`); default
            ``numpy.empty``.

    Raises:
        InvalidArgument: (INVALID_ARGUMENT) ``max_tensor_bytes`` is negative.
    """

    def __init__(
        self,
        *,
        max_tensor_bytes: int | None = None,
        allocate: Callable[[str, np.dtype[np.generic], tuple[int, ...]], np.ndarray] | None = None,
    ) -> None:
        if max_tensor_bytes is not None and max_tensor_bytes < 0:
            raise InvalidArgument(f"max_tensor_bytes must be >= 0, got {max_tensor_bytes}")
        self._max_tensor_bytes = max_tensor_bytes
        self._allocate = allocate
        self._pending: _Pending | None = None
        self._last_key: str | None = None  # key of the last completed tensor, for messages
        #: Header of the tensor :meth:`feed` returned last (its role, dense_shape).
        self.last_header: tensor_pb2.TensorHeader | None = None

    @property
    def in_progress(self) -> str | None:
        """Key of the tensor being assembled, or ``None`` between tensors."""
        return self._pending.key if self._pending is not None else None

    def _fail(self, key: str, what: str) -> MalformedStream:
        self._pending = None
        return MalformedStream(f"malformed tensor stream: {_key_label(key)}: {what}")

    def feed(self, frame: tensor_pb2.TensorFrame) -> tuple[str, np.ndarray] | None:
        """Consume one frame.

        Args:
            frame: The next frame of the stream.

        Returns:
            ``(key, array)`` when this frame completes a tensor, else ``None``. ``array`` is a
            writeable C-contiguous ndarray of the header's dtype and shape, given by
            ``allocate`` (default: a new array).

        Raises:
            MalformedStream: (INVALID_ARGUMENT) the frame breaks the wire format: frame 0
                without header, header on a later frame, header while another tensor is
                incomplete, wrong ``chunk_index`` (missing, duplicate, out of order), wrong
                ``offset_bytes``, data past ``size_bytes``, ``last`` before ``size_bytes``
                arrived, bad header (empty key, unknown dtype, negative dimension,
                ``size_bytes`` != ``prod(shape) * itemsize``).
            InvalidArgument: (INVALID_ARGUMENT) ``size_bytes`` exceeds ``max_tensor_bytes``.
            ResourceExhausted: (RESOURCE_EXHAUSTED) the receive buffer cannot be allocated.
        """
        if frame.HasField("header"):
            self._start(frame)
        elif self._pending is None:
            after = f" (after tensor {self._last_key!r})" if self._last_key is not None else ""
            if frame.chunk_index == 0:
                raise self._fail("", f"frame with chunk_index 0 has no header{after}")
            raise self._fail(
                "",
                f"frame with chunk_index {frame.chunk_index} but no tensor in progress; "
                f"its header is missing{after}",
            )
        pending = self._pending
        assert pending is not None
        key = pending.key
        if frame.chunk_index != pending.next_index:
            raise self._fail(
                key,
                f"expected chunk_index {pending.next_index}, got {frame.chunk_index} "
                "(missing, duplicate or out-of-order frame)",
            )
        if frame.offset_bytes != pending.received_bytes:
            raise self._fail(
                key,
                f"chunk {frame.chunk_index}: expected offset_bytes {pending.received_bytes}, "
                f"got {frame.offset_bytes}",
            )
        data = frame.data
        start = pending.received_bytes
        end = start + len(data)
        size_bytes = pending.buffer.nbytes
        if end > size_bytes:
            raise self._fail(
                key,
                f"chunk {frame.chunk_index}: data runs to byte {end}, past size_bytes {size_bytes}",
            )
        if data:
            pending.buffer.data[start:end] = data
        pending.received_bytes = end
        pending.next_index += 1
        if not frame.last:
            return None
        if end != size_bytes:
            raise self._fail(
                key,
                f"last set on chunk {frame.chunk_index} after {end} of {size_bytes} bytes",
            )
        self._pending = None
        self._last_key = key
        self.last_header = pending.header
        return key, pending.result

    def _start(self, frame: tensor_pb2.TensorFrame) -> None:
        """Validate a header and preallocate the tensor's buffer."""
        header = frame.header
        key = header.key
        if frame.chunk_index != 0:
            raise self._fail(key, f"header on non-first frame (chunk_index {frame.chunk_index})")
        if self._pending is not None:
            previous = self._pending
            raise self._fail(
                previous.key,
                f"new header for {_key_label(key)} while this tensor is incomplete "
                f"({previous.received_bytes} of {previous.buffer.nbytes} bytes)",
            )
        if not key:
            raise self._fail("", "header has an empty key")
        if len(key) * 4 > MAX_KEY_BYTES:
            try:
                check_key(key)
            except InvalidArgument as err:
                raise self._fail(key, err.message) from None
        try:
            dtype = dtype_from_wire(header.dtype, key)
        except InvalidArgument as err:
            raise self._fail(key, f"header dtype: {err.message}") from None
        shape = tuple(int(d) for d in header.shape)
        if any(d < 0 for d in shape):
            raise self._fail(key, f"negative dimension in shape {shape}")
        problem = array_limit_problem(shape, dtype.itemsize)  # (numpy's own limits)
        if problem is not None:
            raise self._fail(key, problem)
        expected = math.prod(shape) * dtype.itemsize
        if header.size_bytes != expected:
            raise self._fail(
                key,
                f"size_bytes {header.size_bytes} != prod(shape {shape}) * itemsize "
                f"{dtype.itemsize} = {expected}",
            )
        if self._max_tensor_bytes is not None and expected > self._max_tensor_bytes:
            raise InvalidArgument(
                f"{_key_label(key)}: size_bytes {expected} exceeds max_tensor_bytes "
                f"{self._max_tensor_bytes}"
            )
        try:
            if self._allocate is None:
                result = np.empty(shape, dtype=dtype)
            else:
                result = self._allocate(key, dtype, shape)
        except (MemoryError, ValueError) as err:
            raise ResourceExhausted(
                f"{_key_label(key)}: cannot allocate {expected} bytes: {err}"
            ) from None
        if not result.flags.c_contiguous or result.dtype != dtype or result.shape != shape:
            raise TypeError(
                f"{_key_label(key)}: allocate gave a {result.dtype} array of shape "
                f"{result.shape} (contiguous: {result.flags.c_contiguous}); "
                f"needed a C-contiguous {dtype} array of shape {shape}"
            )
        self._pending = _Pending(key, result, header)

    def finish(self) -> None:
        """Declare the end of the stream.

        Raises:
            MalformedStream: (INVALID_ARGUMENT) a tensor is incomplete; the message names its key
                and how many bytes and frames arrived.
        """
        pending = self._pending
        if pending is not None:
            raise self._fail(
                pending.key,
                f"stream ended after {pending.received_bytes} of {pending.buffer.nbytes} bytes "
                f"({pending.next_index} frames) without a last frame",
            )


def decode_frames(
    frames: Iterable[tensor_pb2.TensorFrame], *, max_tensor_bytes: int | None = None
) -> dict[str, np.ndarray]:
    """Assemble every tensor of a finished stream.

    Args:
        frames: The stream's frames, in order.
        max_tensor_bytes: Per-tensor size limit in bytes, or ``None``.

    Returns:
        Key -> writeable ndarray (dtype and shape from its header), in stream order.

    Raises:
        MalformedStream: (INVALID_ARGUMENT) any :meth:`TensorAssembler.feed` or
            :meth:`TensorAssembler.finish` error, or the same key sent twice.
        InvalidArgument: (INVALID_ARGUMENT) a tensor exceeds ``max_tensor_bytes``.
        ResourceExhausted: (RESOURCE_EXHAUSTED) a receive buffer cannot be allocated.
    """
    assembler = TensorAssembler(max_tensor_bytes=max_tensor_bytes)
    tensors: dict[str, np.ndarray] = {}
    for frame in frames:
        done = assembler.feed(frame)
        if done is not None:
            key, array = done
            if key in tensors:
                raise MalformedStream(
                    f"malformed tensor stream: {_key_label(key)}: key sent twice in one stream"
                )
            tensors[key] = array
    assembler.finish()
    return tensors
