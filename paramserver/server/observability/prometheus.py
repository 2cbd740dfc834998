"""Prometheus metrics of a server shard (``paramserver serve --metrics-port 9100``).

Two sources, one private :class:`prometheus_client.CollectorRegistry` per daemon:

* :class:`RpcMetrics`, a ``grpc.aio`` server interceptor: calls per method and outcome
  (``paramserver_rpcs_total``), call durations (``paramserver_rpc_duration_seconds``) and the
  consistency wait of pulls (``paramserver_pull_wait_seconds``: time to the first message of a
  Pull, which the server sends once the wait admitted it).
* :class:`CoreCollector`, read at scrape time from the shard's state: applied / duplicate /
  rejected / dropped pushes, live workers, minimum clock, BSP step, keys, stored bytes, pushes in
  flight, the shard's place in the cluster, open Session streams, mapped shared-memory segments
  and local-link connections (opened / refused); and from the engine's
  :class:`~paramserver.server.observability.hooks.ShardObservations`: dropped updates by reason, the
  staleness of applied gradients (histograms in clocks and in versions), BSP barrier wait and
  lag per worker (the straggler ranking), stored bytes per key, checkpoint duration and age.
* :class:`PromServingHooks`, installed on the engine: pushes and pulls counted at the
  servicer's shared seams (so the Session RPC counts too), their bytes and latencies per RPC,
  and bytes pushed / pulled per key.

Label cardinality: per-key series are bounded by :data:`MAX_KEY_LABELS` (later keys share the
label ``key="_other"``) and per-worker series by ``ShardObservations.max_workers`` names.

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
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from paramserver.errors import Unavailable
from paramserver.method_handlers import behaviour_of, same_shape
from paramserver.security.http_access import HttpSecurity, authorized, unauthorized_response
from paramserver.security.tls import bind_failure_reason
from paramserver.server.engine import ServerEngine
from paramserver.server.observability.dashboard import ASSETS, Dashboard, asset
from paramserver.server.observability.hooks import CURRENT_RPC, BucketCounts, ServingHooks
from paramserver.server.observability.table_metrics import TableCollector

logger = logging.getLogger(__name__)

_WAIT_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0)
_BYTES_BUCKETS = tuple(float(4**i * 1024) for i in range(11))  # 1 KiB .. 1 GiB

#: Longest request or header line the metrics endpoint reads; a longer one is answered 431.
MAX_REQUEST_LINE_BYTES = 8192
#: Header lines the metrics endpoint skips at most before answering.
MAX_HEADER_LINES = 100

#: Page policy: every asset from this origin, nothing inline, no frames.
_PAGE_POLICY = (
    "Content-Security-Policy: default-src 'self'; img-src 'self' data:; frame-ancestors 'none'\r\n"
)

#: Keys that get their own ``key`` label; later ones are summed under ``key="_other"``.
MAX_KEY_LABELS = 256


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


class _KeyLabels:
    """Maps keys to bounded label values (first :data:`MAX_KEY_LABELS` keys, then _other)."""

    def __init__(self, limit: int = MAX_KEY_LABELS) -> None:
        self.limit = limit
        self.known: set[str] = set()

    def __call__(self, key: str) -> str:
        if key in self.known:
            return key
        if len(self.known) < self.limit:
            self.known.add(key)
            return key
        return "_other"


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
        behaviour = behaviour_of(handler)
        wrap = self._wrap_stream if handler.response_streaming else self._wrap_unary
        return same_shape(handler, wrap(method, behaviour))

    def _wrap_unary(self, method: str, behaviour: Any) -> Any:
        async def call(request: Any, context: Any) -> Any:
            t0 = time.perf_counter()
            outcome = "error"
            CURRENT_RPC.set(method)
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


@dataclass(frozen=True)
class TransportStats:
    """The Session transport's state, read at scrape time (see :class:`CoreCollector`)."""

    #: Session streams open now, on gRPC and on the local link.
    sessions_open: int = 0
    #: Clients' shared-memory segments mapped now.
    segments_mapped: int = 0
    #: Local-link connections that presented a valid ticket, since start.
    local_links_opened: int = 0
    #: Local-link connections refused (no, bad, spent or expired ticket; a first message that
    #: is not an open; nothing within the open deadline; too many waiting).
    local_links_refused: int = 0


class CoreCollector(Collector):
    """Gauges and counters read from the shard's state at scrape time.

    Args:
        engine: The shard's engine.
        transport: Reads the Session transport's state (None: reported as zeros).
    """

    def __init__(
        self, engine: ServerEngine, transport: Callable[[], TransportStats] | None = None
    ) -> None:
        self.engine = engine
        self.transport = transport

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
        t = self.transport() if self.transport is not None else TransportStats()
        yield gauge(
            "paramserver_sessions_open",
            "Session streams open (one per worker client; gRPC or the same-host local link)",
            t.sessions_open,
        )
        yield gauge(
            "paramserver_shared_memory_segments",
            "Same-host clients' shared-memory segments mapped",
            t.segments_mapped,
        )
        links = CounterMetricFamily(
            "paramserver_local_links",
            "Same-host Session connections on the local-link socket, by outcome (opened / "
            "refused: no, bad, spent or expired ticket, a first message that is not an open, "
            "nothing within the open deadline, or too many waiting)",
            labels=[*labels, "outcome"],
        )
        links.add_metric([*labels.values(), "opened"], t.local_links_opened)
        links.add_metric([*labels.values(), "refused"], t.local_links_refused)
        yield links
        yield from self._observations(labels)

    def _observations(self, labels: dict[str, str]) -> Iterator[Metric]:
        engine = self.engine
        obs = engine.obs
        names = list(labels)
        values = list(labels.values())
        dropped = CounterMetricFamily(
            "paramserver_dropped_updates",
            "Pushes (or queued BSP gradients) not applied, by reason: duplicate, stale "
            "(ASP max_staleness), stale_step, non_finite, invalid, unknown_key, aborted_step, "
            "out_of_range, rejected",
            labels=[*names, "reason"],
        )
        for reason, n in obs.dropped_by_reason.items():
            dropped.add_metric([*values, reason], n)
        yield dropped
        yield _histogram(
            "paramserver_update_staleness_clocks",
            "Staleness of applied gradients in clocks: highest clock applied before it minus "
            "the gradient's clock, floored at 0 (Ho et al. 2013; <= s under SSP, 0 under BSP)",
            labels,
            obs.staleness_clocks,
        )
        yield _histogram(
            "paramserver_update_staleness_versions",
            "Staleness of applied gradients in versions: applied updates at application minus "
            "the pushed base_version (pushes that carry one)",
            labels,
            obs.staleness_versions,
        )
        wait = CounterMetricFamily(
            "paramserver_bsp_barrier_wait_seconds",
            "BSP: seconds from the worker's clock() to each step's close, summed (fast workers "
            "wait long)",
            labels=[*names, "worker"],
        )
        lag = CounterMetricFamily(
            "paramserver_bsp_barrier_lag_seconds",
            "BSP: seconds after each step's first clock() that the worker clocked, summed (the "
            "time the fastest worker waited on it; the highest is the worst straggler)",
            labels=[*names, "worker"],
        )
        steps = CounterMetricFamily(
            "paramserver_bsp_barrier_steps",
            "BSP steps counted in the barrier wait and lag of the worker",
            labels=[*names, "worker"],
        )
        for name, totals in obs.barrier.items():
            wait.add_metric([*values, name], totals.wait_s)
            lag.add_metric([*values, name], totals.lag_s)
            steps.add_metric([*values, name], totals.steps)
        yield wait
        yield lag
        yield steps
        per_key = GaugeMetricFamily(
            "paramserver_key_stored_bytes",
            f"Bytes of each stored tensor (first {MAX_KEY_LABELS} keys; the rest as _other)",
            labels=[*names, "key"],
        )
        sizes: dict[str, int] = {}
        key_label = _KeyLabels()
        for key in list(engine.core.store.keys()):
            label = key_label(key)
            sizes[label] = sizes.get(label, 0) + int(engine.core.store.get(key).value.nbytes)
        for label, nbytes in sizes.items():
            per_key.add_metric([*values, label], nbytes)
        yield per_key
        yield _histogram(
            "paramserver_checkpoint_duration_seconds",
            "Checkpoint time in seconds (snapshot + write + commit)",
            labels,
            obs.checkpoint_seconds,
        )
        if obs.last_checkpoint_unix_s is not None:
            age = GaugeMetricFamily(
                "paramserver_checkpoint_age_seconds",
                "Seconds since the newest checkpoint committed",
                labels=names,
            )
            age.add_metric(values, max(0.0, time.time() - obs.last_checkpoint_unix_s))
            yield age
            stamp = GaugeMetricFamily(
                "paramserver_last_checkpoint_timestamp_seconds",
                "Unix time the newest checkpoint committed",
                labels=names,
            )
            stamp.add_metric(values, obs.last_checkpoint_unix_s)
            yield stamp


def _histogram(
    name: str, doc: str, labels: dict[str, str], buckets: BucketCounts
) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc, labels=list(labels))
    family.add_metric(list(labels.values()), buckets.cumulative(), sum_value=buckets.total)
    return family


class PromServingHooks(ServingHooks):
    """Prometheus series for the servicer's push/pull seams (every transport shares them).

    ``rpc`` is the gRPC method that carried the call (``Push``, ``Pull``, ``Session``...).
    """

    enabled = True

    def __init__(self, registry: CollectorRegistry) -> None:
        self.push_bytes = Histogram(
            "paramserver_push_bytes",
            "Tensor bytes per push (count: pushes, sum: bytes), by RPC and outcome",
            ["rpc", "outcome"],
            registry=registry,
            buckets=_BYTES_BUCKETS,
        )
        self.push_seconds = Histogram(
            "paramserver_push_apply_seconds",
            "Seconds to apply (or queue) a decoded push, WAL commit included, by RPC",
            ["rpc", "outcome"],
            registry=registry,
            buckets=_WAIT_BUCKETS,
        )
        self.pulls = Counter(
            "paramserver_pulls",
            "Pulls admitted by the consistency model (or refused), by RPC and outcome",
            ["rpc", "outcome"],
            registry=registry,
        )
        self.pull_admit = Histogram(
            "paramserver_pull_admit_seconds",
            "Seconds a pull waited for the consistency model, by RPC",
            ["rpc"],
            registry=registry,
            buckets=_WAIT_BUCKETS,
        )
        self.pull_bytes = Counter(
            "paramserver_pull_bytes",
            "Tensor bytes snapshotted for pulls, by RPC",
            ["rpc"],
            registry=registry,
        )
        self.key_pushed = Counter(
            "paramserver_key_pushed_bytes",
            f"Gradient bytes pushed per key (first {MAX_KEY_LABELS} keys; the rest as _other)",
            ["key"],
            registry=registry,
        )
        self.key_pulled = Counter(
            "paramserver_key_pulled_bytes",
            f"Bytes pulled per key (first {MAX_KEY_LABELS} keys; the rest as _other)",
            ["key"],
            registry=registry,
        )
        self._key_label = _KeyLabels()

    def pushed(self, rpc: str, grads: Mapping[str, np.ndarray], seconds: float, ok: bool) -> None:
        outcome = "ok" if ok else "error"
        total = 0
        for key, grad in grads.items():
            nbytes = int(grad.nbytes)
            total += nbytes
            if ok:
                self.key_pushed.labels(self._key_label(key)).inc(nbytes)
        self.push_bytes.labels(rpc, outcome).observe(total)
        self.push_seconds.labels(rpc, outcome).observe(seconds)

    def pull_admitted(self, rpc: str, keys: Sequence[str], seconds: float, ok: bool) -> None:
        self.pulls.labels(rpc, "ok" if ok else "error").inc()
        self.pull_admit.labels(rpc).observe(seconds)

    def pulled(self, rpc: str, key: str, nbytes: int) -> None:
        self.pull_bytes.labels(rpc).inc(nbytes)
        self.key_pulled.labels(self._key_label(key)).inc(nbytes)


class MetricsServer:
    """``GET /metrics`` in the Prometheus text format, ``/`` the dashboard page and
    ``/api/status`` its JSON (:mod:`paramserver.server.observability.dashboard`), served on the
    running
    event loop.

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


def new_registry(
    engine: ServerEngine, transport: Callable[[], TransportStats] | None = None
) -> tuple[CollectorRegistry, RpcMetrics]:
    """A private registry with the shard's state collector and an RPC interceptor; installs
    the Prometheus push/pull hooks on ``engine``."""
    registry = CollectorRegistry()
    registry.register(CoreCollector(engine, transport))
    registry.register(TableCollector(engine))
    engine.hooks = PromServingHooks(registry)
    return registry, RpcMetrics(registry)


def metrics_for(
    engine: ServerEngine, transport: Callable[[], TransportStats] | None = None
) -> tuple[list[Any], MetricsServer | None]:
    """Interceptors for the gRPC server and the (unstarted) metrics endpoint; none when
    ``metrics_port`` is not configured. ``transport`` as in :class:`CoreCollector`."""
    cfg = engine.config
    if cfg.metrics_port is None:
        return [], None
    registry, interceptor = new_registry(engine, transport)
    return [interceptor], MetricsServer(
        registry, cfg.metrics_host, cfg.metrics_port, security=cfg.metrics_security()
    )
