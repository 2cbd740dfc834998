"""Helpers for integration tests: in-process servers, server subprocesses, polling."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from paramserver.cli.serve import daemon_for
from paramserver.server.config import ServerConfig


@asynccontextmanager
async def running_server(**config: Any) -> AsyncIterator[Any]:
    """An in-process server on 127.0.0.1, ephemeral port (the daemon of ``mode``)."""
    config.setdefault("host", "127.0.0.1")
    config.setdefault("port", 0)
    daemon = daemon_for(ServerConfig(**config))
    await daemon.start()
    try:
        yield daemon
    finally:
        await daemon.stop(grace_s=0.2)


async def eventually(
    predicate: Callable[[], bool | Awaitable[bool]], *, timeout_s: float = 10.0, what: str = ""
) -> None:
    """Poll ``predicate`` until true; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    delay = 0.005
    while True:
        result = predicate()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s: {what}")
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.1)


class ServerProcess:
    """``paramserver serve`` as a real subprocess on 127.0.0.1 with an ephemeral port."""

    def __init__(self, tmp: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.port_file = tmp / f"port-{time.monotonic_ns()}"
        self.log_path = tmp / f"server-{time.monotonic_ns()}.log"
        cmd = [
            sys.executable,
            "-m",
            "paramserver",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--port-file",
            str(self.port_file),
            *args,
        ]
        self._log = open(self.log_path, "wb")  # closed in stop()
        full_env = dict(os.environ)
        full_env.update(env or {})
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=full_env)
        deadline = time.monotonic() + 30
        while not self.port_file.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.log_path.read_text()}")
            if time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError("server did not start within 30 s")
            time.sleep(0.02)
        self.port = int(self.port_file.read_text())
        self.address = f"127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 15) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode
