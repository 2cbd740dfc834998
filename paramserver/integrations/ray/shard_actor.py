"""One shard replica as a Ray actor: hosts the ``paramserver serve`` daemon on a private event
loop thread (see :mod:`paramserver.integrations.ray.placement` for the job's layout)."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import ray

from paramserver.errors import Unavailable
from paramserver.server.config import ServerConfig
from paramserver.server.election import address_key

if TYPE_CHECKING:
    from ray.actor import ActorHandle

T = TypeVar("T")

logger = logging.getLogger(__name__)

#: A replica's start count, in its state directory (survives actor restarts on the node).
STARTS_FILE = "starts"


@dataclass
class ShardInfo:
    """One shard replica as its actor reports it.

    Attributes:
        index: Shard index.
        address: ``host:port`` it serves (the same across restarts on its node; a replica
            that Ray placed again on another node serves at that node's IP).
        node_ip: IP of the Ray node its actor runs on.
        pid: Process id of its actor (changes on a restart).
        starts: Times it started on its state directory (1 + restarts; 1 again on a new node).
        restored_applied_updates: Applied updates it held right after its last start (restored
            from its checkpoint and write-ahead log; 0 on a first start).
        applied_updates: Pushes applied so far (each BSP step counts its contributing pushes).
        duplicate_pushes: Retried pushes recognised and not re-applied.
        recovery_s: Seconds its last start spent restoring.
        replica_index: Which replica of the shard this is (0 without replicas).
        role: ``primary`` (serves clients) or ``backup`` (applies the primary's stream).
        epoch: The highest primary epoch this replica has seen (0 without replicas).
        in_sync: At a primary, the replica indexes holding every acknowledged record.
        failovers: Promotions of a new primary after the first (from the job's authority).
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
    replica_index: int = 0
    role: str = "primary"
    epoch: int = 0
    in_sync: list[int] = field(default_factory=list)
    failovers: int = 0


def token_auth_enabled() -> bool | None:
    """Whether this process runs with Ray's token authentication (None: this Ray does not
    say). Reads ``ray._raylet.get_authentication_mode``: Ray is loaded, so it costs
    microseconds."""
    try:
        from ray._raylet import AuthenticationMode, get_authentication_mode

        return bool(get_authentication_mode() == AuthenticationMode.TOKEN)
    except (ImportError, AttributeError):
        return None


class ShardActor:
    """Hosts one shard replica's ``paramserver serve`` daemon on a private event loop thread.

    Created by :class:`~paramserver.integrations.ray.placement.RayShardGroup` as a Ray actor;
    its constructor runs again on every restart. Without replicas it restores the shard from its
    checkpoint directory and write-ahead log, on the node its address names. A replica (more
    than one per shard) starts as a backup and campaigns at the job's authority actor
    (:mod:`paramserver.integrations.ray.authority`); placed again on another node (its node
    was lost) it serves at that node's IP, publishes the new address, and is seeded by the
    primary (checkpoint + stream): no shared disk is needed.

    Args:
        index: Shard index.
        replica_index: Replica index within the shard.
        groups: Every shard's replica addresses as first placed, by shard then replica.
        server: :class:`~paramserver.server.config.ServerConfig` fields of every shard.
        state_dir: Directory on the node under which it keeps
            ``shard-<i>[/replica-<k>]/{checkpoints,wal}``.
        authority: The job's authority actor (elects the primary; None without replicas).
        prefix: The job's key prefix at the authority.

    Raises:
        Unavailable: without replicas, the actor landed on another node than its address names
            (UNAVAILABLE).
        InvalidArgument: a bad setting, or unreadable certificates or token file
            (INVALID_ARGUMENT).
    """

    def __init__(
        self,
        index: int,
        replica_index: int,
        groups: Sequence[Sequence[str]],
        server: Mapping[str, object],
        state_dir: str,
        authority: ActorHandle | None = None,
        prefix: str = "paramserver",
    ) -> None:
        from paramserver.security.tls import ServerSecurity
        from paramserver.server.shard_daemon import ParameterServerDaemon

        self.index = index
        self.replica_index = replica_index
        group = list(groups[index])
        replicas = len(group)
        node_ip = ray.util.get_node_ip_address()
        store = None
        if replicas > 1:
            from paramserver.integrations.ray.authority import RayElectionStore

            assert authority is not None
            for k in range(replicas):  # where the others serve now (any of them may have moved)
                kv = ray.get(authority.get.remote(address_key(prefix, index, k)), timeout=30)
                if kv is not None:
                    group[k] = kv["value"]
            port = group[replica_index].rsplit(":", 1)[1]
            if group[replica_index].rsplit(":", 1)[0] != node_ip:
                group[replica_index] = f"{node_ip}:{port}"
                ray.get(
                    authority.publish.remote(
                        address_key(prefix, index, replica_index), group[replica_index]
                    ),
                    timeout=30,
                )
            store = RayElectionStore(authority)
            replica_dir = Path(state_dir) / f"shard-{index}" / f"replica-{replica_index}"
        else:
            replica_dir = Path(state_dir) / f"shard-{index}"
        self.address = group[replica_index]
        host, port = self.address.rsplit(":", 1)
        if node_ip != host:
            raise Unavailable(
                f"shard {index} was placed on node {node_ip}, but its address is {self.address}"
                " (its bundle moved to another node and the shard has no replicas: restart "
                "the job, or run it with replicas)"
            )
        replica_dir.mkdir(parents=True, exist_ok=True)
        starts_file = replica_dir / STARTS_FILE
        self.starts = (int(starts_file.read_text()) if starts_file.exists() else 0) + 1
        starts_file.write_text(str(self.starts))
        managed: dict[str, object] = {
            "host": host,
            "port": int(port),
            "shard_index": index,
            "shard_addresses": ",".join("|".join(g) for g in groups),
            "checkpoint_dir": str(replica_dir / "checkpoints"),
            "wal": True,
            "wal_dir": str(replica_dir / "wal"),
        }
        if replicas > 1:
            managed |= {
                "replicas": replicas,
                "replica_index": replica_index,
                "replica_addresses": ",".join(group),
                "election_prefix": prefix,
            }
        config = ServerConfig.from_sources({**server, **managed}, os.environ)
        ServerSecurity.of_config(config)  # unreadable certificates: refused here
        self._loop = _new_loop(config.use_uvloop)
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"paramserver-shard-{index}", daemon=True
        )
        self._thread.start()
        self._daemon = ParameterServerDaemon(config, election_store=store)
        self._stopped = False
        self._run(self._daemon.start(), timeout_s=120.0)
        assert self._daemon.engine is not None
        self.restored_applied_updates = self._daemon.engine.core.applied_updates
        logger.info(
            "shard %d replica %d serving on %s (start %d, %d applied updates restored)",
            index,
            replica_index,
            self.address,
            self.starts,
            self.restored_applied_updates,
        )

    def _run(self, coro: Coroutine[object, object, T], timeout_s: float) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def token_auth(self) -> bool | None:
        """Whether this shard's Ray worker process runs with token authentication (as its node
        was started; None: this Ray does not say)."""
        return token_auth_enabled()

    def info(self) -> ShardInfo:
        """This replica's address, node, process, role and counters."""
        engine = self._daemon.engine
        assert engine is not None
        replica = self._daemon.replica
        primary = replica.primary if replica is not None else None
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
            replica_index=self.replica_index,
            role="primary" if replica is None or primary is not None else "backup",
            epoch=replica.epoch if replica is not None else 0,
            in_sync=sorted(primary.in_sync()) if primary is not None else [],
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
