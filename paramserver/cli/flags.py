"""Flags several commands share, and the handler that imports a command's code only when it runs.

Everything here is argparse and the standard library: a command's parser is built (``paramserver
COMMAND --help``) without importing grpc, numpy or the servers. What a flag means is read where
the command runs: :func:`paramserver.security.tls.server_security_from_args` and
:func:`~paramserver.security.tls.client_security_from_args` for the security flags,
:class:`paramserver.security.http_access.MetricsEndpointConfig` for the metrics flags.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from typing import TypeAlias

__all__ = [
    "FlagTarget",
    "Subcommands",
    "add_client_security_flags",
    "add_metrics_flags",
    "add_server_security_flags",
    "deferred",
]

#: What a command module's ``add_subcommands(sub)`` gets: the ``paramserver`` parser's
#: subparsers (``sub.add_parser(NAME, ...)``).
Subcommands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"

#: Where flags are added: a parser or one of its argument groups.
FlagTarget: TypeAlias = argparse._ActionsContainer


def deferred(module: str, function: str) -> Callable[[argparse.Namespace], int]:
    """A command handler that imports ``module`` and calls its ``function(args)`` only when the
    command runs (``parser.set_defaults(func=deferred("paramserver.cli.x", "run"))``)."""

    def run(args: argparse.Namespace) -> int:
        handler = getattr(importlib.import_module(module), function)
        return int(handler(args) or 0)

    run.__qualname__ = run.__name__ = f"deferred({module}:{function})"
    return run


def add_server_security_flags(parser: FlagTarget) -> None:
    """``--tls-cert/--tls-key/--tls-ca/--auth-tokens`` on a server command."""
    g = parser.add_argument_group("security (flags win over PARAMSERVER_TLS_* / _AUTH_TOKENS)")
    g.add_argument("--tls-cert", help="PEM certificate this server presents (turns TLS on)")
    g.add_argument("--tls-key", help="PEM private key of --tls-cert")
    g.add_argument("--tls-ca", help="PEM CA bundle: require client certificates (mutual TLS)")
    g.add_argument(
        "--auth-tokens",
        help="file of 'ROLE TOKEN' lines (roles worker, admin): every RPC needs a bearer token",
    )


def add_client_security_flags(parser: FlagTarget, *, tls: bool = True) -> None:
    """``--tls-ca/--tls-cert/--tls-key/--tls-server-name/--token-file`` on a client command
    (``tls=False``: only the token flag, for commands that take the TLS flags as a server)."""
    g = parser.add_argument_group("client security (flags win over PARAMSERVER_TLS_* / _TOKEN)")
    if tls:
        g.add_argument("--tls-ca", help="PEM CA bundle that signed the server's certificate")
        g.add_argument("--tls-cert", help="PEM client certificate (mutual TLS)")
        g.add_argument("--tls-key", help="PEM private key of --tls-cert")
    g.add_argument("--tls-server-name", help="name on the server's certificate, if not the address")
    g.add_argument(
        "--token-file", help="file holding the bearer token (else PARAMSERVER_TOKEN_FILE/_TOKEN)"
    )


def add_metrics_flags(parser: FlagTarget) -> None:
    """``--metrics-port/--metrics-host/--metrics-token-file/--metrics-tls-cert/--metrics-tls-key``
    (the fields of :class:`~paramserver.security.http_access.MetricsEndpointConfig`) on a
    daemon's command or argument group."""
    parser.add_argument(
        "--metrics-port",
        type=int,
        help="serve Prometheus metrics (/metrics) and the dashboard (/) on this port of "
        "--metrics-host (0 = ephemeral; the bound port is logged: "
        "'metrics on http://HOST:PORT/metrics')",
    )
    parser.add_argument(
        "--metrics-host",
        help="interface of the metrics endpoint (default 127.0.0.1, loopback only; 0.0.0.0 "
        "exposes it, e.g. to a Prometheus in another container)",
    )
    parser.add_argument(
        "--metrics-token-file",
        help="file holding a bearer token every metrics request must present "
        "(Authorization: Bearer TOKEN; others get 401)",
    )
    parser.add_argument("--metrics-tls-cert", help="PEM certificate: serve the metrics over HTTPS")
    parser.add_argument("--metrics-tls-key", help="PEM private key of --metrics-tls-cert")
