"""Prometheus metrics of a rank server (``paramserver rank-server --metrics-port 9101``).

Every block-moving command is counted once it completes, by

* ``direction``: ``local`` (tier to tier on this rank), ``onboard`` (into this rank: from a peer
  or from the object tier G4), ``offload`` (out of this rank: to a peer or to G4);
* ``src_tier`` / ``dst_tier``: ``G1``..``G4``, or ``remote`` for a peer rank's tier;
* ``path``: ``local``, ``shared-memory``, ``grpc`` or ``object``.

Series: ``paramserver_rank_transfer_bytes_total`` (bytes moved),
``paramserver_rank_transfers_total`` (commands), ``paramserver_rank_transfer_seconds`` (a
histogram of command durations; ``rate(bytes_total) / rate(seconds_sum)`` is the mean
throughput), ``paramserver_rank_transfer_gbps`` (GB/s, 1e9 bytes per second, of the newest
command of each label set), and ``paramserver_rank_commands_failed_total`` /
``paramserver_rank_inflight_commands`` read from the servicer at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["RankMetrics", "transfer_direction"]

_SECONDS_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0)

_DIRECTIONS = {
    "local_transfer": "local",
    "remote_onboard": "onboard",
    "get_blocks": "onboard",
    "remote_offload": "offload",
    "put_blocks": "offload",
}


def transfer_direction(command: str) -> str:
    """``local`` / ``onboard`` / ``offload`` for a rank-server command name."""
    return _DIRECTIONS.get(command, command)


class _StateCollector(Collector):
    def __init__(self, read: Callable[[], tuple[int, int]]) -> None:
        self.read = read

    def collect(self) -> Iterator[Metric]:
        failed, inflight = self.read()
        yield CounterMetricFamily(
            "paramserver_rank_commands_failed", "Commands that failed", value=failed
        )
        yield GaugeMetricFamily(
            "paramserver_rank_inflight_commands", "Commands running now", value=inflight
        )


class RankMetrics:
    """The rank server's registry and transfer series.

    Args:
        read_state: Returns ``(commands failed, commands in flight)`` at scrape time.
    """

    def __init__(self, read_state: Callable[[], tuple[int, int]]) -> None:
        self.registry = CollectorRegistry()
        labels = ["direction", "src_tier", "dst_tier", "path"]
        self.bytes = Counter(
            "paramserver_rank_transfer_bytes",
            "Bytes moved by completed commands",
            labels,
            registry=self.registry,
        ).labels
        self.transfers = Counter(
            "paramserver_rank_transfers",
            "Completed block-moving commands",
            labels,
            registry=self.registry,
        ).labels
        self.seconds = Histogram(
            "paramserver_rank_transfer_seconds",
            "Duration of completed commands, seconds (validation to completion)",
            labels,
            registry=self.registry,
            buckets=_SECONDS_BUCKETS,
        ).labels
        self.gbps = Gauge(
            "paramserver_rank_transfer_gbps",
            "Throughput of the newest completed command, GB/s (1e9 bytes per second)",
            labels,
            registry=self.registry,
        ).labels
        self.registry.register(_StateCollector(read_state))

    def transfer(
        self, command: str, src_tier: str, dst_tier: str, path: str, nbytes: int, seconds: float
    ) -> None:
        """Count one completed command that moved ``nbytes`` in ``seconds``."""
        labels = (transfer_direction(command), src_tier, dst_tier, path)
        self.bytes(*labels).inc(nbytes)
        self.transfers(*labels).inc()
        self.seconds(*labels).observe(seconds)
        if seconds > 0:
            self.gbps(*labels).set(nbytes / seconds / 1e9)
