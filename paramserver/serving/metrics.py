"""Prometheus metrics every paramserver daemon shares, and the endpoint that serves them.

* :class:`RpcMetrics`, a ``grpc.aio`` server interceptor: calls per method and outcome
  (``paramserver_rpcs_total``), call durations (``paramserver_rpc_duration_seconds``) and the
  consistency wait of pulls (``paramserver_pull_wait_seconds``: time to the first message of a
  Pull, which the server sends once the wait admitted it). It names the method serving the
  current call in :data:`CURRENT_RPC`.
* :func:`auth_refusal_counter`: calls refused by the bearer-token check.
* :class:`MetricsServer`: ``/metrics`` (the Prometheus text format), ``/`` the dashboard page and
  ``/api/status`` its JSON (:mod:`paramserver.serving.dashboard`), a tiny HTTP/1.0 server on the
  daemon's own event loop, so a scrape reads the state between two events, never half-way
  through one, and no thread shares the daemon's state.

Each daemon adds its own collectors to the registry (a shard's:
:mod:`paramserver.server.observability.prometheus`; a rank server's:
:mod:`paramserver.spmd.rank_metrics`).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from paramserver.errors import Unavailable
from paramserver.method_handlers import (
    Behaviour,
    Handler,
    ServicerContext,
    behaviour_of,
    same_shape,
)
from paramserver.security.http_access import HttpSecurity, authorized, unauthorized_response
from paramserver.security.tls import bind_failure_reason
from paramserver.serving.dashboard import ASSETS, Dashboard, asset

__all__ = [
    "CURRENT_RPC",
    "MAX_HEADER_LINES",
    "MAX_REQUEST_LINE_BYTES",
    "WAIT_BUCKETS",
    "MetricsServer",
    "RpcMetrics",
    "auth_refusal_counter",
    "rpc_metrics_server",
]

logger = logging.getLogger(__name__)

#: gRPC method serving the current call ("Push", "Pull", "Session"...), set by the metrics
#: interceptor; "local" for calls made in-process (tests, WAL replay).
CURRENT_RPC: contextvars.ContextVar[str] = contextvars.ContextVar(
    "paramserver_current_rpc", default="local"
)

#: Histogram buckets of waits and call durations, seconds.
WAIT_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0)

#: Longest request or header line the metrics endpoint reads; a longer one is answered 431.
MAX_REQUEST_LINE_BYTES = 8192
#: Header lines the metrics endpoint skips at most before answering.
MAX_HEADER_LINES = 100

#: Page policy: every asset from this origin, nothing inline, no frames.
_PAGE_POLICY = (
    "Content-Security-Policy: default-src 'self'; img-src 'self' data:; frame-ancestors 'none'\r\n"
)


class RpcMetrics(grpc.aio.ServerInterceptor):
    """Counts and times every RPC; times the consistency wait of pulls."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.rpcs = Counter(
            "paramserver_rpcs",
            "RPCs handled, by method and outcome (ok / error / cancelled)",
            ["method", "outcome"],
            registry=registry,
        )
        self.duration = Histogram(
            "paramserver_rpc_duration_seconds",
            "RPC handling time in seconds, by method",
            ["method"],
            registry=registry,
            buckets=WAIT_BUCKETS,
        )
        self.pull_wait = Histogram(
            "paramserver_pull_wait_seconds",
            "Time a pull waited for the consistency model before its first message, seconds",
            registry=registry,
            buckets=WAIT_BUCKETS,
        )

    def _done(self, method: str, outcome: str, t0: float) -> None:
        self.rpcs.labels(method, outcome).inc()
        self.duration.labels(method).observe(time.perf_counter() - t0)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = str(handler_call_details.method).rsplit("/", 1)[-1]
        behaviour = behaviour_of(handler)
        wrap = self._wrap_stream if handler.response_streaming else self._wrap_unary
        return same_shape(handler, wrap(method, behaviour))

    def _wrap_unary(self, method: str, behaviour: Behaviour) -> Behaviour:
        async def call(request: object, context: ServicerContext) -> object:
            t0 = time.perf_counter()
            outcome = "error"
            CURRENT_RPC.set(method)
            try:
                running = behaviour(request, context)
                assert inspect.isawaitable(running)  # an async def behaviour
                result = await running
                outcome = "ok"
                return result
            except asyncio.CancelledError:
                outcome = "cancelled"
                raise
            finally:
                self._done(method, outcome, t0)

        return call

    def _wrap_stream(self, method: str, behaviour: Behaviour) -> Behaviour:
        if not inspect.isasyncgenfunction(behaviour):  # context.write style: time the call
            return self._wrap_unary(method, behaviour)

        async def call(request: object, context: ServicerContext) -> AsyncIterator[object]:
            t0 = time.perf_counter()
            outcome = "error"
            first = True
            CURRENT_RPC.set(method)
            try:
                async for item in behaviour(request, context):
                    if first and method == "Pull":
                        self.pull_wait.observe(time.perf_counter() - t0)
                    first = False
                    yield item
                outcome = "ok"
            except (asyncio.CancelledError, GeneratorExit):
                outcome = "cancelled"
                raise
            finally:
                self._done(method, outcome, t0)

        return call


class MetricsServer:
    """``GET /metrics`` in the Prometheus text format, ``/`` the dashboard page and
    ``/api/status`` its JSON (:mod:`paramserver.serving.dashboard`), served on the running event
    loop.

    Args:
        registry: What to expose.
        host: Interface to bind.
        port: TCP port (0: ephemeral; :attr:`port` holds the bound one after :meth:`start`).
        dashboard: The page's data (default: RPC counts of ``registry``).
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        host: str,
        port: int,
        dashboard: Dashboard | None = None,
        security: HttpSecurity | None = None,
    ) -> None:
        self.registry = registry
        self.host = host
        self.port = port
        #: The page and JSON at ``/`` and ``/api/status`` (RPC counts only, when not given).
        self.dashboard = dashboard if dashboard is not None else Dashboard("reduce", registry)
        #: TLS and bearer token of the endpoint (:mod:`paramserver.security.http_access`).
        self.security = security
        self._server: asyncio.Server | None = None

    async def _route(self, method: str, path: str, query: str = "") -> tuple[str, str, bytes]:
        """``(status line, content type, body)`` of a request for ``path?query``."""
        if method not in ("GET", "HEAD"):
            return "405 Method Not Allowed", "text/plain", b"only GET and HEAD\n"
        if path == "/metrics":
            return "200 OK", CONTENT_TYPE_LATEST, generate_latest(self.registry)
        if path == "/api/status":
            try:
                return "200 OK", "application/json", await self.dashboard.body(query)
            except ValueError:
                return "400 Bad Request", "text/plain", b"since must be Unix seconds\n"
        name = "index.html" if path == "/" else path.lstrip("/")
        if name in ASSETS:
            return "200 OK", ASSETS[name], asset(name)
        return "404 Not Found", "text/plain", b"not found: try / (dashboard) or /metrics\n"

    async def start(self) -> None:
        """Listen on ``host:port``.

        Raises:
            Unavailable: the port cannot be bound (in use, not an address here...), the address
                and the reason named (UNAVAILABLE).
        """
        try:
            self._server = await asyncio.start_server(
                self._handle,
                self.host,
                self.port,
                limit=MAX_REQUEST_LINE_BYTES,
                ssl=self.security.ssl_context() if self.security is not None else None,
            )
        except OSError as exc:
            address = f"{self.host}:{self.port}"
            raise Unavailable(
                f"could not bind metrics port {address}: {bind_failure_reason(address, exc)}"
            ) from None
        self.port = int(self._server.sockets[0].getsockname()[1])
        await self.dashboard.start()
        scheme = "https" if self.security is not None and self.security.tls_cert else "http"
        logger.info(
            "metrics on %s://%s:%d/metrics, dashboard on %s://%s:%d/",
            scheme,
            self.host,
            self.port,
            scheme,
            self.host,
            self.port,
        )

    async def stop(self) -> None:
        await self.dashboard.stop()
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                request = await asyncio.wait_for(reader.readline(), 10.0)
                headers: list[bytes] = []
                for _ in range(MAX_HEADER_LINES):  # read the headers (bounded)
                    line = await asyncio.wait_for(reader.readline(), 10.0)
                    if line in (b"\r\n", b"\n", b""):
                        break
                    headers.append(line)
            except ValueError:  # a line over MAX_REQUEST_LINE_BYTES (StreamReader's limit)
                peer = writer.get_extra_info("peername")
                logger.warning(
                    "metrics endpoint: request line over %d bytes from %s; answered 431",
                    MAX_REQUEST_LINE_BYTES,
                    peer,
                )
                body = f"request line over {MAX_REQUEST_LINE_BYTES} bytes\n".encode()
                writer.write(
                    b"HTTP/1.0 431 Request Header Fields Too Large\r\n"
                    b"Content-Type: text/plain\r\nConnection: close\r\n"
                    + f"Content-Length: {len(body)}\r\n\r\n".encode("latin-1")
                    + body
                )
                await writer.drain()
                # Let the client read the answer: stop sending, then drop what it still sends
                # (closing with unread input would reset the connection first).
                if writer.can_write_eof():
                    writer.write_eof()
                with contextlib.suppress(TimeoutError, ValueError, ConnectionError):
                    async with asyncio.timeout(1.0):
                        while await reader.read(65536):
                            pass
                return
            if not authorized(self.security, headers):
                writer.write(unauthorized_response())
                await writer.drain()
                return
            parts = request.decode("latin-1").split()
            method = parts[0] if parts else ""
            path, _, query = (parts[1] if len(parts) >= 2 else "").partition("?")
            status, ctype, body = await self._route(method, path, query)
            head = (
                f"HTTP/1.0 {status}\r\nContent-Type: {ctype}\r\n"
                "X-Content-Type-Options: nosniff\r\nCache-Control: no-store\r\n"
            )
            if ctype.startswith("text/html"):
                head += _PAGE_POLICY
            writer.write(f"{head}Content-Length: {len(body)}\r\n\r\n".encode("latin-1"))
            if method != "HEAD":
                writer.write(body)
            await writer.drain()
        except (TimeoutError, ConnectionError, UnicodeDecodeError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


def auth_refusal_counter(registry: CollectorRegistry) -> Callable[[str, str], None]:
    """``paramserver_auth_refusals_total{method, code}`` in ``registry``: calls the token check
    refused (UNAUTHENTICATED / PERMISSION_DENIED), by RPC method. Returns the callback to give
    :meth:`paramserver.security.tls.ServerSecurity.interceptors` as ``on_refusal``."""
    refusals = Counter(
        "paramserver_auth_refusals",
        "Calls refused by the bearer-token check, by RPC method and status code",
        ["method", "code"],
        registry=registry,
    )

    def count(method: str, code: str) -> None:
        refusals.labels(method, code).inc()

    return count


def rpc_metrics_server(
    host: str, port: int, security: HttpSecurity | None = None
) -> tuple[RpcMetrics, MetricsServer]:
    """RPC counts and durations of any ``grpc.aio`` server (the interceptor) and an (unstarted)
    endpoint exposing them, in a registry of their own (``--mode reduce``)."""
    registry = CollectorRegistry()
    return RpcMetrics(registry), MetricsServer(registry, host, port, security=security)
