"""One bootstrap for every paramserver gRPC server.

The parameter-server shard (:class:`~paramserver.server.shard_daemon.ParameterServerDaemon`),
the reduction server (:class:`~paramserver.reduction.reduce_daemon.ReductionDaemon`), a rank
server (:mod:`paramserver.spmd.rank_server`) and a gossip peer's push-sum endpoint
(:class:`~paramserver.reduction.GossipWorker`) all start through :func:`start_grpc_server`
(options, keepalive, authentication interceptors, health, reflection, bind, start; nothing left
bound when a step fails); :func:`serve_until_signalled` runs a started daemon until
SIGTERM/SIGINT. Their errors are mapped by :mod:`paramserver.serving.error_status`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from paramserver.closing import AsyncClosing
from paramserver.protocol.keepalive import SERVER_KEEPALIVE_OPTIONS, ChannelOption
from paramserver.security.tls import ServerSecurity, bind

__all__ = [
    "REFLECTION_V1_SERVICE_NAME",
    "GrpcEndpoint",
    "ServingDaemon",
    "enable_reflection",
    "run_loop",
    "serve_until_signalled",
    "start_grpc_server",
    "write_atomic",
]

_T = TypeVar("_T")

logger = logging.getLogger(__name__)


#: The current server reflection service (grpcurl and newer tools ask for it first).
REFLECTION_V1_SERVICE_NAME = "grpc.reflection.v1.ServerReflection"


def _reflection_v1_registered() -> None:
    """Add ``grpc/reflection/v1/reflection.proto`` to the default descriptor pool.

    grpcio-reflection ships only ``v1alpha``; ``v1`` is the same file with another package
    (every message and field number alike), so its descriptor is that file renamed, and the
    v1alpha messages read and write v1's bytes unchanged.
    """
    from google.protobuf import descriptor_pb2, descriptor_pool
    from grpc_reflection.v1alpha import reflection_pb2

    pool = descriptor_pool.Default()
    name = "grpc/reflection/v1/reflection.proto"
    try:
        pool.FindFileByName(name)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    old_pkg = proto.package
    proto.name, proto.package = name, "grpc.reflection.v1"
    proto.options.Clear()

    def moved(type_name: str) -> str:
        return type_name.replace(f".{old_pkg}.", ".grpc.reflection.v1.")

    for message in proto.message_type:
        for fld in message.field:
            if fld.HasField("type_name"):  # (scalar fields have none: leave it unset)
                fld.type_name = moved(fld.type_name)
    for service in proto.service:
        for method in service.method:
            method.input_type = moved(method.input_type)
            method.output_type = moved(method.output_type)
    pool.Add(proto)


def enable_reflection(server: grpc.aio.Server, *service_names: str) -> None:
    """Serve the standard gRPC server reflection service, as ``grpc.reflection.v1`` and
    ``grpc.reflection.v1alpha``, listing ``service_names``, the health service and itself
    (``grpcurl``, ``grpc_cli`` and Postman use it)."""
    from grpc_health.v1 import health
    from grpc_reflection.v1alpha import reflection_pb2

    _reflection_v1_registered()
    names = (
        *service_names,
        health.SERVICE_NAME,
        REFLECTION_V1_SERVICE_NAME,
        reflection.SERVICE_NAME,
    )
    reflection.enable_server_reflection(names, server)
    v1 = reflection.aio.ReflectionServicer(names)
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                REFLECTION_V1_SERVICE_NAME,
                {
                    "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
                        v1.ServerReflectionInfo,
                        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
                        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
                    )
                },
            ),
        )
    )


@dataclass
class GrpcEndpoint:
    """A started grpc.aio server.

    Attributes:
        server: The running server.
        port: The TCP port bound (the ephemeral one when 0 was asked for).
        health: The ``grpc.health.v1`` servicer (None when started without health).
        service_names: The names health reports on besides ``""``.
    """

    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer | None
    service_names: tuple[str, ...]

    async def set_serving(self, serving: bool) -> None:
        """Health of ``""`` and every service name: SERVING, or NOT_SERVING."""
        if self.health is None:
            return
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", *self.service_names):
            await self.health.set(name, status)


async def start_grpc_server(
    address: str,
    add_services: Callable[[grpc.aio.Server], None],
    *,
    service_names: Sequence[str] = (),
    security: ServerSecurity | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    max_receive_message_bytes: int | None = None,
    health_and_reflection: bool = True,
    on_failure: Callable[[], Awaitable[None]] | None = None,
) -> GrpcEndpoint:
    """Build, bind and start a grpc.aio server: the one bootstrap of every paramserver server.

    Args:
        address: ``host:port`` to bind (port 0: ephemeral).
        add_services: Adds the servicers to the server.
        service_names: Full service names for health and reflection.
        security: TLS / mutual TLS for the port (None: plain text). Token interceptors are the
            caller's (they count refusals in its metrics), first in ``interceptors``.
        interceptors: Server interceptors, outermost first.
        max_receive_message_bytes: ``grpc.max_receive_message_length`` (None: gRPC's 4 MiB).
        health_and_reflection: Add ``grpc.health.v1`` (NOT_SERVING until
            :meth:`GrpcEndpoint.set_serving`) and server reflection.
        on_failure: Awaited when binding or starting fails, after the server is stopped (the
            caller releases what it opened before).

    Returns:
        The started endpoint.

    Raises:
        Unavailable: (UNAVAILABLE) the address is in use or not on this machine.
    """
    options: list[ChannelOption] = [("grpc.so_reuseport", 0), *SERVER_KEEPALIVE_OPTIONS]
    if max_receive_message_bytes is not None:
        options.insert(0, ("grpc.max_receive_message_length", max_receive_message_bytes))
    server = grpc.aio.server(interceptors=list(interceptors) or None, options=options)
    add_services(server)
    health_servicer: health.aio.HealthServicer | None = None
    if health_and_reflection:
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        enable_reflection(server, *service_names)
    try:
        port = bind(server, address, security)
        await server.start()
    except BaseException:
        # grpc.aio keeps a port bound by a server that never started: stop it now, so nothing
        # is left for the garbage collector after the loop closes.
        await server.stop(None)
        if on_failure is not None:
            await on_failure()
        raise
    return GrpcEndpoint(server, port, health_servicer, tuple(service_names))


class ServingDaemon(AsyncClosing):
    """A server that is started, stopped and waited on (what :func:`serve_until_signalled`
    runs). ``async with daemon:`` starts it and stops it with a 0.5 s grace."""

    port: int
    #: The gRPC server once started (:func:`start_grpc_server`); None before and after.
    _endpoint: GrpcEndpoint | None = None

    async def start(self) -> None:
        raise NotImplementedError

    async def stop(self, grace_s: float | None = None) -> None:
        raise NotImplementedError

    async def wait_closed(self) -> None:
        """Until the gRPC server has terminated (at once when it is not running)."""
        if self._endpoint is not None:
            await self._endpoint.server.wait_for_termination()

    async def open(self) -> None:
        await self.start()

    async def close(self) -> None:
        await self.stop(grace_s=0.5)


async def serve_until_signalled(
    daemon: ServingDaemon,
    *,
    grace_s: float,
    port_file: str | None = None,
    notes: Sequence[str] = (),
) -> None:
    """Start ``daemon``, serve until SIGTERM/SIGINT, then stop it gracefully.

    Args:
        daemon: The server to run.
        grace_s: Seconds in-flight calls get to finish (logged; the daemon applies its own).
        port_file: Written atomically with the bound port once serving (for launchers).
        notes: INFO lines logged once the server listens.
    """
    await daemon.start()
    for note in notes:
        logger.info("%s", note)
    if port_file:
        write_atomic(port_file, str(daemon.port))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    serving = asyncio.ensure_future(daemon.wait_closed())
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
    logger.info("shutting down (grace %.1f s)", grace_s)
    await daemon.stop()
    for task in (serving, stopping):
        task.cancel()
    await asyncio.gather(serving, stopping, return_exceptions=True)
    pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    if pending:  # a handler or timer that outlived the shutdown: name it
        logger.warning("%d tasks still pending at exit: %s", len(pending), pending)
    logger.info("stopped (%d tasks pending)", len(pending))


def write_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` by rename (a reader never sees half of it)."""
    tmp = f"{path}.tmp"
    Path(tmp).write_text(text)
    os.replace(tmp, path)


def run_loop(main: Coroutine[object, object, _T], *, use_uvloop: bool = True) -> _T:
    """Run a coroutine on uvloop when installed and asked for, else on the default loop."""
    if use_uvloop:
        try:
            import uvloop
        except ImportError:  # pragma: no cover - uvloop is a runtime dependency on POSIX
            return asyncio.run(main)
        return uvloop.run(main)
    return asyncio.run(main)
