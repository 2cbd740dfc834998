"""The command line starts without the library: ``paramserver --help`` imports no command's
module, ``paramserver COMMAND --help`` only the command's own (and no grpc, numpy or
library module), and ``paramserver health`` (run by container probes every few
seconds) loads grpc and the health stub but nothing of the servers or the client library.

Structural checks (which modules a fresh interpreter loaded), not timings: how fast the
command starts is measured, not asserted."""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from paramserver.cli.main import COMMANDS, build_parser
from tests.harness.timing import scaled

pytestmark = pytest.mark.timeout(120)

#: Modules no parser may load: what a command runs, never what its flags are.
HEAVY = (
    "numpy",
    "grpc",
    "google.protobuf",
    "ml_dtypes",
    "torch",
    "paramserver.api",
    "paramserver.core",
    "paramserver.errors",
    "paramserver.integrations",
    "paramserver.protocol",
    "paramserver.reduction",
    "paramserver.security",
    "paramserver.server",
    "paramserver.serving",
    "paramserver.spmd",
    "paramserver.worker_client",
)

#: What ``paramserver health`` may never load.
NOT_FOR_HEALTH = (
    "numpy",
    "paramserver.api",
    "paramserver.core",
    "paramserver.integrations",
    "paramserver.reduction",
    "paramserver.server",
    "paramserver.serving",
    "paramserver.spmd",
    "paramserver.worker_client",
)

RUN = """
import contextlib, io, json, sys
from paramserver.cli.main import main
out = io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
    try:
        code = main(sys.argv[1:])
    except SystemExit as exit_:
        code = exit_.code
print(json.dumps({"code": code, "output": out.getvalue(), "modules": sorted(sys.modules)}))
"""


def _run(*argv: str) -> dict[str, object]:
    proc = subprocess.run(
        [sys.executable, "-c", RUN, *argv],
        capture_output=True,
        text=True,
        timeout=scaled(60),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result: dict[str, object] = json.loads(proc.stdout.splitlines()[-1])
    return result


def _loaded(modules: object, prefixes: tuple[str, ...]) -> list[str]:
    assert isinstance(modules, list)
    return [m for m in modules if any(m == p or m.startswith(p + ".") for p in prefixes)]


def test_the_top_level_help_imports_no_command_module() -> None:
    result = _run("--help")
    assert result["code"] == 0
    assert "ray-launch" in str(result["output"])
    assert _loaded(result["modules"], HEAVY) == []
    command_modules = tuple({module for module, _ in COMMANDS.values()})
    assert _loaded(result["modules"], command_modules) == []


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_commands_help_imports_its_module_and_nothing_heavy(command: str) -> None:
    result = _run(command, "--help")
    assert result["code"] == 0
    assert f"usage: paramserver {command}" in str(result["output"])
    assert COMMANDS[command][0] in result["modules"]  # type: ignore[operator]
    assert _loaded(result["modules"], HEAVY) == []


@pytest.mark.parametrize("module", sorted({m for m, _ in COMMANDS.values()}))
def test_a_command_module_registers_the_commands_the_table_gives_it(module: str) -> None:
    sub = argparse.ArgumentParser().add_subparsers()
    importlib.import_module(module).add_subcommands(sub)
    assert set(sub.choices) == {name for name, (m, _) in COMMANDS.items() if m == module}


def test_the_full_parser_lists_every_command_with_the_tables_help() -> None:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    listed = {c.dest: c.help for c in action._choices_actions}
    assert listed == {name: help_line for name, (_, help_line) in COMMANDS.items()}


def test_serve_help_states_the_allocators_limits() -> None:
    from paramserver.server.allocator import (
        DEFAULT_RETAIN_BYTES,
        MAX_RETAIN_BYTES,
        MIN_RETAIN_BYTES,
    )

    text = " ".join(_run("serve", "--help")["output"].split())  # type: ignore[union-attr]
    for value in (DEFAULT_RETAIN_BYTES, MIN_RETAIN_BYTES, MAX_RETAIN_BYTES):
        assert str(value) in text
    assert f"{DEFAULT_RETAIN_BYTES >> 20} MiB" in text


@pytest.fixture
def health_server() -> Iterator[str]:
    """A gRPC server with only the standard health service, SERVING, on 127.0.0.1."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(None).wait()


def test_health_loads_grpc_and_the_health_stub_only(health_server: str) -> None:
    result = _run("health", health_server, "--timeout-s", str(scaled(10)))
    assert result["code"] == 0, result["output"]
    assert str(result["output"]).strip() == f"{health_server}: SERVING"
    modules = result["modules"]
    assert _loaded(modules, ("grpc_health.v1.health_pb2_grpc",)) != []
    assert _loaded(modules, NOT_FOR_HEALTH) == []
