"""The ``paramserver`` command line: one subcommand per entry point (``paramserver --help``).

Each subcommand lives beside the code it runs; this module only wires the parsers.
Only entry points configure logging handlers.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from paramserver.errors import InvalidArgument, ParamServerError
from paramserver.logs import LOG_FORMAT_ENV, LOG_FORMATS, configure_logging

#: Subcommands that run until stopped (or train): they take ``--log-format`` after their name too.
LONG_RUNNING = frozenset({"serve", "worker", "rank-server", "demo", "torch-demo", "spmd-demo"})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="paramserver", description=__doc__.splitlines()[0])
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
    from paramserver.server import daemon, ops
    from paramserver.spmd import cli as spmd_cli
    from paramserver.worker_client import cluster_check, training

    for module in (daemon, ops, training, cluster_check, spmd_cli):
        module.add_subcommands(sub)
    for name, command in sub.choices.items():
        if name in LONG_RUNNING:  # also accepted after the subcommand
            command.add_argument(
                "--log-format",
                choices=LOG_FORMATS,
                default=argparse.SUPPRESS,
                help=f"text (default) or json, one object per line (env {LOG_FORMAT_ENV})",
            )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        configure_logging(args.log_level, args.log_format)
    except InvalidArgument as exc:  # a bad PARAMSERVER_LOG_FORMAT
        print(f"paramserver: {exc}", file=sys.stderr)
        return 2
    try:
        rc = args.func(args)
    except ParamServerError as exc:
        # A refusal or an unreachable peer: one line naming what was wrong, not a traceback.
        print(f"paramserver {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, InvalidArgument) else 1
    except KeyboardInterrupt:
        print(f"paramserver {args.command}: interrupted", file=sys.stderr)
        return 130
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
