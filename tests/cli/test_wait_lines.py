"""The command line says what it waits for (issue 28, item 3) and names a server the same way
on every subcommand (item 4): real ``paramserver`` processes."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from paramserver.cli.main import build_parser
from paramserver.cli.server_arg import server_address
from paramserver.errors import InvalidArgument
from tests.harness import ScriptProcess, ServerProcess, eventually, free_port

pytestmark = pytest.mark.timeout(240)

RETRY_DEADLINE_S = 20.0


@pytest.mark.slow
async def test_a_worker_given_a_dead_address_says_so_early_and_every_few_seconds(
    tmp_path: Path,
) -> None:
    """Nothing listens at the address: before its final Unavailable the worker prints lines
    naming the address, the reason and the retry deadline, the first early in the retry window
    (its "N s left" close to the whole deadline), the next ones every ~5 s. Measured against
    the deadline the line itself states, not wall time: a loaded 2-core machine may take
    seconds just to import."""
    address = f"127.0.0.1:{free_port()}"
    t_start = time.monotonic()
    worker = ScriptProcess(
        tmp_path,
        "worker",
        [
            "-m",
            "paramserver",
            "worker",
            address,
            "--worker-index",
            "0",
            "--num-workers",
            "1",
            "--retry-deadline-s",
            str(RETRY_DEADLINE_S),
        ],
    )
    try:
        marker = f"paramserver worker: waiting for {address} ("
        await eventually(
            lambda: marker in worker.stderr() or worker.proc.poll() is not None,
            timeout_s=60,
            what="the first wait line",
        )
        t_line = time.monotonic()
        assert await worker.wait_exit(timeout_s=120) == 1
        t_end = time.monotonic()
    finally:
        worker.close()
    lines = worker.stderr().splitlines()
    waits = [i for i, line in enumerate(lines) if line.startswith(marker)]
    fatal = [i for i, line in enumerate(lines) if "Unavailable (UNAVAILABLE)" in line]
    assert waits and fatal and waits[-1] < fatal[0], lines  # said before giving up
    first = lines[waits[0]]
    match = re.search(
        r"\(connection refused; retrying until \d\d:\d\d:\d\d, (\d+) s left\)$", first
    )
    assert match, first
    # early in the retry window: at most half of it had passed (nominally 1 s of 20)
    assert int(match.group(1)) >= RETRY_DEADLINE_S / 2, first
    assert t_line - t_start < t_end - t_start, (t_line - t_start, t_end - t_start)
    assert len(waits) >= 2, lines  # and again while the wait lasted (every ~5 s)


@pytest.mark.slow
def test_health_takes_the_address_as_written_or_as_server(tmp_path: Path) -> None:
    server = ServerProcess(tmp_path, "--consistency", "asp")
    try:
        for argv in (["health", server.address], ["health", "--server", server.address]):
            run = subprocess.run(
                [sys.executable, "-m", "paramserver", *argv],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert run.returncode == 0, run.stderr
            assert run.stdout.strip() == f"{server.address}: SERVING"
    finally:
        server.stop()


@pytest.mark.parametrize(
    "command",
    [
        ["status"],
        ["health"],
        ["checkpoint"],
        ["worker", "--worker-index", "0", "--num-workers", "1"],
        ["cluster-check", "--results-dir", "r", "--expect", "w"],
    ],
)
def test_every_subcommand_names_its_server_as_addr_or_server(command: list[str]) -> None:
    parser = build_parser()
    name, rest = command[0], command[1:]
    assert server_address(parser.parse_args([name, "h:1", *rest])) == "h:1"
    assert server_address(parser.parse_args([name, "--server", "h:1", *rest])) == "h:1"
    assert server_address(parser.parse_args([name, "h:1", "--server", "h:1", *rest])) == "h:1"
    with pytest.raises(InvalidArgument, match="given twice"):
        server_address(parser.parse_args([name, "h:1", "--server", "h:2", *rest]))
    with pytest.raises(InvalidArgument, match="give the server as ADDR or --server ADDR"):
        server_address(parser.parse_args([name, *rest]))
    (subparsers,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    usage = subparsers.choices[name].format_usage()
    assert "[ADDR]" in usage and "--server ADDR" in usage, usage
