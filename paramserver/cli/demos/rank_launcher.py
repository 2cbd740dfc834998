"""Start rank servers as real subprocesses on 127.0.0.1 with ephemeral ports (demo, tests).

Each process is ``python -m paramserver rank-server ... --port 0 --port-file F``; the
launcher polls for the port files (never a fixed sleep), and reports a process that died during
start-up with the tail of its log. :class:`RankServerCluster` stops its processes with SIGTERM
(clean shutdown: shared memory unlinked, pool files removed) and SIGKILLs stragglers.
:func:`wait_serving` polls rank servers started elsewhere (compose services, other hosts) through
the gRPC health service until each answers SERVING.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from paramserver.closing import Closing
from paramserver.security.tls import ClientSecurity, open_channel
from paramserver.spmd.layout import Layout
from paramserver.waiting import Wait

__all__ = [
    "RankServerCluster",
    "RankServerProcess",
    "async_wait_for",
    "wait_for",
    "wait_serving",
]

T = TypeVar("T")

logger = logging.getLogger(__name__)


def wait_for(
    predicate: Callable[[], T | None], *, timeout_s: float, interval_s: float = 0.01, what: str = ""
) -> T:
    """Poll ``predicate`` until it returns a truthy value; return that value. Given ``what``,
    a wait a person can see (:mod:`paramserver.waiting`: reported when it lasts).

    Raises:
        TimeoutError: still falsy after ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    with _waiting(what, deadline) as waiting:
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"timed out after {timeout_s:.1f} s waiting for {what or predicate}"
                )
            if waiting is not None:
                waiting.tick()
            time.sleep(interval_s)


def _waiting(what: str, deadline: float) -> contextlib.AbstractContextManager[Wait | None]:
    """The wait of a poll for ``what`` (none when ``what`` is empty: the caller reports)."""
    if not what:
        return contextlib.nullcontext()
    return Wait(what, deadline=deadline, logger=logger)


async def async_wait_for(
    predicate: Callable[[], Awaitable[T | None]],
    *,
    timeout_s: float,
    interval_s: float = 0.01,
    what: str = "",
) -> T:
    """Async :func:`wait_for`: await ``predicate()`` until truthy (reported as it says).

    Raises:
        TimeoutError: still falsy after ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    with _waiting(what, deadline):
        while True:
            value = await predicate()
            if value:
                return value
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"timed out after {timeout_s:.1f} s waiting for {what or predicate}"
                )
            await asyncio.sleep(interval_s)


async def _health_status(
    address: str, service: str, timeout_s: float, security: ClientSecurity | None = None
) -> str:
    """One ``grpc.health.v1.Health/Check``: the status name, or the RPC's status code name."""
    # A fresh channel per probe: a channel that failed to connect backs off before retrying
    # (up to minutes), which would hide a server that has come up since.
    async with open_channel(address, security) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            response = await stub.Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            return str(exc.code().name)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))


async def wait_serving(
    addresses: Sequence[str],
    *,
    timeout_s: float,
    interval_s: float = 0.1,
    service: str = "",
    security: ClientSecurity | None = None,
) -> None:
    """Poll the gRPC health service of every address until each answers SERVING.

    All pending addresses are probed concurrently each round; an address counts once it has
    answered SERVING. Unreachable servers (UNAVAILABLE), servers shutting down (NOT_SERVING)
    and probes that time out are retried until ``timeout_s`` has passed.

    Args:
        addresses: ``host:port`` of each server.
        timeout_s: total budget, seconds.
        interval_s: pause between rounds, seconds.
        service: health service name (``""``: the whole server).
        security: TLS settings of the probes (health needs no token, but a TLS server needs
            the handshake).

    Raises:
        TimeoutError: an address did not answer SERVING in time (each such address named with
            the last answer it gave).
    """
    last: dict[str, str] = dict.fromkeys(addresses, "not probed")
    pending = list(dict.fromkeys(addresses))
    deadline = time.monotonic() + timeout_s
    waiting = Wait(
        f"{len(pending)} rank servers to answer SERVING",
        address=pending[0] if len(pending) == 1 else None,
        deadline=deadline,
        logger=logger,
    )

    async def round_done() -> bool:
        probe_s = max(0.05, min(2.0, deadline - time.monotonic()))
        answers = await asyncio.gather(
            *(_health_status(a, service, probe_s, security) for a in pending)
        )
        for address, answer in zip(list(pending), answers, strict=True):
            last[address] = answer
            if answer == "SERVING":
                pending.remove(address)
        shown = ", ".join(f"{a}: {last[a]}" for a in pending[:4])
        more = f" and {len(pending) - 4} more" if len(pending) > 4 else ""
        waiting.update(detail=f"{len(pending)} not yet: {shown}{more}")
        return not pending

    try:
        with waiting:
            await async_wait_for(round_done, timeout_s=timeout_s, interval_s=interval_s)
    except TimeoutError:
        detail = ", ".join(f"{a}: {last[a]}" for a in pending)
        raise TimeoutError(f"rank servers not SERVING after {timeout_s:.1f} s ({detail})") from None


@dataclasses.dataclass
class RankServerProcess:
    """One rank-server subprocess.

    Attributes:
        instance_id: its instance.
        rank: its rank.
        process: the ``Popen``.
        port_file: where it writes its bound port.
        log_path: its stdout/stderr.
        port: the bound port once started (0 before).
    """

    instance_id: str
    rank: int
    process: subprocess.Popen[bytes]
    port_file: Path
    log_path: Path
    port: int = 0

    @property
    def address(self) -> str:
        """``127.0.0.1:port``."""
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        """Process id."""
        return self.process.pid

    def alive(self) -> bool:
        """True while the process runs."""
        return self.process.poll() is None

    def log_tail(self, max_bytes: int = 4000) -> str:
        """The last ``max_bytes`` of its log."""
        try:
            data = self.log_path.read_bytes()
        except FileNotFoundError:
            return ""
        return data[-max_bytes:].decode(errors="replace")

    def kill(self) -> None:
        """SIGKILL the process (a crash: no clean shutdown) and reap it."""
        if self.alive():
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)

    def terminate(self, timeout_s: float = 5.0) -> None:
        """SIGTERM (clean shutdown), SIGKILL if it has not exited after ``timeout_s``."""
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        else:
            self.process.wait(timeout=timeout_s)


class RankServerCluster(Closing):
    """Rank-server subprocesses of one or more instances (context manager; stops them all).

    Args:
        base_dir: directory for port files, logs, the G3 pool files (``disk/``) and, unless
            ``object_dir`` is given, the shared object store (``objects/``).
        layout: block format of every rank (``num_blocks`` ignored).
        host_blocks: G2 blocks per rank.
        disk_blocks: G3 blocks per rank.
        object_dir: object store root shared by every rank started here.
        extra_env: environment added to every process.
    """

    def __init__(
        self,
        base_dir: Path,
        *,
        layout: Layout | None = None,
        host_blocks: int = 64,
        disk_blocks: int = 64,
        object_dir: Path | None = None,
        extra_env: Mapping[str, str] | None = None,
    ) -> None:
        self.base_dir = base_dir
        self.layout = layout if layout is not None else Layout(num_blocks=0)
        self.host_blocks = host_blocks
        self.disk_blocks = disk_blocks
        self.object_dir = object_dir if object_dir is not None else base_dir / "objects"
        self.extra_env = dict(extra_env or {})
        self.processes: list[RankServerProcess] = []

    def _layout_arg(self) -> str:
        lay = self.layout
        return (
            f"num_layers={lay.num_layers},outer_dim={lay.outer_dim},page_size={lay.page_size},"
            f"inner_dim={lay.inner_dim},dtype={lay.dtype}"
        )

    def spawn(
        self,
        instance_id: str,
        rank: int,
        *,
        env: Mapping[str, str] | None = None,
        host_blocks: int | None = None,
        disk_blocks: int | None = None,
        extra_args: Sequence[str] = (),
    ) -> RankServerProcess:
        """Start one rank server (does not wait for it; see :meth:`wait_ready`)."""
        run_dir = self.base_dir / instance_id
        run_dir.mkdir(parents=True, exist_ok=True)
        port_file = run_dir / f"rank{rank}.port"
        log_path = run_dir / f"rank{rank}.log"
        with contextlib.suppress(FileNotFoundError):
            port_file.unlink()
        cmd = [
            sys.executable,
            "-m",
            "paramserver",
            "rank-server",
            "--instance-id",
            instance_id,
            "--rank",
            str(rank),
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--port-file",
            str(port_file),
            "--host-blocks",
            str(self.host_blocks if host_blocks is None else host_blocks),
            "--disk-blocks",
            str(self.disk_blocks if disk_blocks is None else disk_blocks),
            "--disk-dir",
            str(self.base_dir / "disk"),
            "--object-dir",
            str(self.object_dir),
            "--layout",
            self._layout_arg(),
            *extra_args,
        ]
        full_env = dict(os.environ)
        full_env.update(self.extra_env)
        full_env.update(env or {})
        with open(log_path, "ab") as log:
            process = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=full_env
            )
        proc = RankServerProcess(instance_id, rank, process, port_file, log_path)
        self.processes.append(proc)
        return proc

    def spawn_instance(
        self,
        instance_id: str,
        num_ranks: int,
        *,
        env_per_rank: Mapping[int, Mapping[str, str]] | None = None,
        extra_args: Sequence[str] = (),
    ) -> list[RankServerProcess]:
        """Start ``num_ranks`` rank servers of one instance (does not wait)."""
        env_per_rank = env_per_rank or {}
        return [
            self.spawn(instance_id, r, env=env_per_rank.get(r), extra_args=extra_args)
            for r in range(num_ranks)
        ]

    def wait_ready(
        self, procs: Sequence[RankServerProcess] | None = None, timeout_s: float = 30.0
    ) -> None:
        """Wait until every process wrote its port file.

        Raises:
            RuntimeError: a process exited during start-up (its log tail included).
            TimeoutError: not ready within ``timeout_s``.
        """
        pending = list(self.processes if procs is None else procs)

        def check() -> bool:
            for proc in list(pending):
                if proc.port_file.exists():
                    text = proc.port_file.read_text().strip()
                    if text:
                        proc.port = int(text)
                        pending.remove(proc)
                        continue
                if not proc.alive():
                    raise RuntimeError(
                        f"rank server {proc.instance_id}/{proc.rank} exited with "
                        f"{proc.process.returncode} during start-up:\n{proc.log_tail()}"
                    )
            return not pending

        wait_for(check, timeout_s=timeout_s, interval_s=0.02, what="rank servers to start")

    def addresses(self, instance_id: str) -> list[str]:
        """Addresses of ``instance_id``'s ranks, ordered by rank (latest process per rank)."""
        latest: dict[int, RankServerProcess] = {}
        for proc in self.processes:
            if proc.instance_id == instance_id:
                latest[proc.rank] = proc
        return [latest[r].address for r in sorted(latest)]

    def process(self, instance_id: str, rank: int) -> RankServerProcess:
        """The process of ``instance_id`` rank ``rank`` (the latest one spawned)."""
        for proc in reversed(self.processes):
            if proc.instance_id == instance_id and proc.rank == rank:
                return proc
        raise KeyError((instance_id, rank))

    def stop(self) -> None:
        """Terminate every process (SIGTERM, then SIGKILL stragglers)."""
        for proc in self.processes:
            if proc.alive():
                proc.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5.0
        for proc in self.processes:
            try:
                proc.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()

    close = stop
