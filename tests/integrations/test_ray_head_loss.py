"""Losing the Ray head mid-job ends ``paramserver ray-launch`` with its result (issue 31,
item 3): exit 1, one JSON object on stdout with ``ok: false`` and the reason, one error line
on stderr, within ``--head-timeout-s`` plus a few seconds (Ray alone would end the driver
after about a minute with no result)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="the Ray tests need Ray: pip install 'paramserver[ray]'")

from tests.harness.processes import ScriptProcess
from tests.harness.ray_cluster import HEAD_IP, LocalRayCluster
from tests.harness.timing import scaled

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]


def test_head_loss_ends_the_job_with_a_failed_result(tmp_path: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    with LocalRayCluster(env, nodes=2) as cluster:
        run_env = {**cluster.auth_env, "RAY_USAGE_STATS_ENABLED": "0"}
        run_env["PYTHONPATH"] = env["PYTHONPATH"]
        argv = [
            "-m",
            "paramserver",
            "--log-level",
            "WARNING",
            "ray-launch",
            *("--address", cluster.address, "--shards", "1", "--workers", "1"),
            *("--state-dir", str(tmp_path / "state"), "--epochs", "400"),
            *("--slow-factor", "3", "--head-timeout-s", "5", "--timeout-s", "600"),
        ]
        with ScriptProcess(tmp_path, "ray-launch", argv, env=run_env) as proc:
            # the job is under way once the shards serve (the driver logs nothing at WARNING
            # until then): give it time to start, then lose the head
            time.sleep(scaled(25.0))
            assert proc.proc.poll() is None, proc.stderr()
            cluster.kill_node(HEAD_IP)
            t_kill = time.monotonic()
            out, err = proc.communicate(timeout_s=120.0)
            took = time.monotonic() - t_kill
            code = proc.proc.returncode
    assert code == 1, (out, err)
    result = json.loads(out.strip().splitlines()[-1])
    assert result["ok"] is False
    assert "Ray head" in result["error"], result
    failed = [line for line in err.splitlines() if "the job failed" in line]
    assert len(failed) == 1 and "Ray head" in failed[0], err[-2000:]
    assert "Traceback" not in err, err[-3000:]
    print(f"\n[ray] head lost: ray-launch ended {took:.1f} s later with a failed result")
