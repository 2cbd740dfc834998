"""Prometheus metrics of a server shard (``paramserver serve --metrics-port 9100``).

One private :class:`prometheus_client.CollectorRegistry` per daemon, holding what every daemon
counts (:class:`~paramserver.serving.metrics.RpcMetrics`: calls, durations and the consistency
wait of pulls, per method) and the shard's own series:

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

The endpoint is :class:`~paramserver.serving.metrics.MetricsServer` (the dashboard's page is
:class:`~paramserver.server.observability.shard_dashboard.ShardDashboard`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import grpc
import numpy as np
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from paramserver.server.engine import ServerEngine
from paramserver.server.observability.hooks import BucketCounts, ServingHooks
from paramserver.server.observability.table_metrics import TableCollector
from paramserver.serving.metrics import WAIT_BUCKETS, MetricsServer, RpcMetrics

logger = logging.getLogger(__name__)

_BYTES_BUCKETS = tuple(float(4**i * 1024) for i in range(11))  # 1 KiB .. 1 GiB

#: Keys that get their own ``key`` label; later ones are summed under ``key="_other"``.
MAX_KEY_LABELS = 256


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
            buckets=WAIT_BUCKETS,
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
            buckets=WAIT_BUCKETS,
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
) -> tuple[list[grpc.aio.ServerInterceptor], MetricsServer | None]:
    """Interceptors for the gRPC server and the (unstarted) metrics endpoint; none when
    ``metrics_port`` is not configured. ``transport`` as in :class:`CoreCollector`."""
    cfg = engine.config
    if cfg.metrics_port is None:
        return [], None
    registry, interceptor = new_registry(engine, transport)
    return [interceptor], MetricsServer(
        registry, cfg.metrics_host, cfg.metrics_port, security=cfg.metrics_security()
    )
