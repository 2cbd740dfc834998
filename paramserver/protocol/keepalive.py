"""HTTP/2 keepalive policy shared by every paramserver server and client (gRPC channel args).

gRPC servers by default accept a client's keepalive ping only every 5 minutes while no data
flows, and answer the third early ping with ``GOAWAY too_many_pings``. A worker waiting on a BSP
barrier, a rank-server transfer or any long call sends no data for as long as it waits, and
clients behind load balancers or NAT commonly ping every 10-30 s, so the default policy would
cut exactly the long waits. Every server of the product (parameter server, reduction server,
rank server, gossip peer endpoint) therefore accepts pings at the interval below, with or
without calls in flight, and every client of the product pings at a slower interval.

=====================================================  ==========  =======================
Option                                                 Server      Client (product's own)
=====================================================  ==========  =======================
``grpc.http2.min_ping_interval_without_data_ms``       5000        -
``grpc.http2.max_ping_strikes``                        2           -
``grpc.keepalive_permit_without_calls``                1           1
``grpc.keepalive_time_ms``                             60000       20000
``grpc.keepalive_timeout_ms``                          20000       20000
``grpc.http2.max_pings_without_data``                  -           0 (no cap)
=====================================================  ==========  =======================

So any client may ping every :data:`MIN_CLIENT_PING_INTERVAL_MS` (5 s) or slower, during a
call or between calls, for as long as it likes; pings faster than that are counted and the third
such strike ends the connection with GOAWAY (gRPC's abuse protection). Servers also ping silent
clients every 60 s, so a dead peer's connection is noticed within about 80 s. Reference: gRPC's
keepalive guide (https://grpc.io/docs/guides/keepalive/ and ``doc/keepalive.md`` in grpc/grpc).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, TypeAlias

__all__ = [
    "CLIENT_KEEPALIVE_OPTIONS",
    "CLIENT_PING_INTERVAL_MS",
    "MIN_CLIENT_PING_INTERVAL_MS",
    "SERVER_KEEPALIVE_OPTIONS",
    "ChannelOption",
    "with_keepalive",
]

#: Shortest interval (ms) between a client's pings that every paramserver server accepts.
MIN_CLIENT_PING_INTERVAL_MS: Final = 5_000

#: Interval (ms) at which the product's own clients ping a connection while it is idle.
CLIENT_PING_INTERVAL_MS: Final = 20_000

#: One gRPC channel argument: its name and its value (C-core takes ints and strings).
ChannelOption: TypeAlias = tuple[str, int | str]

SERVER_KEEPALIVE_OPTIONS: Final[tuple[tuple[str, int], ...]] = (
    ("grpc.http2.min_ping_interval_without_data_ms", MIN_CLIENT_PING_INTERVAL_MS),
    ("grpc.http2.max_ping_strikes", 2),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
)
"""Channel args of every ``grpc.aio.server`` of the product (see the module docstring)."""

CLIENT_KEEPALIVE_OPTIONS: Final[tuple[tuple[str, int], ...]] = (
    ("grpc.keepalive_time_ms", CLIENT_PING_INTERVAL_MS),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
)
"""Channel args of every channel the product's clients open (caller options win)."""


def with_keepalive(
    options: Sequence[ChannelOption], defaults: Sequence[ChannelOption]
) -> list[ChannelOption]:
    """``options`` plus each of ``defaults`` whose name ``options`` does not set."""
    given = {name for name, _ in options}
    return [*options, *(o for o in defaults if o[0] not in given)]
