"""Framing of the same-host local link, shared by both ends: length-prefixed protobuf messages.

Each message on the Unix-domain stream socket is its serialized bytes after a 4-byte
little-endian length (the ``Session`` messages of ``parameter_server.proto``). The server end
is :mod:`paramserver.server.transports.link_service`, the client end
:mod:`paramserver.worker_client.transport.link_client`.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Generic, TypeVar

from google.protobuf.message import DecodeError, Message

from paramserver.errors import MalformedStream

#: Bytes of the length prefix of every frame.
HEADER_BYTES = 4
_HEADER = HEADER_BYTES

_M = TypeVar("_M", bound=Message)


def available() -> bool:
    """Abstract Unix sockets exist (Linux)."""
    return sys.platform.startswith("linux")


def socket_address(address: str) -> str:
    """The ``LocalLink.address`` form (leading ``@`` = abstract) as the socket API takes it."""
    return "\0" + address[1:] if address.startswith("@") else address


class FrameReader(Generic[_M]):
    """Splits a byte stream into length-prefixed protobuf messages.

    Args:
        message: The message class every frame holds.
        max_frame_bytes: Largest frame accepted (a larger length is a protocol violation);
            may be changed later (:attr:`max_frame_bytes`).
    """

    __slots__ = ("_buf", "_parse", "max_frame_bytes")

    def __init__(self, message: type[_M], max_frame_bytes: int) -> None:
        self._buf = bytearray()
        self.max_frame_bytes = max_frame_bytes
        self._parse = message.FromString

    def feed(self, data: bytes, max_messages: int | None = None) -> list[_M]:
        """Messages completed by ``data``, in order: at most ``max_messages`` (the bytes of
        the rest stay buffered; ``feed(b"")`` parses on).

        Raises:
            MalformedStream: a frame longer than ``max_frame_bytes`` or not a valid message.
        """
        buf = self._buf
        limit = self.max_frame_bytes
        if not buf and len(data) >= _HEADER:  # common case: whole frames in one chunk, no copy
            n = int.from_bytes(data[:_HEADER], "little")
            if len(data) == _HEADER + n and n <= limit and max_messages != 0:
                return [self._decode(memoryview(data)[_HEADER:])]
        buf += data
        out: list[_M] = []
        start = 0
        end = len(buf)
        with memoryview(buf) as view:
            while end - start >= _HEADER and (max_messages is None or len(out) < max_messages):
                n = int.from_bytes(view[start : start + _HEADER], "little")
                if n > limit:
                    raise MalformedStream(
                        f"local-link frame of {n} bytes exceeds the limit of {limit}"
                    )
                if end - start < _HEADER + n:
                    break
                out.append(self._decode(view[start + _HEADER : start + _HEADER + n]))
                start += _HEADER + n
        del buf[:start]
        return out

    @property
    def buffered_bytes(self) -> int:
        """Bytes received and not yet returned as messages."""
        return len(self._buf)

    def _decode(self, view: memoryview) -> _M:
        try:
            return self._parse(view)  # type: ignore[arg-type]  # upb parses any buffer
        except DecodeError as exc:
            raise MalformedStream(f"local-link frame is not a valid message: {exc}") from None


def write_frame(transport: asyncio.WriteTransport, msg: Message) -> None:
    """Send one message with its 4-byte little-endian length."""
    body = msg.SerializeToString()
    transport.writelines((len(body).to_bytes(_HEADER, "little"), body))
