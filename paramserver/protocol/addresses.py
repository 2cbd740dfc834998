"""Server addresses as every command and client takes them: ``HOST:PORT``, checked.

grpc itself would take ``127.0.0.1:99999`` as port 99999 mod 65536, so every address a user gives
is checked here first, and the error names how it was given.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from paramserver.errors import InvalidArgument

__all__ = ["parse_address", "parse_addresses"]

_HOST_NAME = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?")
_IPV6 = re.compile(r"\[[0-9A-Fa-f:.]+(%[A-Za-z0-9_.-]+)?\]")


def parse_address(text: str, what: str = "address", *, allow_port_zero: bool = False) -> str:
    """Check one ``HOST:PORT`` address: a host name or IPv4 address, or an IPv6 address in
    brackets (``[::1]:50051``), and a decimal port in [1, 65535] (0 too with
    ``allow_port_zero``). Every client command checks its server addresses with this: grpc
    itself would take ``127.0.0.1:99999`` as port 99999 mod 65536.

    Args:
        text: The address, surrounding whitespace ignored.
        what: What it is, for the message (e.g. ``"--server"``).
        allow_port_zero: Accept port 0 (an ephemeral port a server picks; never a target).

    Returns:
        The stripped address.

    Raises:
        InvalidArgument: anything else, the address and ``what`` named (INVALID_ARGUMENT).
    """
    addr = text.strip()
    host, sep, port = addr.rpartition(":")
    low = 0 if allow_port_zero else 1
    if not sep or not host or not port.isdigit() or not low <= int(port) <= 65535:
        hint = f"PORT in [{low}, 65535]" if host and port.isdigit() else "HOST:PORT"
        raise InvalidArgument(f"{what}: {addr!r} is not HOST:PORT ({hint} expected)")
    if ":" in host and not _IPV6.fullmatch(host):
        raise InvalidArgument(
            f"{what}: {addr!r} is not HOST:PORT (an IPv6 host goes in brackets: [::1]:{port})"
        )
    if ":" not in host and not _HOST_NAME.fullmatch(host):
        raise InvalidArgument(f"{what}: {addr!r} is not HOST:PORT (bad host {host!r})")
    return addr


def parse_addresses(text: str | Iterable[str]) -> tuple[str, ...]:
    """``"h0:p0,h1:p1"`` (or an iterable of addresses) -> ``("h0:p0", "h1:p1")``; each entry
    checked by :func:`parse_address` (port 0 allowed: a shard not yet started).

    Raises:
        InvalidArgument: empty, or an entry that is not ``host:port`` (INVALID_ARGUMENT).
    """
    items = text.split(",") if isinstance(text, str) else list(text)
    out = tuple(a.strip() for a in items if a.strip())
    if not out:
        raise InvalidArgument("shard addresses must name at least one host:port")
    return tuple(parse_address(addr, "shard address", allow_port_zero=True) for addr in out)
