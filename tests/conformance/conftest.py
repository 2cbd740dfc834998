"""Servers for the conformance suite: real server processes on 127.0.0.1, reached only through
the .proto contract.

By default each server is ``python -m paramserver serve``. To run the suite against another
implementation, set ``PARAMSERVER_CONFORMANCE_SERVE`` to its command line with the fields
``{host}``, ``{port}``, ``{consistency}`` (bsp, ssp or asp) and ``{staleness}``, e.g.::

    PARAMSERVER_CONFORMANCE_SERVE='./my-ps --listen {host}:{port} --mode {consistency} \\
        --staleness {staleness}' pytest tests/conformance

The server must listen on the port it is given; the suite waits until a TCP connection to it
succeeds (30 s at most).
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

START_TIMEOUT_S = 30.0


@dataclass
class ServerUnderTest:
    address: str
    consistency: str
    staleness: int
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _command(port: int, consistency: str, staleness: int) -> list[str]:
    template = os.environ.get("PARAMSERVER_CONFORMANCE_SERVE")
    fields = {"host": "127.0.0.1", "port": port, "consistency": consistency}
    fields["staleness"] = staleness
    if template:
        return shlex.split(template.format(**fields))
    return [
        sys.executable,
        "-m",
        "paramserver",
        "serve",
        *("--host", "127.0.0.1", "--port", str(port)),
        *("--consistency", consistency, "--staleness", str(staleness)),
        "--no-shared-memory",
    ]


@contextmanager
def serve(tmp: Path, consistency: str, staleness: int = 0) -> Iterator[ServerUnderTest]:
    """A server process; killed and reaped on exit, pass or fail."""
    port = _free_port()
    log_path = tmp / f"conformance-{consistency}-{port}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            _command(port, consistency, staleness),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = ServerUnderTest(f"127.0.0.1:{port}", consistency, staleness, proc, log_path)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited ({proc.returncode}): {server.log()}")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    break
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"not listening after 30 s: {server.log()}") from exc
                time.sleep(0.02)
        yield server
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def asp_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerUnderTest]:
    """One ASP server shared by a module's tests (each test uses its own keys and names)."""
    with serve(tmp_path_factory.mktemp("asp"), "asp") as server:
        yield server


@pytest.fixture
def fresh_server(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[ServerUnderTest]:
    """A server of its own for one test: ``@pytest.mark.parametrize("fresh_server",
    [("ssp", 1)], indirect=True)``."""
    consistency, staleness = request.param
    with serve(tmp_path, consistency, staleness) as server:
        yield server
