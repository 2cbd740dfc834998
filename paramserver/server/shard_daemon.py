"""The parameter-server shard daemon: a :class:`ParameterServerDaemon` serves one shard.

It binds a grpc.aio server (:func:`paramserver.serving.bootstrap.start_grpc_server`) with the
parameter-server servicer, the standard gRPC health service (``grpc.health.v1``: SERVING while
up, NOT_SERVING from the start of a graceful shutdown, before the server stops) and server
reflection. :meth:`ParameterServerDaemon.stop` stops accepting calls at once, finishes what is in
flight within ``grace_s``, writes a final checkpoint when a checkpoint directory is configured and
closes the write-ahead log. ``paramserver serve`` (:mod:`paramserver.cli.serve`) runs it until
SIGTERM/SIGINT.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
from prometheus_client import CollectorRegistry

from paramserver.api.v1 import parameter_server_pb2_grpc as pb_grpc
from paramserver.closing import cancelled
from paramserver.core.sharding import ShardMap
from paramserver.errors import InvalidArgument, StorageError, StorageFull, storage_error
from paramserver.protocol.link import available as local_link_available
from paramserver.security.tls import (
    ServerSecurity,
    open_channel,
    peer_security,
)
from paramserver.server.checkpoint import CheckpointManager
from paramserver.server.checkpoint_cut import shard_map_of
from paramserver.server.config import ServerConfig
from paramserver.server.election import Election, ElectionStore, moved_groups
from paramserver.server.engine import ServerEngine
from paramserver.server.observability.prometheus import TransportStats, metrics_for
from paramserver.server.observability.shard_dashboard import ShardDashboard
from paramserver.server.observability.status_table import status_to_dict
from paramserver.server.replication import SERVICE_NAME as REPLICATION_SERVICE
from paramserver.server.replication import Replica, ReplicationServicer
from paramserver.server.replication import add_to_server as add_replication
from paramserver.server.restore import prepare_checkpoint_dir
from paramserver.server.shard_service import ShardService
from paramserver.server.table_export import load_export
from paramserver.server.transports import link_service as local_link
from paramserver.server.transports.grpc_service import ParameterServerServicer, add_to_server
from paramserver.server.wal import WriteAheadLog
from paramserver.server.wal_records import replay_into
from paramserver.serving.bootstrap import ServingDaemon, start_grpc_server
from paramserver.serving.dashboard import PEER_TIMEOUT_S, gather_peers
from paramserver.serving.metrics import MetricsServer, auth_refusal_counter

logger = logging.getLogger(__name__)

SERVICE_NAME = "paramserver.api.v1.ParameterServer"


class ParameterServerDaemon(ServingDaemon):
    """A running server shard. Use ``async with ParameterServerDaemon(config) as d:``.

    Attributes:
        address: ``host:port`` actually bound (port resolved when 0 was asked for).
        engine: The engine holding the core state.
    """

    def __init__(self, config: ServerConfig, election_store: ElectionStore | None = None) -> None:
        self.config = config
        #: The authority electing this replica's shard's primary when not etcd at
        #: ``election_endpoints`` (the Ray launcher's authority actor).
        self.election_store = election_store
        self.engine: ServerEngine | None = None
        self.checkpoints: CheckpointManager | None = None
        self._timer: asyncio.Task[None] | None = None
        self._pending: set[asyncio.Task[Path | None]] = set()
        self._checkpoint_lock = asyncio.Lock()
        self._health_tasks: set[asyncio.Task[None]] = set()
        self.recovery_s = 0.0
        #: Recovery restored state from this daemon's own disk (a checkpoint or log records).
        self.recovered = False
        self.port = 0
        #: The shard map as configured (set on start; tests may replace it); GetShardMap
        #: serves :attr:`shard_map`.
        self.configured_map: ShardMap | None = None
        self.metrics: MetricsServer | None = None
        #: The parameter-server servicer once started (mode "ps").
        self.servicer: ParameterServerServicer | None = None
        #: The same-host local link once started (mode "ps", same-host paths on, Linux).
        self.local_link: local_link.LocalLinkServer | None = None
        #: TLS / token settings from the config (None: plain text, no tokens; validated here).
        self.security: ServerSecurity | None = ServerSecurity.of_config(config)
        #: Channels to the other shards, for the dashboard's cluster view (opened on first use).
        self._peer_channels: dict[str, grpc.aio.Channel] = {}
        #: This shard replica's role when ``replicas`` > 1 (see
        #: :mod:`paramserver.server.replication`).
        self.replica: Replica | None = None
        #: The etcd election of this replica (``election_endpoints``).
        self.election: Election | None = None

    @property
    def address(self) -> str:
        host = self.config.host if self.config.host not in ("0.0.0.0", "::") else "127.0.0.1"
        return f"{host}:{self.port}"

    @property
    def shard_map(self) -> ShardMap | None:
        """The shard map served by GetShardMap: as configured, with every replica that
        moved to another host (its new address published to the election's store) at its
        new address, so a client that discovers the cluster now reaches every shard."""
        configured = self.configured_map
        if configured is None or self.election is None or not self.election.moved:
            return configured
        groups = moved_groups(configured.addresses, self.election.moved)
        return dataclasses.replace(configured, addresses=groups)

    @shard_map.setter
    def shard_map(self, shard_map: ShardMap | None) -> None:
        self.configured_map = shard_map

    async def start(self) -> None:
        """Recover (newest checkpoint + WAL replay), bind, and start serving."""
        if self.config.mode != "ps":
            raise InvalidArgument(
                f"ParameterServerDaemon serves mode 'ps', not {self.config.mode!r} "
                "(mode 'reduce': paramserver.reduction.reduce_daemon.ReductionDaemon)"
            )
        engine = ServerEngine(self.config)
        self.engine = engine
        prepare_checkpoint_dir(self.config)  # --restore-from; refuse foreign shards
        self._recover(engine)
        interceptors, self.metrics = metrics_for(engine, self._transport_stats)
        if self.metrics is not None:
            self.metrics.dashboard = self._dashboard(self.metrics.registry)
            # Before the gRPC port: grpc.aio keeps a port bound by a server that never started
            # (even after stop), so a metrics port in use must fail before grpc binds anything.
            await self._start_metrics()
        if self.security is not None:  # authentication first: a refused call reaches nothing
            interceptors = [*self.security.interceptors(self._refusal_counter()), *interceptors]
        self.servicer = ParameterServerServicer(ShardService(engine), self)
        servicer = self.servicer
        replica = self._replica(engine)

        def add_services(server: grpc.aio.Server) -> None:
            add_to_server(servicer, server)
            if replica is not None:
                add_replication(ReplicationServicer(replica.backup), server)

        endpoint = await start_grpc_server(
            f"{self.config.host}:{self.config.port}",
            add_services,
            service_names=(SERVICE_NAME,) + ((REPLICATION_SERVICE,) if replica else ()),
            security=self.security,
            interceptors=interceptors,
            max_receive_message_bytes=self.config.max_receive_message_bytes,
            on_failure=self._abandon,
        )
        self._endpoint = endpoint
        self.port = endpoint.port
        if self.metrics is not None:
            self.metrics.dashboard.info["address"] = self.address
        await self._start_local_link()
        # A replicated shard is reached at whichever replica is primary: all of them.
        group = "|".join(self.config.replica_address_list) or self.address
        self.configured_map = shard_map_of(self.config, group)
        if replica is None:
            engine.start()
        if self.checkpoints is not None and self.config.checkpoint_every_s > 0:
            self._timer = asyncio.get_running_loop().create_task(
                self._checkpoint_timer(), name="paramserver-checkpoint-timer"
            )
        await endpoint.set_serving(True)
        engine.on_storage_failure = self._storage_failed
        if replica is not None:
            await self._start_replica(replica)
        logger.info(
            "paramserver listening on %s:%d (%s, staleness %d, aggregation %s, lease %d ms%s)",
            self.config.host,
            self.port,
            self.config.consistency,
            engine.core.cluster.staleness,
            self.config.aggregation,
            self.config.lease_ms,
            ", write-ahead log on" if engine.wal is not None else "",
        )

    def _replica(self, engine: ServerEngine) -> Replica | None:
        """This shard replica's role, a backup until promoted (None without replicas)."""
        cfg = self.config
        if cfg.replicas == 1:
            return None
        assert self.checkpoints is not None  # replicas need checkpoint_dir (config checks)
        client = None
        if self.security is not None:  # replicas share TLS and the token file: an admin token
            tokens = self.security.tokens
            client = peer_security(self.security, tokens.first_admin() if tokens else None)
        replica = Replica(
            engine,
            self.checkpoints,
            shard_index=cfg.shard_index,
            index=cfg.replica_index,
            addresses=cfg.replica_address_list,
            security=client,
            set_health=self._primary_health,
        )
        replica.recovered = self.recovered
        self.replica = replica
        engine.replication = replica
        return replica

    async def _start_replica(self, replica: Replica) -> None:
        """Serve as a backup (clients see NOT_SERVING) until etcd names this replica primary
        (:mod:`paramserver.server.election`); without etcd replica 0 is primary at epoch 1
        and there is no failover."""
        await self._primary_health(False)
        if self.config.election_endpoints is None and self.election_store is None:
            if self.config.replica_index == 0:
                await replica.promote(1)
            return
        self.election = Election(self.config, replica, self.election_store)
        await self.election.start()

    async def _primary_health(self, serving: bool) -> None:
        """Health of the parameter-server service: SERVING only at the primary, so a client
        channel over all replicas (gRPC client-side health checking) calls the primary."""
        endpoint = self._endpoint
        if endpoint is None or endpoint.health is None:
            return
        from grpc_health.v1 import health_pb2

        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        await endpoint.health.set(SERVICE_NAME, status)

    def _storage_failed(self, exc: StorageError) -> None:
        """The write-ahead log failed with memory possibly ahead of it: health NOT_SERVING
        (orchestrators restart the server, which then replays the log)."""
        endpoint = self._endpoint
        if endpoint is None:
            return
        task = asyncio.get_running_loop().create_task(
            endpoint.set_serving(False), name="paramserver-health-failed"
        )
        self._health_tasks.add(task)
        task.add_done_callback(self._health_tasks.discard)

    async def _start_local_link(self) -> None:
        """Same-host workers' Session over a Unix socket
        (:mod:`paramserver.server.transports.link_service`),
        unless same-host paths are off (``--no-shared-memory``) or there are no abstract
        sockets; a socket that cannot be bound only costs the speed-up."""
        assert self.servicer is not None
        if not (self.config.shared_memory and local_link_available()):
            return
        link = local_link.LocalLinkServer(
            self.servicer.sessions, self.config.max_receive_message_bytes
        )
        try:
            await link.start()
        except OSError as exc:
            logger.warning("no same-host local link (%s): workers stay on gRPC", exc)
            return
        self.local_link = link
        self.servicer.sessions.local_link = link

    def _dashboard(self, registry: CollectorRegistry) -> ShardDashboard:
        """The metrics port's page of this shard: its Status and, in a sharded cluster, every
        other shard's, read over gRPC from the shard map's addresses."""
        cfg = self.config

        async def status() -> dict[str, Any]:
            if self.servicer is None:
                return {}
            return status_to_dict(await self.servicer.status())

        async def read_peer(address: str) -> dict[str, Any]:
            from paramserver.api.v1 import parameter_server_pb2 as pb

            channel = self._peer_channels.get(address)
            if channel is None:
                client = peer_security(self.security, None) if self.security is not None else None
                channel = self._peer_channels[address] = open_channel(address, client)
            try:
                stub = pb_grpc.ParameterServerStub(channel)
                resp = await stub.Status(pb.StatusRequest(), timeout=PEER_TIMEOUT_S)
            except BaseException:  # a fresh channel next time (the peer may have moved)
                self._peer_channels.pop(address, None)
                await channel.close()
                raise
            return status_to_dict(resp)

        async def peers() -> list[dict[str, Any]]:
            shard_map = self.shard_map
            if shard_map is None:
                return []
            others = [(i, a) for i, a in enumerate(shard_map.addresses) if i != cfg.shard_index]
            return await gather_peers(others, read_peer)

        info = {
            "mode": cfg.mode,
            "shard_index": cfg.shard_index,
            "num_shards": cfg.num_shards,
            "address": "",  # set once the gRPC port is bound
            "wal": cfg.wal,
            "checkpoint_dir": cfg.checkpoint_dir or "",
            "checkpoint_every_s": cfg.checkpoint_every_s,
            "lease_ms": cfg.lease_ms,
        }
        return ShardDashboard(
            registry, info=info, status=status, peers=peers if cfg.num_shards > 1 else None
        )

    def _transport_stats(self) -> TransportStats:
        """The Session transport's state for the metrics endpoint (read at scrape time)."""
        servicer = self.servicer
        if servicer is None:
            return TransportStats()
        link = self.local_link
        return TransportStats(
            sessions_open=servicer.sessions.open_sessions,
            segments_mapped=servicer.sessions.mapped_segments,
            local_links_opened=link.links_opened if link is not None else 0,
            local_links_refused=link.links_refused if link is not None else 0,
        )

    def _refusal_counter(self) -> Callable[[str, str], None] | None:
        """Counts token refusals in the metrics registry (None without metrics)."""
        return auth_refusal_counter(self.metrics.registry) if self.metrics is not None else None

    async def _start_metrics(self) -> None:
        """Start the metrics endpoint; when it cannot bind, close the write-ahead log
        :meth:`_recover` opened and re-raise (nothing else is running yet)."""
        assert self.metrics is not None
        try:
            await self.metrics.start()
        except BaseException:
            self.metrics = None
            await self._close_wal()
            raise

    async def _close_wal(self) -> None:
        if self.engine is not None and self.engine.wal is not None:
            await self.engine.wal.close()
            self.engine.wal = None

    async def _abandon(self) -> None:
        """Undo a start that failed before serving (the gRPC server is stopped already): stop
        the metrics endpoint and close the write-ahead log."""
        if self.metrics is not None:
            await self.metrics.stop()
        await self._close_wal()

    def _recover(self, engine: ServerEngine) -> None:
        """Restore the newest verified checkpoint, replay the WAL after it, open the WAL."""
        cfg = self.config
        t0 = time.monotonic()
        if cfg.from_export:  # --read-only: the export's tables, this shard's ids
            loaded = load_export(
                engine.core.tables,
                Path(cfg.from_export),
                shard_index=cfg.shard_index,
                num_shards=cfg.num_shards,
            )
            logger.info("serving table export %s read-only: rows %s", cfg.from_export, loaded)
        if cfg.checkpoint_dir:
            self.checkpoints = CheckpointManager(
                Path(cfg.checkpoint_dir), keep=cfg.keep_checkpoints
            )
            restored = self.checkpoints.restore_latest(engine.core)
            self.recovered = restored is not None
            if restored is not None:
                logger.info("restored checkpoint %s", restored.name)
                engine.obs.checkpoint_restored(restored.name, restored.stat().st_mtime)
            if cfg.checkpoint_every_steps:
                engine.core.on_progress = self._on_progress
        wal_dir = Path(cfg.wal_dir) if cfg.wal_dir else Path(cfg.checkpoint_dir or ".") / "wal"
        after = self.checkpoints.last_restored_wal_sequence if self.checkpoints else 0
        if not cfg.wal and (cfg.wal_dir or cfg.checkpoint_dir) and wal_dir.is_dir():
            unreplayed = sum(1 for _ in WriteAheadLog(wal_dir).replay(after))
            if unreplayed:
                raise InvalidArgument(
                    f"the write-ahead log in {wal_dir} holds {unreplayed} acknowledged "
                    "record(s) that no checkpoint contains: start with --wal to replay them "
                    "(or delete that directory to discard them)"
                )
        if cfg.wal:
            log = WriteAheadLog(
                wal_dir, fsync_interval_ms=cfg.wal_fsync_interval_ms if cfg.wal_fsync else None
            )
            last = log.open()
            replayed = replay_into(engine.core, log.replay(after))
            self.recovered = self.recovered or replayed > 0
            if last < after:
                log.next_sequence = after + 1
            engine.wal = log
            if replayed:
                logger.info(
                    "replayed %d write-ahead-log records after sequence %d", replayed, after
                )
        self.recovery_s = time.monotonic() - t0

    def _on_progress(self, mark: int) -> None:
        every = self.config.checkpoint_every_steps
        if every and mark % every == 0:
            self.request_checkpoint()

    def request_checkpoint(self) -> asyncio.Task[Path | None]:
        """Start a checkpoint now (one at a time); the task returns its path (None if off)."""
        task = asyncio.get_running_loop().create_task(self.checkpoint(), name="paramserver-ckpt")
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
        return task

    async def checkpoint(self) -> Path | None:
        """Write one consistent checkpoint; the snapshot is taken without yielding.

        The write-ahead log is rotated at the snapshot and truncated once the checkpoint
        commits. The file writing runs in a worker thread so the server keeps serving.

        Raises:
            StorageFull: (RESOURCE_EXHAUSTED) the disk is full; the previous checkpoint stands.
            StorageError: (UNAVAILABLE) another I/O error; the previous checkpoint stands.
        """
        if self.checkpoints is None or self.engine is None:
            return None
        async with self._checkpoint_lock:
            engine = self.engine
            t0 = time.monotonic()
            # Pushes applied in worker threads: wait for them and hold new ones back while the
            # snapshot is taken (no await inside), so values match counters and dedup state.
            async with engine.offload.quiesced():
                wal_sequence = engine.wal.rotate() if engine.wal is not None else 0
                snap = self.checkpoints.snapshot(engine.core, wal_sequence=wal_sequence)
            try:
                path = await asyncio.get_running_loop().run_in_executor(
                    None, self.checkpoints.write, snap
                )
            except OSError as exc:  # disk full, EIO...: the previous checkpoint stands
                raise storage_error(exc, f"checkpoint in {self.checkpoints.directory}") from exc
            if engine.wal is not None:
                engine.wal.truncate_through(wal_sequence)
            engine.obs.checkpoint_written(time.monotonic() - t0, Path(path).name)
            return path

    async def _checkpoint_timer(self) -> None:
        while True:
            await asyncio.sleep(self.config.checkpoint_every_s)
            try:
                await self.checkpoint()
            except (StorageFull, StorageError) as exc:
                logger.error("periodic checkpoint failed; the previous one stands: %s", exc)

    async def stop(self, grace_s: float | None = None) -> None:
        """Refuse new calls, end waits with UNAVAILABLE, let in-flight calls finish within the
        grace, write a final checkpoint, close the WAL."""
        grace = self.config.grace_s if grace_s is None else grace_s
        await cancelled(self._timer)
        self._timer = None
        if self.election is not None:
            await self.election.stop()
            self.election = None
        if self.engine is not None:
            self.engine.begin_shutdown()
        if self.servicer is not None:  # idle Session streams end now, not after the grace
            self.servicer.sessions.begin_shutdown()
        endpoint, self._endpoint = self._endpoint, None
        if endpoint is not None and endpoint.health is not None:
            await endpoint.health.enter_graceful_shutdown()
        link, self.local_link = self.local_link, None
        if endpoint is not None:
            stopping: list[Awaitable[None]] = [endpoint.server.stop(grace)]
            if link is not None:
                self.servicer.sessions.local_link = None  # type: ignore[union-attr]
                stopping.append(link.stop(grace))
            await asyncio.gather(*stopping)
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)
        if self.replica is not None:
            await self.replica.stop()
        if self.engine is not None:
            await self.engine.stop()
            if self.checkpoints is not None:
                try:
                    path = await self.checkpoint()
                    logger.info("final checkpoint %s", path)
                except (StorageFull, StorageError) as exc:
                    logger.error("final checkpoint failed; the previous one stands: %s", exc)
            if self.engine.wal is not None:
                await self.engine.wal.close()
        if self.metrics is not None:
            await self.metrics.stop()
        channels, self._peer_channels = list(self._peer_channels.values()), {}
        for channel in channels:
            await channel.close()
