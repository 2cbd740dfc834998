"""paramserver on a real 2-node Ray cluster on this machine (``paramserver.integrations.ray``).

The cluster is two ``ray start`` nodes, 127.0.0.2 (head) and 127.0.0.3, started and stopped by
PID (:mod:`integration.ray_cluster`; never ``ray stop``). The shards are Ray actors in a SPREAD
placement group, the workers Ray tasks. What the engines' users asked for, checked here:

* stable shard addresses across a restart, and state restored instead of an empty shard
  (``test_digits_on_two_nodes_rides_through_a_killed_shard``);
* worker index and the shard map injected by the launcher (every test: each worker reports the
  index it was given);
* a per-role choice between restarting and failing, and finished or restarted workers not
  hanging the job (``test_failed_worker_fails_the_job_at_once``,
  ``test_retried_worker_takes_its_name_over``).

Expected values are independent of the product: the workers' own count of acknowledged pushes,
and closed forms for the ``add`` jobs.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="the Ray tests need Ray: pip install 'paramserver[ray]'")

from paramserver.cli.demos.digits import DigitsJob  # noqa: E402
from paramserver.integrations.ray import RayJobConfig, RayShardGroup  # noqa: E402
from paramserver.worker_client import UpdateRule  # noqa: E402
from tests.harness.ray_cluster import HEAD_IP, NODE_IP, LocalRayCluster, live  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(420)]

REPO = Path(__file__).resolve().parents[2]


def free_port_pair(count: int = 2) -> int:
    """A port p such that p .. p + count - 1 are free on both node addresses right now."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind((HEAD_IP, 0))
            base = int(s.getsockname()[1])
        if base + count - 1 > 65535:
            continue
        try:
            for host in (HEAD_IP, NODE_IP):
                for port in range(base, base + count):
                    with socket.socket() as s:
                        s.bind((host, port))
        except OSError:
            continue
        return base
    raise RuntimeError("no two consecutive free ports")


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalRayCluster]:
    env = dict(os.environ)
    # The Ray workers import this checkout (and these test modules, for the train functions).
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO), str(REPO / "tests"), *filter(None, [env.get("PYTHONPATH")])]
    )
    t0 = time.monotonic()
    with LocalRayCluster(env) as c:
        saved = {k: os.environ.get(k) for k in c.auth_env}
        os.environ.update(c.auth_env)  # this process is a driver of the cluster
        ray.init(address=c.address, log_to_driver=False)
        print(f"\n[ray] 2-node cluster up in {time.monotonic() - t0:.1f} s {c.start_s}")
        try:
            yield c
        finally:
            ray.shutdown()
            for k, value in saved.items():
                if value is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = value
            left = c.stop()
            assert not left, f"cluster processes still running after stop: {sorted(left)}"


def config(tmp_path: Path, **overrides: Any) -> RayJobConfig:
    values: dict[str, Any] = {
        "num_shards": 2,
        "num_workers": 4,
        "replicas": 1,  # one replica per shard: what a restart on the same node restores
        "base_port": free_port_pair(),
        "state_dir": str(tmp_path / "state"),
        "server": {"consistency": "ssp", "staleness": 2, "lease_ms": 5000},
        "shard_max_restarts": 2,
        "retry_deadline_s": 120.0,
        "start_timeout_s": 120.0,
        "job_timeout_s": 240.0,
        "stop_grace_s": 2.0,
    }
    return RayJobConfig(**(values | overrides))


def test_digits_on_two_nodes_rides_through_a_killed_shard(
    cluster: LocalRayCluster, tmp_path: Path
) -> None:
    """2 shards (one per node) + 4 digits workers, SSP(2), periodic checkpoints and the WAL.
    Shard 1's actor is killed mid-run (``ray.kill(no_restart=False)``); Ray restarts it on the
    same node, it binds the same address and restores its checkpoint + log. The job ends with
    every worker done, test accuracy >= 0.93, and on each shard exactly as many applied
    updates as the workers count acknowledged pushes: none lost, none applied twice."""
    t0 = time.monotonic()
    cfg = config(
        tmp_path,
        server={
            "consistency": "ssp",
            "staleness": 2,
            "lease_ms": 5000,
            "checkpoint_every_steps": 20,
        },
    )
    job_spec = DigitsJob(epochs=10, slow_factor=8.0)
    with RayShardGroup(cfg) as shards:
        started = shards.infos()
        start_s = time.monotonic() - t0
        assert {s.node_ip for s in started} == {HEAD_IP, NODE_IP}, started
        for s in started:
            assert s.address == f"{s.node_ip}:{cfg.base_port + s.index}"
            assert s.starts == 1 and s.restored_applied_updates == 0
        shard_pids = {s.pid for s in started}
        job = shards.submit(job_spec)
        t_submit = time.monotonic()

        deadline = time.monotonic() + 180
        while (seen := shards.info(1).applied_updates) < 100:
            assert not job.done(), "the job ended before the kill"
            assert time.monotonic() < deadline, f"shard 1 at {seen} applied updates"
            time.sleep(0.1)
        shards.kill(1)
        t_kill = time.monotonic()
        # ray.kill returns at once: poll until a new process answers (Ray queues the calls
        # made while the actor restarts).
        while (after := shards.info(1, timeout_s=120)).pid == started[1].pid:
            assert time.monotonic() - t_kill < 120, "shard 1 was not restarted"
            time.sleep(0.05)
        restart_s = time.monotonic() - t_kill
        shard_pids.add(after.pid)
        assert after.address == started[1].address and after.node_ip == started[1].node_ip
        assert after.starts == 2
        assert after.restored_applied_updates >= seen, "acknowledged updates lost by the kill"
        assert not job.done(), "the kill did not land mid-run"

        result = job.result()
        train_s = time.monotonic() - t_submit
        assert result.ok, [w.error for w in result.workers]
        assert [w.index for w in result.workers] == [0, 1, 2, 3]
        assert [w.result["worker"] for w in result.workers] == [0, 1, 2, 3]
        acked = sum(int(w.result["steps"]) for w in result.workers)  # each step one push
        assert acked == 4 * 10 * ((1437 // 4) // 32)
        for s in result.shards:
            assert s.applied_updates == acked, (s, acked)
        assert [s.starts for s in result.shards] == [1, 2]
        assert result.metrics["test_accuracy"] >= 0.93, result.metrics
        cluster.track()
    # Teardown: the shard actors' processes are gone, and the ports are free again (a server
    # could bind them: connections of the workers may linger in TIME_WAIT).
    deadline = time.monotonic() + 30
    while live(shard_pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not live(shard_pids), f"shard processes left behind: {live(shard_pids)}"
    for s in result.shards:
        host, port = s.address.rsplit(":", 1)
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a server binds
            sock.bind((host, int(port)))
    print(
        f"\n[ray] digits on 2 nodes, shard 1 killed at {seen} applied updates: shards up in "
        f"{start_s:.1f} s, restart (kill -> restored, serving) {restart_s:.1f} s, "
        f"{after.restored_applied_updates} updates restored, job {train_s:.1f} s, "
        f"test accuracy {result.metrics['test_accuracy']:.4f}, duplicates "
        f"{[s.duplicate_pushes for s in result.shards]}, workers on "
        f"{sorted({w.node_ip or '?' for w in result.workers})}, total "
        f"{time.monotonic() - t0:.1f} s"
    )


# ------------------------------------------------------------ user functions (index injection)
def count_to_ten(ps: Any, worker_index: int, num_workers: int) -> dict[str, Any]:
    """Each worker adds 1 ten times at its own index of ``hits``, then reads it back."""
    ps.init({"hits": np.zeros(num_workers, np.int64)}, UpdateRule("add"))
    one = np.zeros(num_workers, np.int64)
    one[worker_index] = 1
    for _ in range(10):
        ps.push({"hits": one})
        ps.clock()
    return {"index": worker_index, "of": num_workers, "hits": int(ps.pull(["hits"])["hits"][0])}


def fail_on_worker_one(ps: Any, worker_index: int, num_workers: int) -> int:
    """Worker 1 fails at once; the others would wait (almost) forever."""
    if worker_index == 1:
        raise RuntimeError("worker 1 gives up")
    time.sleep(600)
    return worker_index


async def fail_once_then_count(ps: Any, worker_index: int, num_workers: int) -> int:
    """Async train function: worker 0's first attempt dies after registering (so its
    registration is still live when Ray retries it); the retry must take the name over."""
    await ps.init({"n": np.zeros((), np.int64)}, UpdateRule("add"))
    marker = Path(os.environ["PS_TEST_MARKER_DIR"]) / f"attempt-{worker_index}"
    if worker_index == 0 and not marker.exists():
        marker.write_text("1")
        os._exit(3)  # the worker process dies: no Leave, its lease is still running
    await ps.push({"n": np.ones((), np.int64)})
    return worker_index


def test_user_function_gets_its_index_and_the_shard_map(
    cluster: LocalRayCluster, tmp_path: Path
) -> None:
    """A plain ``train(client, worker_index, num_workers)`` on 3 workers: each is told its
    own index and the count, and the shards see 3 x 10 pushes, none lost."""
    with RayShardGroup(config(tmp_path, num_workers=3, server={"consistency": "asp"})) as s:
        result = s.submit(count_to_ten).result(timeout_s=120)
        assert result.ok, [w.error for w in result.workers]
        assert [w.result["index"] for w in result.workers] == [0, 1, 2]
        assert {w.result["of"] for w in result.workers} == {3}
        # "hits" lives on one shard; its applied updates are the 30 pushes of every worker.
        assert sorted(sh.applied_updates for sh in result.shards) == [0, 30]
        assert result.workers[0].result["hits"] == 10


def test_failed_worker_fails_the_job_at_once(cluster: LocalRayCluster, tmp_path: Path) -> None:
    """``worker_failure="fail"``, no retries: worker 1 raising ends the job at once (the
    others, sleeping for 10 minutes, are cancelled), and the result names the failure."""
    cfg = config(tmp_path, num_workers=3, worker_failure="fail")
    t0 = time.monotonic()
    with RayShardGroup(cfg) as shards:
        result = shards.submit(fail_on_worker_one).result(timeout_s=200)
    elapsed = time.monotonic() - t0
    assert not result.ok
    assert "worker 1 gives up" in (result.workers[1].error or "")
    assert [w.ok for w in result.workers] == [False, False, False]
    assert elapsed < 150, f"the job hung for {elapsed:.0f} s after a worker failed"


def test_retried_worker_takes_its_name_over(cluster: LocalRayCluster, tmp_path: Path) -> None:
    """``worker_max_retries=1``: worker 0's process dies (no Leave) after registering; Ray
    re-runs the task, whose client registers with ``replace=True`` and fences the dead
    registration at once (lease 60 s: waiting it out would outlast the test), so the job
    finishes with each worker's one push applied once (the dead try pushed nothing)."""
    marker_dir = tmp_path / "markers"
    marker_dir.mkdir()
    cfg = config(
        tmp_path,
        num_workers=2,
        worker_max_retries=1,
        server={"consistency": "asp", "lease_ms": 60000},
        worker_env={"PS_TEST_MARKER_DIR": str(marker_dir)},
    )
    with RayShardGroup(cfg) as shards:
        result = shards.submit(fail_once_then_count).result(timeout_s=150)
    assert result.ok, [w.error for w in result.workers]
    assert (marker_dir / "attempt-0").exists(), "worker 0's first attempt did not run"
    assert sorted(sh.applied_updates for sh in result.shards) == [0, 2]


def test_ray_launch_command_runs_the_digits_job(cluster: LocalRayCluster, tmp_path: Path) -> None:
    """``paramserver ray-launch`` (a driver process of its own) on the running cluster: 2
    shards, 2 digits workers, the default replicas (2 on this 2-node cluster: each shard's
    primary and backup on different nodes, the backup in sync); it prints the job result as
    JSON and exits 0 (accuracy >= 0.93)."""
    import json
    import subprocess
    import sys

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    env.update(cluster.auth_env)
    cmd = [
        sys.executable,
        "-m",
        "paramserver",
        "--log-level",
        "WARNING",
        "ray-launch",
        *("--address", cluster.address, "--shards", "2", "--workers", "2"),
        *("--base-port", str(free_port_pair(4)), "--state-dir", str(tmp_path / "state")),
        *("--serve-args", "--consistency bsp"),
        *("--name", "cli-job", "--timeout-s", "200"),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["ok"] is True
    assert [w["index"] for w in result["workers"]] == [0, 1]
    assert result["replicas"] == 2 and result["failovers"] == 0
    for s in result["shards"]:
        assert s["role"] == "primary" and s["in_sync"] == [0, 1], s
    assert result["metrics"]["test_accuracy"] >= 0.93
    acked = sum(int(w["result"]["steps"]) for w in result["workers"])
    assert [s["applied_updates"] for s in result["shards"]] == [acked, acked]
