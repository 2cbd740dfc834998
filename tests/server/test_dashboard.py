"""The metrics port's dashboard without a browser (``/``, its assets, ``/api/status``) and the
Grafana dashboard under monitoring/ checked against the metrics the servers export.

Expected values come from what each test did (pushes made, bytes pulled, blocks moved).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from prometheus_client import CollectorRegistry

from paramserver.serving.metrics import auth_refusal_counter
from paramserver.spmd import SpmdParallelWorkers, Tier
from paramserver.spmd.layout import Layout
from paramserver.spmd.rank_server import RankServerConfig, start_rank_server
from paramserver.worker_client import UpdateRule, connect
from tests.harness import eventually, running_cluster, running_server
from tests.harness.browser import get, get_json

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "monitoring" / "grafana"


async def _sampled(base: str, pred: object, what: str) -> dict:  # type: ignore[type-arg]
    """The newest ``/api/status`` once ``pred(history[-1])`` holds (the sampler runs at 1 Hz)."""
    out: dict = {}  # type: ignore[type-arg]

    async def ready() -> bool:
        out.update(await get_json(f"{base}/api/status"))
        return bool(pred(out["history"][-1]))  # type: ignore[operator]

    await eventually(ready, timeout_s=15, what=what)
    return out


async def test_page_assets_and_status_json_of_a_shard() -> None:
    """Three pushes of 4 float32 and two pulls of the key: the JSON's counters say so, and its
    Status is what the Status RPC answers."""
    async with running_server(consistency="ssp", staleness=2, metrics_port=0) as srv:
        assert srv.metrics is not None
        base = f"http://127.0.0.1:{srv.metrics.port}"
        status, headers, page = await get(f"{base}/")
        assert status == 200 and headers["Content-Type"].startswith("text/html")
        assert "default-src 'self'" in headers["Content-Security-Policy"]
        # Every asset the page names is served here; nothing is fetched from elsewhere.
        refs = re.findall(r'(?:src|href)="([^"]+)"', page.decode())
        assert refs and all(not r.startswith(("http:", "https:", "//")) for r in refs)
        for ref in refs:
            code, _, body = await get(f"{base}/{ref.lstrip('/')}")
            assert code == 200 and body, ref
        _, js_headers, js = await get(f"{base}/app.js")
        assert js_headers["Content-Type"].startswith("text/javascript")
        assert b"/api/status" in js and b"http" not in js.replace(b"http://www.w3.org", b"")
        assert (await get(f"{base}/nope"))[0] == 404
        assert (await get(f"{base}/metrics"))[0] == 200

        grad = np.ones(4, np.float32)
        async with connect(srv.address, "w0") as w:
            await w.init({"k": np.zeros(4, np.float32)}, rule=UpdateRule("add"))
            after_init = time.time()  # init reads the value back: count pulls from here
            first = await _sampled(base, lambda h: h["t"] > after_init, "a sample after init")
            pulled_before = first["history"][-1]["pull_bytes"]
            for _ in range(3):
                await w.push({"k": grad})
            for _ in range(2):
                await w.pull(["k"])
            data = await _sampled(
                base,
                lambda h: h["pushes"] == 3 and h["pull_bytes"] == pulled_before + 2 * 16,
                "3 pushes, 2 pulls",
            )
        last = data["history"][-1]
        assert data["kind"] == "ps" and "shards" not in data  # one shard: no shard list
        assert last["push_bytes"] == 3 * grad.nbytes and last["applied"] == 3
        assert last["staleness_clocks"][-1] == 3  # the +Inf bucket counts every applied push
        st = data["status"]
        assert st["applied_updates"] == 3 and st["view"]["consistency"] == "CONSISTENCY_SSP"
        assert [w["worker_name"] for w in st["workers"]] == ["w0"]
        assert [(k["key"], k["size_bytes"], k["updates"]) for k in st["keys"]] == [("k", 16, 3)]
        assert data["server"]["address"] == srv.address
        newer = await get_json(f"{base}/api/status?since={last['t']}")
        assert all(h["t"] > last["t"] for h in newer["history"])  # what the page polls for
        assert len(newer["history"]) < len(data["history"])
        assert (await get(f"{base}/api/status?since=yesterday"))[0] == 400
        rates = data["key_rates"]["k"]
        assert rates["pushed_bytes"] == 3 * 16
        assert rates["pulled_bytes"] == pulled_before + 2 * 16


async def test_one_shard_page_shows_every_shard() -> None:
    """A 2-shard cluster: shard 0's JSON carries shard 1's Status, read over gRPC."""
    async with running_cluster(2, consistency="asp", metrics_port=0) as shards:
        async with connect(shards[0].address, "m0") as ps:
            await ps.init({f"k{i}": np.zeros(4) for i in range(8)}, rule=UpdateRule("add"))
            await ps.push({f"k{i}": np.ones(4) for i in range(8)})
        port = shards[0].metrics.port  # type: ignore[union-attr]
        data = await get_json(f"http://127.0.0.1:{port}/api/status")
    (other,) = data["shards"]
    assert other["index"] == 1 and other["address"] == shards[1].address
    own_keys = {k["key"] for k in data["status"]["keys"]}
    other_keys = {k["key"] for k in other["status"]["keys"]}
    assert own_keys | other_keys == {f"k{i}" for i in range(8)} and not own_keys & other_keys
    assert other["status"]["applied_updates"] == shards[1].engine.core.applied_updates  # type: ignore[union-attr]


def test_rank_server_page_shows_throughput_per_tier_and_path(tmp_path: Path) -> None:
    """Five blocks moved G2 -> G3 on one rank: the JSON counts their bytes under
    ``local G2->G3 local``."""
    layout = Layout(0, num_layers=2, outer_dim=2, page_size=8, inner_dim=64, dtype="float16")
    block_bytes = 2 * 2 * 8 * 64 * 2  # layers x outer x page x inner x float16 itemsize

    async def body() -> dict:  # type: ignore[type-arg]
        cfg = RankServerConfig(
            instance_id="dash",
            rank=0,
            layout=layout,
            host_blocks=8,
            disk_blocks=8,
            disk_dir=tmp_path / "disk",
            metrics_port=0,
        )
        handle = await start_rank_server(cfg)
        try:
            assert handle.metrics is not None
            base = f"http://127.0.0.1:{handle.metrics.port}"
            async with SpmdParallelWorkers([handle.address], default_timeout_s=10) as g:
                await g.write_blocks(0, Tier.G2, range(5), np.zeros((5, block_bytes), np.uint8))
                await (await g.execute_local_transfer(Tier.G2, Tier.G3, range(5), range(5)))
            label = "local G2->G3 local"
            return await _sampled(
                base, lambda h: h["transfer_bytes"].get(label) == 5 * block_bytes, label
            )
        finally:
            await handle.stop(0.5)

    data = asyncio.run(body())
    last = data["history"][-1]
    assert data["kind"] == "rank" and data["server"]["rank"] == 0
    assert last["transfers"]["local G2->G3 local"] == 1
    assert last["transfer_s"]["local G2->G3 local"] > 0


# --------------------------------------------------------------------------- Grafana

_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gauge": ("",),
    "summary": ("", "_sum", "_count", "_created"),
    "untyped": ("",),
}


def _exported_names(exposition: str) -> set[str]:
    """Every sample name an exposition can hold, from its ``# TYPE`` lines (a family with no
    series yet still declares its name and type)."""
    names = set()
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", exposition, re.M):
        if kind == "counter":  # the text format's TYPE line names a counter with its _total
            name = name.removesuffix("_total")
        names.update(name + suffix for suffix in _SUFFIXES[kind])
    return names


async def _live_exports(tmp_path: Path) -> set[str]:
    """Scrapes of a live shard (after a checkpoint), a live rank server and the token-refusal
    counter (registered only when tokens are on)."""
    from prometheus_client import generate_latest

    names: set[str] = set()
    async with running_server(
        consistency="bsp", metrics_port=0, checkpoint_dir=str(tmp_path / "ckpt")
    ) as srv:
        assert srv.metrics is not None
        assert await srv.checkpoint() is not None  # the checkpoint age series appear after one
        _, _, body = await get(f"http://127.0.0.1:{srv.metrics.port}/metrics")
        names |= _exported_names(body.decode())
    cfg = RankServerConfig(instance_id="graf", rank=0, host_blocks=2, disk_blocks=0, metrics_port=0)
    handle = await start_rank_server(cfg)
    try:
        assert handle.metrics is not None
        _, _, body = await get(f"http://127.0.0.1:{handle.metrics.port}/metrics")
        names |= _exported_names(body.decode())
    finally:
        await handle.stop(0.5)
    registry = CollectorRegistry()
    auth_refusal_counter(registry)
    names |= _exported_names(generate_latest(registry).decode())
    return names


def _panels(dashboard: dict) -> list[dict]:  # type: ignore[type-arg]
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def test_grafana_dashboard_queries_only_exported_metrics(tmp_path: Path) -> None:
    """Every query of monitoring/grafana/dashboards/paramserver.json names metrics a live
    server exports, on the provisioned data source; compose mounts both."""
    dashboard = json.loads((GRAFANA / "dashboards" / "paramserver.json").read_text())
    exported = asyncio.run(_live_exports(tmp_path))
    assert "paramserver_applied_updates_total" in exported  # the scrape is the real one
    assert "paramserver_rank_transfer_bytes_total" in exported

    datasources = yaml.safe_load(
        (GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text()
    )["datasources"]
    uids = {d["uid"] for d in datasources if d["type"] == "prometheus"}
    panels = _panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    queried: set[str] = set()
    queries = 0
    for panel in panels:
        if panel["type"] == "row":
            continue
        assert panel["title"] and {"h", "w", "x", "y"} <= panel["gridPos"].keys()
        assert panel["datasource"]["uid"] in uids, panel["title"]
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            expr = target["expr"]
            queries += 1
            assert expr.count("(") == expr.count(")"), expr
            names = set(re.findall(r"\bparamserver_[a-zA-Z0-9_]*", expr))
            assert names, f"{panel['title']!r}: {expr!r} names no paramserver metric"
            unknown = names - exported
            assert not unknown, f"{panel['title']!r} queries {sorted(unknown)}, not exported"
            queried |= names
    assert queries >= 20
    # The headline series are on the dashboard.
    for name in (
        "paramserver_update_staleness_clocks_bucket",
        "paramserver_bsp_barrier_lag_seconds_total",
        "paramserver_pull_bytes_total",
        "paramserver_rank_transfer_bytes_total",
    ):
        assert name in queried

    providers = yaml.safe_load(
        (GRAFANA / "provisioning" / "dashboards" / "paramserver.yml").read_text()
    )["providers"]
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    grafana = compose["services"]["grafana"]
    assert grafana["profiles"] == ["monitoring"]
    mounts = dict(v.rsplit(":", 1)[0].split(":", 1) for v in grafana["volumes"])
    assert mounts["./monitoring/grafana/dashboards"] == providers[0]["options"]["path"]
    assert mounts["./monitoring/grafana/provisioning"] == "/etc/grafana/provisioning"
    prometheus = next(d for d in datasources if d["uid"] in uids)
    assert prometheus["url"] == "http://prometheus:9090" and "prometheus" in compose["services"]
