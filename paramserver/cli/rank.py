"""``paramserver rank-server`` and ``paramserver spmd-demo``.

Configuration precedence for ``rank-server``: CLI flag, then the ``PARAMSERVER_SPMD_*``
environment variable, then the default of
:class:`~paramserver.spmd.rank_server.rank_config.RankServerConfig`.

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
``--metrics-port``              ``PARAMSERVER_SPMD_METRICS_PORT``
``--metrics-host``              ``PARAMSERVER_SPMD_METRICS_HOST``
``--metrics-token-file``        ``PARAMSERVER_SPMD_METRICS_TOKEN_FILE``
``--metrics-tls-cert/-key``     ``PARAMSERVER_SPMD_METRICS_TLS_CERT`` / ``_KEY``
(test only)                     ``PARAMSERVER_SPMD_FAULTS``
==============================  =========================================

``spmd-demo`` drives rank servers that already run when given both instances (same precedence,
flag then environment variable); without them it starts its own on 127.0.0.1:

==============================  =========================================
flag                            environment variable
==============================  =========================================
``--instance-a``                ``PARAMSERVER_SPMD_INSTANCE_A``
``--instance-b``                ``PARAMSERVER_SPMD_INSTANCE_B``
``--wait-s``                    ``PARAMSERVER_SPMD_WAIT_S``
==============================  =========================================

Security (both commands; see :mod:`paramserver.security.tls`): ``--tls-cert``, ``--tls-key``,
``--tls-ca`` (``PARAMSERVER_TLS_*``). A rank server serves TLS with its certificate, requires
client certificates signed by ``--tls-ca`` (mutual TLS), checks bearer tokens from
``--auth-tokens`` (``PARAMSERVER_AUTH_TOKENS``), and reaches its peers with the same certificate
and CA and the token of ``--token-file`` (``PARAMSERVER_TOKEN_FILE`` / ``PARAMSERVER_TOKEN``).
``spmd-demo --instance-a/--instance-b`` connects with ``--tls-ca``, ``--tls-cert``/``--tls-key``
and ``--token-file`` (an admin token: ``connect_remote`` imports peer metadata, an admin RPC).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from paramserver.cli.flags import (
    Subcommands,
    add_client_security_flags,
    add_metrics_flags,
    add_server_security_flags,
)

if TYPE_CHECKING:
    from paramserver.spmd.rank_server.rank_config import RankServerConfig

__all__ = [
    "DemoTargets",
    "add_subcommands",
    "config_from_args",
    "demo_targets_from_args",
    "parse_rank_addresses",
    "run_event_loop",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

ENV_PREFIX = "PARAMSERVER_SPMD_"


def add_subcommands(sub: Subcommands) -> None:
    """Register ``rank-server`` and ``spmd-demo`` on an argparse subparsers object."""
    rs = sub.add_parser(
        "rank-server",
        help="serve one rank's block pools (G1/G2/G3 + object tier) for an SPMD group",
        description="Serve one rank of an SPMD block-transfer instance (docs/spmd.md).",
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
        "--max-object-bytes",
        type=int,
        default=None,
        help="largest object PutObject accepts, bytes, >= 0 (default 16 GiB; "
        "env PARAMSERVER_SPMD_MAX_OBJECT_BYTES)",
    )
    add_metrics_flags(rs)
    rs.add_argument(
        "--no-fsync", action="store_true", help="do not fsync objects (faster, not durable)"
    )
    rs.add_argument(
        "--loop", choices=("uvloop", "asyncio"), default="uvloop", help="event loop (uvloop)"
    )
    add_server_security_flags(rs)
    add_client_security_flags(rs, tls=False)  # the token (and name) it presents to its peers
    rs.set_defaults(func=_run_rank_server)

    demo = sub.add_parser(
        "spmd-demo",
        help="two instances x 2 rank servers: fill, offload, onboard, verify, report GB/s",
        description="End-to-end demo of the SPMD block-transfer layer: on rank servers it "
        "starts on 127.0.0.1, or on running ones given by --instance-a and --instance-b.",
    )
    demo.add_argument("--blocks", type=int, default=128, help="blocks moved per rank")
    demo.add_argument(
        "--layout",
        default=None,
        help="block format (default for its own servers: num_layers=4,outer_dim=2,"
        "page_size=16,inner_dim=128,dtype=float16, 32 KiB blocks; running servers must match "
        "it when given)",
    )
    demo.add_argument(
        "--ranks", type=int, default=None, help="ranks per instance it starts (default 2)"
    )
    demo.add_argument(
        "--instance-a",
        default=None,
        metavar="HOST:PORT,...",
        help="running rank servers of instance A, in rank order (with --instance-b)",
    )
    demo.add_argument(
        "--instance-b",
        default=None,
        metavar="HOST:PORT,...",
        help="running rank servers of instance B, in rank order (with --instance-a)",
    )
    demo.add_argument(
        "--wait-s",
        type=float,
        default=None,
        help="how long to poll rank servers until they answer SERVING (default 60 s)",
    )
    demo.add_argument("--work-dir", type=Path, default=None, help="keep files here")
    demo.add_argument("--json", action="store_true", help="print one JSON line per path")
    demo.add_argument(
        "--loop", choices=("uvloop", "asyncio"), default="uvloop", help="event loop (uvloop)"
    )
    add_client_security_flags(demo)  # towards --instance-a / --instance-b
    demo.set_defaults(func=_run_demo)


def _env(env: Mapping[str, str], name: str) -> str | None:
    value = env.get(ENV_PREFIX + name)
    return value if value not in (None, "") else None


def parse_rank_addresses(text: str, what: str = "addresses") -> list[str]:
    """Parse ``"host:port,host:port"`` (rank order) into a list of ``host:port``.

    Raises:
        InvalidArgument: empty, a duplicate, or an item that is not ``host:port`` with a port
            in [1, 65535] (INVALID_ARGUMENT).
    """
    from paramserver.errors import InvalidArgument
    from paramserver.protocol.addresses import parse_address

    items = [item.strip() for item in text.split(",")]
    if not items or any(not item for item in items):
        raise InvalidArgument(f"{what}: expected HOST:PORT,HOST:PORT..., got {text!r}")
    for item in items:
        parse_address(item, what)
    if len(set(items)) != len(items):
        raise InvalidArgument(f"{what}: {text!r} names one rank server twice")
    return items


@dataclasses.dataclass(frozen=True)
class DemoTargets:
    """Running rank servers for ``spmd-demo`` to drive.

    Attributes:
        instance_a: ``host:port`` of instance A's ranks, by rank.
        instance_b: ``host:port`` of instance B's ranks, by rank (as many as A's).
    """

    instance_a: tuple[str, ...]
    instance_b: tuple[str, ...]

    def __post_init__(self) -> None:
        from paramserver.errors import InvalidArgument

        if not self.instance_a or len(self.instance_a) != len(self.instance_b):
            raise InvalidArgument(
                f"instance A has {len(self.instance_a)} rank servers and B "
                f"{len(self.instance_b)}; rank i of B pairs with rank i of A, so give as many"
            )
        if set(self.instance_a) & set(self.instance_b):
            raise InvalidArgument("instances A and B share a rank server address")


def demo_targets_from_args(
    args: argparse.Namespace, env: Mapping[str, str]
) -> tuple[DemoTargets | None, float]:
    """Which rank servers ``spmd-demo`` drives: flag, then ``PARAMSERVER_SPMD_*``, then default.

    Returns:
        ``(targets, wait_s)``: ``targets`` is ``None`` when neither instance is given (the demo
        starts its own rank servers); ``wait_s`` bounds the polling until every rank server
        answers SERVING, seconds (default 60).

    Raises:
        InvalidArgument: only one instance given, malformed addresses, a ``--ranks`` that
            disagrees with the addresses, or a bad ``--wait-s`` (INVALID_ARGUMENT).
    """
    from paramserver.errors import InvalidArgument

    a_text = args.instance_a if args.instance_a is not None else _env(env, "INSTANCE_A")
    b_text = args.instance_b if args.instance_b is not None else _env(env, "INSTANCE_B")
    wait_raw: str | float | None = args.wait_s if args.wait_s is not None else _env(env, "WAIT_S")
    try:
        wait_s = 60.0 if wait_raw is None else float(wait_raw)
    except ValueError:
        raise InvalidArgument(f"{ENV_PREFIX}WAIT_S={wait_raw!r} is malformed") from None
    if wait_s <= 0:
        raise InvalidArgument(f"--wait-s must be > 0, got {wait_s}")
    if a_text is None and b_text is None:
        return None, wait_s
    if a_text is None or b_text is None:
        raise InvalidArgument(
            "give both --instance-a and --instance-b (or PARAMSERVER_SPMD_INSTANCE_A/_B), "
            "or neither to start rank servers here"
        )
    targets = DemoTargets(
        tuple(parse_rank_addresses(a_text, "--instance-a")),
        tuple(parse_rank_addresses(b_text, "--instance-b")),
    )
    if args.ranks is not None and args.ranks != len(targets.instance_a):
        raise InvalidArgument(
            f"--ranks {args.ranks} but --instance-a lists {len(targets.instance_a)} rank servers"
        )
    return targets, wait_s


_CONFIG_FLAGS: dict[str, Callable[[str], object]] = {
    **dict.fromkeys(["host_blocks", "disk_blocks", "device_blocks", "max_object_bytes"], int),
    **dict.fromkeys(["disk_dir", "object_dir"], Path),
    "timeout_s": float,
    "metrics_port": int,
    **dict.fromkeys(
        ["metrics_host", "metrics_token_file", "metrics_tls_cert", "metrics_tls_key"], str
    ),
}
"""``rank-server`` flags read by :func:`config_from_args` (dest -> conversion of the variable)."""


def config_from_args(args: argparse.Namespace, env: Mapping[str, str]) -> RankServerConfig:
    """Build the rank-server config: flag, then ``PARAMSERVER_SPMD_*`` in ``env``, then default.

    Raises:
        InvalidArgument: malformed values (INVALID_ARGUMENT).
    """
    from paramserver.errors import InvalidArgument
    from paramserver.protocol.addresses import parse_address
    from paramserver.security.tls import (
        peer_security,
        server_security_from_args,
        token_from_sources,
    )
    from paramserver.spmd.faults import Faults
    from paramserver.spmd.layout import parse_layout_spec
    from paramserver.spmd.rank_server.rank_config import RankServerConfig

    kwargs: dict[str, Any] = {"instance_id": args.instance_id, "rank": args.rank}

    def pick(flag: T | None, name: str, convert: Callable[[str], T]) -> T | None:
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
        h, _, p = parse_address(args.address, "--address", allow_port_zero=True).rpartition(":")
        host, port = h, int(p)
    if host is not None:
        kwargs["host"] = host
    kwargs["port"] = port
    # Flag dest -> conversion; the variable is PARAMSERVER_SPMD_<DEST>, the config field the
    # dest (timeout_s: default_timeout_s).
    for dest, convert in _CONFIG_FLAGS.items():
        value = pick(getattr(args, dest), dest.upper(), convert)
        if value is not None:
            kwargs["default_timeout_s" if dest == "timeout_s" else dest] = value
    if args.no_object_tier:
        kwargs["object_dir"] = None
    layout_text = pick(args.layout, "LAYOUT", str)
    if layout_text is not None:
        kwargs["layout"] = parse_layout_spec(layout_text)
    kwargs["port_file"] = args.port_file
    kwargs["object_durable"] = not args.no_fsync
    kwargs["faults"] = Faults.from_env(env)
    security = server_security_from_args(args, env)
    token = token_from_sources(getattr(args, "token_file", None), env)
    kwargs["security"] = security
    kwargs["peer_security"] = peer_security(security, token, getattr(args, "tls_server_name", None))
    return RankServerConfig(**kwargs)


def run_event_loop(coro: Coroutine[object, object, T], loop: str) -> T:
    """Run ``coro`` to completion on uvloop (``loop == "uvloop"``, when installed) or asyncio."""
    from paramserver.serving.bootstrap import run_loop

    return run_loop(coro, use_uvloop=loop == "uvloop")


def _run_rank_server(args: argparse.Namespace) -> int:
    # Bad flags (InvalidArgument, exit 2) and a port that cannot be bound (Unavailable, exit 1)
    # end the command with one line (paramserver.cli.main.run_command).
    from paramserver.spmd.rank_server.rank_daemon import serve

    config = config_from_args(args, os.environ)
    return int(run_event_loop(serve(config), args.loop))


def _run_demo(args: argparse.Namespace) -> int:
    from paramserver.cli.demos.spmd_demo import run_demo
    from paramserver.errors import InvalidArgument
    from paramserver.security.tls import client_security_from_args
    from paramserver.spmd.layout import parse_layout_spec

    # Bad flags: InvalidArgument, one line and exit 2 (paramserver.cli.main.run_command).
    targets, wait_s = demo_targets_from_args(args, os.environ)
    security = client_security_from_args(args, os.environ) if targets is not None else None
    if args.blocks < 1:
        raise InvalidArgument(f"--blocks must be >= 1, got {args.blocks}")
    if args.layout is not None:
        parse_layout_spec(args.layout)
    return run_demo(
        blocks=args.blocks,
        layout_text=args.layout,
        ranks=2 if args.ranks is None else args.ranks,
        work_dir=args.work_dir,
        json_lines=args.json,
        loop=args.loop,
        instance_a=targets.instance_a if targets is not None else None,
        instance_b=targets.instance_b if targets is not None else None,
        wait_s=wait_s,
        security=security,
    )
