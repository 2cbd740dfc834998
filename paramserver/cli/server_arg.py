"""How a subcommand that talks to one server is told which: ``paramserver COMMAND ADDR`` or
``paramserver COMMAND --server ADDR``, the same on every such subcommand (``status``,
``health``, ``checkpoint``, ``worker``, ``cluster-check``). Both given, they must agree.
Subcommands that take a list of servers (``--shard-addresses``) keep it.
"""

from __future__ import annotations

import argparse

__all__ = ["add_server_arguments", "server_address"]


def add_server_arguments(parser: argparse.ArgumentParser, what: str = "the server") -> None:
    """Add the positional ``ADDR`` and ``--server ADDR`` (either names ``what``)."""
    parser.add_argument(
        "server_addr",
        nargs="?",
        metavar="ADDR",
        help=f"HOST:PORT of {what} (or --server ADDR; a replicated shard: its replicas H:P|H:P)",
    )
    parser.add_argument("--server", metavar="ADDR", help="the same as ADDR")


def server_address(args: argparse.Namespace) -> str:
    """The server ``args`` name (see :func:`add_server_arguments`), checked as ``HOST:PORT``.

    Raises:
        InvalidArgument: none given, two different ones, or not ``HOST:PORT``, naming how it
            was given (INVALID_ARGUMENT: the command exits 2).
    """
    from paramserver.errors import InvalidArgument
    from paramserver.protocol.addresses import parse_server

    positional, flag = args.server_addr, args.server
    if positional and flag and positional.strip() != flag.strip():
        raise InvalidArgument(
            f"the server is given twice, as ADDR {positional!r} and as --server {flag!r}: "
            "give it once"
        )
    if not positional and not flag:
        raise InvalidArgument("give the server as ADDR or --server ADDR (HOST:PORT)")
    return parse_server(flag or positional, "--server" if flag else "ADDR")
