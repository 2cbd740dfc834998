"""Servers for the conformance suite: real server processes on 127.0.0.1, reached only through
the .proto contract.

By default each server is ``python -m paramserver serve``. To run the suite against another
implementation, set ``PARAMSERVER_CONFORMANCE_SERVE`` to its command line with the fields
``{host}``, ``{port}``, ``{consistency}`` (bsp, ssp or asp), ``{staleness}`` and ``{lease_ms}``,
e.g.::

    PARAMSERVER_CONFORMANCE_SERVE='./my-ps --listen {host}:{port} --mode {consistency} \\
        --staleness {staleness} --lease-ms {lease_ms}' pytest tests/conformance

``{lease_ms}`` is :data:`SUITE_LEASE_MS` (10 minutes): the suite's raw workers heartbeat only
where a test is about heartbeats, so on a loaded machine a short lease would evict them between
two requests; the test of the default lease asks for 10000, the contract's default.

The placement test starts one shard of a cluster (:func:`serve` with ``shard``): the
template's fields ``{shard_index}`` and ``{shard_addresses}`` (``host:port,...``, one per
shard; the other shards need not run) say which; a template without ``{shard_addresses}``
skips that test. A plain server gets ``{shard_index}`` 0 and ``{shard_addresses}`` its own
address.

The server must listen on the port it is given; the suite waits until a TCP connection to it
succeeds (30 s at most on an idle machine, scaled with the load: tests/harness/timing.py).
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

from tests.harness.timing import scaled

START_TIMEOUT_S = 30.0
#: The lease the suite's servers grant (see the module docstring).
SUITE_LEASE_MS = 600_000
#: The contract's default lease (a server given no lease flag grants it).
DEFAULT_LEASE_MS = 10_000


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


def _command(
    port: int,
    consistency: str,
    staleness: int,
    lease_ms: int | None,
    shard: tuple[int, list[str]] | None = None,
) -> list[str]:
    """``lease_ms`` None: the server's default lease (a template is given DEFAULT_LEASE_MS);
    ``shard``: (index, every shard's address) of a shard of a cluster."""
    template = os.environ.get("PARAMSERVER_CONFORMANCE_SERVE")
    fields: dict[str, object] = {"host": "127.0.0.1", "port": port, "consistency": consistency}
    fields["staleness"] = staleness
    fields["lease_ms"] = DEFAULT_LEASE_MS if lease_ms is None else lease_ms
    index, addresses = shard if shard is not None else (0, [f"127.0.0.1:{port}"])
    fields["shard_index"] = index
    fields["shard_addresses"] = ",".join(addresses)
    if template:
        if shard is not None and "{shard_addresses}" not in template:
            pytest.skip("PARAMSERVER_CONFORMANCE_SERVE has no {shard_addresses} field")
        return shlex.split(template.format(**fields))
    lease = () if lease_ms is None else ("--lease-ms", str(lease_ms))
    sharding = () if shard is None else ("--shard-index", str(index))
    sharding += () if shard is None else ("--shard-addresses", ",".join(addresses))
    return [
        sys.executable,
        "-m",
        "paramserver",
        "serve",
        *("--host", "127.0.0.1", "--port", str(port)),
        *("--consistency", consistency, "--staleness", str(staleness)),
        "--no-shared-memory",
        *lease,
        *sharding,
    ]


@contextmanager
def serve(
    tmp: Path,
    consistency: str,
    staleness: int = 0,
    lease_ms: int | None = SUITE_LEASE_MS,
    *,
    shard: tuple[int, int] | None = None,
) -> Iterator[ServerUnderTest]:
    """A server process; killed and reaped on exit, pass or fail. ``lease_ms`` None: the
    server's default lease. ``shard``: (index, count): the server is shard ``index`` of a
    cluster of ``count`` (the other shards' addresses are placeholders; they do not run)."""
    port = _free_port()
    placement = None
    if shard is not None:
        index, count = shard
        addresses = [f"127.0.0.1:{port if k == index else _free_port()}" for k in range(count)]
        placement = (index, addresses)
    log_path = tmp / f"conformance-{consistency}-{port}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            _command(port, consistency, staleness, lease_ms, placement),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = ServerUnderTest(f"127.0.0.1:{port}", consistency, staleness, proc, log_path)
    try:
        start_timeout_s = scaled(START_TIMEOUT_S)
        deadline = time.monotonic() + start_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited ({proc.returncode}): {server.log()}")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    break
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"not listening after {start_timeout_s:.0f} s: {server.log()}"
                    ) from exc
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
    [("ssp", 1)], indirect=True)``; a third item is the lease (None: the default)."""
    consistency, staleness, *lease = request.param
    with serve(tmp_path, consistency, staleness, *lease) as server:
        yield server
