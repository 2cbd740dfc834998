"""The server shard daemon: ``paramserver serve``, plus an in-process server for tests and demos.

``ParameterServerDaemon`` binds a grpc.aio server with the parameter-server servicer and the
standard gRPC health service (``grpc.health.v1``); :func:`run_daemon` adds signal handling:
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
import sys
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from paramserver.api.v1 import parameter_server_pb2_grpc as pb_grpc
from paramserver.errors import ParamServerError
from paramserver.server.checkpoint import CheckpointManager
from paramserver.server.config import ServerConfig
from paramserver.server.engine import ServerEngine
from paramserver.server.servicer import ParameterServerServicer

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
        self.checkpoints: CheckpointManager | None = None
        self._server: grpc.aio.Server | None = None
        self._health: health.aio.HealthServicer | None = None
        self.port = 0

    @property
    def address(self) -> str:
        host = self.config.host if self.config.host not in ("0.0.0.0", "::") else "127.0.0.1"
        return f"{host}:{self.port}"

    async def start(self) -> None:
        """Restore the newest checkpoint (if any), bind, and start serving."""
        engine = ServerEngine(self.config)
        self.engine = engine
        if self.config.checkpoint_dir:
            self.checkpoints = CheckpointManager(
                Path(self.config.checkpoint_dir), keep=self.config.keep_checkpoints
            )
            restored = self.checkpoints.restore_latest(engine.core)
            if restored is not None:
                logger.info("restored checkpoint %s", restored)
            if self.config.checkpoint_every_steps:
                engine.core.on_progress = self._maybe_checkpoint
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", self.config.max_receive_message_bytes),
                ("grpc.so_reuseport", 0),
            ]
        )
        pb_grpc.add_ParameterServerServicer_to_server(ParameterServerServicer(engine), server)
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        self.port = server.add_insecure_port(f"{self.config.host}:{self.config.port}")
        if self.port == 0:
            raise ParamServerError(f"could not bind {self.config.host}:{self.config.port}")
        await server.start()
        self._server = server
        engine.start()
        for name in ("", SERVICE_NAME):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        logger.info(
            "paramserver listening on %s:%d (%s, staleness %d, aggregation %s, lease %d ms)",
            self.config.host,
            self.port,
            self.config.consistency,
            engine.core.cluster.staleness,
            self.config.aggregation,
            self.config.lease_ms,
        )

    def _maybe_checkpoint(self, step: int) -> None:
        every = self.config.checkpoint_every_steps
        if self.checkpoints is not None and self.engine is not None and every and step % every == 0:
            try:
                self.checkpoints.save(self.engine.core)
            except OSError:
                logger.exception(
                    "periodic checkpoint at step %d failed; the previous one stands", step
                )

    async def stop(self, grace_s: float | None = None) -> None:
        """Refuse new calls, let in-flight ones finish within the grace, checkpoint, stop."""
        grace = self.config.grace_s if grace_s is None else grace_s
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None
        if self.engine is not None:
            await self.engine.stop()
            if self.checkpoints is not None:
                try:
                    path = self.checkpoints.save(self.engine.core)
                    logger.info("final checkpoint %s", path)
                except OSError:
                    logger.exception("final checkpoint failed; the previous one stands")

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


async def run_daemon(config: ServerConfig, *, port_file: str | None = None) -> None:
    """Serve until SIGTERM/SIGINT, then shut down gracefully."""
    daemon = ParameterServerDaemon(config)
    await daemon.start()
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
    logger.info("stopped")


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


def _cmd_serve(args: argparse.Namespace) -> int:
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
        "checkpoint_dir": args.checkpoint_dir,
        "checkpoint_every_steps": args.checkpoint_every_steps,
        "keep_checkpoints": args.keep_checkpoints,
        "grace_s": args.grace_s,
        "use_uvloop": False if args.no_uvloop else None,
    }
    try:
        config = ServerConfig.from_sources(cli, os.environ)
    except ParamServerError as exc:
        print(f"paramserver serve: {exc}", file=sys.stderr)
        return 2
    run_loop(run_daemon(config, port_file=args.port_file), use_uvloop=config.use_uvloop)
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    from google.protobuf.json_format import MessageToDict

    from paramserver.api.v1 import parameter_server_pb2 as pb

    async def fetch() -> dict[str, Any]:
        async with grpc.aio.insecure_channel(args.server) as channel:
            stub = pb_grpc.ParameterServerStub(channel)
            resp = await stub.Status(pb.StatusRequest(), timeout=args.timeout_s)
        return dict(MessageToDict(resp, preserving_proto_field_name=True))

    try:
        status = run_loop(fetch(), use_uvloop=False)
    except grpc.aio.AioRpcError as err:
        print(f"paramserver status: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    print(json.dumps(status, indent=2, sort_keys=True))
    return 0


def add_subcommands(sub: Any) -> None:
    """Register ``serve`` and ``status`` on the ``paramserver`` command line."""
    st = sub.add_parser("status", help="print a server's status as JSON")
    st.add_argument("--server", required=True, help="HOST:PORT")
    st.add_argument("--timeout-s", type=float, default=10.0)
    st.set_defaults(func=_cmd_status)

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
    p.add_argument("--checkpoint-dir", help="directory of checkpoints (restored on start)")
    p.add_argument("--checkpoint-every-steps", type=int)
    p.add_argument("--keep-checkpoints", type=int)
    p.add_argument("--grace-s", type=float, help="graceful shutdown period (default 5 s)")
    p.add_argument("--no-uvloop", action="store_true", help="use the default asyncio loop")
    p.add_argument("--port-file", help="write the bound port to this file once serving")
    p.set_defaults(func=_cmd_serve)
