"""``paramserver health``: the container health check (Docker ``healthcheck``, Kubernetes probes).

``paramserver health ADDR`` (or ``--server ADDR``) asks the standard gRPC health service
(``grpc.health.v1.Health/Check``) and exits 0 only when the answer is SERVING; ``--service``
checks one service (default: the whole server); ``--allow-unimplemented`` accepts a gRPC server
that has no health service (a liveness probe). A probe runs it every few seconds, so it imports
only grpc, the health stub and the client's TLS settings: nothing of the servers or the client
library.
"""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING

from paramserver.cli.flags import Subcommands, add_client_security_flags
from paramserver.cli.server_arg import add_server_arguments

if TYPE_CHECKING:
    from paramserver.security.tls import ClientSecurity

__all__ = ["add_subcommands", "check_health"]

logger = logging.getLogger(__name__)


async def check_health(
    address: str,
    service: str = "",
    timeout_s: float = 3.0,
    security: ClientSecurity | None = None,
) -> str:
    """The health status name of ``service`` at ``address`` (``SERVING``, ``NOT_SERVING``...).

    The health service needs no token; against a TLS server ``security`` gives the CA (and the
    client certificate under mutual TLS).

    Raises:
        grpc.aio.AioRpcError: unreachable, or the service is unknown (NOT_FOUND).
    """
    import time

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from paramserver.security.tls import open_channel
    from paramserver.waiting import Wait

    with Wait(
        address,
        address=address,
        detail="no answer yet",
        deadline=time.monotonic() + timeout_s,
        logger=logger,
    ):
        async with open_channel(address, security) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            resp = await stub.Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))


def _cmd_health(args: argparse.Namespace) -> int:
    import asyncio
    import os

    import grpc

    from paramserver.cli.server_arg import server_address
    from paramserver.security.tls import client_security_from_args

    address = server_address(args)
    security = client_security_from_args(args, os.environ)
    try:
        status = asyncio.run(check_health(address, args.service, args.timeout_s, security))
    except grpc.aio.AioRpcError as err:
        if args.allow_unimplemented and err.code() == grpc.StatusCode.UNIMPLEMENTED:
            print(f"{address}: serving gRPC (no health service)")
            return 0
        raise  # the entry point's one-line error (paramserver.cli.main)
    print(f"{address}: {status}")
    return 0 if status == "SERVING" else 1


def add_subcommands(sub: Subcommands) -> None:
    """Register ``health``."""
    h = sub.add_parser("health", help="gRPC health check of a server; exit 0 iff SERVING")
    add_server_arguments(h)
    h.add_argument("--service", default="", help="service name (default: the whole server)")
    h.add_argument("--timeout-s", type=float, default=3.0)
    h.add_argument(
        "--allow-unimplemented",
        action="store_true",
        help="count a gRPC server without the health service (UNIMPLEMENTED) as up",
    )
    add_client_security_flags(h)
    h.set_defaults(func=_cmd_health)
