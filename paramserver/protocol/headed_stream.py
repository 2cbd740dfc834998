"""Headed tensor streams: the push, pull, reduction and push-sum streams, whose messages carry
in their ``body`` oneof either the stream's one head message (``header``, ``info`` or
``result``) or a tensor ``frame`` of :mod:`paramserver.protocol.tensor`'s format.

Every violation raises :class:`paramserver.errors.MalformedStream` (INVALID_ARGUMENT) naming
the stream and what is wrong.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterable, AsyncIterator, Callable
from typing import Generic, Literal, Protocol, TypeAlias, TypedDict, TypeVar, Unpack, overload

import numpy as np

from paramserver.api.v1 import tensor_pb2
from paramserver.errors import MalformedStream
from paramserver.protocol.tensor import TensorAssembler

__all__ = ["FramedMessage", "HeadedStream", "ReadOptions", "read_headed_stream"]

_Head = TypeVar("_Head")
_Head_co = TypeVar("_Head_co", covariant=True)


class FramedMessage(Protocol):
    """A message of a headed stream: its ``body`` oneof holds the head message or a frame."""

    @property
    def frame(self) -> tensor_pb2.TensorFrame: ...

    def WhichOneof(self, oneof_group: Literal["body"]) -> str | None: ...


class _HeaderMessage(FramedMessage, Protocol[_Head_co]):
    """A headed stream's message whose head is its ``header`` (push and reduce requests)."""

    @property
    def header(self) -> _Head_co: ...


class _InfoMessage(FramedMessage, Protocol[_Head_co]):
    """A headed stream's message whose head is its ``info`` (pull answers)."""

    @property
    def info(self) -> _Head_co: ...


class _ResultMessage(FramedMessage, Protocol[_Head_co]):
    """A headed stream's message whose head is its ``result`` (reduce answers)."""

    @property
    def result(self) -> _Head_co: ...


@dataclasses.dataclass(eq=False)
class HeadedStream(Generic[_Head]):
    """A stream whose messages carry, in their ``body`` oneof, either its one head message or
    a tensor ``frame`` (the push, pull, reduction and push-sum streams): iterating it yields
    the frames; :attr:`head` is the head message once it came.

    Attributes:
        messages: The stream.
        head_field: The oneof field of the head message (``"header"``, ``"info"``,
            ``"result"``).
        what: The stream in error messages (``"reduce stream"``).
        head_first: The head must come before every frame (False: anywhere, e.g. a result
            after the tensors it describes).
        on_head: Called with the head message as soon as it arrives (before the frames after
            it are read).
        head: The head message (None until it came).

    Raises:
        MalformedStream: (INVALID_ARGUMENT) while iterating: two heads, a frame before the
            head when ``head_first``, or a message that is neither; from
            :meth:`received_head`: no head.
    """

    messages: AsyncIterable[FramedMessage]
    head_field: str
    what: str
    head_first: bool = True
    on_head: Callable[[_Head], None] | None = None
    head: _Head | None = dataclasses.field(default=None, init=False)

    async def __aiter__(self) -> AsyncIterator[tensor_pb2.TensorFrame]:
        head, what = self.head_field, self.what
        async for msg in self.messages:
            which = msg.WhichOneof("body")
            if which == head:
                if self.head is not None:
                    raise MalformedStream(f"second {head} in one {what}")
                got: _Head = getattr(msg, head)
                self.head = got
                if self.on_head is not None:
                    self.on_head(got)
            elif which != "frame":
                raise MalformedStream(f"{what}: a message with neither {head} nor frame")
            elif self.head is None and self.head_first:
                raise MalformedStream(f"a {what} must start with its {head}")
            else:
                yield msg.frame

    def received_head(self) -> _Head:
        """The head message, once the stream is read.

        Raises:
            MalformedStream: (INVALID_ARGUMENT) the stream ended without its head.
        """
        if self.head is None:
            raise MalformedStream(f"{self.what} ended without its {self.head_field}")
        return self.head


_Allocate: TypeAlias = Callable[[str, np.dtype[np.generic], tuple[int, ...]], np.ndarray]


class ReadOptions(TypedDict, total=False):
    """The optional keywords of :func:`read_headed_stream` (as documented there)."""

    max_tensor_bytes: int | None
    head_first: bool
    allocate: _Allocate | None


@overload
async def read_headed_stream(
    messages: AsyncIterable[_HeaderMessage[_Head]],
    *,
    head: Literal["header"],
    what: str,
    **options: Unpack[ReadOptions],
) -> tuple[_Head, dict[str, np.ndarray]]: ...


@overload
async def read_headed_stream(
    messages: AsyncIterable[_InfoMessage[_Head]],
    *,
    head: Literal["info"],
    what: str,
    **options: Unpack[ReadOptions],
) -> tuple[_Head, dict[str, np.ndarray]]: ...


@overload
async def read_headed_stream(
    messages: AsyncIterable[_ResultMessage[_Head]],
    *,
    head: Literal["result"],
    what: str,
    **options: Unpack[ReadOptions],
) -> tuple[_Head, dict[str, np.ndarray]]: ...


async def read_headed_stream(
    messages: AsyncIterable[FramedMessage],
    *,
    head: str,
    what: str,
    max_tensor_bytes: int | None = None,
    head_first: bool = True,
    allocate: _Allocate | None = None,
) -> tuple[object, dict[str, np.ndarray]]:
    """Read a stream whose messages carry either its one ``head`` message or a tensor ``frame``
    (the ``body`` oneof of the reduction and push-sum streams).

    Args:
        messages: The stream.
        head: The oneof field of the head message (``"header"``, ``"result"``).
        what: The stream in error messages (``"reduce stream"``).
        max_tensor_bytes: Largest tensor accepted, checked at its frame header (None: no limit).
        head_first: The head must come before every frame (False: anywhere, e.g. a result
            after the tensors it describes).
        allocate: Where each tensor is received (see :class:`TensorAssembler`; default new
            arrays).

    Returns:
        ``(head message, key -> array)``; each array is complete and owned by the caller.

    Raises:
        MalformedStream: (INVALID_ARGUMENT) no head, two heads, a frame before the head when
            ``head_first``, a message that is neither, a key twice, or a broken tensor.
        InvalidArgument: (INVALID_ARGUMENT) a tensor larger than ``max_tensor_bytes``.
    """
    stream: HeadedStream[object] = HeadedStream(messages, head, what, head_first)
    tensors: dict[str, np.ndarray] = {}
    assembler = TensorAssembler(max_tensor_bytes=max_tensor_bytes, allocate=allocate)
    async for frame in stream:
        done = assembler.feed(frame)
        if done is not None:
            if done[0] in tensors:
                raise MalformedStream(f"tensor {done[0]!r} appears twice in one {what}")
            tensors[done[0]] = done[1]
    assembler.finish()
    return stream.received_head(), tensors
