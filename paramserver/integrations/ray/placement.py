"""Shards as replicated, restartable Ray actors in placement groups, workers as Ray tasks.

Layout of a job (``paramserver ray-launch``, or :func:`launch` / :class:`RayShardGroup`):

* **Shards and replicas.** Each shard has ``replicas`` replicas (default 2 when the cluster
  has at least 2 nodes with CPUs, else 1). With replicas, shard i gets a placement group of
  its own with one bundle per replica, ``STRICT_SPREAD`` (each replica on another node);
  without, one group holds every shard (``strategy``, ``SPREAD`` by default). Once placed, the
  launcher reads each bundle's node and fixes replica k of shard i at ``<node IP>:<base_port
  + i * replicas + k>``; every replica is started with the whole map, so it is known before any
  worker connects. A shard's client address names all its replicas (``"h:p|h:p"``); clients
  reach whichever is primary. Each replica is a Ray actor pinned to its bundle that hosts the
  ``paramserver serve`` daemon (:class:`~paramserver.integrations.ray.shard_actor.ShardActor`),
  configured like any shard (:meth:`~paramserver.server.config.ServerConfig.from_sources`: the
  job's ``server`` settings over ``PARAMSERVER_*`` variables over defaults), with its own
  checkpoints and write-ahead log under ``<state dir>/shard-<i>[/replica-<k>]`` on its node.
  The state directory is ``state_dir`` when given, else one per job: ``<system temp
  dir>/paramserver-ray/<job id>`` (:func:`job_state_dir`), so two jobs never share state.
* **Failover.** The launcher is the authority that names each shard's primary: one
  :class:`~paramserver.integrations.ray.authority.Authority` actor on the launcher's node holds
  leases and epochs with etcd's meaning, and every replica campaigns there
  (:mod:`paramserver.server.election`). The primary streams every mutation record to its
  backups and acknowledges a push only once every backup in sync holds it durably. When a
  primary's node is lost, its lease lapses (``election_ttl_s``, default 2 s) and an in-sync
  backup is promoted under a higher epoch; workers' clients find it and retry (same request
  ids: applied once). Ray places the lost replica's bundle on another node; the replica starts
  there empty, publishes its new address, and the primary seeds it (checkpoint + stream): no
  shared disk is needed.
* **Restarts.** The actors have ``max_restarts`` > 0 (``shard_max_restarts``). A dead replica
  actor on a live node is re-created in the same bundle; it binds the same address and
  restores its checkpoint plus the log after it (a replica then catches up from its primary).
  Workers ride through: their client retries UNAVAILABLE until ``retry_deadline_s``.
* **Workers.** ``num_workers`` Ray tasks (``SPREAD``), worker i told its index, the worker count
  and the shard addresses. Each runs the job: a :class:`ClusterJob` (an object with ``run_worker``
  and ``final_metrics``, e.g. the digits demo's :class:`~paramserver.cli.demos.digits.DigitsJob`,
  what ``paramserver worker`` runs), a user function ``train(client, worker_index,
  num_workers)`` (an ``async def`` gets the asyncio
  :class:`~paramserver.worker_client.ClusterWorkerClient`, a plain function the blocking
  :class:`~paramserver.worker_client.SyncWorkerClient`), or a user's script, unchanged
  (:class:`ScriptJob`: the process ``paramserver run`` would start, with the same
  environment). A worker task retried by Ray (``worker_max_retries``; e.g. its node was lost)
  registers with ``replace=True``: it fences its dead predecessor's registration instead of
  waiting out its lease, and reads what the name already completed
  (:meth:`~paramserver.worker_client.ClusterWorkerClient.progress`).
* **Result.** :class:`JobResult`, on every exit of :func:`launch`: each worker's exit (its
  return value or its error, its task's starts), each shard's primary's counters, the
  failovers, the retried workers, and for a :class:`ClusterJob` its final metrics (the digits
  job: the test accuracy of the final parameters); ``error`` when the job could not run to its
  end. Teardown stops every replica gracefully (final checkpoint), kills the actors for good,
  cancels unfinished worker tasks and removes the placement groups.

Ray is an optional dependency: ``pip install 'paramserver[ray]'``. Without replicas, a shard
whose node is lost cannot come back (its state directory was on that node): Ray places its
bundle on another node and the shard refuses to start there. See docs/engines.md.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import secrets
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypedDict, runtime_checkable

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from paramserver.closing import Closing
from paramserver.errors import InvalidArgument, WaitTimeout
from paramserver.integrations.ray.authority import Authority, Primary, Report
from paramserver.integrations.ray.results import JobResult, WorkerOutcome
from paramserver.integrations.ray.script_job import ScriptFailed, ScriptJob
from paramserver.integrations.ray.shard_actor import ShardActor, ShardInfo, token_auth_enabled
from paramserver.server.config import ServerConfig
from paramserver.server.election import address_key, moved_groups
from paramserver.waiting import Wait
from paramserver.worker_client.retry import RetryPolicy

if TYPE_CHECKING:
    from ray.actor import ActorHandle

logger = logging.getLogger(__name__)


def _ray_ready(refs: list[ray.ObjectRef], timeout_s: float, what: str) -> list[ray.ObjectRef]:
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
    {
        "host",
        "port",
        "shard_index",
        "shard_addresses",
        "checkpoint_dir",
        "wal",
        "wal_dir",
        "replicas",
        "replica_index",
        "replica_addresses",
        "election_endpoints",
        "election_prefix",
    }
)
STRATEGIES = ("SPREAD", "STRICT_SPREAD", "PACK", "STRICT_PACK")
WORKER_FAILURE = ("fail", "continue")
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


def warn_without_token_auth(shard: ActorHandle | None = None) -> bool:
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
        replicas: Replicas of each shard (a primary and ``replicas - 1`` backups, each on
            another node: one ``STRICT_SPREAD`` placement group per shard). None (the
            default): 2 when the cluster has at least 2 nodes with CPUs, else 1. With one,
            a shard whose node is lost cannot come back (restart the job).
        base_port: Replica k of shard i listens on ``<its node IP>:<base_port + i * replicas
            + k>`` (the same address after a restart on its node).
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
    replicas: int | None = None
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
        if self.replicas is not None and (
            isinstance(self.replicas, bool) or not 1 <= self.replicas <= 9
        ):
            raise InvalidArgument(f"replicas must be an int in [1, 9], got {self.replicas!r}")
        ports = self.num_shards * (self.replicas or 2)
        if not 1 <= self.base_port <= 65535 - (ports - 1):
            raise InvalidArgument(
                f"base_port must leave room for {ports} ports below 65536, got {self.base_port}"
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
    ) -> object:
        """Run worker ``index`` of ``num_workers`` against the cluster that serves
        ``address`` (any shard); ``name`` is the job's name prefix, ``retry`` the backoff
        while a shard restarts. Returns the worker's result."""
        ...

    def final_metrics(self, address: str) -> Mapping[str, float]:
        """The job's metrics, read from the cluster once every worker has ended."""
        ...


#: A user's training function: ``train(client, worker_index, num_workers) -> result``; an
#: ``async def`` one gets a :class:`~paramserver.worker_client.ClusterWorkerClient`, any other
#: a :class:`~paramserver.worker_client.SyncWorkerClient`.
TrainFunction = Callable[..., object]


class WorkerReturn(TypedDict):
    """What a worker task returns: the node it ran on and the job's result there."""

    node_ip: str
    result: object


# ---------------------------------------------------------------------------- worker tasks
def _current_addresses(addresses: Sequence[str], authority: ActorHandle, prefix: str) -> list[str]:
    """Each shard's replica group with the addresses its replicas published at the
    authority (a replica placed again on another node) in place of the first ones."""
    moved: dict[tuple[int, int], str] = {}
    for shard, group in enumerate(addresses):
        for k in range(len(group.split("|"))):
            kv = ray.get(authority.get.remote(address_key(prefix, shard, k)), timeout=30)
            if kv is not None:
                moved[(shard, k)] = kv["value"]
    return list(moved_groups(addresses, moved))


def _worker_main(
    addresses: Sequence[str],
    index: int,
    num_workers: int,
    job: ClusterJob | ScriptJob | TrainFunction,
    name: str,
    retry_deadline_s: float,
    authority: ActorHandle | None = None,
    prefix: str = "",
) -> WorkerReturn:
    """Body of worker task ``index``: connect to the cluster, run the job, leave.

    A task Ray retries after losing its node starts with the shard addresses of the job's
    start; replicas placed again since serve elsewhere, so the addresses they published at
    the authority (under ``prefix``) replace the first ones.
    """
    from paramserver.serving.bootstrap import run_loop
    from paramserver.worker_client import connect, connect_sync

    node_ip = ray.util.get_node_ip_address()
    if authority is not None:  # counted for the job's result (a retried task starts again)
        ray.get(authority.worker_started.remote(index), timeout=30)
        if prefix:
            addresses = _current_addresses(addresses, authority, prefix)
    retry = RetryPolicy(deadline_s=retry_deadline_s)
    worker_name = f"{name}-worker-{index}"
    result: object
    if isinstance(job, ScriptJob):
        result = job.run(addresses, index, num_workers, worker_name)
    elif isinstance(job, ClusterJob):  # any shard: the client fetches the shard map from it
        result = job.run_worker(addresses[0], index, num_workers, name=name, retry=retry)
    elif inspect.iscoroutinefunction(job):

        async def run_async() -> object:
            async with connect(addresses[0], worker_name, replace=True, retry=retry) as ps:
                running = job(ps, index, num_workers)
                assert inspect.isawaitable(running)  # job is a coroutine function
                return await running

        result = run_loop(run_async())
    else:
        with connect_sync(addresses[0], worker_name, replace=True, retry=retry) as ps:
            result = job(ps, index, num_workers)
    return {"node_ip": node_ip, "result": result}


def _final_metrics_main(addresses: Sequence[str], job: ClusterJob) -> Mapping[str, float]:
    """The job's final metrics, read from the cluster (a task of its own)."""
    return job.final_metrics(addresses[0])


def cluster_cpu_nodes() -> int:
    """Alive Ray nodes that offer CPUs."""
    return sum(1 for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("CPU", 0))


# ---------------------------------------------------------------------------- the group
class RayShardGroup(Closing):
    """The shards of one job on a Ray cluster (``ray.init`` must have run).

    Use as ``with RayShardGroup(cfg) as shards: job = shards.submit(DigitsJob());
    result = job.result()`` (any :class:`ClusterJob` or training function); leaving the block
    tears everything down.

    Attributes:
        addresses: Each shard's client address, in shard order (fixed for the group's life);
            a replicated shard's names every replica as first placed (``"h:p|h:p"``), and
            clients reach its primary (and follow a replica placed again elsewhere: its
            primary names the new address in heartbeat answers).
        groups: Each shard's replica addresses as first placed.
        replicas: Replicas of each shard (``config.replicas``, or the default it resolved to).
        actors: The replica actors' handles, by shard then replica.
        authority: The job's authority actor (:mod:`paramserver.integrations.ray.authority`).
        job_id: This group's job id (:func:`new_job_id`).
        state_dir: Where its shards keep their state on their nodes (:func:`job_state_dir`).
    """

    def __init__(self, config: RayJobConfig) -> None:
        self.config = config
        self.job_id = new_job_id(config.name)
        self.state_dir = job_state_dir(config.state_dir, self.job_id)
        self.replicas = config.replicas or 1
        self.addresses: list[str] = []
        self.groups: list[list[str]] = []
        self.actors: list[list[ActorHandle]] = []
        self.authority: ActorHandle | None = None
        self._pgs: list[PlacementGroup] = []
        self._jobs: list[WorkerJob] = []

    def _slot(self, i: int, k: int) -> tuple[PlacementGroup, int]:
        """Replica k of shard i: its placement group and bundle."""
        return (self._pgs[0], i) if self.replicas == 1 else (self._pgs[i], k)

    def _place(self) -> None:
        cfg = self.config
        if self.replicas == 1:  # one group of every shard, spread by cfg.strategy
            shapes = [(cfg.num_shards, cfg.strategy, f"{cfg.name}-shards")]
        else:  # each shard's replicas on different nodes
            shapes = [
                (self.replicas, "STRICT_SPREAD", f"{cfg.name}-shard-{i}")
                for i in range(cfg.num_shards)
            ]
        for count, strategy, name in shapes:
            bundles = [{"CPU": cfg.shard_num_cpus} for _ in range(count)]
            self._pgs.append(placement_group(bundles, strategy=strategy, name=name))
        what = f"{cfg.name}'s shards to be placed"
        ready = _ray_ready([pg.ready() for pg in self._pgs], cfg.start_timeout_s, what)
        if len(ready) < len(self._pgs):
            raise WaitTimeout(
                f"the shards' placement groups ({cfg.num_shards} shards x {self.replicas} "
                f"replicas, bundles of {cfg.shard_num_cpus} CPU, "
                f"{cfg.strategy if self.replicas == 1 else 'STRICT_SPREAD per shard'}) were not "
                f"placed within {cfg.start_timeout_s} s"
            )

    def start(self) -> RayShardGroup:
        """Place the replicas, fix the addresses, start every replica and wait until each
        serves (and, with replicas, each shard has a primary).

        Raises:
            WaitTimeout: the group was not placed or the shards did not start within
                ``start_timeout_s`` (DEADLINE_EXCEEDED); what was started is torn down.
        """
        cfg = self.config
        try:
            if cfg.replicas is None:
                self.replicas = 2 if cluster_cpu_nodes() >= 2 else 1
            r = self.replicas
            here = ray.get_runtime_context().get_node_id()
            self.authority = (
                ray.remote(Authority)
                .options(
                    name=f"{self.job_id}-authority",
                    num_cpus=0,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
                )
                .remote()
            )
            self._place()
            self.groups = [
                [
                    f"{_bundle_node_ip(*self._slot(i, k))}:{cfg.base_port + i * r + k}"
                    for k in range(r)
                ]
                for i in range(cfg.num_shards)
            ]
            self.addresses = ["|".join(g) for g in self.groups]
            actor_class = ray.remote(ShardActor)
            for i in range(cfg.num_shards):
                self.actors.append([])
                for k in range(r):
                    pg, bundle = self._slot(i, k)
                    self.actors[i].append(
                        actor_class.options(
                            name=f"{self.job_id}-shard-{i}-replica-{k}",
                            num_cpus=cfg.shard_num_cpus,
                            max_restarts=cfg.shard_max_restarts,
                            max_task_retries=-1 if cfg.shard_max_restarts else 0,
                            scheduling_strategy=PlacementGroupSchedulingStrategy(
                                pg, placement_group_bundle_index=bundle
                            ),
                        ).remote(
                            i,
                            k,
                            self.groups,
                            dict(cfg.server),
                            self.state_dir,
                            self.authority if r > 1 else None,
                            self.job_id,
                        )
                    )
            refs = [a.info.remote() for shard in self.actors for a in shard]
            done = _ray_ready(refs, cfg.start_timeout_s, f"{len(refs)} shard replicas to serve")
            if len(done) < len(refs):
                raise WaitTimeout(f"the shards did not all start within {cfg.start_timeout_s} s")
            ray.get(refs)  # a replica that failed to start raises here
            if r > 1:
                self._wait_for_primaries(time.monotonic() + cfg.start_timeout_s)
            warn_without_token_auth(self.actors[0][0])
        except BaseException:
            self.close()
            raise
        logger.info(
            "shards serving: %s (%d replicas each; state in %s)",
            ",".join(self.addresses),
            r,
            self.state_dir,
        )
        return self

    def _wait_for_primaries(self, deadline: float) -> None:
        with Wait("every shard to elect a primary", deadline=deadline, logger=logger) as waiting:
            while True:
                have = [self.primary(i) for i in range(self.config.num_shards)]
                if all(p is not None for p in have):
                    return
                if time.monotonic() > deadline:
                    raise WaitTimeout(
                        f"shards {[i for i, p in enumerate(have) if p is None]} elected no "
                        "primary in time"
                    )
                waiting.tick()
                time.sleep(0.1)

    def primary(self, index: int) -> Primary | None:
        """Shard ``index``'s primary now, as the authority names it: ``{"index": replica,
        "address", "epoch"}`` (None while there is none; without replicas: replica 0)."""
        if self.replicas == 1:
            return {"index": 0, "address": self.groups[index][0], "epoch": 0}
        authority = self._started_authority()
        out: Primary | None = ray.get(authority.primary.remote(index, self.job_id), timeout=30)
        return out

    def _started_authority(self) -> ActorHandle:
        """The authority actor (a started group with replicas has one)."""
        assert self.authority is not None
        return self.authority

    def replica_infos(self, timeout_s: float = 10.0) -> list[list[ShardInfo | None]]:
        """Every replica's info, by shard then replica (None: it did not answer within
        ``timeout_s``, e.g. its node was lost and Ray has not placed it again)."""
        refs = [[a.info.remote() for a in shard] for shard in self.actors]
        flat = [ref for shard in refs for ref in shard]
        ready, _ = ray.wait(flat, num_returns=len(flat), timeout=timeout_s)
        done = set(ready)
        out: list[list[ShardInfo | None]] = []
        for shard in refs:
            row: list[ShardInfo | None] = []
            for ref in shard:
                try:
                    row.append(ray.get(ref) if ref in done else None)
                except ray.exceptions.RayError:
                    row.append(None)
            out.append(row)
        return out

    def info(self, index: int, timeout_s: float = 60.0) -> ShardInfo:
        """Shard ``index``'s primary: address, node, process and counters (waits out a restart
        or a failover, at most ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.replicas == 1:
                out: ShardInfo = ray.get(self.actors[index][0].info.remote(), timeout=timeout_s)
                return out
            primary = self.primary(index)
            if primary is not None:
                try:
                    out = ray.get(
                        self.actors[index][primary["index"]].info.remote(),
                        timeout=max(1.0, deadline - time.monotonic()),
                    )
                    if out.role == "primary":
                        report = ray.get(self._started_authority().report.remote(), timeout=30)
                        out.failovers = max(0, len(report["promotions"].get(index, [])) - 1)
                        return out
                except ray.exceptions.RayError:
                    pass
            if time.monotonic() > deadline:
                raise WaitTimeout(f"shard {index} has no primary that answers")
            time.sleep(0.2)

    def infos(self, timeout_s: float = 60.0) -> list[ShardInfo]:
        """Every shard's primary (:meth:`info`)."""
        return [self.info(i, timeout_s) for i in range(self.config.num_shards)]

    def kill(self, index: int, replica: int | None = None) -> None:
        """Kill the actor process of replica ``replica`` of shard ``index`` now (default: the
        primary; Ray restarts it: ``max_restarts``)."""
        if replica is None:
            primary = self.primary(index)
            replica = primary["index"] if primary is not None else 0
        ray.kill(self.actors[index][replica], no_restart=False)

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
            task.remote(
                self.addresses,
                i,
                cfg.num_workers,
                job,
                cfg.name,
                cfg.retry_deadline_s,
                self.authority,
                self.job_id,
            )
            for i in range(cfg.num_workers)
        ]
        worker_job = WorkerJob(self, job, refs)
        self._jobs.append(worker_job)
        return worker_job

    def report(self) -> Report:
        """The authority's counts: ``{"promotions": {shard: [(epoch, replica)]},
        "worker_starts": {worker: n}}`` (empty when it is gone)."""
        if self.authority is None:
            return {"promotions": {}, "worker_starts": {}}
        try:
            out: Report = ray.get(self.authority.report.remote(), timeout=30)
        except ray.exceptions.RayError:
            return {"promotions": {}, "worker_starts": {}}
        return out

    def close(self) -> None:
        """Teardown: cancel unfinished worker tasks, stop each replica gracefully (final
        checkpoint), kill the actors for good, remove the placement groups."""
        for job in self._jobs:
            job.cancel()
        actors = [a for shard in self.actors for a in shard]
        stops = [a.stop.remote(self.config.stop_grace_s) for a in actors]
        if stops:
            ray.wait(stops, num_returns=len(stops), timeout=self.config.stop_grace_s + 30.0)
        for actor in actors + ([self.authority] if self.authority is not None else []):
            ray.kill(actor, no_restart=True)
        self.actors = []
        self.authority = None
        for pg in self._pgs:
            remove_placement_group(pg)
        self._pgs = []

    open = start


class WorkerJob:
    """The worker tasks of one submitted job."""

    def __init__(
        self,
        shards: RayShardGroup,
        job: ClusterJob | ScriptJob | TrainFunction,
        refs: list[ray.ObjectRef],
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
        Returns each worker's exit, each shard's counters, failovers and retries, and the
        job's final metrics."""
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
        metrics: dict[str, float | str] = {}
        if isinstance(self.job, ClusterJob):
            evaluate = ray.remote(_final_metrics_main).options(num_cpus=0)
            try:
                metrics = ray.get(evaluate.remote(self.shards.addresses, self.job), timeout=120)
            except Exception as exc:  # the shards are unreachable: say so in the result
                metrics = {"error": f"evaluation failed: {type(exc).__name__}: {exc}"}
        report = self.shards.report()
        starts = report["worker_starts"]
        for i, outcome in outcomes.items():
            outcome.starts = max(1, int(starts.get(i, 1)))
        shards: list[ShardInfo] = []
        error = None
        try:
            shards = self.shards.infos(timeout_s=60.0)
        except (WaitTimeout, ray.exceptions.RayError) as exc:
            error = f"the shards' final state could not be read: {exc}"
        return JobResult(
            workers=[outcomes[i] for i in range(len(self.refs))],
            shards=shards,
            metrics=metrics,
            elapsed_s=round(elapsed, 3),
            state_dir=self.shards.state_dir,
            replicas=self.shards.replicas,
            failovers=sum(max(0, len(p) - 1) for p in report["promotions"].values()),
            retried_workers=sorted(i for i, o in outcomes.items() if o.starts > 1),
            error=error,
        )


def _bundle_node_ip(pg: PlacementGroup, bundle: int) -> str:
    """The IP of the node bundle ``bundle`` of ``pg`` was placed on."""
    node_of = placement_group_table(pg)["bundles_to_node_id"]
    ip_of = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    return str(ip_of[node_of[bundle]])


def launch(config: RayJobConfig, job: ClusterJob | ScriptJob | TrainFunction) -> JobResult:
    """Run one job on the Ray cluster this process is connected to and tear it down.

    Args:
        config: Shards, replicas, workers, restart policies, deadlines.
        job: A :class:`ClusterJob` (the digits demo's
            :class:`~paramserver.cli.demos.digits.DigitsJob`), a :class:`ScriptJob` (a
            training script) or a function ``train(client, worker_index, num_workers)``.

    Returns:
        The :class:`JobResult` (workers' exits, shards' counters, failovers, retried workers,
        final metrics). A job that could not run to its end (the shards did not start within
        ``start_timeout_s``, the cluster failed under it) returns one too, with ``ok``
        false and ``error`` saying why; nothing is raised for it.
    """
    shards = RayShardGroup(config)
    try:
        with shards:
            return shards.submit(job).result()
    except (WaitTimeout, ray.exceptions.RayError, OSError) as exc:
        logger.error("the job failed: %s", exc)
        return JobResult.failed(f"{type(exc).__name__}: {exc}", shards.state_dir)


#: What this module defines for use elsewhere, and ScriptFailed, what a ScriptJob's worker
#: task raises (:mod:`paramserver.integrations.ray` takes every name it exports from here once
#: ``ray`` is imported; it names the other modules' own).
__all__ = [
    "MANAGED_SERVER_FIELDS",
    "ClusterJob",
    "RayJobConfig",
    "RayShardGroup",
    "ScriptFailed",
    "TrainFunction",
    "WorkerJob",
    "WorkerReturn",
    "launch",
]
