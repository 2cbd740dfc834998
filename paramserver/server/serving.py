"""The server shard daemon: ``paramserver serve``, plus an in-process server for tests and demos.

``ParameterServerDaemon`` binds a grpc.aio server with the parameter-server servicer, the
standard gRPC health service (``grpc.health.v1``: SERVING while up, NOT_SERVING from the start of
a graceful shutdown, before the server stops) and server reflection
(``grpc.reflection.v1alpha``); :func:`run_daemon` adds signal handling:
SIGTERM/SIGINT stop accepting calls at once, finish what is in flight within ``grace_s``, write
a final checkpoint when a checkpoint directory is configured, and exit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from paramserver.api.v1 import parameter_server_pb2_grpc as pb_grpc
from paramserver.core.sharding import ShardMap, parse_address
from paramserver.errors import InvalidArgument, StorageError, StorageFull, storage_error
from paramserver.protocol.keepalive import SERVER_KEEPALIVE_OPTIONS
from paramserver.protocol.link import available as local_link_available
from paramserver.reduction.reduce_service import SERVICE_NAME as REDUCTION_SERVICE_NAME
from paramserver.reduction.reduce_service import ReductionEngine, add_reduction_service
from paramserver.security.tls import (
    ServerSecurity,
    add_client_security_flags,
    add_server_security_flags,
    bind,
    client_security_from_args,
    open_channel,
    peer_security,
)
from paramserver.server.allocator import (
    DEFAULT_RETAIN_BYTES,
    MAX_RETAIN_BYTES,
    MIN_RETAIN_BYTES,
    retain_freed_memory,
    user_malloc_settings,
)
from paramserver.server.checkpoint import CheckpointManager
from paramserver.server.checkpoint_cut import shard_map_of
from paramserver.server.config import ServerConfig
from paramserver.server.engine import ServerEngine
from paramserver.server.observability.dashboard import PEER_TIMEOUT_S, Dashboard, gather_peers
from paramserver.server.observability.prometheus import (
    MetricsServer,
    TransportStats,
    auth_refusal_counter,
    enable_reflection,
    metrics_for,
    metrics_security,
    rpc_metrics_server,
)
from paramserver.server.observability.status_table import status_to_dict
from paramserver.server.reshard import prepare_checkpoint_dir
from paramserver.server.transports import link_service as local_link
from paramserver.server.transports.grpc_service import ParameterServerServicer, add_to_server
from paramserver.server.wal import WriteAheadLog, replay_into

logger = logging.getLogger(__name__)

SERVICE_NAME = "paramserver.api.v1.ParameterServer"


class ParameterServerDaemon:
    """A running server shard. Use ``async with ParameterServerDaemon(config) as d:``.

    Attributes:
        address: ``host:port`` actually bound (port resolved when 0 was asked for).
        engine: The engine holding the core state.
    """

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.engine: ServerEngine | None = None
        self.reduction: ReductionEngine | None = None  # mode "reduce" only
        self.checkpoints: CheckpointManager | None = None
        self._server: grpc.aio.Server | None = None
        self._health: health.aio.HealthServicer | None = None
        self._timer: asyncio.Task[None] | None = None
        self._pending: set[asyncio.Task[Path | None]] = set()
        self._checkpoint_lock = asyncio.Lock()
        self._health_tasks: set[asyncio.Task[None]] = set()
        self.recovery_s = 0.0
        self.port = 0
        #: The shard map served by GetShardMap (set on start; tests may replace it).
        self.shard_map: ShardMap | None = None
        self.metrics: MetricsServer | None = None
        #: The parameter-server servicer once started (mode "ps").
        self.servicer: ParameterServerServicer | None = None
        #: The same-host local link once started (mode "ps", same-host paths on, Linux).
        self.local_link: local_link.LocalLinkServer | None = None
        #: TLS / token settings from the config (None: plain text, no tokens; validated here).
        self.security: ServerSecurity | None = ServerSecurity.of_config(config)
        #: Channels to the other shards, for the dashboard's cluster view (opened on first use).
        self._peer_channels: dict[str, grpc.aio.Channel] = {}

    @property
    def address(self) -> str:
        host = self.config.host if self.config.host not in ("0.0.0.0", "::") else "127.0.0.1"
        return f"{host}:{self.port}"

    async def start(self) -> None:
        """Recover (newest checkpoint + WAL replay), bind, and start serving."""
        if self.config.mode == "reduce":
            await self._start_reduction()
            return
        engine = ServerEngine(self.config)
        self.engine = engine
        prepare_checkpoint_dir(self.config)  # restore-time resharding; refuse foreign shards
        self._recover(engine)
        interceptors, self.metrics = metrics_for(engine, self._transport_stats)
        if self.metrics is not None:
            self.metrics.dashboard = self._dashboard(self.metrics.registry)
            # Before the gRPC port: grpc.aio keeps a port bound by a server that never started
            # (even after stop), so a metrics port in use must fail before grpc binds anything.
            await self._start_metrics()
        if self.security is not None:  # authentication first: a refused call reaches nothing
            interceptors = [*self.security.interceptors(self._refusal_counter()), *interceptors]
        server = grpc.aio.server(
            interceptors=interceptors,
            options=[
                ("grpc.max_receive_message_length", self.config.max_receive_message_bytes),
                ("grpc.so_reuseport", 0),
                *SERVER_KEEPALIVE_OPTIONS,
            ],
        )
        self.servicer = ParameterServerServicer(engine, self)
        add_to_server(self.servicer, server)
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        enable_reflection(server, SERVICE_NAME)
        try:
            self.port = _bind(server, self.config.host, self.config.port, self.security)
        except BaseException:
            await self._abandon(server)
            raise
        await server.start()
        self._server = server
        if self.metrics is not None:
            self.metrics.dashboard.info["address"] = self.address
        await self._start_local_link()
        self.shard_map = shard_map_of(self.config, self.address)
        engine.start()
        if self.checkpoints is not None and self.config.checkpoint_every_s > 0:
            self._timer = asyncio.get_running_loop().create_task(
                self._checkpoint_timer(), name="paramserver-checkpoint-timer"
            )
        for name in ("", SERVICE_NAME):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        engine.on_storage_failure = self._storage_failed
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

    def _storage_failed(self, exc: StorageError) -> None:
        """The write-ahead log failed with memory possibly ahead of it: health NOT_SERVING
        (orchestrators restart the server, which then replays the log)."""
        health_servicer = self._health
        if health_servicer is None:
            return

        async def mark() -> None:
            for name in ("", SERVICE_NAME):
                await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

        task = asyncio.get_running_loop().create_task(mark(), name="paramserver-health-failed")
        self._health_tasks.add(task)
        task.add_done_callback(self._health_tasks.discard)

    async def _start_reduction(self) -> None:
        """Mode ``reduce``: the reduction service (no parameters, no checkpoints) and health;
        with ``metrics_port``, RPC counts and durations and the token refusals."""
        interceptors: list[Any] = []
        if self.config.metrics_port is not None:
            rpc_metrics, self.metrics = rpc_metrics_server(
                self.config.metrics_host, self.config.metrics_port, metrics_security(self.config)
            )
            await self._start_metrics()  # before the gRPC port (see start())
            interceptors.append(rpc_metrics)
        if self.security is not None:
            interceptors = [*self.security.interceptors(self._refusal_counter()), *interceptors]
        server = grpc.aio.server(
            interceptors=interceptors or None,
            options=[
                ("grpc.max_receive_message_length", self.config.max_receive_message_bytes),
                ("grpc.so_reuseport", 0),
                *SERVER_KEEPALIVE_OPTIONS,
            ],
        )
        reduction = add_reduction_service(server, self.config)
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        enable_reflection(server, REDUCTION_SERVICE_NAME)
        try:
            self.port = _bind(server, self.config.host, self.config.port, self.security)
        except BaseException:
            await self._abandon(server)
            raise
        await server.start()
        self._server = server
        self.reduction = reduction
        reduction.start()
        for name in ("", REDUCTION_SERVICE_NAME):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        logger.info(
            "paramserver reduction server listening on %s:%d (%s, aggregation %s, lease %d ms)",
            self.config.host,
            self.port,
            self.config.reduce_strategy,
            reduction.coordinator.optimizer.method,
            self.config.lease_ms,
        )

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

    def _dashboard(self, registry: Any) -> Dashboard:
        """The metrics port's page of this shard: its Status and, in a sharded cluster, every
        other shard's, read over gRPC from the shard map's addresses."""
        cfg = self.config

        async def status() -> dict[str, Any]:
            if self.servicer is None:
                return {}
            from paramserver.api.v1 import parameter_server_pb2 as pb

            return status_to_dict(await self.servicer.Status(pb.StatusRequest(), None))

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
        return Dashboard(
            "ps", registry, info=info, status=status, peers=peers if cfg.num_shards > 1 else None
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

    async def _abandon(self, server: grpc.aio.Server) -> None:
        """Undo a start that failed before serving: stop the gRPC server (so nothing is left
        for the garbage collector after the loop closes), the metrics endpoint, and close the
        write-ahead log."""
        await server.stop(None)
        if self.metrics is not None:
            await self.metrics.stop()
        await self._close_wal()

    def _recover(self, engine: ServerEngine) -> None:
        """Restore the newest verified checkpoint, replay the WAL after it, open the WAL."""
        cfg = self.config
        t0 = time.monotonic()
        if cfg.checkpoint_dir:
            self.checkpoints = CheckpointManager(
                Path(cfg.checkpoint_dir), keep=cfg.keep_checkpoints
            )
            restored = self.checkpoints.restore_latest(engine.core)
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
        if self._timer is not None:
            self._timer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._timer
            self._timer = None
        if self.engine is not None:
            self.engine.begin_shutdown()
        if self.servicer is not None:  # idle Session streams end now, not after the grace
            self.servicer.sessions.begin_shutdown()
        if self.reduction is not None:
            self.reduction.begin_shutdown()
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        link, self.local_link = self.local_link, None
        if self._server is not None:
            stopping: list[Any] = [self._server.stop(grace)]
            if link is not None:
                self.servicer.sessions.local_link = None  # type: ignore[union-attr]
                stopping.append(link.stop(grace))
            await asyncio.gather(*stopping)
            self._server = None
        if self.reduction is not None:
            await self.reduction.stop()
            self.reduction = None
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)
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

    async def wait_closed(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()

    async def __aenter__(self) -> ParameterServerDaemon:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop(grace_s=0.5)


async def run_daemon(
    config: ServerConfig, *, port_file: str | None = None, notes: Sequence[str] = ()
) -> None:
    """Serve until SIGTERM/SIGINT, then shut down gracefully (``notes``: INFO lines logged once
    the server listens)."""
    daemon = ParameterServerDaemon(config)
    await daemon.start()
    for note in notes:
        logger.info("%s", note)
    if port_file:
        _write_atomic(port_file, str(daemon.port))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    serving = asyncio.ensure_future(daemon.wait_closed())
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
    logger.info("shutting down (grace %.1f s)", config.grace_s)
    await daemon.stop()
    for task in (serving, stopping):
        task.cancel()
    await asyncio.gather(serving, stopping, return_exceptions=True)
    pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    if pending:  # a handler or timer that outlived the shutdown: name it
        logger.warning("%d tasks still pending at exit: %s", len(pending), pending)
    logger.info("stopped (%d tasks pending)", len(pending))


def _bind(
    server: grpc.aio.Server, host: str, port: int, security: ServerSecurity | None = None
) -> int:
    """Bind ``host:port`` (TLS when ``security`` says so); a port in use or a host not on this
    machine is a clear error (:class:`~paramserver.errors.Unavailable` naming the address)."""
    return bind(server, f"{host}:{port}", security)


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    Path(tmp).write_text(text)
    os.replace(tmp, path)


def run_loop(main: Any, *, use_uvloop: bool = True) -> Any:
    """Run a coroutine on uvloop when installed and asked for, else on the default loop."""
    if use_uvloop:
        try:
            import uvloop
        except ImportError:  # pragma: no cover - uvloop is a runtime dependency on POSIX
            return asyncio.run(main)
        return uvloop.run(main)
    return asyncio.run(main)


def serve_config(args: argparse.Namespace, env: Mapping[str, str]) -> ServerConfig:
    """The :class:`ServerConfig` of parsed ``paramserver serve`` flags over ``env``'s
    ``PARAMSERVER_*`` variables (what ``serve`` runs; launchers that host a shard in-process,
    such as :mod:`paramserver.integrations.ray`, build it the same way).

    Raises:
        InvalidArgument: a bad flag, or unreadable certificates or token file (INVALID_ARGUMENT).
    """
    cli = {
        "host": args.host,
        "port": args.port,
        "consistency": args.consistency,
        "staleness": args.staleness,
        "aggregation": args.aggregation,
        "lease_ms": args.lease_ms,
        "death_policy": args.death_policy,
        "wait_timeout_ms": args.wait_timeout_ms,
        "allow_non_finite": True if args.allow_non_finite else None,
        "max_staleness": args.max_staleness,
        "max_receive_message_bytes": args.max_receive_message_bytes,
        "max_tensor_bytes": args.max_tensor_bytes,
        "offload_min_bytes": args.offload_min_bytes,
        "checkpoint_dir": args.checkpoint_dir,
        "checkpoint_every_steps": args.checkpoint_every_steps,
        "keep_checkpoints": args.keep_checkpoints,
        "checkpoint_every_s": args.checkpoint_every_s,
        "max_inflight_pushes_per_worker": args.max_inflight_pushes_per_worker,
        "max_inflight_pushes": args.max_inflight_pushes,
        "max_inflight_push_bytes": args.max_inflight_push_bytes,
        "wal": True if args.wal else None,
        "wal_dir": args.wal_dir,
        "wal_fsync_interval_ms": args.wal_fsync_interval_ms,
        "wal_fsync": False if args.no_wal_fsync else None,
        "grace_s": args.grace_s,
        "use_uvloop": False if args.no_uvloop else None,
        "mode": args.mode,
        "reduce_strategy": args.reduce_strategy,
        "replicas_to_aggregate": args.replicas_to_aggregate,
        "staleness_threshold": args.staleness_threshold,
        "scale_by_staleness": True if args.scale_by_staleness else None,
        "min_updates": args.min_updates,
        "fanout": args.fanout,
        "shard_index": args.shard_index,
        "shard_addresses": args.shard_addresses,
        "slice_bytes": args.slice_bytes,
        "shard_map_epoch": args.shard_map_epoch,
        "restore_from": args.restore_from,
        "metrics_port": args.metrics_port,
        "metrics_host": args.metrics_host,
        "metrics_token_file": args.metrics_token_file,
        "metrics_tls_cert": args.metrics_tls_cert,
        "metrics_tls_key": args.metrics_tls_key,
        "tls_cert": args.tls_cert,
        "tls_key": args.tls_key,
        "tls_ca": args.tls_ca,
        "auth_tokens": args.auth_tokens,
        "shared_memory": False if args.no_shared_memory else None,
        "malloc_retain_bytes": args.malloc_retain_bytes,
    }
    config = ServerConfig.from_sources(cli, env)
    ServerSecurity.of_config(config)
    return config


def _cmd_serve(args: argparse.Namespace) -> int:
    # Bad flags, unreadable certificates or token file: InvalidArgument here, before any
    # socket (the entry point prints one line and exits 2; paramserver.cli.main.run_command).
    config = serve_config(args, os.environ)
    note = _retain_freed_memory(config.malloc_retain_bytes)
    daemon = run_daemon(config, port_file=args.port_file, notes=(note,))
    run_loop(daemon, use_uvloop=config.use_uvloop)
    return 0


def _retain_freed_memory(limit: int) -> str:
    """Apply ``--malloc-retain-bytes`` to this process (before it allocates much); returns what
    took effect, logged once the server listens (a failed start stays one line)."""
    applied = retain_freed_memory(limit, os.environ)
    if applied:
        return f"malloc: freed blocks under {applied} bytes are kept for reuse"
    if limit and user_malloc_settings(os.environ):
        return "malloc: the environment's own glibc malloc settings are used"
    if limit:
        return "malloc: allocator left as it is (not glibc, or the setting was refused)"
    return "malloc: glibc's defaults kept (--malloc-retain-bytes 0)"


def _cmd_status(args: argparse.Namespace) -> int:
    from paramserver.api.v1 import parameter_server_pb2 as pb
    from paramserver.server.observability.status_table import render_status

    address = args.server or args.address
    if not address:
        raise InvalidArgument("give the server as ADDRESS or --server HOST:PORT")
    address = parse_address(address, "--server" if args.server else "ADDRESS")
    security = client_security_from_args(args, os.environ)

    async def fetch() -> Any:
        async with open_channel(address, security) as channel:
            stub = pb_grpc.ParameterServerStub(channel)
            return await stub.Status(pb.StatusRequest(), timeout=args.timeout_s)

    resp = run_loop(fetch(), use_uvloop=False)  # a failed RPC: one line (paramserver.cli.main)
    if args.json:
        print(json.dumps(status_to_dict(resp), indent=2, sort_keys=True))
    else:
        print(render_status(resp, address), end="")
    return 0


def _cmd_checkpoint(args: argparse.Namespace) -> int:
    from paramserver.api.v1 import parameter_server_pb2 as pb

    address = parse_address(args.server, "--server")
    security = client_security_from_args(args, os.environ)

    async def ask() -> Any:
        async with open_channel(address, security) as channel:
            stub = pb_grpc.ParameterServerStub(channel)
            return await stub.Checkpoint(pb.CheckpointRequest(), timeout=args.timeout_s)

    resp = run_loop(ask(), use_uvloop=False)  # a failed RPC: one line (paramserver.cli.main)
    print(
        json.dumps(
            {"path": resp.path, "wal_sequence": resp.wal_sequence, "duration_ms": resp.duration_ms}
        )
    )
    return 0


def add_subcommands(sub: Any) -> None:
    """Register ``serve`` and ``status`` on the ``paramserver`` command line."""
    st = sub.add_parser(
        "status", help="print a server's workers, clocks, stragglers and keys (table or JSON)"
    )
    st.add_argument("address", nargs="?", help="HOST:PORT of the server (or use --server)")
    st.add_argument("--server", help="HOST:PORT (same as ADDRESS)")
    st.add_argument("--json", action="store_true", help="machine-readable JSON instead of tables")
    st.add_argument("--timeout-s", type=float, default=10.0)
    add_client_security_flags(st)
    st.set_defaults(func=_cmd_status)
    ck = sub.add_parser("checkpoint", help="ask a server to write a checkpoint now")
    ck.add_argument("--server", required=True, help="HOST:PORT")
    ck.add_argument("--timeout-s", type=float, default=300.0)
    add_client_security_flags(ck)
    ck.set_defaults(func=_cmd_checkpoint)

    p = sub.add_parser(
        "serve",
        help="run a parameter-server shard",
        description="Run a parameter-server shard. Every flag can also be set as "
        "PARAMSERVER_<FLAG> (e.g. PARAMSERVER_LEASE_MS); flags win over the environment.",
    )
    p.add_argument("--host", help="interface to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="TCP port, 0 = ephemeral (default 50051)")
    p.add_argument("--consistency", choices=["bsp", "ssp", "asp"], help="default bsp")
    p.add_argument("--staleness", type=int, help="SSP staleness bound s in clocks")
    p.add_argument("--aggregation", choices=["mean", "sum", "weighted_mean"])
    p.add_argument("--lease-ms", type=int, help="worker lease in ms (default 10000)")
    p.add_argument("--death-policy", choices=["shrink", "fail_fast", "wait"])
    p.add_argument("--wait-timeout-ms", type=int, help="default deadline of a pull's wait")
    p.add_argument("--allow-non-finite", action="store_true", help="accept NaN/Inf gradients")
    p.add_argument("--max-staleness", type=int, help="ASP: drop gradients older than N versions")
    p.add_argument("--max-receive-message-bytes", type=int)
    p.add_argument("--max-tensor-bytes", type=int)
    p.add_argument(
        "--offload-min-bytes",
        type=int,
        help="tensors of at least this many bytes are applied/copied in worker threads "
        "(default 8 MiB)",
    )
    p.add_argument("--checkpoint-dir", help="directory of checkpoints (restored on start)")
    p.add_argument("--checkpoint-every-steps", type=int)
    p.add_argument("--keep-checkpoints", type=int)
    p.add_argument("--checkpoint-every-s", type=float, help="periodic checkpoint interval")
    p.add_argument("--max-inflight-pushes-per-worker", type=int, help="back-pressure bound")
    p.add_argument("--max-inflight-pushes", type=int, help="back-pressure bound, all workers")
    p.add_argument("--max-inflight-push-bytes", type=int, help="back-pressure bound in bytes")
    p.add_argument("--wal", action="store_true", help="write-ahead log: no acked update lost")
    p.add_argument("--wal-dir", help="WAL directory (default <checkpoint-dir>/wal)")
    p.add_argument("--wal-fsync-interval-ms", type=float, help="group-commit window (ms)")
    p.add_argument("--no-wal-fsync", action="store_true", help="skip fsync (not power-safe)")
    p.add_argument("--grace-s", type=float, help="graceful shutdown period (default 5 s)")
    p.add_argument("--no-uvloop", action="store_true", help="use the default asyncio loop")
    p.add_argument(
        "--no-shared-memory",
        action="store_true",
        help="no same-host data paths (shared-memory segments, the local-link socket): tensor "
        "bytes go over gRPC as between hosts (PARAMSERVER_SHARED_MEMORY=0)",
    )
    p.add_argument(
        "--malloc-retain-bytes",
        type=int,
        help="glibc malloc keeps freed blocks below this many bytes for reuse instead of "
        "returning them to the kernel, so large per-round buffers do not fault in fresh pages "
        f"every round (default {DEFAULT_RETAIN_BYTES} = {DEFAULT_RETAIN_BYTES >> 20} MiB; "
        f"0 keeps glibc's defaults; otherwise {MIN_RETAIN_BYTES} (128 KiB, glibc's own "
        f"threshold) to {MAX_RETAIN_BYTES}; env PARAMSERVER_MALLOC_RETAIN_BYTES; "
        "MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_, MALLOC_TOP_PAD_ or those "
        "GLIBC_TUNABLES in the environment take precedence)",
    )
    p.add_argument("--port-file", help="write the bound port to this file once serving")
    g = p.add_argument_group("sharded cluster and metrics")
    g.add_argument("--shard-index", type=int, help="this shard's index in --shard-addresses")
    g.add_argument(
        "--shard-addresses",
        help="host:port,host:port,... of every shard in index order, as workers reach them",
    )
    g.add_argument("--slice-bytes", type=int, help="slice tensors above this size (4 MiB)")
    g.add_argument("--shard-map-epoch", type=int, help="bump when the cluster is resharded")
    g.add_argument(
        "--restore-from",
        help="DIR,DIR,...: checkpoint dirs of an earlier cluster (any shard count); an empty "
        "--checkpoint-dir starts from this shard's part of their newest common cut",
    )
    g.add_argument(
        "--metrics-port",
        type=int,
        help="serve Prometheus metrics (/metrics) and the dashboard (/) on this port of "
        "--metrics-host (0 = ephemeral; the bound port is logged: "
        "'metrics on http://HOST:PORT/metrics')",
    )
    g.add_argument(
        "--metrics-host",
        help="interface of the metrics endpoint (default 127.0.0.1, loopback only; 0.0.0.0 "
        "exposes it, e.g. to a Prometheus in another container)",
    )
    g.add_argument(
        "--metrics-token-file",
        help="file holding a bearer token every metrics request must present "
        "(Authorization: Bearer TOKEN; others get 401)",
    )
    g.add_argument("--metrics-tls-cert", help="PEM certificate: serve the metrics over HTTPS")
    g.add_argument("--metrics-tls-key", help="PEM private key of --metrics-tls-cert")
    add_server_security_flags(p)
    r = p.add_argument_group("reduction server (--mode reduce)")
    r.add_argument(
        "--mode",
        choices=["ps", "reduce"],
        help="ps: parameter server (default); reduce: reduction server (gradients in, "
        "aggregates out, no parameters)",
    )
    r.add_argument(
        "--reduce-strategy",
        choices=["synchronous", "asynchronous", "federated_average", "gossip"],
        help="aggregation strategy of --mode reduce (default synchronous)",
    )
    r.add_argument(
        "--replicas-to-aggregate", type=int, help="synchronous: aggregate the first N workers"
    )
    r.add_argument(
        "--staleness-threshold", type=int, help="asynchronous: largest accepted staleness (steps)"
    )
    r.add_argument(
        "--scale-by-staleness", action="store_true", help="asynchronous: scale by 1/(1+staleness)"
    )
    r.add_argument("--min-updates", type=int, help="federated_average: workers per round")
    r.add_argument("--fanout", type=int, help="gossip: peers per push-sum round")
    p.set_defaults(func=_cmd_serve)
