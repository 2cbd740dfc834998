"""The ``paramserver`` command line: one subcommand per entry point (``paramserver --help``).

Each subcommand lives beside the code it runs; this module only wires the parsers.
Only entry points configure logging handlers.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import NoReturn

import grpc

from paramserver.cli.logs import LOG_FORMAT_ENV, LOG_FORMATS, configure_logging, wait_printer
from paramserver.errors import InvalidArgument, ParamServerError, from_rpc_error

#: Subcommands that run until stopped (or train): they take ``--log-level`` and ``--log-format``
#: after their name too.
LONG_RUNNING = frozenset({"serve", "worker", "rank-server", "demo", "torch-demo", "spmd-demo"})


class _OneLineParser(argparse.ArgumentParser):
    """argparse with its errors on one line (``prog: error: message (see prog --help)``, exit
    2) instead of the usage block first: every failing command prints one line."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


DESCRIPTION = (
    "paramserver: a parameter server for distributed training (BSP, SSP and ASP consistency, "
    "server-side optimizers, leases, write-ahead log, checkpoints) and an SPMD block-transfer "
    "layer. Start with 'paramserver demo'; 'paramserver COMMAND --help' lists a command's flags."
)


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="paramserver", description=DESCRIPTION)
    parser.add_argument(
        "--log-level", default="INFO", help="logging level (DEBUG, INFO, WARNING, ...)"
    )
    parser.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default=None,
        help=f"text (default) or json: one JSON object per line (env {LOG_FORMAT_ENV})",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    # Imported here, not at module level, so `paramserver --help` stays cheap to reach.
    from paramserver.cli import cluster_check, ops
    from paramserver.cli import rank as spmd_cli
    from paramserver.cli import ray_launch as ray_cli
    from paramserver.cli import serve as daemon
    from paramserver.cli.demos import digits as training

    for module in (daemon, ops, training, cluster_check, spmd_cli, ray_cli):
        module.add_subcommands(sub)
    for name, command in sub.choices.items():
        if name in LONG_RUNNING:  # also accepted after the subcommand
            command.add_argument(
                "--log-level",
                default=argparse.SUPPRESS,
                help="logging level (DEBUG, INFO, WARNING, ...)",
            )
            command.add_argument(
                "--log-format",
                choices=LOG_FORMATS,
                default=argparse.SUPPRESS,
                help=f"text (default) or json, one object per line (env {LOG_FORMAT_ENV})",
            )
    return parser


def error_line(exc: ParamServerError) -> str:
    """The one-line form of a fatal error: ``<ErrorClass> (<STATUS_CODE>): <message>``, e.g.
    ``Unavailable (UNAVAILABLE): could not bind 127.0.0.1:50051: address in use``. A failed
    RPC is first mapped to its class by :func:`paramserver.errors.from_rpc_error`. Advice that
    names an option (``exc.hint``, :class:`paramserver.errors.OptionHint`) names the flag here
    (``--replace``) where the library's message names the keyword (``replace=True``)."""
    message = exc.message
    if exc.hint is not None:
        message = message.replace(exc.hint.python(), exc.hint.cli())
    prefix = f"{exc.code.name}: "
    if message.startswith(prefix):  # from_rpc_error's generic class repeats the code
        message = message[len(prefix) :]
    return f"{type(exc).__name__} ({exc.code.name}): {message}"


def run_command(prog: str, args: argparse.Namespace, log_format: str) -> int:
    """Run ``args.func(args)``; a :class:`ParamServerError` or a failed RPC ends the command
    with one line (no traceback): ``<prog>: <ErrorClass> (<STATUS>): <message>`` on stderr, or
    with ``log_format == "json"`` one JSON log record at level ERROR (fields ``error`` and
    ``code`` beside the message). Exit status: 2 for bad input or usage (INVALID_ARGUMENT),
    1 for any other error, 130 on Ctrl-C. While it runs, every wait it sits in is shown
    (:func:`paramserver.cli.logs.wait_printer`)."""
    try:
        with wait_printer(prog, log_format):
            return int(args.func(args) or 0)
    except (ParamServerError, grpc.RpcError) as raw:
        exc = raw if isinstance(raw, ParamServerError) else from_rpc_error(raw)
        line = f"{prog}: {error_line(exc)}"
        if log_format == "json":
            logging.getLogger("paramserver.cli.main").error(
                line, extra={"error": type(exc).__name__, "code": exc.code.name}
            )
        else:
            print(line, file=sys.stderr)
        return 2 if isinstance(exc, InvalidArgument) else 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        log_format = configure_logging(args.log_level, args.log_format)
    except InvalidArgument as exc:  # a bad PARAMSERVER_LOG_FORMAT
        print(f"paramserver: {error_line(exc)}", file=sys.stderr)
        return 2
    return run_command(f"paramserver {args.command}", args, log_format)


if __name__ == "__main__":
    sys.exit(main())
