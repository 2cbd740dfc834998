"""The suite's one process harness: every server and worker process a test starts.

* :class:`ServerProcess` runs ``paramserver serve`` on 127.0.0.1; the first start takes an
  ephemeral port (``--port 0 --port-file``), later starts reuse it, so clients that ride
  through a kill and restart find the successor at the same address.
* :class:`ScriptProcess` runs one of this package's scripts (or any command) with its
  stderr in a log file; :class:`JsonWorker` collects the JSON lines a worker prints,
  :class:`PlanWorker` waits for the ``READY`` line of :mod:`tests.harness.plan_worker`.

Each is a context manager (:class:`paramserver.closing.Closing`: every process it started is
killed and reaped on exit, pass or fail), and every wait has a deadline. The session's check in
``tests/conftest.py`` fails the run if a process is still left at the end anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from signal import SIGKILL, SIGTERM
from typing import Any

import grpc

from paramserver.api.v1 import parameter_server_pb2 as pb
from paramserver.api.v1 import parameter_server_pb2_grpc as pb_grpc
from paramserver.closing import Closing

from .polling import eventually
from .timing import scaled

HERE = Path(__file__).resolve().parent
#: The fault-injection suite's worker (``fault_worker.py MODE ARGS``).
FAULT_WORKER = HERE / "fault_worker.py"
#: ``paramserver`` under a checkpoint failpoint (``failpoint_server.py POINT serve ARGS``).
FAILPOINT_SERVER = HERE / "failpoint_server.py"
#: A worker that runs a plan of pushes and then hangs or leaves (``plan_worker.py``).
PLAN_WORKER = HERE / "plan_worker.py"
#: A reduction-service worker (``reduce_worker.py``).
REDUCE_WORKER = HERE / "reduce_worker.py"
#: How long a server process gets to write its port file on an idle machine (scaled).
START_TIMEOUT_S = 60.0


def free_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago (bound to port 0, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rss_bytes(pid: int) -> int:
    """Resident set size of a process of this host in bytes (Linux /proc)."""
    with open(f"/proc/{pid}/statm", encoding="ascii") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reap(proc: subprocess.Popen[Any], sig: int = SIGKILL, timeout_s: float = 15) -> int:
    """Send ``sig`` to a live process and wait for it (SIGKILL after ``timeout_s``)."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return int(proc.returncode)


class ServerProcess(Closing):
    """``paramserver serve`` as real subprocesses on 127.0.0.1, killed and restarted at will.

    Args:
        tmp: Directory for port files and logs.
        *args: ``paramserver serve`` flags (``--host``/``--port``/``--port-file`` are set
            here); :attr:`args` may be changed between starts.
        env: Extra environment of the processes.
        start: Start the first process now (and wait until it serves).
        port: The port of every incarnation; default: an ephemeral one picked by the first.
    """

    def __init__(
        self,
        tmp: Path,
        *args: str,
        env: dict[str, str] | None = None,
        start: bool = True,
        port: int = 0,
    ) -> None:
        owned = {"--host", "--port", "--port-file"}.intersection(args)
        if owned:
            raise ValueError(f"ServerProcess sets {sorted(owned)} itself (use port=...)")
        self.tmp = tmp
        self.args: Sequence[str] = args
        self.env = env
        self.port = port
        self.incarnations: list[tuple[subprocess.Popen[bytes], Path]] = []
        #: Monotonic time of the newest spawn.
        self.spawned_at = 0.0
        if start:
            self.start()

    @property
    def address(self) -> str:
        if not self.port:
            raise RuntimeError("the server has no port yet: start it first")
        return f"127.0.0.1:{self.port}"

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
        stem = f"server-{time.monotonic_ns()}-{n}"
        port_file = self.tmp / f"{stem}.port"
        log_path = self.tmp / f"{stem}.log"
        launcher = [str(FAILPOINT_SERVER), failpoint] if failpoint else ["-m", "paramserver"]
        cmd = [
            sys.executable,
            *launcher,
            "serve",
            *self.args,
            *("--host", "127.0.0.1", "--port", str(self.port), "--port-file", str(port_file)),
        ]
        env = {**os.environ, **(self.env or {})}
        self.spawned_at = time.monotonic()
        with open(log_path, "wb") as log:  # the child holds its own descriptor
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.incarnations.append((proc, log_path))
        start_timeout_s = scaled(START_TIMEOUT_S)
        deadline = self.spawned_at + start_timeout_s
        try:
            while not port_file.exists() or not port_file.read_text().strip():
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited ({proc.returncode}): {self.log()}")
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"server did not start within {start_timeout_s:.0f} s: {self.log()}"
                    )
                time.sleep(0.005)
        except BaseException:  # a failed start (or a test timeout meanwhile) leaves nothing
            _reap(proc)
            raise
        self.port = int(port_file.read_text())
        return time.monotonic() - self.spawned_at

    async def astart(self, *, failpoint: str | None = None) -> float:
        """:meth:`start` off the event loop (clients in this loop keep running meanwhile)."""
        return await asyncio.to_thread(functools.partial(self.start, failpoint=failpoint))

    def kill(self) -> None:
        """SIGKILL the newest process and reap it."""
        _reap(self.proc)

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self, sig: int = SIGTERM, timeout_s: float = 15) -> int:
        """Send ``sig`` to the newest process and reap it (SIGKILL after ``timeout_s``);
        returns its exit status."""
        return _reap(self.proc, sig, timeout_s)

    async def wait_exit(self, timeout_s: float) -> int | None:
        """Wait (off the event loop) until the newest process exits; its exit code, or None
        when it is still running after ``timeout_s``."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            await asyncio.to_thread(self.proc.wait, max(0.0, timeout_s))
        return self.proc.poll()

    def log(self) -> str:
        """Every incarnation's log, oldest first (headed by its number when there are
        several)."""
        if len(self.incarnations) == 1:
            return self.last_log()
        return "\n".join(
            f"--- incarnation {i}\n{path.read_text(errors='replace')}"
            for i, (_, path) in enumerate(self.incarnations)
        )

    def last_log(self) -> str:
        """The newest incarnation's log."""
        return self.incarnations[-1][1].read_text(errors="replace")

    def close(self) -> None:
        """Kill and reap every incarnation still running."""
        for proc, _ in self.incarnations:
            _reap(proc)


async def status(address: str, timeout_s: float = 5.0) -> pb.StatusResponse:
    """The server's Status over a fresh channel (raises AioRpcError when it does not answer)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.ParameterServerStub(channel)
        return await stub.Status(pb.StatusRequest(), timeout=scaled(timeout_s))


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


class ScriptProcess(Closing):
    """A Python script (or ``-c`` / ``-m`` command line) as a subprocess: stdout a pipe,
    stderr in a log file under ``log_dir``.

    Args:
        log_dir: Directory of the stderr log.
        name: What the log file is named after.
        argv: Arguments after ``python``.
        text: Read stdout as text (else bytes).
        env: Extra environment of the process.
        group: Start it in its own process group, and kill the whole group on close (for a
            command that starts processes of its own, such as ``paramserver demo``).
        cwd: Its working directory (default: this process's).
    """

    def __init__(
        self,
        log_dir: Path,
        name: str,
        argv: Sequence[str],
        *,
        text: bool = True,
        env: dict[str, str] | None = None,
        group: bool = False,
        cwd: Path | None = None,
    ) -> None:
        self.name = name
        self.group = group
        self.log_path = log_dir / f"{name}-{time.monotonic_ns()}.log"
        with open(self.log_path, "wb") as err:  # the child holds its own descriptor
            self.proc = subprocess.Popen(
                [sys.executable, *argv],
                stdout=subprocess.PIPE,
                stderr=err,
                text=text,
                env={**os.environ, **(env or {})},
                start_new_session=group,
                cwd=cwd,
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stderr(self) -> str:
        """What the process wrote to stderr so far."""
        return self.log_path.read_text(errors="replace")

    log = stderr

    async def readline(self, timeout_s: float = 30.0) -> Any:
        """The next stdout line (off the event loop); AssertionError with the log when none
        comes within ``timeout_s`` (the process is killed then)."""
        assert self.proc.stdout is not None
        timeout_s = scaled(timeout_s)
        try:
            return await asyncio.wait_for(asyncio.to_thread(self.proc.stdout.readline), timeout_s)
        except TimeoutError:
            self.close()
            raise AssertionError(
                f"{self.name}: no line within {timeout_s:.0f} s: {self.stderr()}"
            ) from None

    async def wait_exit(self, timeout_s: float = 30.0) -> int:
        """Wait for the process to exit on its own; its exit status."""
        await eventually(
            lambda: self.proc.poll() is not None, timeout_s=timeout_s, what=f"{self.name} exits"
        )
        return int(self.proc.returncode)

    def kill(self) -> None:
        """SIGKILL (no goodbye) and reap."""
        self.close()

    def communicate(self, timeout_s: float) -> tuple[Any, str]:
        """Wait up to ``timeout_s`` for the process to exit on its own (it is killed after);
        returns (its whole stdout, its stderr)."""
        timeout_s = scaled(timeout_s)
        try:
            out, _ = self.proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.close()
            raise AssertionError(
                f"{self.name} still running after {timeout_s:.0f} s: {self.stderr()}"
            ) from None
        return out, self.stderr()

    def close(self) -> None:
        """Kill the process (its group too when started with ``group``) if it still runs,
        reap it and close its pipe."""
        if self.group:
            with contextlib.suppress(ProcessLookupError):  # stragglers of the group, if any
                os.killpg(self.proc.pid, SIGKILL)
        _reap(self.proc)
        if self.proc.stdout is not None:
            with contextlib.suppress(OSError):
                self.proc.stdout.close()


class JsonWorker(ScriptProcess):
    """``fault_worker.py MODE ARGS`` (or another script printing JSON lines); its events are
    collected by a reader thread, each with ``received`` (this process's monotonic clock
    when the line was read)."""

    def __init__(self, tmp: Path, mode: str, *args: str, script: Path = FAULT_WORKER) -> None:
        super().__init__(tmp, f"worker-{mode}", [str(script), mode, *args])
        self.events: list[dict[str, Any]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with contextlib.suppress(ValueError, OSError):  # the pipe closed under us
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

    def close(self) -> None:
        _reap(self.proc)
        self._reader.join(timeout=5)
        super().close()


class PlanWorker(ScriptProcess):
    """``plan_worker.py ADDRESS NAME PLAN_JSON`` as a subprocess; :meth:`ready` waits for its
    ``READY <worker id> <clock>`` line."""

    def __init__(self, address: str, name: str, plan: dict[str, Any], log_dir: Path) -> None:
        super().__init__(
            log_dir, f"worker-{name}", [str(PLAN_WORKER), address, name, json.dumps(plan)],
            text=False,
        )  # fmt: skip
        self.worker_id = ""
        self.clock = -1

    async def ready(self, timeout_s: float = 30.0) -> None:
        """Wait for ``READY <id> <clock>``; fail with the worker's log if it exits first."""
        line = await self.readline(timeout_s)
        parts = line.decode().split()
        if len(parts) != 3 or parts[0] != "READY":
            self.close()
            raise AssertionError(f"worker {self.name} said {line!r}: {self.stderr()}")
        self.worker_id, self.clock = parts[1], int(parts[2])

    async def wait(self, timeout_s: float = 30.0) -> int:
        """Wait for a voluntary exit; returns the exit status."""
        rc = await self.wait_exit(timeout_s)
        self.close()
        return rc
