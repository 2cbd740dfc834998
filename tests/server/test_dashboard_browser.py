"""The dashboard in a real browser: headless Chromium (Debian's ``chromium`` package, installed
by ``make browser``) loads the page of a live shard that trained the digits job.

The rendered DOM must show a row per worker with the clock and applied updates that
``paramserver status --json`` prints for the same server, the keys with their sizes, charts
with data points (the staleness histogram holds every applied gradient, all at 0 clocks: BSP),
and no page error (the page records ``window.onerror``, unhandled rejections and
``console.error`` in ``#errors``). A screenshot is saved (``PARAMSERVER_DASHBOARD_PNG=path``
also copies it there: that is how docs/images/dashboard.png is made).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.harness import ScriptProcess, running_server
from tests.harness.browser import CHROMIUM, get_json, parse_dom, run_chromium

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not CHROMIUM.exists(),
        reason="needs Debian's chromium at /usr/bin/chromium (make browser installs it)",
    ),
]

WORKERS = 3
HIDDEN = 32  # the digits MLP: 64 inputs, HIDDEN hidden units, 10 classes, float32


async def _status_json(address: str) -> dict:  # type: ignore[type-arg]
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "paramserver",
        "status",
        address,
        "--json",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    return dict(json.loads(out))


@pytest.mark.timeout(300)
def test_dashboard_page_of_a_digits_cluster_in_headless_chromium(tmp_path: Path) -> None:
    asyncio.run(_page_of_a_digits_cluster(tmp_path))


async def _page_of_a_digits_cluster(tmp_path: Path) -> None:
    workers: list[ScriptProcess] = []
    async with running_server(consistency="bsp", metrics_port=0) as srv:
        assert srv.metrics is not None
        base = f"http://127.0.0.1:{srv.metrics.port}"
        try:
            for i in range(WORKERS):
                argv = ["-m", "paramserver", "worker", "--server", srv.address,
                        "--worker-index", str(i), "--num-workers", str(WORKERS),
                        "--epochs", "3", "--hidden", str(HIDDEN), "--no-eval",
                        "--min-accuracy", "0",
                        "--slow-factor", "3" if i == WORKERS - 1 else "1"]  # fmt: skip
                workers.append(ScriptProcess(tmp_path, f"worker-{i}", argv, group=True))
            codes = await asyncio.gather(*(w.wait_exit(timeout_s=200) for w in workers))
            assert codes == [0] * WORKERS, [w.stderr()[-2000:] for w in workers]
        finally:
            for w in workers:
                await asyncio.to_thread(w.close)

        # The run is over: what the page shows must now equal what `status --json` prints.
        applied = srv.engine.core.applied_updates  # type: ignore[union-attr]
        deadline = time.monotonic() + 30
        while (await get_json(f"{base}/api/status"))["history"][-1]["applied"] != applied:
            assert time.monotonic() < deadline, "the dashboard's sampler never caught up"
            await asyncio.sleep(0.2)

        rc, dom_html, err = await run_chromium(
            f"{base}/",
            tmp_path / "profile-dom",
            "--virtual-time-budget=3000",
            "--enable-logging=stderr",
            "--dump-dom",
        )
        assert rc == 0, err[-2000:]
        # The browser's console log (Chromium writes every console message at INFO, errors
        # too): the page writes nothing there, so any line is an error, a refused or a
        # missing asset, whatever the page's own error element says.
        console = [line for line in err.splitlines() if ":CONSOLE" in line]
        assert not console, console
        png = tmp_path / "dashboard.png"
        rc, _, err = await run_chromium(
            f"{base}/",
            tmp_path / "profile-shot",
            "--virtual-time-budget=3000",
            "--window-size=1280,1150",
            f"--screenshot={png}",
        )
        assert rc == 0, err[-2000:]
        status = await _status_json(srv.address)

    dom = parse_dom(dom_html)
    errors = dom.find(id="errors")
    assert errors.attrs.get("data-count") == "0", f"page errors: {errors.text}"
    assert int(dom.find(tag="body").attrs["data-polls"]) >= 1

    # Summary cards.
    def card(field: str) -> str:
        return dom.find(class_="value", data_field=field).attrs["data-value"]

    assert card("applied_updates") == str(status["applied_updates"]) == str(applied)
    assert card("consistency") == "bsp" == status["view"]["consistency"].split("_")[1].lower()
    assert card("bsp_step") == str(status["bsp_step"])
    assert card("min_clock") == str(status["view"]["min_clock"])
    assert card("live_workers") == "0" == str(status["view"]["live_workers"])  # all left

    # Worker rows: one per worker, slowest first (BSP: by total barrier lag), with the clock
    # and the applied updates `status --json` prints.
    rows = dom.find_all(class_="worker-row")
    expected = sorted(
        status["workers"], key=lambda w: (-w["barrier_lag_ms"], w["clock"], w["worker_name"])
    )
    assert [r.attrs["data-worker"] for r in rows] == [w["worker_name"] for w in expected]
    assert len(rows) == WORKERS
    for row, w in zip(rows, expected, strict=True):
        assert row.find(data_field="clock").attrs["data-value"] == str(w["clock"])
        assert row.find(data_field="clock").text == str(w["clock"])
        assert row.find(data_field="applied_updates").attrs["data-value"] == str(
            w["applied_updates"]
        )
        assert row.find(data_field="barrier_lag_ms").attrs["data-value"] == str(w["barrier_lag_ms"])
    assert sum(w["applied_updates"] for w in status["workers"]) == applied

    # Keys: the digits MLP's four tensors, float32 bytes from their shapes.
    sizes = {
        "layer0/weight": 64 * HIDDEN * 4,
        "layer0/bias": HIDDEN * 4,
        "layer1/weight": HIDDEN * 10 * 4,
        "layer1/bias": 10 * 4,
    }
    key_rows = {r.attrs["data-key"]: r for r in dom.find_all(class_="key-row")}
    assert set(key_rows) == set(sizes) == {k["key"] for k in status["keys"]}
    for key, nbytes in sizes.items():
        assert key_rows[key].find(data_field="size_bytes").attrs["data-value"] == str(nbytes)

    # Charts with data: pushes/s has points; the staleness histogram counts every applied
    # gradient, all in the 0-clock bucket (BSP applies each step once, in order).
    pushes = dom.find(tag="svg", data_chart="pushes")
    assert int(pushes.attrs["data-points"]) >= 2
    assert pushes.find_all(tag="polyline")
    bars = dom.find(tag="svg", data_chart="staleness").find_all(tag="rect")
    counts = [float(b.attrs["data-value"]) for b in bars]
    assert sum(counts) == applied and counts[0] == applied
    lag_bars = dom.find(tag="svg", data_chart="barrier-lag").find_all(tag="rect")
    assert {b.attrs["data-label"] for b in lag_bars} == {w["worker_name"] for w in expected}

    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    copy_to = os.environ.get("PARAMSERVER_DASHBOARD_PNG")
    if copy_to:
        shutil.copyfile(png, copy_to)


@pytest.mark.timeout(180)
def test_sharded_rank_and_reduction_pages_render_without_errors(tmp_path: Path) -> None:
    """The other pages, in the browser: a 2-shard cluster's page lists both shards (one row
    each, from the shard map), a rank server's lists the transfer it did per tiers and path,
    a reduction server's charts its RPCs; no page error, no console line."""
    asyncio.run(_other_pages(tmp_path))


async def _other_pages(tmp_path: Path) -> None:
    import numpy as np

    from paramserver.core.sharding import home_shard
    from paramserver.spmd import SpmdParallelWorkers, Tier
    from paramserver.spmd.layout import Layout
    from paramserver.spmd.rank_server import RankServerConfig, start_rank_server
    from paramserver.worker_client import UpdateRule, connect
    from tests.harness import running_cluster

    async def page(url: str, name: str) -> Any:
        rc, html, err = await run_chromium(
            url,
            tmp_path / name,
            "--virtual-time-budget=2500",
            "--enable-logging=stderr",
            "--dump-dom",
        )
        assert rc == 0, err[-2000:]
        console = [line for line in err.splitlines() if ":CONSOLE" in line]
        assert not console, console
        dom = parse_dom(html)
        errors = dom.find(id="errors")
        assert errors.attrs.get("data-count") == "0", f"page errors: {errors.text}"
        assert int(dom.find(tag="body").attrs["data-polls"]) >= 1
        return dom

    async with running_cluster(2, consistency="asp", metrics_port=0) as shards:
        async with connect(shards[0].address, "m0") as ps:
            await ps.init({f"k{i}": np.zeros(4) for i in range(4)}, rule=UpdateRule("add"))
            await ps.push({f"k{i}": np.ones(4) for i in range(4)})
        dom = await page(f"http://127.0.0.1:{shards[1].metrics.port}/", "shards")  # type: ignore[union-attr]
    rows = dom.find_all(class_="shard-row")
    assert [r.attrs["data-shard"] for r in rows] == ["0", "1"]
    applied = [int(r.find(data_field="applied_updates").attrs["data-value"]) for r in rows]
    # One push of 4 keys: one applied update on each shard that is home to one of them.
    homes = {home_shard(f"k{i}", 2) for i in range(4)}
    assert applied == [1 if i in homes else 0 for i in range(2)]
    assert dom.find(tag="svg", data_chart="shards").attrs["data-series"] == "2"

    layout = Layout(0, num_layers=1, outer_dim=1, page_size=4, inner_dim=16, dtype="float16")
    block_bytes = 4 * 16 * 2
    cfg = RankServerConfig(
        instance_id="page",
        rank=0,
        layout=layout,
        host_blocks=4,
        disk_blocks=4,
        disk_dir=tmp_path / "disk",
        metrics_port=0,
    )
    handle = await start_rank_server(cfg)
    try:
        async with SpmdParallelWorkers([handle.address], default_timeout_s=10) as g:
            await g.write_blocks(0, Tier.G2, range(3), np.zeros((3, block_bytes), np.uint8))
            await (await g.execute_local_transfer(Tier.G2, Tier.G3, range(3), range(3)))
        base = f"http://127.0.0.1:{handle.metrics.port}"  # type: ignore[union-attr]
        deadline = time.monotonic() + 15
        while not (await get_json(f"{base}/api/status"))["history"][-1]["transfer_bytes"]:
            assert time.monotonic() < deadline, "the rank server's sampler never saw it"
            await asyncio.sleep(0.2)
        dom = await page(f"{base}/", "rank")
    finally:
        await handle.stop(0.5)
    (row,) = dom.find_all(class_="transfer-row")
    assert row.attrs["data-transfer"] == "local G2->G3 local"
    assert row.find(data_field="bytes").attrs["data-value"] == str(3 * block_bytes)
    assert row.find(data_field="transfers").attrs["data-value"] == "1"

    async with running_server(mode="reduce", metrics_port=0) as srv:
        dom = await page(f"http://127.0.0.1:{srv.metrics.port}/", "reduce")  # type: ignore[union-attr]
    assert dom.find(tag="svg", data_chart="rpcs") is not None
