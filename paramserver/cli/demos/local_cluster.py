"""Start ``paramserver serve`` processes on 127.0.0.1 from Python: :func:`local_cluster`.

``local_cluster`` plays the part ``ray.init()`` or ``torch.distributed.rpc.init_rpc()`` play for
their users: it starts real server processes on free loopback ports, yields their addresses
and a ``connect`` helper, and stops every process on exit, whether the block passed or failed::

    async with paramserver.local_cluster(shards=2, consistency="ssp", staleness=2) as cluster:
        async with cluster.connect("w0") as ps:
            ...

    with paramserver.local_cluster() as cluster:          # the blocking twin
        with cluster.connect_sync("w0") as ps:
            ...

A sharded cluster's shard map lists every shard's address, so each shard must know the others'
ports before it serves: :func:`start_servers` reserves free ports first (bind to port 0, read,
release), then starts shard i with ``--port p_i --shard-index i --shard-addresses ...``. One
shard is started on an ephemeral port (``--port 0 --port-file``). Either way the port file a
server writes once it serves is polled with a deadline. The demo, the benchmarks and the tests
start their servers here too.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from paramserver.closing import Closing
from paramserver.errors import InvalidArgument, Unavailable
from paramserver.waiting import Wait

if TYPE_CHECKING:
    from paramserver.cli.demos.local_etcd import LocalEtcd
    from paramserver.worker_client.cluster import ClusterWorkerClient
    from paramserver.worker_client.sync import SyncWorkerClient

__all__ = ["LocalCluster", "free_ports", "local_cluster", "start_servers", "stop_servers"]

logger = logging.getLogger(__name__)


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
    stdout: int | IO[bytes] | IO[str] | None = None,
    log_dir: Path | None = None,
    replicas: int = 1,
    state_dir: Path | None = None,
) -> tuple[list[subprocess.Popen[bytes]], list[str]]:
    """Start ``shards`` server processes (``shards`` x ``replicas`` with replicas) and wait
    until each serves.

    Args:
        serve_cmd: The command up to and including ``serve`` plus shared flags (no host/port).
        shards: Number of shards (1: a single server on an ephemeral port).
        work_dir: Where the port files go.
        env: Environment of the processes (default: this one's).
        slice_bytes: ``--slice-bytes`` of a sharded cluster.
        extra: Extra flags per shard (e.g. its own ``--checkpoint-dir``).
        timeout_s: How long each may take to start.
        stdout: Where their output goes (default: inherited); ignored with ``log_dir``.
        log_dir: Write server i's stdout and stderr to ``log_dir/server-<i>.log`` (its last
            lines are quoted when it fails to start).
        replicas: Replicas of each shard (``--replicas``); process ``i * replicas + k`` is
            replica k of shard i, with ``--checkpoint-dir state_dir/shard-<i>/replica-<k>``
            and ``--wal``.
        state_dir: Where the replicas' state directories go (needed with replicas).

    Returns:
        The processes (shard-major) and each shard's address (``"h:p|h:p"`` for the
        replicas of a replicated shard), in shard order.

    Raises:
        Unavailable: a server exited or did not serve in time (UNAVAILABLE; every server
            started is stopped first).
    """
    if replicas > 1 and state_dir is None:
        raise InvalidArgument("start_servers: replicas need a state_dir")
    count = shards * replicas
    ports = free_ports(count) if count > 1 else [0]
    each = [f"127.0.0.1:{p}" for p in ports]
    groups = [each[i * replicas : (i + 1) * replicas] for i in range(shards)]
    addresses = ["|".join(g) for g in groups]
    procs: list[subprocess.Popen[bytes]] = []
    files = []
    try:
        for n in range(count):
            i, k = divmod(n, replicas)
            port_file = work_dir / f"port-{n}-{time.monotonic_ns()}"
            files.append(port_file)
            cmd = [*serve_cmd, "--host", "127.0.0.1", "--port", str(ports[n])]
            cmd += ["--port-file", str(port_file)]
            if shards > 1:
                cmd += ["--shard-index", str(i), "--shard-addresses", ",".join(addresses)]
                if slice_bytes:
                    cmd += ["--slice-bytes", str(slice_bytes)]
            if replicas > 1:
                assert state_dir is not None
                cmd += ["--replicas", str(replicas), "--replica-index", str(k)]
                cmd += ["--replica-addresses", ",".join(groups[i])]
                cmd += ["--checkpoint-dir", str(state_dir / f"shard-{i}" / f"replica-{k}")]
                cmd += ["--wal"]
            if extra is not None:
                cmd += list(extra[n])
            penv = dict(env if env is not None else os.environ)
            if log_dir is not None:
                with open(log_dir / f"server-{n}.log", "ab") as log:
                    procs.append(
                        subprocess.Popen(cmd, env=penv, stdout=log, stderr=subprocess.STDOUT)
                    )
            else:
                procs.append(subprocess.Popen(cmd, env=penv, stdout=stdout))
        deadline = time.monotonic() + timeout_s
        with Wait("the servers to start", deadline=deadline, logger=logger) as waiting:
            for i, (proc, port_file) in enumerate(zip(procs, files, strict=True)):
                where = f" on {each[i]}" if count > 1 else ""
                waiting.update(
                    what=f"server {i}{where} to start serving",
                    detail=f"process {proc.pid} started, {i} of {count} serving",
                )
                while not _port_written(port_file):
                    if proc.poll() is not None:
                        raise Unavailable(
                            f"server {i} exited early with code {proc.returncode}"
                            + _log_tail(log_dir, i)
                        )
                    if time.monotonic() > deadline:
                        raise Unavailable(
                            f"server {i} did not serve within {timeout_s} s" + _log_tail(log_dir, i)
                        )
                    waiting.tick()
                    time.sleep(0.05)
                if count == 1:
                    addresses[0] = f"127.0.0.1:{int(port_file.read_text())}"
    except BaseException:
        stop_servers(procs)
        raise
    return procs, addresses


def _port_written(path: Path) -> bool:
    """True once ``path`` holds a whole port number (written, then renamed or flushed)."""
    try:
        return path.read_text().strip().isdigit()
    except OSError:
        return False


def _log_tail(log_dir: Path | None, i: int, lines: int = 5) -> str:
    if log_dir is None:
        return ""
    try:
        text = (log_dir / f"server-{i}.log").read_text(errors="replace").strip()
    except OSError:
        return ""
    return f"; its last output: {' | '.join(text.splitlines()[-lines:])}" if text else ""


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


def _flag_args(flags: Mapping[str, object]) -> list[str]:
    """``serve`` flags from keyword arguments: ``death_policy="fail_fast"`` ->
    ``--death-policy fail_fast``, ``wal=True`` -> ``--wal``; False and None are left out."""
    out: list[str] = []
    for name, value in flags.items():
        flag = "--" + name.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            out.append(flag)
        else:
            out += [flag, str(value)]
    return out


class LocalCluster(Closing):
    """Real ``paramserver serve`` processes on 127.0.0.1, for one ``with`` block.

    Use it as ``async with`` (start and stop run in a worker thread, the event loop keeps
    running) or as a plain ``with``; :func:`local_cluster` builds one. On exit every server
    gets SIGTERM (a graceful stop: a final checkpoint when ``checkpoint_dir`` is set) and is
    killed after ``stop_timeout_s``; a server still running when the interpreter exits is
    stopped then too.

    Args:
        shards: Number of server processes; more than 1 forms a sharded cluster (keys placed
            by hash, large keys sliced, ``slice_bytes`` each).
        consistency: ``bsp``, ``ssp`` or ``asp``.
        staleness: SSP staleness bound in clocks (None: the server's default).
        slice_bytes: Slice size of large keys in a sharded cluster (None: the default 4 MiB).
        start_timeout_s: How long the servers may take to serve (seconds).
        stop_timeout_s: How long each may take to stop before it is killed (seconds).
        log_dir: Directory of the servers' output, ``server-<i>.log`` (default: a temporary
            directory removed on exit). The servers log at WARNING unless ``log_level`` says.
        log_level: The servers' ``--log-level``.
        env: Environment of the server processes (default: this process's).
        python: Interpreter that runs the servers (default: this one, ``sys.executable``).
        replicas: Replicas of each shard (1: none). With more, each replica keeps its
            checkpoints and write-ahead log in ``state_dir/shard-<i>/replica-<k>``; a primary
            acknowledges a mutation once every backup in sync holds it, and a backup takes
            over when the primary is lost (see ``election``). A shard's address then names
            all its replicas (``"h:p|h:p"``); clients reach the primary.
        election: With replicas, who decides the primary: ``"auto"`` (default) starts a
            private etcd (:class:`~paramserver.cli.demos.local_etcd.LocalEtcd`, leases of
            1 s) when an ``etcd`` binary is installed, else replica 0 is primary with no
            failover (logged); ``"etcd"`` requires it; ``"none"``: replica 0, no failover.
            Ignored when ``election_endpoints`` is given.
        state_dir: Where the replicas' state goes (default: inside the log directory).
        **serve_flags: Every other ``paramserver serve`` flag, named in Python style:
            ``aggregation="sum"``, ``lease_ms=2000``, ``death_policy="fail_fast"``,
            ``checkpoint_dir=path``, ``wal=True`` (``paramserver serve --help`` lists them).

    Attributes:
        addresses: ``host:port`` of every server, in shard order (empty until started).
        address: The first server's address; a client given any shard finds the others.
        processes: The server processes.

    Raises:
        InvalidArgument: ``shards`` < 1 or an unknown ``consistency`` (INVALID_ARGUMENT).
    """

    def __init__(
        self,
        shards: int = 1,
        *,
        consistency: str = "bsp",
        staleness: int | None = None,
        slice_bytes: int | None = None,
        start_timeout_s: float = 60.0,
        stop_timeout_s: float = 15.0,
        log_dir: str | Path | None = None,
        log_level: str = "WARNING",
        env: Mapping[str, str] | None = None,
        python: str | None = None,
        replicas: int = 1,
        state_dir: str | Path | None = None,
        election: str = "auto",
        **serve_flags: object,
    ) -> None:
        if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
            raise InvalidArgument(f"local_cluster: shards must be an int >= 1, got {shards!r}")
        if consistency not in ("bsp", "ssp", "asp"):
            raise InvalidArgument(
                f"local_cluster: consistency must be bsp, ssp or asp, got {consistency!r}"
            )
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise InvalidArgument(f"local_cluster: replicas must be an int >= 1, got {replicas!r}")
        if election not in ("auto", "etcd", "none"):
            raise InvalidArgument(
                f"local_cluster: election must be auto, etcd or none: {election!r}"
            )
        self.shards = shards
        self.replicas = replicas
        self.election = election if "election_endpoints" not in serve_flags else "given"
        #: The private etcd electing primaries (started with the cluster; None without).
        self.etcd: LocalEtcd | None = None
        #: The cluster's key prefix in etcd.
        self.election_prefix = str(serve_flags.get("election_prefix") or "")
        self._state_dir = Path(state_dir) if state_dir is not None else None
        self.consistency = consistency
        self.slice_bytes = slice_bytes
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.env = dict(env) if env is not None else None
        self._log_dir = Path(log_dir) if log_dir is not None else None
        self._tmp: str | None = None
        flags: dict[str, object] = {"consistency": consistency, "staleness": staleness}
        flags.update(serve_flags)
        self.serve_cmd = [
            python or sys.executable,
            "-m",
            "paramserver",
            "--log-level",
            log_level,
            "serve",
            *_flag_args(flags),
        ]
        self.processes: list[subprocess.Popen[bytes]] = []
        self.addresses: list[str] = []

    @property
    def address(self) -> str:
        if not self.addresses:
            raise Unavailable("local_cluster: not started (use it in a with block)")
        return self.addresses[0]

    @property
    def log_dir(self) -> Path:
        """Where the servers' ``server-<i>.log`` files are (valid while the cluster runs)."""
        if self._log_dir is not None:
            return self._log_dir
        if self._tmp is None:
            raise Unavailable("local_cluster: not started (use it in a with block)")
        return Path(self._tmp)

    @property
    def state_dir(self) -> Path:
        """Where the replicas' state directories are (``shard-<i>/replica-<k>``)."""
        return self._state_dir if self._state_dir is not None else self.log_dir / "state"

    def replica_dir(self, shard: int, replica: int) -> Path:
        """Replica ``replica`` of shard ``shard``: its checkpoint and log directory."""
        return self.state_dir / f"shard-{shard}" / f"replica-{replica}"

    def process(self, shard: int, replica: int = 0) -> subprocess.Popen[bytes]:
        """The process of replica ``replica`` of shard ``shard``."""
        return self.processes[shard * self.replicas + replica]

    def replica_address(self, shard: int, replica: int = 0) -> str:
        """``host:port`` of one replica."""
        return self.addresses[shard].split("|")[replica]

    def primary(self, shard: int) -> int | None:
        """The replica of ``shard`` whose health says it serves clients (the primary), or
        None while none does."""
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        from paramserver.protocol.addresses import PS_SERVICE

        for k in range(self.replicas):
            with grpc.insecure_channel(self.replica_address(shard, k)) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                try:
                    got = stub.Check(health_pb2.HealthCheckRequest(service=PS_SERVICE), timeout=1)
                except grpc.RpcError:
                    continue
                if got.status == health_pb2.HealthCheckResponse.SERVING:
                    return k
        return None

    def restart(self, shard: int, replica: int = 0) -> subprocess.Popen[bytes]:
        """Start replica ``replica`` of ``shard`` again (after it was killed) with the same
        command, on the same port, and wait until it serves.

        Raises:
            Unavailable: it did not serve within ``start_timeout_s`` (UNAVAILABLE).
        """
        n = shard * self.replicas + replica
        old = self.processes[n]
        if old.poll() is None:
            raise InvalidArgument(f"local_cluster: replica {replica} of shard {shard} still runs")
        cmd = [str(a) for a in old.args]  # type: ignore[union-attr]
        port_file = Path(cmd[cmd.index("--port-file") + 1])
        port_file.unlink(missing_ok=True)
        with open(self.log_dir / f"server-{n}.log", "ab") as log:
            proc = subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        self.processes[n] = proc
        deadline = time.monotonic() + self.start_timeout_s
        while not _port_written(port_file):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise Unavailable(
                    f"replica {replica} of shard {shard} did not serve again"
                    + _log_tail(self.log_dir, n)
                )
            time.sleep(0.05)
        return proc

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> LocalCluster:
        """Start the servers and wait until each serves (blocking).

        Raises:
            Unavailable: a server exited or did not serve within ``start_timeout_s``, with
                its last output (UNAVAILABLE; every server started is stopped first).
        """
        if self.processes:
            return self
        if self._log_dir is None:
            self._tmp = tempfile.mkdtemp(prefix="paramserver-local-")
        else:
            self._log_dir.mkdir(parents=True, exist_ok=True)
        try:
            serve_cmd = [*self.serve_cmd, *self._election_flags()]
            self.processes, self.addresses = start_servers(
                serve_cmd,
                self.shards,
                self.log_dir,
                env=self.env,
                slice_bytes=self.slice_bytes,
                timeout_s=self.start_timeout_s,
                log_dir=self.log_dir,
                replicas=self.replicas,
                state_dir=self.state_dir if self.replicas > 1 else None,
            )
        except BaseException:
            self._stop_etcd()
            self._remove_tmp()
            raise
        atexit.register(self.stop)
        return self

    def _election_flags(self) -> list[str]:
        """Start the private etcd the ``election`` setting asks for; the serve flags naming it."""
        if self.replicas == 1 or self.election in ("none", "given"):
            return []
        from paramserver.cli.demos.local_etcd import LocalEtcd, etcd_binary

        if etcd_binary() is None:
            if self.election == "etcd":
                raise Unavailable(
                    "local_cluster: no etcd binary (Debian: apt-get install etcd-server)"
                )
            logger.warning(
                "local_cluster: no etcd binary, so replica 0 of each shard is primary with no "
                "failover (Debian: apt-get install etcd-server)"
            )
            return []
        import uuid

        self.etcd = LocalEtcd().start()
        self.election_prefix = f"local-{uuid.uuid4().hex}"
        return [
            "--election-endpoints",
            self.etcd.endpoint,
            "--election-prefix",
            self.election_prefix,
            "--election-ttl-s",
            "1",
        ]

    def in_sync(self, shard: int) -> list[int]:
        """The replicas of ``shard`` the private etcd lists as holding every acknowledged
        record (those that may take over); [] without a private etcd."""
        if self.etcd is None:
            return []
        return list(self.etcd.in_sync(self.election_prefix, shard))

    def _stop_etcd(self) -> None:
        etcd, self.etcd = self.etcd, None
        if etcd is not None:
            etcd.stop()

    def stop(self) -> None:
        """SIGTERM every server, wait up to ``stop_timeout_s``, kill the rest; reap all."""
        procs, self.processes = self.processes, []
        try:
            if procs:
                stop_servers(procs, timeout_s=self.stop_timeout_s)
            self._stop_etcd()
        finally:
            self.addresses = []
            atexit.unregister(self.stop)
            self._remove_tmp()

    def _remove_tmp(self) -> None:
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    open = start
    close = stop

    async def __aenter__(self) -> LocalCluster:
        starting = asyncio.ensure_future(asyncio.to_thread(self.start))
        try:
            return await asyncio.shield(starting)
        except asyncio.CancelledError:
            # A thread cannot be cancelled: let it finish, then stop what it started.
            with contextlib.suppress(BaseException):
                await starting
            self.stop()
            raise

    async def __aexit__(self, *exc_info: object) -> None:
        try:
            await asyncio.to_thread(self.stop)
        finally:
            self.stop()  # cancelled while stopping: finish here, nothing is left

    # ------------------------------------------------------------------ clients
    def connect(self, worker_name: str, **kwargs: Any) -> ClusterWorkerClient:
        """An async worker session with this cluster: ``async with cluster.connect("w0")``
        (keyword arguments: those of :class:`~paramserver.worker_client.WorkerClient`)."""
        from paramserver.worker_client.cluster import ClusterWorkerClient

        return ClusterWorkerClient(self.address, worker_name, **kwargs)

    def connect_sync(self, worker_name: str, **kwargs: Any) -> SyncWorkerClient:
        """A blocking worker session with this cluster: ``with cluster.connect_sync("w0")``."""
        from paramserver.worker_client.sync import connect_sync

        return connect_sync(self.address, worker_name, **kwargs)

    def __repr__(self) -> str:
        return (
            f"LocalCluster(shards={self.shards}, replicas={self.replicas}, "
            f"consistency={self.consistency!r}, addresses={self.addresses})"
        )


def local_cluster(shards: int = 1, **kwargs: Any) -> LocalCluster:
    """Start ``shards`` real ``paramserver serve`` processes on free 127.0.0.1 ports for one
    ``async with`` (or ``with``) block, and stop them all on exit, pass or fail.

    Example::

        async with paramserver.local_cluster(shards=2, consistency="bsp") as cluster:
            async with cluster.connect("w0") as ps:
                await ps.init({"w": np.zeros(4, np.float32)})

    Keyword arguments are those of :class:`LocalCluster` (``consistency``, ``staleness``,
    ``slice_bytes``, any ``serve`` flag such as ``lease_ms=2000``).

    Raises:
        InvalidArgument: bad arguments (INVALID_ARGUMENT), here.
        Unavailable: on entering the block, a server that did not start (UNAVAILABLE).
    """
    return LocalCluster(shards, **kwargs)
