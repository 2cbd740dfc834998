"""Shards as restartable Ray actors in a placement group, workers as Ray tasks.

Layout of a job (``paramserver ray-launch``, or :func:`launch` / :class:`RayShardGroup`):

* **Shards.** One placement group of ``num_shards`` bundles (strategy ``SPREAD`` by default:
  across nodes where it can). Once the group is placed, the launcher reads each bundle's node and
  fixes shard i's address to ``<node IP>:<base_port + i>``; every shard is started with the whole
  list (``shard_index``, ``shard_addresses``), so the shard map is known before any worker
  connects. Shard i is a Ray actor pinned to bundle i that hosts the ``paramserver serve`` daemon
  in its own process, configured like any shard
  (:meth:`~paramserver.server.config.ServerConfig.from_sources`: the job's ``server`` settings
  over ``PARAMSERVER_*`` variables over defaults), bound to its node's IP, with its own checkpoint
  directory and write-ahead log under ``<state dir>/shard-<i>`` on that node. The state directory
  is ``state_dir`` when given (the same one again resumes a job), else one per job: ``<system temp
  dir>/paramserver-ray/<job id>`` (:func:`job_state_dir`), so two jobs never share state by
  default.
* **Restarts.** The actors have ``max_restarts`` > 0 (``shard_max_restarts``). Ray re-creates a
  dead shard actor in the same bundle, hence on the same node; its constructor binds the same
  address again and restores the newest checkpoint plus the log after it, so the shard comes back
  with every acknowledged update. Workers ride through: their client retries UNAVAILABLE (same
  request ids, applied once) until ``retry_deadline_s``.
* **Workers.** ``num_workers`` Ray tasks (``SPREAD``), worker i told its index, the worker count
  and the shard addresses. Each runs the job: a :class:`ClusterJob` (an object with ``run_worker``
  and ``final_metrics``, e.g. the digits demo's :class:`~paramserver.cli.demos.digits.DigitsJob`,
  what ``paramserver worker`` runs), a user function ``train(client, worker_index,
  num_workers)`` (an ``async def`` gets the asyncio
  :class:`~paramserver.worker_client.ClusterWorkerClient`, a plain function the blocking
  :class:`~paramserver.worker_client.SyncWorkerClient`), or a user's script, unchanged
  (:class:`ScriptJob`: the process ``paramserver run`` would start, with the same
  environment). A worker task retried by Ray
  (``worker_max_retries``) registers with ``replace=True``: it fences its dead predecessor's
  registration instead of waiting out its lease.
* **Result.** :class:`JobResult`: each worker's exit (its return value or its error), each shard's
  counters and restarts, and for a :class:`ClusterJob` its final metrics (the digits job: the test
  accuracy of the final parameters). Teardown stops every shard gracefully (final checkpoint),
  kills the actors for good, cancels unfinished worker tasks and removes the placement group.

Ray is an optional dependency: ``pip install 'paramserver[ray]'``. The stable address holds
while the shard's node lives; if the node itself is lost Ray places the bundle on another node,
whose IP differs, and the shard refuses to start there (its state directory was on the lost
node too). See docs/engines.md.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import inspect
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from paramserver.closing import Closing
from paramserver.errors import InvalidArgument, Unavailable, WaitTimeout
from paramserver.server.config import ServerConfig
from paramserver.waiting import Wait
from paramserver.worker_client.retry import RetryPolicy

logger = logging.getLogger(__name__)


def _ray_ready(refs: list[Any], timeout_s: float, what: str) -> list[Any]:
    """``ray.wait`` for all of ``refs`` within ``timeout_s``: the ready ones (all, unless the
    time ran out). A wait a person can see (:mod:`paramserver.waiting`): polled in steps of at
    most a second so that it is reported while it lasts."""
    deadline = time.monotonic() + timeout_s
    with Wait(what, deadline=deadline, logger=logger) as waiting:
        while True:
            left = deadline - time.monotonic()
            done, pending = ray.wait(refs, num_returns=len(refs), timeout=max(0.0, min(1.0, left)))
            if not pending or left <= 0:
                return list(done)
            waiting.update(detail=f"{len(done)} of {len(refs)} ready")
            waiting.tick()


#: :class:`~paramserver.server.config.ServerConfig` fields the launcher sets itself for each
#: shard (its address, its place in the cluster, its state directories; ``wal`` is always on).
MANAGED_SERVER_FIELDS = frozenset(
    {"host", "port", "shard_index", "shard_addresses", "checkpoint_dir", "wal", "wal_dir"}
)
STRATEGIES = ("SPREAD", "STRICT_SPREAD", "PACK", "STRICT_PACK")
WORKER_FAILURE = ("fail", "continue")
#: Shard i's start count, in its state directory (survives actor restarts on the node).
STARTS_FILE = "starts"
#: Directory (in the system temp dir of each node) of the per-job state directories.
DEFAULT_STATE_ROOT = "paramserver-ray"


def new_job_id(name: str) -> str:
    """A fresh job id: ``<name>-<UTC start time>-<8 random hex digits>``, unique per launch."""
    return f"{name}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{secrets.token_hex(4)}"


def job_state_dir(state_dir: str | None, job_id: str) -> str:
    """The directory a job keeps its shards' state under: ``state_dir`` when given, else
    ``<system temp dir>/paramserver-ray/<job_id>`` (one per job, never shared)."""
    if state_dir:
        return state_dir
    return os.path.join(tempfile.gettempdir(), DEFAULT_STATE_ROOT, job_id)


def token_auth_enabled() -> bool | None:
    """Whether this process runs with Ray's token authentication (None: this Ray does not
    say). Reads ``ray._raylet.get_authentication_mode``: Ray is loaded, so it costs
    microseconds."""
    try:
        from ray._raylet import AuthenticationMode, get_authentication_mode

        return bool(get_authentication_mode() == AuthenticationMode.TOKEN)
    except (ImportError, AttributeError):
        return None


def warn_without_token_auth(shard: Any | None = None) -> bool:
    """Log one warning when the Ray cluster this driver joined has no token authentication;
    returns whether it warned.

    A cluster with token authentication refuses a driver without its token, so a driver that
    connected with authentication off found an open cluster. A driver with authentication on
    (``RAY_AUTH_MODE=token``, or a token file that ``address="auto"`` picked up) may still have
    joined an open one: then ``shard`` (a running shard actor, whose process runs in the mode its
    node was started with) is asked, one actor call. ``ray start --head`` turns authentication
    on only with ``RAY_AUTH_MODE=token`` or an existing token file.
    """
    enabled = token_auth_enabled()
    if enabled and shard is not None:
        try:
            enabled = ray.get(shard.token_auth.remote(), timeout=30)
        except Exception:  # a shard that does not answer: say nothing rather than guess
            enabled = None
    if enabled is not False:
        return False
    logger.warning(
        "this Ray cluster has no token authentication: anyone who reaches its ports can run "
        "code on it and reach the shards (start every node with RAY_AUTH_MODE=token; see "
        "docs/engines.md)"
    )
    return True


@dataclass(frozen=True)
class RayJobConfig:
    """A paramserver job on a Ray cluster.

    Attributes:
        num_shards: Server shards (Ray actors, one placement-group bundle each).
        num_workers: Worker tasks.
        base_port: Shard i listens on ``<its node IP>:<base_port + i>`` (fixed: the same
            address after a restart).
        state_dir: Directory, on every node, under which shard i keeps ``shard-<i>/checkpoints``
            and ``shard-<i>/wal``; a directory holding an earlier job's state resumes that
            job. None (the default): one per job, ``<system temp dir>/paramserver-ray/<job
            id>`` (:func:`job_state_dir`).
        server: Settings of every shard, as :class:`~paramserver.server.config.ServerConfig`
            fields (``{"consistency": "ssp", "staleness": 2, "checkpoint_every_s": 30}``;
            TLS, tokens...); they win over the shards' ``PARAMSERVER_*`` variables. The fields
            in :data:`MANAGED_SERVER_FIELDS` are the launcher's.
        strategy: Placement-group strategy of the shards (``SPREAD``: across nodes where
            possible; ``STRICT_SPREAD``: one node each or fail).
        shard_max_restarts: Times Ray re-creates a dead shard (0: a dead shard fails the job).
        worker_max_retries: Times Ray re-runs a failed worker task (0: no retry).
        worker_failure: What a worker that failed for good does to the job: ``fail`` (the
            other workers are cancelled and the job fails at once) or ``continue`` (the others
            carry on; the job result still records the failure).
        shard_num_cpus: Ray CPUs reserved per shard.
        worker_num_cpus: Ray CPUs reserved per worker.
        start_timeout_s: Deadline (seconds) for placing the group and starting the shards.
        job_timeout_s: Deadline (seconds) for the workers; the unfinished are cancelled.
        retry_deadline_s: How long (seconds) a worker's client retries an unavailable shard
            (a restart must fit in it).
        stop_grace_s: Grace (seconds) of a shard's graceful stop at teardown.
        name: Prefix of the workers' names and the actors' names.
        worker_env: Environment variables of the worker tasks (a Ray ``runtime_env``).
    """

    num_shards: int = 2
    num_workers: int = 4
    base_port: int = 50051
    state_dir: str | None = None
    server: Mapping[str, Any] = field(default_factory=dict)
    strategy: str = "SPREAD"
    shard_max_restarts: int = 3
    worker_max_retries: int = 0
    worker_failure: str = "fail"
    shard_num_cpus: float = 1.0
    worker_num_cpus: float = 1.0
    start_timeout_s: float = 120.0
    job_timeout_s: float = 3600.0
    retry_deadline_s: float = 120.0
    stop_grace_s: float = 5.0
    name: str = "paramserver"
    worker_env: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_shards < 1 or self.num_workers < 1:
            raise InvalidArgument(
                f"num_shards and num_workers must be >= 1, got {self.num_shards} and "
                f"{self.num_workers}"
            )
        if not 1 <= self.base_port <= 65535 - (self.num_shards - 1):
            raise InvalidArgument(
                f"base_port must leave room for {self.num_shards} ports below 65536, "
                f"got {self.base_port}"
            )
        if self.strategy not in STRATEGIES:
            raise InvalidArgument(
                f"strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}"
            )
        if self.worker_failure not in WORKER_FAILURE:
            raise InvalidArgument(
                f"worker_failure must be fail or continue, got {self.worker_failure!r}"
            )
        if self.shard_max_restarts < 0 or self.worker_max_retries < 0:
            raise InvalidArgument("shard_max_restarts and worker_max_retries must be >= 0")
        for what in ("start_timeout_s", "job_timeout_s", "retry_deadline_s"):
            if not getattr(self, what) > 0:
                raise InvalidArgument(f"{what} must be > 0, got {getattr(self, what)}")
        known = {f.name for f in dataclasses.fields(ServerConfig)}
        for name in self.server:
            if name not in known:
                raise InvalidArgument(f"server: {name!r} is not a ServerConfig field")
            if name in MANAGED_SERVER_FIELDS:
                raise InvalidArgument(
                    f"server: {name} is set by the launcher for each shard "
                    f"(managed: {', '.join(sorted(MANAGED_SERVER_FIELDS))})"
                )
        ServerConfig(**self.server)  # a bad value fails here, not on every shard


@runtime_checkable
class ClusterJob(Protocol):
    """A job whose worker tasks run ``run_worker`` (the digits demo's
    :class:`~paramserver.cli.demos.digits.DigitsJob` is one). It travels to the workers by
    pickle, so a module-level class."""

    def run_worker(
        self, address: str, index: int, num_workers: int, *, name: str, retry: RetryPolicy
    ) -> Any:
        """Run worker ``index`` of ``num_workers`` against the cluster that serves
        ``address`` (any shard); ``name`` is the job's name prefix, ``retry`` the backoff
        while a shard restarts. Returns the worker's result."""
        ...

    def final_metrics(self, address: str) -> dict[str, Any]:
        """The job's metrics, read from the cluster once every worker has ended."""
        ...


#: A user's training function: ``train(client, worker_index, num_workers) -> result``.
TrainFunction = Callable[[Any, int, int], Any]


class ScriptFailed(RuntimeError):
    """A worker's script exited with a status other than 0 (the message holds its last
    lines of output)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code

    def __reduce__(self) -> tuple[Any, ...]:  # travels back to the driver by pickle
        return (ScriptFailed, (str(self), self.exit_code))


@dataclass(frozen=True)
class ScriptJob:
    """Worker tasks that each run a user's training script, unchanged, as ``paramserver run``
    starts it: ``python -u SCRIPT ARGS`` (this node's interpreter) for a ``.py`` file, else
    ``SCRIPT ARGS``, with the environment of :mod:`paramserver.worker_client.env` set
    (``PARAMSERVER_ADDRESS``, ``PARAMSERVER_SHARD_ADDRESSES``, ``WORKER_INDEX``,
    ``NUM_WORKERS``, ``WORKER_NAME`` = ``<job name>-worker-<index>``,
    ``PARAMSERVER_REPLACE=1``) over the Ray worker's own and :attr:`env`. So the script reads
    the cluster with ``ps.connect_sync_from_env()`` or a
    :class:`~paramserver.integrations.torch.ServerOptimizer`.

    Each line the script prints is printed by the task as ``[worker I] line`` (the driver shows
    it with ``log_to_driver``). The script dies with its task (Linux: the parent-death
    signal), so a cancelled or killed task leaves no process behind. A worker's result is
    ``{"exit_code": 0, "output": [its last lines]}``; a status other than 0 fails the task
    with :class:`ScriptFailed` (retried by Ray up to ``worker_max_retries`` times; the retry
    replaces the dead registration under the same name and resumes its progress).

    Attributes:
        script: Path of the script, as every node sees it (an absolute path: the same file on
            every node, e.g. a shared filesystem or the same image).
        args: Its arguments.
        env: More environment variables of the script (a token file, TLS files...).
        cwd: Its working directory (default: the Ray worker's).
        output_lines: How many of its last lines each worker's result keeps.
    """

    script: str
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str | None = None
    output_lines: int = 20

    def argv(self) -> list[str]:
        """The command line on this node."""
        if self.script.endswith(".py"):
            return [sys.executable, "-u", self.script, *self.args]
        return [self.script, *self.args]

    def environment(
        self, base: Mapping[str, str], addresses: Sequence[str], index: int, num_workers: int,
        worker_name: str,
    ) -> dict[str, str]:  # fmt: skip
        """The script's environment: ``base``, then :attr:`env`, then the launcher's
        variables."""
        from paramserver.worker_client import env as names

        out = {**base, **self.env}
        out[names.ADDRESS_ENV] = addresses[0]
        out[names.SHARD_ADDRESSES_ENV] = ",".join(addresses)
        out[names.WORKER_INDEX_ENV] = str(index)
        out[names.NUM_WORKERS_ENV] = str(num_workers)
        out[names.WORKER_NAME_ENV] = worker_name
        out[names.REPLACE_ENV] = "1"
        out["PYTHONUNBUFFERED"] = "1"
        return out

    def run(
        self, addresses: Sequence[str], index: int, num_workers: int, worker_name: str
    ) -> dict[str, Any]:
        """Run the script as worker ``index`` to its end.

        Raises:
            ScriptFailed: it exited with a status other than 0 (or was killed by a signal).
        """
        env = self.environment(os.environ, addresses, index, num_workers, worker_name)
        last: collections.deque[str] = collections.deque(maxlen=max(1, self.output_lines))
        proc = subprocess.Popen(
            self.argv(),
            env=env,
            cwd=self.cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent,
        )
        try:
            assert proc.stdout is not None
            for raw in iter(proc.stdout.readline, b""):
                line = raw.decode(errors="replace").rstrip("\n")
                last.append(line)
                print(f"[worker {index}] {line}", flush=True)
            code = proc.wait()
        finally:  # cancelled (KeyboardInterrupt) or failed here: the script goes too
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        if code != 0:
            status = f"signal {-code}" if code < 0 else f"status {code}"
            tail = "\n".join(last)
            raise ScriptFailed(
                f"{' '.join(self.argv()[-len(self.args) - 1 :])} (worker {index}) exited with "
                f"{status}; its last lines:\n{tail}",
                128 - code if code < 0 else code,
            )
        return {"exit_code": 0, "output": list(last)}


def _die_with_parent() -> None:
    """In the script's process before exec: SIGKILL it when its parent (the Ray worker) dies
    (Linux ``prctl(PR_SET_PDEATHSIG)``; elsewhere nothing)."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclass
class ShardInfo:
    """One shard as its actor reports it.

    Attributes:
        index: Shard index.
        address: ``host:port`` it serves (the same across restarts).
        node_ip: IP of the Ray node its actor runs on.
        pid: Process id of its actor (changes on a restart).
        starts: Times it started (1 + restarts; read from its state directory).
        restored_applied_updates: Applied updates it held right after its last start (restored
            from its checkpoint and write-ahead log; 0 on a first start).
        applied_updates: Pushes applied so far (each BSP step counts its contributing pushes).
        duplicate_pushes: Retried pushes recognised and not re-applied.
        recovery_s: Seconds its last start spent restoring.
    """

    index: int
    address: str
    node_ip: str
    pid: int
    starts: int
    restored_applied_updates: int
    applied_updates: int
    duplicate_pushes: int
    recovery_s: float


@dataclass
class WorkerOutcome:
    """One worker task's exit.

    Attributes:
        index: Worker index.
        ok: It returned (no exception, not cancelled, within the deadline).
        result: Its return value (the digits job: its ``done`` summary).
        error: Why it failed (``None`` when ok).
        node_ip: IP of the node it last ran on (``None`` if unknown).
    """

    index: int
    ok: bool
    result: Any = None
    error: str | None = None
    node_ip: str | None = None


@dataclass
class JobResult:
    """What a job on Ray returns to its driver.

    Attributes:
        workers: Every worker's exit, by index.
        shards: Every shard's state at the end (before teardown).
        metrics: Final metrics; the digits job: ``test_accuracy`` of the final parameters.
        elapsed_s: Seconds from the workers' submission to their last exit.
        state_dir: Where the shards kept their state, on each shard's node (what a later
            ``--restore-from`` reads).
    """

    workers: list[WorkerOutcome]
    shards: list[ShardInfo]
    metrics: dict[str, Any] = field(default_factory=dict)
    elapsed_s: float = 0.0
    state_dir: str = ""

    @property
    def ok(self) -> bool:
        """Every worker returned."""
        return all(w.ok for w in self.workers)

    def to_json(self) -> str:
        """The result as one JSON object (worker results that JSON cannot hold as ``repr``)."""
        return json.dumps(asdict(self) | {"ok": self.ok}, default=repr, sort_keys=True)


# ---------------------------------------------------------------------------- the shard actor
class ShardActor:
    """Hosts one shard's ``paramserver serve`` daemon on a private event loop thread.

    Created by :class:`RayShardGroup` as a Ray actor; its constructor runs again on every
    restart, restoring the shard from its checkpoint directory and write-ahead log.

    Raises:
        Unavailable: the actor landed on another node than its address names (UNAVAILABLE).
        InvalidArgument: a bad setting, or unreadable certificates or token file
            (INVALID_ARGUMENT).
    """

    def __init__(
        self, index: int, addresses: Sequence[str], server: Mapping[str, Any], state_dir: str
    ) -> None:
        from paramserver.security.tls import ServerSecurity
        from paramserver.server.shard_daemon import ParameterServerDaemon

        self.index = index
        self.address = addresses[index]
        host, port = self.address.rsplit(":", 1)
        node_ip = ray.util.get_node_ip_address()
        if node_ip != host:
            raise Unavailable(
                f"shard {index} was placed on node {node_ip}, but its address is {self.address}"
                " (its bundle moved to another node: restart the job)"
            )
        shard_dir = Path(state_dir) / f"shard-{index}"
        shard_dir.mkdir(parents=True, exist_ok=True)
        starts_file = shard_dir / STARTS_FILE
        self.starts = (int(starts_file.read_text()) if starts_file.exists() else 0) + 1
        starts_file.write_text(str(self.starts))
        managed = {
            "host": host,
            "port": int(port),
            "shard_index": index,
            "shard_addresses": ",".join(addresses),
            "checkpoint_dir": str(shard_dir / "checkpoints"),
            "wal": True,
            "wal_dir": str(shard_dir / "wal"),
        }
        config = ServerConfig.from_sources({**server, **managed}, os.environ)
        ServerSecurity.of_config(config)  # unreadable certificates: refused here
        self._loop = _new_loop(config.use_uvloop)
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"paramserver-shard-{index}", daemon=True
        )
        self._thread.start()
        self._daemon = ParameterServerDaemon(config)
        self._stopped = False
        self._run(self._daemon.start(), timeout_s=120.0)
        assert self._daemon.engine is not None
        self.restored_applied_updates = self._daemon.engine.core.applied_updates
        logger.info(
            "shard %d serving on %s (start %d, %d applied updates restored)",
            index,
            self.address,
            self.starts,
            self.restored_applied_updates,
        )

    def _run(self, coro: Any, timeout_s: float) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def token_auth(self) -> bool | None:
        """Whether this shard's Ray worker process runs with token authentication (as its node
        was started; None: this Ray does not say)."""
        return token_auth_enabled()

    def info(self) -> ShardInfo:
        """This shard's address, node, process and counters."""
        engine = self._daemon.engine
        assert engine is not None
        return ShardInfo(
            index=self.index,
            address=self.address,
            node_ip=ray.util.get_node_ip_address(),
            pid=os.getpid(),
            starts=self.starts,
            restored_applied_updates=self.restored_applied_updates,
            applied_updates=engine.core.applied_updates,
            duplicate_pushes=engine.core.duplicate_pushes,
            recovery_s=self._daemon.recovery_s,
        )

    def stop(self, grace_s: float) -> None:
        """Graceful stop: in-flight calls finish within ``grace_s``, a final checkpoint
        (once; later calls return at once)."""
        if self._stopped:
            return
        self._stopped = True
        self._run(self._daemon.stop(grace_s), timeout_s=grace_s + 60.0)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10.0)


def _new_loop(use_uvloop: bool) -> asyncio.AbstractEventLoop:
    if use_uvloop:
        try:
            import uvloop
        except ImportError:  # pragma: no cover - uvloop is a runtime dependency on POSIX
            return asyncio.new_event_loop()
        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


# ---------------------------------------------------------------------------- worker tasks
def _worker_main(
    addresses: Sequence[str],
    index: int,
    num_workers: int,
    job: ClusterJob | ScriptJob | TrainFunction,
    name: str,
    retry_deadline_s: float,
) -> dict[str, Any]:
    """Body of worker task ``index``: connect to the cluster, run the job, leave."""
    from paramserver.serving.bootstrap import run_loop
    from paramserver.worker_client import connect, connect_sync

    node_ip = ray.util.get_node_ip_address()
    retry = RetryPolicy(deadline_s=retry_deadline_s)
    worker_name = f"{name}-worker-{index}"
    result: Any
    if isinstance(job, ScriptJob):
        result = job.run(addresses, index, num_workers, worker_name)
    elif isinstance(job, ClusterJob):  # any shard: the client fetches the shard map from it
        result = job.run_worker(addresses[0], index, num_workers, name=name, retry=retry)
    elif inspect.iscoroutinefunction(job):

        async def run_async() -> Any:
            async with connect(addresses[0], worker_name, replace=True, retry=retry) as ps:
                return await job(ps, index, num_workers)

        result = run_loop(run_async())
    else:
        with connect_sync(addresses[0], worker_name, replace=True, retry=retry) as ps:
            result = job(ps, index, num_workers)
    return {"node_ip": node_ip, "result": result}


def _final_metrics_main(addresses: Sequence[str], job: ClusterJob) -> dict[str, Any]:
    """The job's final metrics, read from the cluster (a task of its own)."""
    return job.final_metrics(addresses[0])


# ---------------------------------------------------------------------------- the group
class RayShardGroup(Closing):
    """The shards of one job on a Ray cluster (``ray.init`` must have run).

    Use as ``with RayShardGroup(cfg) as shards: job = shards.submit(DigitsJob());
    result = job.result()`` (any :class:`ClusterJob` or training function); leaving the block
    tears everything down.

    Attributes:
        addresses: Shard addresses in shard order (fixed for the group's life).
        actors: The shard actors' handles, in shard order.
        job_id: This group's job id (:func:`new_job_id`).
        state_dir: Where its shards keep their state on their nodes (:func:`job_state_dir`).
    """

    def __init__(self, config: RayJobConfig) -> None:
        self.config = config
        self.job_id = new_job_id(config.name)
        self.state_dir = job_state_dir(config.state_dir, self.job_id)
        self.addresses: list[str] = []
        self.actors: list[Any] = []
        self._pg: PlacementGroup | None = None
        self._jobs: list[WorkerJob] = []

    def start(self) -> RayShardGroup:
        """Place the group, fix the addresses, start every shard and wait until each serves.

        Raises:
            WaitTimeout: the group was not placed or the shards did not start within
                ``start_timeout_s`` (DEADLINE_EXCEEDED); what was started is torn down.
        """
        cfg = self.config
        try:
            bundles = [{"CPU": cfg.shard_num_cpus} for _ in range(cfg.num_shards)]
            self._pg = placement_group(bundles, strategy=cfg.strategy, name=f"{cfg.name}-shards")
            ready = _ray_ready(
                [self._pg.ready()], cfg.start_timeout_s, f"{cfg.name}'s shards to be placed"
            )
            if not ready:
                raise WaitTimeout(
                    f"the shards' placement group ({cfg.num_shards} bundles of "
                    f"{cfg.shard_num_cpus} CPU, {cfg.strategy}) was not placed within "
                    f"{cfg.start_timeout_s} s"
                )
            ips = _bundle_node_ips(self._pg, cfg.num_shards)
            self.addresses = [f"{ip}:{cfg.base_port + i}" for i, ip in enumerate(ips)]
            actor_class = ray.remote(ShardActor)
            for i in range(cfg.num_shards):
                self.actors.append(
                    actor_class.options(
                        name=f"{cfg.name}-shard-{i}",
                        num_cpus=cfg.shard_num_cpus,
                        max_restarts=cfg.shard_max_restarts,
                        max_task_retries=-1 if cfg.shard_max_restarts else 0,
                        scheduling_strategy=PlacementGroupSchedulingStrategy(
                            self._pg, placement_group_bundle_index=i
                        ),
                    ).remote(i, self.addresses, dict(cfg.server), self.state_dir)
                )
            refs = [a.info.remote() for a in self.actors]
            done = _ray_ready(refs, cfg.start_timeout_s, f"{cfg.num_shards} shards to serve")
            if len(done) < len(refs):
                raise WaitTimeout(f"the shards did not all start within {cfg.start_timeout_s} s")
            ray.get(refs)  # a shard that failed to start raises here
            warn_without_token_auth(self.actors[0])
        except BaseException:
            self.close()
            raise
        logger.info("shards serving: %s (state in %s)", ",".join(self.addresses), self.state_dir)
        return self

    def info(self, index: int, timeout_s: float = 60.0) -> ShardInfo:
        """Shard ``index``'s address, node, process and counters (waits out a restart)."""
        out: ShardInfo = ray.get(self.actors[index].info.remote(), timeout=timeout_s)
        return out

    def infos(self, timeout_s: float = 60.0) -> list[ShardInfo]:
        out: list[ShardInfo] = ray.get([a.info.remote() for a in self.actors], timeout=timeout_s)
        return out

    def kill(self, index: int) -> None:
        """Kill shard ``index``'s actor process now (Ray restarts it: ``max_restarts``)."""
        ray.kill(self.actors[index], no_restart=False)

    def submit(self, job: ClusterJob | ScriptJob | TrainFunction) -> WorkerJob:
        """Start ``num_workers`` worker tasks running ``job``."""
        cfg = self.config
        task = ray.remote(_worker_main).options(
            num_cpus=cfg.worker_num_cpus,
            max_retries=cfg.worker_max_retries,
            retry_exceptions=cfg.worker_max_retries > 0,
            scheduling_strategy="SPREAD",
            **({"runtime_env": {"env_vars": dict(cfg.worker_env)}} if cfg.worker_env else {}),
        )
        refs = [
            task.remote(self.addresses, i, cfg.num_workers, job, cfg.name, cfg.retry_deadline_s)
            for i in range(cfg.num_workers)
        ]
        worker_job = WorkerJob(self, job, refs)
        self._jobs.append(worker_job)
        return worker_job

    def close(self) -> None:
        """Teardown: cancel unfinished worker tasks, stop each shard gracefully (final
        checkpoint), kill the actors for good, remove the placement group."""
        for job in self._jobs:
            job.cancel()
        stops = [a.stop.remote(self.config.stop_grace_s) for a in self.actors]
        if stops:
            ray.wait(stops, num_returns=len(stops), timeout=self.config.stop_grace_s + 30.0)
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []
        if self._pg is not None:
            remove_placement_group(self._pg)
            self._pg = None

    open = start


class WorkerJob:
    """The worker tasks of one submitted job."""

    def __init__(
        self, shards: RayShardGroup, job: ClusterJob | ScriptJob | TrainFunction, refs: list[Any]
    ) -> None:
        self.shards = shards
        self.job = job
        self.refs = refs
        self.t0 = time.monotonic()

    def done(self) -> bool:
        """Every worker task has ended."""
        ready, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        return len(ready) == len(self.refs)

    def cancel(self) -> None:
        """Cancel the worker tasks still running."""
        _, pending = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        for ref in pending:
            ray.cancel(ref, force=True)

    def result(self, timeout_s: float | None = None) -> JobResult:
        """Wait for every worker (at most ``timeout_s``, default ``job_timeout_s``); with
        ``worker_failure="fail"`` the first worker that fails for good cancels the rest.
        Returns each worker's exit, each shard's counters and the job's final metrics."""
        cfg = self.shards.config
        deadline = time.monotonic() + (cfg.job_timeout_s if timeout_s is None else timeout_s)
        outcomes: dict[int, WorkerOutcome] = {}
        index_of = {ref: i for i, ref in enumerate(self.refs)}
        pending = list(self.refs)
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            ready, pending = ray.wait(pending, num_returns=1, timeout=min(left, 1.0))
            for ref in ready:
                i = index_of[ref]
                try:
                    out = ray.get(ref)
                    outcomes[i] = WorkerOutcome(i, True, out["result"], None, out["node_ip"])
                except Exception as exc:
                    outcomes[i] = WorkerOutcome(i, False, None, f"{type(exc).__name__}: {exc}")
                    if cfg.worker_failure == "fail" and pending:
                        logger.error("worker %d failed; cancelling the others: %s", i, exc)
                        for ref_left in pending:
                            ray.cancel(ref_left, force=True)
        for ref in pending:
            ray.cancel(ref, force=True)
            i = index_of[ref]
            outcomes.setdefault(
                i, WorkerOutcome(i, False, None, "not finished within the job deadline")
            )
        elapsed = time.monotonic() - self.t0
        metrics: dict[str, Any] = {}
        if isinstance(self.job, ClusterJob):
            evaluate = ray.remote(_final_metrics_main).options(num_cpus=0)
            try:
                metrics = ray.get(evaluate.remote(self.shards.addresses, self.job), timeout=120)
            except Exception as exc:  # the shards are unreachable: say so in the result
                metrics = {"error": f"evaluation failed: {type(exc).__name__}: {exc}"}
        return JobResult(
            workers=[outcomes[i] for i in range(len(self.refs))],
            shards=self.shards.infos(),
            metrics=metrics,
            elapsed_s=round(elapsed, 3),
            state_dir=self.shards.state_dir,
        )


def _bundle_node_ips(pg: PlacementGroup, count: int) -> list[str]:
    """The IP of the node each bundle of ``pg`` was placed on, in bundle order."""
    table = placement_group_table(pg)
    node_of = table["bundles_to_node_id"]
    ip_of = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    return [ip_of[node_of[i]] for i in range(count)]


def launch(config: RayJobConfig, job: ClusterJob | ScriptJob | TrainFunction) -> JobResult:
    """Run one job on the Ray cluster this process is connected to and tear it down.

    Args:
        config: Shards, workers, restart policies, deadlines.
        job: A :class:`ClusterJob` (the digits demo's
            :class:`~paramserver.cli.demos.digits.DigitsJob`), a :class:`ScriptJob` (a
            training script) or a function ``train(client, worker_index, num_workers)``.

    Returns:
        The :class:`JobResult` (workers' exits, shards' counters, final metrics).

    Raises:
        WaitTimeout: the shards did not start within ``start_timeout_s`` (DEADLINE_EXCEEDED).
    """
    with RayShardGroup(config) as shards:
        return shards.submit(job).result()
