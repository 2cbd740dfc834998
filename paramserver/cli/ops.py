"""Operator commands: ``paramserver health`` (container health checks) and ``reshard``.

``paramserver health ADDR`` (or ``--server ADDR``) asks the standard gRPC health service
(``grpc.health.v1.Health/Check``) and exits 0 only when the answer is SERVING, so it fits a
docker-compose ``healthcheck``; ``--service`` checks one service (default: the whole server);
``--allow-unimplemented`` accepts a gRPC server that has no health service (a liveness probe).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from paramserver.cli.server_arg import add_server_arguments, server_address
from paramserver.core.sharding import parse_addresses
from paramserver.errors import ParamServerError
from paramserver.security.tls import (
    ClientSecurity,
    add_client_security_flags,
    client_security_from_args,
    open_channel,
)
from paramserver.server import reshard
from paramserver.waiting import Wait

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


def add_subcommands(sub: Any) -> None:
    """Register ``health`` and ``reshard``."""
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
    add_reshard_subcommand(sub)


def _cmd_reshard(args: argparse.Namespace) -> int:
    try:
        summary = reshard.reshard(
            args.sources,
            args.to_shards,
            args.out,
            slice_bytes=args.slice_bytes,
            addresses=parse_addresses(args.to_addresses) if args.to_addresses else None,
            allow_inexact=args.allow_inexact,
        )
    except ParamServerError as exc:
        print(f"paramserver reshard: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(summary, sort_keys=True))
    return 0


def add_reshard_subcommand(sub: Any) -> None:
    """Register ``reshard``."""
    p = sub.add_parser(
        "reshard",
        help="rewrite a sharded cluster's newest common checkpoint cut for another shard count",
        description="Merge the newest consistent cut of S shards' checkpoints and write it as "
        "checkpoints of N shards: OUT/shard-i for i < N (start shard i with "
        "--checkpoint-dir OUT/shard-i).",
    )
    p.add_argument(
        "--from",
        dest="sources",
        nargs="+",
        required=True,
        metavar="DIR",
        help="checkpoint directory of each old shard (or one directory holding shard-*)",
    )
    p.add_argument("--to-shards", type=int, required=True, help="shards of the new cluster")
    p.add_argument("--out", required=True, help="output directory (shard-0, shard-1, ...)")
    p.add_argument("--slice-bytes", type=int, help="slice size of the new cluster")
    p.add_argument("--to-addresses", help="host:port,... of the new shards (recorded only)")
    p.add_argument(
        "--allow-inexact",
        action="store_true",
        help="accept SSP/ASP cuts (the state at a minimum clock; see docs)",
    )
    p.set_defaults(func=_cmd_reshard)
