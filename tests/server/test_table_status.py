"""Per-table figures of Status, ``paramserver status`` and the dashboard: rows stored, memory
per row, rows pulled and pushed per second, filtered and expired ids, and the hit rate that
workers' row caches report with their pulls."""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest

from paramserver.core.tables import TableRule, TableSpec
from paramserver.server.observability.status_table import render_status
from paramserver.server.transports.table_service import TableRates
from paramserver.worker_client import connect
from paramserver.worker_client.row_cache import RowCache
from tests.harness import running_server
from tests.harness.browser import get, get_json

pytestmark = pytest.mark.timeout(60)


def test_rates_over_the_window() -> None:
    """Samples at most once a second; the rate runs from the oldest sample in the window."""
    t = SimpleNamespace(spec=SimpleNamespace(name="t"), rows_pulled=0, rows_pushed=0)
    rates = TableRates(window_s=10.0)
    rates.note(100.0, t)  # type: ignore[arg-type]
    t.rows_pulled, t.rows_pushed = 100, 10
    rates.note(100.5, t)  # type: ignore[arg-type]  # under a second: not sampled
    rates.note(102.0, t)  # type: ignore[arg-type]
    t.rows_pulled, t.rows_pushed = 300, 30
    assert rates.per_s(104.0, t) == (300 / 4, 30 / 4)  # type: ignore[arg-type]
    rates.note(111.0, t)  # type: ignore[arg-type]  # the sample of 100.0 leaves the window
    t.rows_pulled = 500
    assert rates.per_s(112.0, t) == ((500 - 100) / 10, (30 - 10) / 10)  # type: ignore[arg-type]
    assert rates.per_s(200.0, t) == (0.0, 0.0)  # idle longer than the window
    assert rates.per_s(0.0, SimpleNamespace(spec=SimpleNamespace(name="x"))) == (0.0, 0.0)  # type: ignore[arg-type]


async def test_status_cli_and_dashboard_show_the_table_figures() -> None:
    async with running_server(consistency="asp", metrics_port=0) as srv:
        async with connect(srv.address, "w") as w:
            await w.init_table(TableSpec("emb", 4, rule=TableRule("sgd", lr=0.1)))
            await w.init_table(TableSpec("filt", 2, min_pushes=2))
            await w.init_table(TableSpec("exp", 2, expiry_clocks=1))
            ids = np.arange(200, dtype=np.int64)
            await w.push_rows("emb", ids, np.ones((200, 4), np.float32))
            await w.push_rows("filt", [1, 2, 3], np.ones((3, 2), np.float32))  # filtered: 3
            await w.push_rows("exp", [5, 6], np.ones((2, 2), np.float32))
            await w.clock()
            await w.push_rows("exp", [7], np.ones((1, 2), np.float32))  # sweep: 5, 6 expire
            cache = RowCache(w, staleness=2)
            await cache.pull_rows("emb", ids[:50])  # 50 requested, 0 hit (all sent)
            await cache.pull_rows("emb", ids[:50])  # 50 requested, 50 hit (not re-sent)
            await cache.pull_rows("emb", ids[:120])  # 120, 50 hit: 70 re-sent
            st = await w.status()
        tables = {t.spec.name: t for t in st.tables}
        emb, filt, exp = tables["emb"], tables["filt"], tables["exp"]
        assert emb.rows == 200 and emb.rows_pushed == 200 and emb.rows_pulled == 50 + 70
        assert emb.bytes_per_row == pytest.approx(emb.size_bytes / 200)
        assert 0 < emb.rows_pulled_per_s <= emb.rows_pulled
        assert 0 < emb.rows_pushed_per_s <= emb.rows_pushed
        assert (emb.cache_rows_requested, emb.cache_rows_hit) == (220, 100)
        assert (cache.stats.rows_requested, cache.stats.rows_hit) == (220, 100)
        assert filt.filtered == 3 and filt.rows == 0 and filt.bytes_per_row == 0.0
        assert exp.expired == 2 and exp.rows == 1

        text = render_status(st, srv.address)
        assert "TABLES (3)" in text
        line = next(x for x in text.splitlines() if x.startswith("emb "))
        cells = re.split(r"\s{2,}", line.strip())
        assert cells[:5] == ["emb", "4", "float32", "200", f"{emb.bytes_per_row:.1f}"]
        assert cells[-3:] == ["0", "0", "45.5%"]  # filtered, expired, 100 of 220 hit

        assert srv.metrics is not None
        base = f"http://127.0.0.1:{srv.metrics.port}"
        _, _, page = await get(f"{base}/")
        assert b'id="tables-section"' in page
        data = await get_json(f"{base}/api/status")
        shown = {t["spec"]["name"]: t for t in data["status"]["tables"]}
        assert shown["emb"]["cache_rows_hit"] == 100 and shown["filt"]["filtered"] == 3
        _, _, js = await get(f"{base}/app.js")
        assert b"tables-section" in js and b"cache_rows_requested" in js
