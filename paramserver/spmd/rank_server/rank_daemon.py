"""The rank-server daemon: start one rank server in the running loop, or run it until a signal.

:func:`start_rank_server` allocates the pools, binds the gRPC port (and the metrics port) and
serves; :func:`serve` is ``paramserver rank-server``: it runs until SIGTERM/SIGINT and then shuts
down cleanly.

Each rank server also serves the standard gRPC health service (``grpc.health.v1.Health``):
SERVING for the whole server (``""``) and for :data:`SERVICE_NAME` once it listens, NOT_SERVING
from the start of a graceful shutdown, so ``paramserver health --server HOST:PORT`` (a compose
health check) and :func:`paramserver.cli.demos.rank_launcher.wait_serving` can probe it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
from pathlib import Path

import grpc

from paramserver.api.v1 import spmd_pb2_grpc
from paramserver.serving.bootstrap import GrpcEndpoint, start_grpc_server
from paramserver.serving.dashboard import Dashboard
from paramserver.serving.metrics import MetricsServer, auth_refusal_counter
from paramserver.spmd.objects import FilesystemObjectStore
from paramserver.spmd.rank_metrics import RankMetrics
from paramserver.spmd.rank_server.rank_config import (
    MAX_MESSAGE_BYTES,
    SERVICE_NAME,
    RankServerConfig,
)
from paramserver.spmd.rank_server.rank_service import RankServicer
from paramserver.spmd.rank_server.rank_state import RankState

__all__ = ["RankServerHandle", "serve", "start_rank_server"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class RankServerHandle:
    """A running rank server inside the current event loop (tests, embedding)."""

    endpoint: GrpcEndpoint
    servicer: RankServicer
    metrics: MetricsServer | None = None

    @property
    def server(self) -> grpc.aio.Server:
        """The running ``grpc.aio`` server."""
        return self.endpoint.server

    @property
    def port(self) -> int:
        """The bound port (the ephemeral one when ``config.port == 0``)."""
        return self.endpoint.port

    @property
    def address(self) -> str:
        """``host:port`` the server listens on."""
        return self.servicer.state.address

    async def stop(self, grace_s: float = 1.0) -> None:
        """Stop serving (in-flight RPCs get ``grace_s`` seconds) and release the pools.

        Health turns NOT_SERVING first (watchers are told), then the server stops.
        """
        if self.endpoint.health is not None:
            await self.endpoint.health.enter_graceful_shutdown()
        await self.endpoint.server.stop(grace_s)
        await self.servicer.close()
        if self.metrics is not None:
            await self.metrics.stop()


def _metrics_server(state: RankState) -> MetricsServer:
    """The Prometheus endpoint and dashboard of ``state`` (its series attached to it)."""
    config = state.config
    assert config.metrics_port is not None
    state.metrics = RankMetrics(lambda: (state.failed, state.inflight))
    registry = state.metrics.registry
    blocks = {"G1": config.device_blocks, "G2": config.host_blocks, "G3": config.disk_blocks}
    info: dict[str, object] = {
        "instance_id": config.instance_id,
        "rank": config.rank,
        "tier_blocks": blocks,
        "object_store": config.object_dir is not None,
    }
    return MetricsServer(
        registry,
        config.metrics_host,
        config.metrics_port,
        Dashboard("rank", registry, info=info),
        security=config.metrics_security(),
    )


async def start_rank_server(config: RankServerConfig) -> RankServerHandle:
    """Allocate the pools, bind ``config.host:config.port`` (and the metrics port) and start
    serving.

    Returns:
        A handle whose ``port`` is the bound port (ephemeral when ``config.port == 0``).

    Raises:
        TierNotRegistered: G1 requested without a GPU (FAILED_PRECONDITION).
        Unavailable: the port or the metrics port cannot be bound, the address and the reason
            named (UNAVAILABLE); nothing is left running.
    """
    servicer = RankServicer.create(config)
    state = servicer.state
    metrics: MetricsServer | None = None
    try:
        on_refusal = None
        if config.metrics_port is not None:
            metrics = _metrics_server(state)
            assert state.metrics is not None
            on_refusal = auth_refusal_counter(state.metrics.registry)
            # Before the gRPC port: grpc.aio keeps a port bound by a server that never started.
            await metrics.start()
        sec = config.security
        endpoint = await start_grpc_server(
            f"{config.host}:{config.port}",
            lambda server: spmd_pb2_grpc.add_RankServerServicer_to_server(servicer, server),
            service_names=(SERVICE_NAME,),
            security=sec,
            interceptors=sec.interceptors(on_refusal) if sec is not None else (),
            max_receive_message_bytes=MAX_MESSAGE_BYTES,
        )
    except BaseException:
        if metrics is not None:
            await metrics.stop()
        await servicer.close()
        raise
    host = config.host if config.host not in ("0.0.0.0", "::", "") else socket.gethostname()
    state.address = f"{host}:{endpoint.port}"
    if metrics is not None:
        metrics.dashboard.info["address"] = state.address
    if isinstance(state.store, FilesystemObjectStore):
        removed = await asyncio.to_thread(state.store.sweep_temp, 3600.0)
        if removed:
            logger.info("removed %d stale object temp files", removed)
    await endpoint.set_serving(True)
    return RankServerHandle(endpoint, servicer, metrics)


def _write_port_file(path: Path, port: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(f"{port}\n")
    os.replace(tmp, path)


async def serve(config: RankServerConfig) -> int:
    """Run one rank server until SIGTERM/SIGINT, then shut down cleanly (the daemon).

    Prints ``rank-server ready instance=... rank=... address=host:port`` on stdout once serving
    and writes the port to ``config.port_file`` when set. Shared memory and the pool file are
    released on the way out.

    Returns:
        Process exit status (0).
    """
    handle = await start_rank_server(config)
    state = handle.servicer.state
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    try:
        if config.port_file is not None:
            _write_port_file(config.port_file, handle.port)
        if config.faults.any:
            logger.warning("TEST-ONLY fault injection active: %s", config.faults)
        print(
            f"rank-server ready instance={config.instance_id} rank={config.rank} "
            f"address={handle.address} incarnation={state.incarnation_id}",
            flush=True,
        )
        tiers = [t.name for t in state.pools] + (["G4 (objects)"] if state.store else [])
        logger.info(
            "rank server %s rank %d serving on %s with tiers %s",
            config.instance_id,
            config.rank,
            handle.address,
            ", ".join(tiers) or "none",
        )
        await stop.wait()
        logger.info("rank server %s rank %d shutting down", config.instance_id, config.rank)
    finally:
        await handle.stop(1.0)
    return 0
