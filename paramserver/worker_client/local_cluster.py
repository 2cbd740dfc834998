"""Start ``paramserver serve`` shard processes on 127.0.0.1 (demo, benchmarks, tests).

A sharded cluster's shard map lists every shard's address, so each shard must know the others'
ports before it serves: :func:`start_servers` reserves free ports first (bind to port 0, read,
release), then starts shard i with ``--port p_i --shard-index i --shard-addresses ...``. One
shard is started on an ephemeral port (``--port 0 --port-file``) as before.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct TCP ports free right now on ``host`` (all held until all are read)."""
    with ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind((host, 0))
            ports.append(int(sock.getsockname()[1]))
        return ports


def start_servers(
    serve_cmd: Sequence[str],
    shards: int,
    work_dir: Path,
    *,
    env: Mapping[str, str] | None = None,
    slice_bytes: int | None = None,
    extra: Sequence[Sequence[str]] | None = None,
    timeout_s: float = 30.0,
    stdout: int | None = None,
) -> tuple[list[subprocess.Popen[bytes]], list[str]]:
    """Start ``shards`` server processes and wait until each serves.

    Args:
        serve_cmd: The command up to and including ``serve`` plus shared flags (no host/port).
        shards: Number of shards (1: a single server on an ephemeral port).
        work_dir: Where the port files go.
        env: Environment of the processes (default: this one's).
        slice_bytes: ``--slice-bytes`` of a sharded cluster.
        extra: Extra flags per shard (e.g. its own ``--checkpoint-dir``).
        timeout_s: How long each may take to start.
        stdout: Where their output goes (default: inherited).

    Returns:
        The processes and their addresses, in shard order.

    Raises:
        RuntimeError: a server exited or did not serve in time (the others are stopped).
    """
    ports = free_ports(shards) if shards > 1 else [0]
    addresses = [f"127.0.0.1:{p}" for p in ports]
    procs: list[subprocess.Popen[bytes]] = []
    files = []
    try:
        for i in range(shards):
            port_file = work_dir / f"port-{i}-{time.monotonic_ns()}"
            files.append(port_file)
            cmd = [*serve_cmd, "--host", "127.0.0.1", "--port", str(ports[i])]
            cmd += ["--port-file", str(port_file)]
            if shards > 1:
                cmd += ["--shard-index", str(i), "--shard-addresses", ",".join(addresses)]
                if slice_bytes:
                    cmd += ["--slice-bytes", str(slice_bytes)]
            if extra is not None:
                cmd += list(extra[i])
            penv = dict(env if env is not None else os.environ)
            procs.append(subprocess.Popen(cmd, env=penv, stdout=stdout))
        deadline = time.monotonic() + timeout_s
        for i, (proc, port_file) in enumerate(zip(procs, files, strict=True)):
            while not port_file.exists():
                if proc.poll() is not None:
                    raise RuntimeError(f"server {i} exited early with code {proc.returncode}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"server {i} did not serve within {timeout_s} s")
                time.sleep(0.05)
            if shards == 1:
                addresses[0] = f"127.0.0.1:{int(port_file.read_text())}"
    except BaseException:
        stop_servers(procs)
        raise
    return procs, addresses


def stop_servers(procs: Sequence[subprocess.Popen[bytes]], timeout_s: float = 15.0) -> None:
    """SIGTERM every server (graceful stop, final checkpoint), then wait; kill stragglers."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
