"""Prometheus series of a shard's embedding tables, read at scrape time (label ``table``).

Series (labels ``shard``, ``table``): ``paramserver_table_rows`` (stored rows),
``paramserver_table_bytes`` (rows + optimizer state), ``paramserver_table_pushes`` (row pushes
applied; a closed bsp step counts once), ``paramserver_table_rows_pushed``,
``paramserver_table_rows_pulled``, ``paramserver_table_filtered`` (id pushes dropped by the
frequency filter), ``paramserver_table_expired`` (rows dropped by expiry),
``paramserver_table_queued_pushes`` (bsp pushes waiting for their step) and
``paramserver_table_staleness_max`` / ``paramserver_table_staleness_mean`` (clocks between the
table's newest applied clock and an applied push's clock).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from paramserver.server.engine import ServerEngine

__all__ = ["TableCollector"]


class TableCollector(Collector):
    """Per-table series of one shard.

    Args:
        engine: The shard's :class:`~paramserver.server.engine.ServerEngine`.
    """

    def __init__(self, engine: ServerEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        tables = self.engine.core.tables
        shard = str(self.engine.config.shard_index)
        names = ["shard", "table"]
        counters = {
            "pushes": "Row pushes applied (a closed bsp step counts once)",
            "rows_pushed": "Rows an update rule was applied to",
            "rows_pulled": "Rows pulled",
            "filtered": "Id pushes dropped by the frequency filter",
            "expired": "Rows dropped by expiry",
        }
        gauges = {
            "rows": "Rows stored",
            "bytes": "Bytes of stored rows and optimizer state",
            "queued_pushes": "bsp row pushes waiting for their step to close",
            "staleness_max": "Largest staleness of an applied row push (clocks)",
            "staleness_mean": "Mean staleness of applied row pushes (clocks)",
        }
        fams: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}
        for k, doc in counters.items():
            fams[k] = CounterMetricFamily(f"paramserver_table_{k}", doc, labels=names)
        for k, doc in gauges.items():
            fams[k] = GaugeMetricFamily(f"paramserver_table_{k}", doc, labels=names)
        for name, table in tables.tables.items():
            stats = tables.stats[name]
            values = {
                "pushes": table.pushes,
                "rows_pushed": table.rows_pushed,
                "rows_pulled": table.rows_pulled,
                "filtered": table.filtered,
                "expired": table.expired,
                "rows": table.n,
                "bytes": table.stored_bytes(),
                "queued_pushes": stats.queued_pushes(),
                "staleness_max": stats.staleness_max,
                "staleness_mean": (
                    stats.staleness_sum / stats.applied_pushes if stats.applied_pushes else 0.0
                ),
            }
            for k, v in values.items():
                fams[k].add_metric([shard, name], float(v))
        yield from fams.values()
