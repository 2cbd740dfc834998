"""The reduction server daemon (``paramserver serve --mode reduce``): the reduction service, health
and, with a metrics port, RPC counts, durations and token refusals. No parameters, no checkpoints.
"""

from __future__ import annotations

import logging

import grpc

from paramserver.errors import InvalidArgument
from paramserver.reduction.reduce_service import (
    SERVICE_NAME,
    ReductionEngine,
    ReductionSettings,
    add_reduction_service,
)
from paramserver.security.tls import ServerSecurity
from paramserver.serving.bootstrap import ServingDaemon, start_grpc_server
from paramserver.serving.metrics import MetricsServer, auth_refusal_counter, rpc_metrics_server

logger = logging.getLogger(__name__)


class ReductionDaemon(ServingDaemon):
    """A running reduction server. Use ``async with ReductionDaemon(config) as d:``.

    Attributes:
        address: ``host:port`` actually bound (port resolved when 0 was asked for).
        reduction: The reduction engine once started.
        metrics: The metrics endpoint (with ``config.metrics_port``).

    Raises:
        InvalidArgument: (INVALID_ARGUMENT) ``config.mode`` is not ``"reduce"``.
    """

    def __init__(self, config: ReductionSettings) -> None:
        if config.mode != "reduce":
            raise InvalidArgument(f"ReductionDaemon serves mode 'reduce', not {config.mode!r}")
        self.config = config
        self.reduction: ReductionEngine | None = None
        self.metrics: MetricsServer | None = None
        self.security: ServerSecurity | None = ServerSecurity.of_config(config)
        self.port = 0

    @property
    def address(self) -> str:
        host = self.config.host if self.config.host not in ("0.0.0.0", "::") else "127.0.0.1"
        return f"{host}:{self.port}"

    async def start(self) -> None:
        """Bind and start serving (the metrics port first: a port in use fails before gRPC)."""
        interceptors: list[grpc.aio.ServerInterceptor] = []
        if self.config.metrics_port is not None:
            rpc_metrics, self.metrics = rpc_metrics_server(
                self.config.metrics_host, self.config.metrics_port, self.config.metrics_security()
            )
            await self.metrics.start()
            interceptors.append(rpc_metrics)
        if self.security is not None:
            counter = auth_refusal_counter(self.metrics.registry) if self.metrics else None
            interceptors = [*self.security.interceptors(counter), *interceptors]
        engines: list[ReductionEngine] = []
        config = self.config
        self._endpoint = await start_grpc_server(
            f"{config.host}:{config.port}",
            lambda server: engines.append(add_reduction_service(server, config)),
            service_names=(SERVICE_NAME,),
            security=self.security,
            interceptors=interceptors,
            max_receive_message_bytes=config.max_receive_message_bytes,
            on_failure=self._stop_metrics,
        )
        self.port = self._endpoint.port
        reduction = self.reduction = engines[0]
        reduction.start()
        await self._endpoint.set_serving(True)
        logger.info(
            "paramserver reduction server listening on %s:%d (%s, aggregation %s, lease %d ms)",
            config.host,
            self.port,
            config.reduce_strategy,
            reduction.coordinator.optimizer.method,
            config.lease_ms,
        )

    async def _stop_metrics(self) -> None:
        if self.metrics is not None:
            await self.metrics.stop()
            self.metrics = None

    async def stop(self, grace_s: float | None = None) -> None:
        """Health NOT_SERVING, refuse new calls, end waits, finish in-flight calls within the
        grace, stop the engine and the metrics endpoint."""
        grace = self.config.grace_s if grace_s is None else grace_s
        if self.reduction is not None:
            self.reduction.begin_shutdown()
        endpoint, self._endpoint = self._endpoint, None
        if endpoint is not None:
            if endpoint.health is not None:
                await endpoint.health.enter_graceful_shutdown()
            await endpoint.server.stop(grace)
        if self.reduction is not None:
            await self.reduction.stop()
            self.reduction = None
        await self._stop_metrics()
