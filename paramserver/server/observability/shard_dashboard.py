"""The dashboard of a parameter-server shard's metrics port (kind ``ps``).

Per sample, besides what :class:`~paramserver.serving.dashboard.Dashboard` keeps: applied
updates, pushes and their bytes (the push seam's ``paramserver_push_bytes`` histogram, outcome
ok), pulls and pulled bytes, the staleness histogram in clocks (cumulative counts per bucket),
BSP barrier lag and steps per worker (the :data:`MAX_CHARTED_WORKERS` worst stragglers),
Heartbeat RPCs and their handling seconds. The JSON adds the histogram's bucket bounds and the
bytes/s pushed and pulled per key over the last :data:`KEY_RATE_SAMPLES` samples; the shard's
``Status`` and, in a sharded cluster, every other shard's come through ``status`` and ``peers``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry

from paramserver.server.observability.hooks import STALENESS_CLOCK_BOUNDS
from paramserver.serving.dashboard import Dashboard, Sampler, Series, series_by, series_sum

__all__ = ["KEY_RATE_SAMPLES", "MAX_CHARTED_WORKERS", "ShardDashboard", "ps_sample"]

#: Workers whose barrier lag each sample keeps (the worst stragglers by total lag).
MAX_CHARTED_WORKERS = 16
#: Samples over which the per-key push and pull rates are computed.
KEY_RATE_SAMPLES = 10


def ps_sample(s: dict[str, Series]) -> dict[str, Any]:
    """The history entry of a parameter-server shard from its registry's samples."""
    lag = series_by(s.get("paramserver_bsp_barrier_lag_seconds_total"), "worker")
    steps = series_by(s.get("paramserver_bsp_barrier_steps_total"), "worker")
    worst = sorted(lag, key=lambda w: (-lag[w], w))[:MAX_CHARTED_WORKERS]
    buckets = {
        labels.get("le", ""): v
        for labels, v in s.get("paramserver_update_staleness_clocks_bucket", [])
    }
    staleness = [buckets.get(repr(float(b)), 0.0) for b in STALENESS_CLOCK_BOUNDS]
    staleness.append(buckets.get("+Inf", 0.0))
    return {
        "applied": series_sum(s.get("paramserver_applied_updates_total")),
        "pushes": series_sum(s.get("paramserver_push_bytes_count"), outcome="ok"),
        "push_bytes": series_sum(s.get("paramserver_push_bytes_sum"), outcome="ok"),
        "pulls": series_sum(s.get("paramserver_pulls_total"), outcome="ok"),
        "pull_bytes": series_sum(s.get("paramserver_pull_bytes_total")),
        "staleness_clocks": staleness,
        "barrier_lag_s": {w: lag[w] for w in worst},
        "barrier_steps": {w: steps.get(w, 0.0) for w in worst},
        "heartbeats": series_sum(
            s.get("paramserver_rpc_duration_seconds_count"), method="Heartbeat"
        ),
        "heartbeat_s": series_sum(
            s.get("paramserver_rpc_duration_seconds_sum"), method="Heartbeat"
        ),
    }


def _key_rates(
    window: Sequence[tuple[float, dict[str, float], dict[str, float]]],
) -> dict[str, dict[str, float]]:
    """Bytes/s pushed and pulled per key between the oldest and newest entry of ``window``."""
    if len(window) < 2:
        return {}
    (t0, pushed0, pulled0), (t1, pushed1, pulled1) = window[0], window[-1]
    dt = t1 - t0
    if dt <= 0:
        return {}
    keys = set(pushed1) | set(pulled1)
    return {
        k: {
            "push_bytes_per_s": max(0.0, pushed1.get(k, 0.0) - pushed0.get(k, 0.0)) / dt,
            "pull_bytes_per_s": max(0.0, pulled1.get(k, 0.0) - pulled0.get(k, 0.0)) / dt,
            "pushed_bytes": pushed1.get(k, 0.0),
            "pulled_bytes": pulled1.get(k, 0.0),
        }
        for k in sorted(keys)
    }


class ShardDashboard(Dashboard):
    """A shard's dashboard: :class:`~paramserver.serving.dashboard.Dashboard` of kind ``ps``
    (the same arguments but ``kind``), with the per-key rates."""

    SAMPLERS: dict[str, Sampler] = {"ps": ps_sample}

    def __init__(self, registry: CollectorRegistry, **kwargs: Any) -> None:
        super().__init__("ps", registry, **kwargs)
        self._keys: deque[tuple[float, dict[str, float], dict[str, float]]] = deque(
            maxlen=KEY_RATE_SAMPLES + 1
        )

    def _sampled(self, t: float, samples: dict[str, Series]) -> None:
        self._keys.append(
            (
                t,
                series_by(samples.get("paramserver_key_pushed_bytes_total"), "key"),
                series_by(samples.get("paramserver_key_pulled_bytes_total"), "key"),
            )
        )

    def _facts(self) -> dict[str, Any]:
        return {
            "staleness_clock_bounds": list(STALENESS_CLOCK_BOUNDS),
            "key_rates": _key_rates(list(self._keys)),
        }
