"""``paramserver rank-server`` and ``paramserver spmd-demo``.

Configuration precedence for ``rank-server``: CLI flag, then the ``PARAMSERVER_SPMD_*``
environment variable, then the default of :class:`~paramserver.spmd.rank_server.RankServerConfig`.

==============================  =========================================
flag                            environment variable
==============================  =========================================
``--host``                      ``PARAMSERVER_SPMD_HOST``
``--host-blocks``               ``PARAMSERVER_SPMD_HOST_BLOCKS``
``--disk-blocks``               ``PARAMSERVER_SPMD_DISK_BLOCKS``
``--device-blocks``             ``PARAMSERVER_SPMD_DEVICE_BLOCKS``
``--disk-dir``                  ``PARAMSERVER_SPMD_DISK_DIR``
``--object-dir``                ``PARAMSERVER_SPMD_OBJECT_DIR``
``--layout``                    ``PARAMSERVER_SPMD_LAYOUT``
``--timeout-s``                 ``PARAMSERVER_SPMD_TIMEOUT_S``
(test only)                     ``PARAMSERVER_SPMD_FAULTS``
==============================  =========================================
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from paramserver.errors import InvalidArgument, ParamServerError
from paramserver.spmd.faults import Faults
from paramserver.spmd.layout import parse_layout_spec
from paramserver.spmd.rank_server import RankServerConfig, serve

__all__ = ["add_subcommands", "config_from_args", "main", "run_event_loop"]

logger = logging.getLogger(__name__)

ENV_PREFIX = "PARAMSERVER_SPMD_"


def add_subcommands(sub: Any) -> None:
    """Register ``rank-server`` and ``spmd-demo`` on an argparse subparsers object."""
    rs = sub.add_parser(
        "rank-server",
        help="serve one rank's block pools (G1/G2/G3 + object tier) for an SPMD group",
        description="Serve one rank of an SPMD block-transfer instance (DESIGN §4).",
    )
    rs.add_argument("--instance-id", required=True, help="instance this rank belongs to")
    rs.add_argument("--rank", type=int, required=True, help="rank index within the instance")
    rs.add_argument("--host", default=None, help="interface to bind (default 127.0.0.1)")
    rs.add_argument("--port", type=int, default=0, help="TCP port; 0 = ephemeral (default)")
    rs.add_argument("--address", default=None, help="host:port to bind (overrides --host/--port)")
    rs.add_argument("--port-file", type=Path, default=None, help="write the bound port here")
    rs.add_argument("--host-blocks", type=int, default=None, help="G2 blocks (default 64)")
    rs.add_argument("--disk-blocks", type=int, default=None, help="G3 blocks (default 64)")
    rs.add_argument(
        "--device-blocks", type=int, default=None, help="G1 blocks (default 0; needs a GPU)"
    )
    rs.add_argument("--disk-dir", type=Path, default=None, help="directory of the G3 pool file")
    rs.add_argument(
        "--object-dir", type=Path, default=None, help="object store root (shared by ranks)"
    )
    rs.add_argument("--no-object-tier", action="store_true", help="run without G4")
    rs.add_argument(
        "--layout",
        default=None,
        help="block format, e.g. num_layers=4,outer_dim=2,page_size=16,inner_dim=128,"
        "dtype=float16 (those are the defaults)",
    )
    rs.add_argument("--timeout-s", type=float, default=None, help="default command deadline")
    rs.add_argument(
        "--no-fsync", action="store_true", help="do not fsync objects (faster, not durable)"
    )
    rs.add_argument(
        "--loop", choices=("uvloop", "asyncio"), default="uvloop", help="event loop (uvloop)"
    )
    rs.set_defaults(func=_run_rank_server)

    demo = sub.add_parser(
        "spmd-demo",
        help="two instances x 2 rank servers: fill, offload, onboard, verify, report GB/s",
        description="End-to-end demo of the SPMD block-transfer layer on 127.0.0.1.",
    )
    demo.add_argument("--blocks", type=int, default=128, help="blocks moved per rank")
    demo.add_argument(
        "--layout",
        default="num_layers=4,outer_dim=2,page_size=16,inner_dim=128,dtype=float16",
        help="block format (default: 32 KiB blocks)",
    )
    demo.add_argument("--ranks", type=int, default=2, help="ranks per instance")
    demo.add_argument("--work-dir", type=Path, default=None, help="keep files here")
    demo.add_argument("--json", action="store_true", help="print one JSON line per path")
    demo.add_argument(
        "--loop", choices=("uvloop", "asyncio"), default="uvloop", help="event loop (uvloop)"
    )
    demo.set_defaults(func=_run_demo)


def _env(env: Mapping[str, str], name: str) -> str | None:
    value = env.get(ENV_PREFIX + name)
    return value if value not in (None, "") else None


def config_from_args(args: argparse.Namespace, env: Mapping[str, str]) -> RankServerConfig:
    """Build the rank-server config: flag, then ``PARAMSERVER_SPMD_*`` in ``env``, then default.

    Raises:
        InvalidArgument: malformed values (INVALID_ARGUMENT).
    """
    kwargs: dict[str, Any] = {"instance_id": args.instance_id, "rank": args.rank}

    def pick(flag: Any, name: str, convert: Any) -> Any:
        if flag is not None:
            return flag
        raw = _env(env, name)
        if raw is None:
            return None
        try:
            return convert(raw)
        except ValueError:
            raise InvalidArgument(f"{ENV_PREFIX}{name}={raw!r} is malformed") from None

    host = pick(args.host, "HOST", str)
    port = args.port
    if args.address:
        h, sep, p = args.address.rpartition(":")
        if not sep:
            raise InvalidArgument(f"--address must be host:port, got {args.address!r}")
        host, port = h, int(p)
    if host is not None:
        kwargs["host"] = host
    kwargs["port"] = port
    for field, flag, name, convert in (
        ("host_blocks", args.host_blocks, "HOST_BLOCKS", int),
        ("disk_blocks", args.disk_blocks, "DISK_BLOCKS", int),
        ("device_blocks", args.device_blocks, "DEVICE_BLOCKS", int),
        ("disk_dir", args.disk_dir, "DISK_DIR", Path),
        ("object_dir", args.object_dir, "OBJECT_DIR", Path),
        ("default_timeout_s", args.timeout_s, "TIMEOUT_S", float),
    ):
        value = pick(flag, name, convert)
        if value is not None:
            kwargs[field] = value
    if args.no_object_tier:
        kwargs["object_dir"] = None
    layout_text = pick(args.layout, "LAYOUT", str)
    if layout_text is not None:
        kwargs["layout"] = parse_layout_spec(layout_text)
    kwargs["port_file"] = args.port_file
    kwargs["object_durable"] = not args.no_fsync
    kwargs["faults"] = Faults.from_env(env)
    return RankServerConfig(**kwargs)


def run_event_loop(coro: Any, loop: str) -> Any:
    """Run ``coro`` to completion on uvloop (when installed and asked for) or asyncio."""
    if loop == "uvloop":
        try:
            import uvloop
        except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
            return asyncio.run(coro)
        return uvloop.run(coro)
    return asyncio.run(coro)


def _run_rank_server(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args, os.environ)
    except ParamServerError as exc:
        print(f"paramserver rank-server: {exc.message}", file=sys.stderr)
        return 2
    try:
        return int(run_event_loop(serve(config), args.loop))
    except ParamServerError as exc:
        logger.error("rank server failed to start: %s", exc.message)
        return 1


def _run_demo(args: argparse.Namespace) -> int:
    from paramserver.spmd.demo import run_demo

    return run_demo(
        blocks=args.blocks,
        layout_text=args.layout,
        ranks=args.ranks,
        work_dir=args.work_dir,
        json_lines=args.json,
        loop=args.loop,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m paramserver.spmd`` (the subcommands without the rest of the
    ``paramserver`` CLI; the launcher uses it)."""
    parser = argparse.ArgumentParser(prog="python -m paramserver.spmd")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    add_subcommands(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    return int(args.func(args) or 0)
