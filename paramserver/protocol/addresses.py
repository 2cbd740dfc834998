"""Server addresses as every command and client takes them: ``HOST:PORT``, checked.

grpc itself would take ``127.0.0.1:99999`` as port 99999 mod 65536, so every address a user gives
is checked here first, and the error names how it was given.

A replicated shard is addressed by its replicas, ``"h0:p0|h1:p1"``: :func:`channel_target`
turns that into one gRPC channel over all of them whose calls go to whichever replica reports
the parameter-server service SERVING in its health (the primary; gRPC client-side health
checking with round-robin over the healthy ones), so a client follows a failover without
knowing of it.
"""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Iterable

from paramserver.errors import InvalidArgument
from paramserver.protocol.keepalive import ChannelOption

__all__ = [
    "PS_SERVICE",
    "channel_target",
    "parse_address",
    "parse_addresses",
    "parse_server",
    "replicas_moved",
]

#: The parameter-server service: its health is SERVING at a shard's primary only.
PS_SERVICE = "paramserver.api.v1.ParameterServer"
#: Separates a replicated shard's replicas in one address.
REPLICA_SEPARATOR = "|"

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
    return tuple(
        REPLICA_SEPARATOR.join(
            parse_address(one, "shard address", allow_port_zero=True)
            for one in addr.split(REPLICA_SEPARATOR)
        )
        for addr in out
    )


def parse_server(text: str, what: str = "address") -> str:
    """A server as a client is given it: ``HOST:PORT``, or a replicated shard's replicas
    ``h0:p0|h1:p1`` (each checked by :func:`parse_address`).

    Raises:
        InvalidArgument: an entry that is not ``HOST:PORT``, ``what`` named (INVALID_ARGUMENT).
    """
    return REPLICA_SEPARATOR.join(
        parse_address(one, what) for one in text.strip().split(REPLICA_SEPARATOR)
    )


def replicas_moved(given: str, now: str) -> bool:
    """``now`` names a replicated shard's replicas (``"h0:p0|h1:p1"``) other than ``given``
    does (in any order): a replica was placed again on another host since ``given`` was
    written down. False when ``now`` names one server (its own view of its address may
    differ from the one its clients use)."""
    if REPLICA_SEPARATOR not in now:
        return False
    return set(now.split(REPLICA_SEPARATOR)) != set(given.split(REPLICA_SEPARATOR))


def channel_target(address: str) -> tuple[str, list[ChannelOption]]:
    """The gRPC target and channel options of ``address``.

    A plain ``host:port`` is its own target. A replicated shard's ``"h0:p0|h1:p1"`` becomes
    one ``ipv4:``/``ipv6:`` target over every replica (host names resolved now) with
    round-robin over the replicas whose health reports :data:`PS_SERVICE` SERVING: the
    primary.

    Raises:
        InvalidArgument: a host name that does not resolve (INVALID_ARGUMENT).
    """
    if REPLICA_SEPARATOR not in address:
        return address, []
    hosts = [_resolve(a.strip()) for a in address.split(REPLICA_SEPARATOR)]
    v6 = [h.startswith("[") for h in hosts]
    if any(v6) and not all(v6):
        raise InvalidArgument(f"replicas {address!r}: mix IPv4 and IPv6 in one shard")
    target = ("ipv6:" if all(v6) else "ipv4:") + ",".join(hosts)
    config = {
        "loadBalancingConfig": [{"round_robin": {}}],
        "healthCheckConfig": {"serviceName": PS_SERVICE},
    }
    return target, [("grpc.service_config", json.dumps(config))]


def _resolve(address: str) -> str:
    host, _, port = address.rpartition(":")
    if host.startswith("[") or re.fullmatch(r"[0-9.]+", host):
        return address
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except OSError as exc:
        raise InvalidArgument(f"replica {address!r}: {host!r} does not resolve ({exc})") from None
    family, _, _, _, sockaddr = infos[0]
    ip = str(sockaddr[0])
    return f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}"
