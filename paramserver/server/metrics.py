"""Prometheus metrics of a server shard (``paramserver serve --metrics-port 9100``).

Two sources, one private :class:`prometheus_client.CollectorRegistry` per daemon:

* :class:`RpcMetrics`, a ``grpc.aio`` server interceptor: calls per method and outcome
  (``paramserver_rpcs_total``), call durations (``paramserver_rpc_duration_seconds``) and the
  consistency wait of pulls (``paramserver_pull_wait_seconds``: time to the first message of a
  Pull, which the server sends once the wait admitted it).
* :class:`CoreCollector`, read at scrape time from the shard's state: applied / duplicate /
  rejected / dropped pushes, live workers, minimum clock, BSP step, keys, stored bytes, pushes in
  flight, and the shard's place in the cluster.

The exposition endpoint is a tiny HTTP/1.0 server on the daemon's own event loop
(:class:`MetricsServer`), so a scrape reads the state between two events, never half-way through
one, and no thread shares the core.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from paramserver.server.engine import ServerEngine

logger = logging.getLogger(__name__)

_WAIT_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0)


class RpcMetrics(grpc.aio.ServerInterceptor):  # type: ignore[misc]
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
            buckets=_WAIT_BUCKETS,
        )
        self.pull_wait = Histogram(
            "paramserver_pull_wait_seconds",
            "Time a pull waited for the consistency model before its first message, seconds",
            registry=registry,
            buckets=_WAIT_BUCKETS,
        )

    def _done(self, method: str, outcome: str, t0: float) -> None:
        self.rpcs.labels(method, outcome).inc()
        self.duration.labels(method).observe(time.perf_counter() - t0)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = str(handler_call_details.method).rsplit("/", 1)[-1]
        if handler.response_streaming:
            behaviour = handler.unary_stream or handler.stream_stream
            make = (
                grpc.unary_stream_rpc_method_handler
                if handler.unary_stream
                else grpc.stream_stream_rpc_method_handler
            )
            wrapped = self._wrap_stream(method, behaviour)
        else:
            behaviour = handler.unary_unary or handler.stream_unary
            make = (
                grpc.unary_unary_rpc_method_handler
                if handler.unary_unary
                else grpc.stream_unary_rpc_method_handler
            )
            wrapped = self._wrap_unary(method, behaviour)
        return make(
            wrapped,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    def _wrap_unary(self, method: str, behaviour: Any) -> Any:
        async def call(request: Any, context: Any) -> Any:
            t0 = time.perf_counter()
            outcome = "error"
            try:
                result = await behaviour(request, context)
                outcome = "ok"
                return result
            except asyncio.CancelledError:
                outcome = "cancelled"
                raise
            finally:
                self._done(method, outcome, t0)

        return call

    def _wrap_stream(self, method: str, behaviour: Any) -> Any:
        if not inspect.isasyncgenfunction(behaviour):  # context.write style: time the call
            return self._wrap_unary(method, behaviour)

        async def call(request: Any, context: Any) -> AsyncIterator[Any]:
            t0 = time.perf_counter()
            outcome = "error"
            first = True
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


class CoreCollector(Collector):
    """Gauges and counters read from the shard's state at scrape time."""

    def __init__(self, engine: ServerEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        core = self.engine.core
        cfg = self.engine.config
        labels = {"shard": str(cfg.shard_index)}

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=list(labels))
            family.add_metric(list(labels.values()), value)
            return family

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=list(labels))
            family.add_metric(list(labels.values()), value)
            return family

        workers = list(core.cluster.workers.values())
        stored = 0
        for key in list(core.store.keys()):
            stored += int(core.store.get(key).value.nbytes)
        yield counter(
            "paramserver_applied_updates",
            "Pushes applied (a BSP step counts its contributors)",
            core.applied_updates,
        )
        yield counter(
            "paramserver_duplicate_pushes",
            "Retried pushes answered as duplicates",
            core.duplicate_pushes,
        )
        yield counter("paramserver_rejected_pushes", "Pushes refused", core.rejected_pushes)
        yield counter(
            "paramserver_dropped_stale_pushes",
            "ASP pushes dropped by max_staleness",
            core.dropped_stale,
        )
        yield gauge("paramserver_live_workers", "Live workers", sum(1 for w in workers if w.live))
        yield gauge("paramserver_min_clock", "Minimum clock over live workers", core.min_clock())
        yield gauge("paramserver_bsp_step", "Open BSP step (0 outside BSP)", core.bsp_step)
        yield gauge("paramserver_keys", "Stored tensors (slices count one each)", len(core.store))
        yield gauge("paramserver_stored_bytes", "Bytes of stored parameters", stored)
        yield gauge(
            "paramserver_inflight_pushes", "Pushes being received", self.engine.backpressure.total
        )
        yield gauge("paramserver_shards", "Shards in the cluster", cfg.num_shards)


class MetricsServer:
    """``GET /metrics`` in the Prometheus text format, served on the running event loop.

    Args:
        registry: What to expose.
        host: Interface to bind.
        port: TCP port (0: ephemeral; :attr:`port` holds the bound one after :meth:`start`).
    """

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        self.registry = registry
        self.host = host
        self.port = port
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        self.port = int(self._server.sockets[0].getsockname()[1])
        logger.info("metrics on http://%s:%d/metrics", self.host, self.port)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readline(), 10.0)
            while (line := await asyncio.wait_for(reader.readline(), 10.0)) not in (b"\r\n", b""):
                if len(line) > 8192:
                    break
            parts = request.decode("latin-1").split()
            path = parts[1] if len(parts) >= 2 else ""
            if (
                len(parts) >= 2
                and parts[0] in ("GET", "HEAD")
                and path.split("?")[0]
                in (
                    "/metrics",
                    "/",
                )
            ):
                body = generate_latest(self.registry)
                head = f"HTTP/1.0 200 OK\r\nContent-Type: {CONTENT_TYPE_LATEST}\r\n"
            else:
                body = b"not found: try /metrics\n"
                head = "HTTP/1.0 404 Not Found\r\nContent-Type: text/plain\r\n"
            writer.write(f"{head}Content-Length: {len(body)}\r\n\r\n".encode("latin-1"))
            if parts and parts[0] != "HEAD":
                writer.write(body)
            await writer.drain()
        except (TimeoutError, ConnectionError, UnicodeDecodeError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


def new_registry(engine: ServerEngine) -> tuple[CollectorRegistry, RpcMetrics]:
    """A private registry with the shard's state collector and an RPC interceptor."""
    registry = CollectorRegistry()
    registry.register(CoreCollector(engine))
    return registry, RpcMetrics(registry)


def metrics_for(engine: ServerEngine) -> tuple[list[Any], MetricsServer | None]:
    """Interceptors for the gRPC server and the (unstarted) metrics endpoint; none when
    ``metrics_port`` is not configured."""
    cfg = engine.config
    if cfg.metrics_port is None:
        return [], None
    registry, interceptor = new_registry(engine)
    return [interceptor], MetricsServer(registry, cfg.host, cfg.metrics_port)
