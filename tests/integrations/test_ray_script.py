"""``paramserver ray-launch --script``: a user's training script, unchanged, as Ray worker tasks
on a real single-node Ray cluster started here (no dashboard, no usage stats, stopped by PID,
never ``ray stop``).

The script is the one ``tests/cli/test_run.py`` runs under ``paramserver run``
(``tests/harness/run_worker.py``): it reads its place in the job from the environment, declares
``x`` (rule ``add``), resumes at its name's progress and pushes 1 per step. Expected values are
closed forms: with sum aggregation under BSP, 2 workers x 4 steps add 8 to ``x``.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="the Ray tests need Ray: pip install 'paramserver[ray]'")

from tests.harness import ScriptProcess  # noqa: E402
from tests.harness.processes import HERE  # noqa: E402
from tests.harness.ray_cluster import HEAD_IP, LocalRayCluster  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]


def free_port_pair(host: str) -> int:
    """A port p such that p and p + 1 are free on ``host`` right now."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind((host, 0))
            base = int(s.getsockname()[1])
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind((host, base))
                b.bind((host, base + 1))
        except OSError:
            continue
        return base
    raise RuntimeError("no two consecutive free ports")


def test_ray_launch_runs_the_paramserver_run_script_unchanged(tmp_path: Path) -> None:
    steps, workers = 4, 2
    env = {"RAY_USAGE_STATS_ENABLED": "0"}
    t0 = time.monotonic()
    with LocalRayCluster({**os.environ, **env}, num_cpus=4, nodes=1) as cluster:
        up_s = time.monotonic() - t0
        argv = [
            "-m", "paramserver", "--log-level", "WARNING", "ray-launch",
            "--address", cluster.address, "--shards", "2", "--workers", str(workers),
            "--base-port", str(free_port_pair(HEAD_IP)), "--state-dir", str(tmp_path / "state"),
            "--serve-args", "--consistency bsp --aggregation sum", "--strategy", "PACK",
            "--name", "scr", "--timeout-s", "150",
            "--script", str(HERE / "run_worker.py"), str(steps), "-", "a", "--b",
        ]  # fmt: skip
        t1 = time.monotonic()
        with ScriptProcess(tmp_path, "ray-launch", argv, env={**env, **cluster.auth_env}) as p:
            out, err = p.communicate(timeout_s=200)
            assert p.proc.returncode == 0, err[-3000:]
        job_s = time.monotonic() - t1
        left = cluster.stop()
        assert not left, f"cluster processes still running after stop: {sorted(left)}"
    result = json.loads(out.strip().splitlines()[-1])
    assert result["ok"] is True, result
    assert [w["index"] for w in result["workers"]] == list(range(workers))
    for i, w in enumerate(result["workers"]):
        lines = w["result"]["output"]
        assert w["result"]["exit_code"] == 0
        assert "resumed 0" in lines, lines
        # Its index, the job's size, its name and its arguments, from the environment.
        assert f"done {i} {workers} scr-worker-{i} ['a', '--b']" in lines, lines
        planned = steps * workers
        assert f"final x {float(planned)} applied {planned}" in lines, lines
    # x lives on one of the two shards: its applied updates are every worker's every step.
    assert sorted(s["applied_updates"] for s in result["shards"]) == [0, steps * workers]
    print(
        f"\n[ray] 1-node cluster up in {up_s:.1f} s; ray-launch --script (2 shards, "
        f"{workers} workers) {job_s:.1f} s"
    )
