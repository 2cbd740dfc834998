"""The dashboard's history without a server: samples read from a real registry (the push and
pull seams' series), bounded history, per-key rates, the page's files."""

from __future__ import annotations

import re

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from paramserver.server.observability.prometheus import PromServingHooks
from paramserver.server.observability.shard_dashboard import ShardDashboard
from paramserver.serving.dashboard import ASSETS, Dashboard, asset


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


async def test_samples_count_pushes_bytes_and_key_rates() -> None:
    """Two pushes of 8 float32 (32 bytes each), one refused push and a 24-byte pull; 2 s
    later two more pushes: 64 bytes of key "w" in those 2 s, 32 B/s."""
    registry = CollectorRegistry()
    hooks = PromServingHooks(registry)
    now = Clock()
    dash = ShardDashboard(registry, history=3, now=now)
    grad = {"w": np.ones(8, np.float32)}
    hooks.pushed("Session", grad, 0.001, ok=True)
    hooks.pushed("Push", grad, 0.001, ok=True)
    hooks.pushed("Push", grad, 0.001, ok=False)  # refused: not a push of the chart
    hooks.pulled("Session", "w", 24)
    first = dash.sample()
    assert first["t"] == 1000.0
    assert (first["pushes"], first["push_bytes"], first["pull_bytes"]) == (2, 64, 24)
    now.t += 2.0
    hooks.pushed("Session", grad, 0.001, ok=True)
    hooks.pushed("Session", grad, 0.001, ok=True)
    second = dash.sample()
    assert (second["pushes"], second["push_bytes"]) == (4, 128)
    rates = (await dash.snapshot())["key_rates"]["w"]
    assert rates["push_bytes_per_s"] == pytest.approx(64 / 2.0)
    assert rates["pull_bytes_per_s"] == 0 and rates["pulled_bytes"] == 24
    for _ in range(5):
        now.t += 1.0
        dash.sample()
    snap = await dash.snapshot()
    assert [h["t"] for h in snap["history"]] == [1005.0, 1006.0, 1007.0]  # the newest 3
    assert [h["t"] for h in (await dash.snapshot(1005.5))["history"]] == [1006.0, 1007.0]


def test_unknown_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="rank, reduce"):
        Dashboard("web", CollectorRegistry())
    with pytest.raises(ValueError, match="rank, reduce"):  # a shard's is a ShardDashboard
        Dashboard("ps", CollectorRegistry())


def test_the_page_names_only_its_own_files() -> None:
    page = asset("index.html").decode()
    refs = set(re.findall(r'(?:src|href)="([^"]+)"', page))
    assert {"app.js", "style.css"} <= refs
    assert all(r in ASSETS or r.startswith("/") for r in refs)  # /metrics, /api/status links
    for name in ASSETS:
        assert asset(name)
