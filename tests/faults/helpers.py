"""Helpers of the fault-injection suite: restartable servers on a fixed port, worker processes
whose JSON reports are collected, raw status calls, an independent checkpoint reader, and a
timing report.

Every wait polls a condition (:func:`integration.ps_helpers.eventually`) with a deadline; no
helper sleeps to synchronise.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc
import numpy as np
from integration.ps_helpers import eventually
from safetensors.numpy import load_file

from paramserver.api.v1 import parameter_server_pb2 as pb
from paramserver.api.v1 import parameter_server_pb2_grpc as pb_grpc

__all__ = [
    "Server",
    "WorkerProcess",
    "eventually",
    "free_port",
    "report",
    "rss_bytes",
    "status",
    "verify_checkpoint",
    "wait_serving",
]

WORKER_SCRIPT = Path(__file__).with_name("worker_main.py")
FAILPOINT_SCRIPT = Path(__file__).with_name("failpoint_server.py")


def free_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago (bound to port 0, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def report(fault: str, **measured: Any) -> None:
    """Print one measurement line (``pytest -s`` shows them; docs/durability.md quotes them)."""
    values = ", ".join(
        f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in measured.items()
    )
    print(f"\n[fault-timing] {fault}: {values}", flush=True)


def rss_bytes(pid: int) -> int:
    """Resident set size of a process of this host in bytes (Linux /proc)."""
    with open(f"/proc/{pid}/statm", encoding="ascii") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def verify_checkpoint(path: Path) -> dict[str, Any]:
    """Read a committed checkpoint independently of the product's reader: recompute every
    tensor's sha256 against the manifest (AssertionError on any mismatch). Returns
    ``{"tensors": name -> array of the manifest's shape, "manifest": dict}``."""
    manifest = json.loads((path / "manifest.json").read_text())
    tensors = load_file(str(path / "tensors.safetensors"))
    assert set(tensors) == set(manifest["tensors"]), path
    for name, info in manifest["tensors"].items():
        digest = hashlib.sha256(np.ascontiguousarray(tensors[name]).tobytes()).hexdigest()
        assert digest == info["sha256"], f"{path.name}: checksum of {name}"
        tensors[name] = tensors[name].reshape(info["shape"])
    return {"tensors": tensors, "manifest": manifest}


class Server:
    """``paramserver serve`` on one fixed 127.0.0.1 port, killed and restarted at will.

    The port is picked once (:func:`free_port`) so clients that ride through a restart find
    the successor at the same address. Use as a context manager: every process it started is
    killed on exit.

    Args:
        tmp: Directory for port files and logs.
        *args: ``paramserver serve`` flags (``--host``/``--port`` are set here); :attr:`args`
            may be changed between starts.
    """

    def __init__(self, tmp: Path, *args: str) -> None:
        self.tmp = tmp
        self.args = args
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.incarnations: list[tuple[subprocess.Popen[bytes], Path]] = []
        self.spawned_at = 0.0

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        """The newest process."""
        return self.incarnations[-1][0]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def start(self, *, failpoint: str | None = None) -> float:
        """Start a process and wait until it serves (its port file appears); returns seconds
        from spawn to serving. ``failpoint``: run it under ``failpoint_server.py POINT``."""
        n = len(self.incarnations)
        port_file = self.tmp / f"server-{self.port}-{n}.port"
        log_path = self.tmp / f"server-{self.port}-{n}.log"
        launcher = [str(FAILPOINT_SCRIPT), failpoint] if failpoint else ["-m", "paramserver"]
        cmd = [
            sys.executable,
            *launcher,
            "serve",
            *self.args,
            *("--host", "127.0.0.1", "--port", str(self.port), "--port-file", str(port_file)),
        ]
        self.spawned_at = time.monotonic()
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        self.incarnations.append((proc, log_path))
        deadline = self.spawned_at + 60
        while not port_file.exists():
            if proc.poll() is not None:
                raise RuntimeError(f"server exited ({proc.returncode}): {self.log()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"server did not start within 60 s: {self.log()}")
            time.sleep(0.005)
        return time.monotonic() - self.spawned_at

    async def astart(self, *, failpoint: str | None = None) -> float:
        """:meth:`start` off the event loop (clients in this loop keep running meanwhile)."""
        return await asyncio.to_thread(functools.partial(self.start, failpoint=failpoint))

    def kill(self) -> None:
        """SIGKILL the newest process and reap it."""
        self.proc.kill()
        self.proc.wait()

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    async def wait_exit(self, timeout_s: float) -> int | None:
        """Wait (off the event loop) until the newest process exits; its exit code, or None
        when it is still running after ``timeout_s``."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            await asyncio.to_thread(self.proc.wait, max(0.0, timeout_s))
        return self.proc.poll()

    def log(self) -> str:
        """Every incarnation's log, oldest first."""
        return "\n".join(
            f"--- incarnation {i}\n{path.read_text(errors='replace')}"
            for i, (_, path) in enumerate(self.incarnations)
        )

    def last_log(self) -> str:
        """The newest incarnation's log."""
        return self.incarnations[-1][1].read_text(errors="replace")

    def __enter__(self) -> Server:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for proc, _ in self.incarnations:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


async def status(address: str, timeout_s: float = 5.0) -> pb.StatusResponse:
    """The server's Status over a fresh channel (raises AioRpcError when it does not answer)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.ParameterServerStub(channel)
        return await stub.Status(pb.StatusRequest(), timeout=timeout_s)


async def wait_serving(address: str, timeout_s: float = 30.0) -> pb.StatusResponse:
    """Poll Status until the server answers; returns that answer."""
    got: list[pb.StatusResponse] = []

    async def answers() -> bool:
        try:
            got.append(await status(address, timeout_s=1.0))
        except grpc.aio.AioRpcError:
            return False
        return True

    await eventually(answers, timeout_s=timeout_s, what=f"{address} answers Status")
    return got[-1]


class WorkerProcess:
    """``tests/faults/worker_main.py MODE ARGS`` as a subprocess; its JSON lines are collected.

    Each event gets ``received`` (this process's monotonic clock when the line was read).
    """

    def __init__(self, tmp: Path, mode: str, *args: str) -> None:
        self.log_path = tmp / f"worker-{mode}-{time.monotonic_ns()}.log"
        self._err = open(self.log_path, "wb")  # closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER_SCRIPT), mode, *args],
            stdout=subprocess.PIPE,
            stderr=self._err,
            text=True,
        )
        self.events: list[dict[str, Any]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            event["received"] = time.monotonic()
            self.events.append(event)

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in list(self.events) if e["event"] == kind]

    async def wait_for(self, kind: str, count: int = 1, timeout_s: float = 30.0) -> dict[str, Any]:
        """Poll until ``count`` events of ``kind`` arrived; returns the last one."""

        def arrived() -> bool:
            if len(self.of(kind)) >= count:
                return True
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"worker exited ({self.proc.returncode}) before {count} {kind!r} events: "
                    f"{self.stderr()[-3000:]}"
                )
            return False

        await eventually(arrived, timeout_s=timeout_s, what=f"{count} {kind!r} events")
        return self.of(kind)[count - 1]

    async def wait_exit(self, timeout_s: float = 30.0) -> int:
        await eventually(
            lambda: self.proc.poll() is not None, timeout_s=timeout_s, what="worker exits"
        )
        return int(self.proc.returncode)

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stderr(self) -> str:
        return self.log_path.read_text(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._reader.join(timeout=5)
        self._err.close()
