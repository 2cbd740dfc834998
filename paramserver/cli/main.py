"""The ``paramserver`` command line: one subcommand per entry point (``paramserver --help``).

Each subcommand lives beside the code it runs; this module only wires the parsers.
:data:`COMMANDS` names every subcommand's module, which is imported only when that subcommand is
given: ``paramserver --help`` imports none of them, ``paramserver serve ...`` only
:mod:`paramserver.cli.serve`. A command's module keeps its own imports light (argparse, the
standard library, :mod:`paramserver.cli.flags`) and loads what the command runs inside the
handler, so ``paramserver COMMAND --help`` starts as fast as the interpreter.

Adding a command is one entry in :data:`COMMANDS`; its module defines
``add_subcommands(sub)``, which adds the command's parser (``sub.add_parser(NAME, ...)``) and
sets its handler (``set_defaults(func=...)``). Only entry points configure logging handlers.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, NoReturn

from paramserver.cli.logs import LOG_FORMAT_ENV, LOG_FORMATS

if TYPE_CHECKING:
    from paramserver.errors import ParamServerError

#: Every subcommand, in the order ``paramserver --help`` lists them: the module that registers
#: and runs it (imported only when the command is given) and its line in ``paramserver --help``
#: (this one, whatever help the module's ``add_parser`` passes).
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("paramserver.cli.serve", "run a parameter-server shard"),
    "status": (
        "paramserver.cli.serve",
        "print a server's workers, clocks, stragglers and keys (table or JSON)",
    ),
    "checkpoint": ("paramserver.cli.serve", "ask a server to write a checkpoint now"),
    "health": ("paramserver.cli.health", "gRPC health check of a server; exit 0 iff SERVING"),
    "reshard": (
        "paramserver.cli.ops",
        "rewrite a sharded cluster's newest common checkpoint cut for another shard count",
    ),
    "export-tables": (
        "paramserver.cli.export",
        "write embedding tables' stored ids and rows from checkpoints, for serving",
    ),
    "worker": ("paramserver.cli.training", "train the digits model against a running server"),
    "demo": (
        "paramserver.cli.training",
        "start a local cluster (1 server + N workers) training on digits",
    ),
    "torch-demo": (
        "paramserver.cli.training",
        "the demo with torch.nn workers (= demo --framework torch --workers 2)",
    ),
    "cluster-check": (
        "paramserver.cli.cluster_check",
        "verdict job of the compose cluster: jobs' exit codes + the model's accuracy",
    ),
    "rank-server": (
        "paramserver.cli.rank",
        "serve one rank's block pools (G1/G2/G3 + object tier) for an SPMD group",
    ),
    "spmd-demo": (
        "paramserver.cli.rank",
        "two instances x 2 rank servers: fill, offload, onboard, verify, report GB/s",
    ),
    "run": ("paramserver.cli.run", "run your training script as N workers on a local cluster"),
    "ray-launch": (
        "paramserver.cli.ray_launch",
        "run a job on a Ray cluster: shards as actors, workers as tasks (paramserver[ray])",
    ),
}

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


def build_parser(commands: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The ``paramserver`` parser.

    Args:
        commands: The subcommands built with their flags (their modules are imported); every
            other one is only its name and help line. None: every subcommand with its flags.
    """
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
    # A module registers every command it holds (all of COMMANDS' names mapped to it).
    modules = {m for name, (m, _) in COMMANDS.items() if commands is None or name in commands}
    for name, (module, help_line) in COMMANDS.items():
        if module not in modules:  # listed, not built: its module stays unimported
            sub.add_parser(name, help=help_line)
        elif name not in sub.choices:
            importlib.import_module(module).add_subcommands(sub)
    for listed in sub._choices_actions:  # the table's help line, whoever registered it
        listed.help = COMMANDS[listed.dest][1]
    for name, command_parser in sub.choices.items():
        if name in LONG_RUNNING and COMMANDS[name][0] in modules:  # also after the subcommand
            command_parser.add_argument(
                "--log-level",
                default=argparse.SUPPRESS,
                help="logging level (DEBUG, INFO, WARNING, ...)",
            )
            command_parser.add_argument(
                "--log-format",
                choices=LOG_FORMATS,
                default=argparse.SUPPRESS,
                help=f"text (default) or json, one object per line (env {LOG_FORMAT_ENV})",
            )
    return parser


def command_of(argv: Sequence[str]) -> str | None:
    """The subcommand ``argv`` names (the first word that is not an option or the value of
    ``--log-level``/``--log-format``); None when it names none of :data:`COMMANDS`."""
    words = iter(argv)
    for word in words:
        if word in ("--log-level", "--log-format"):
            next(words, None)
        elif not word.startswith("-"):
            return word if word in COMMANDS else None
    return None


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
    import grpc

    from paramserver.cli.logs import wait_printer
    from paramserver.errors import InvalidArgument, ParamServerError, from_rpc_error

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
    words = sys.argv[1:] if argv is None else list(argv)
    command = command_of(words)
    parser = build_parser([command] if command is not None else [])
    args = parser.parse_args(words)  # --help ends here, before anything below is imported
    from paramserver.cli.logs import configure_logging
    from paramserver.errors import InvalidArgument

    try:
        log_format = configure_logging(args.log_level, args.log_format)
    except InvalidArgument as exc:  # a bad PARAMSERVER_LOG_FORMAT
        print(f"paramserver: {error_line(exc)}", file=sys.stderr)
        return 2
    return run_command(f"paramserver {args.command}", args, log_format)


if __name__ == "__main__":
    sys.exit(main())
