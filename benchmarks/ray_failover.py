"""Failover on Ray when a node is lost: the time from the kill to the first push applied at the
new primary, with Ray's own node-death handling, exactly-once checked.

Each round starts a fresh 4-node Ray cluster on this host (a head without CPUs for the driver
and the job's authority actor, three nodes with 4 CPUs on 127.0.0.3-5; health checks every
second), launches the digits job (2 shards x 2 replicas, 3 workers, SSP(2), Ray retries worker
tasks), waits until a third of the planned updates are applied, then kills the whole node
that holds the busier shard's primary (its ``ray start`` process group and everything on it)
and deletes that replica's state directory. Measured: seconds from the kill to the first push
applied at the promoted backup (``failover_s``), to the lost replica back in sync on another
node (``reseeded_s``), and the job's end. Verified: every shard's applied updates equal the
planned count (workers x epochs x steps), so nothing acknowledged was lost and nothing applied
twice, retried workers included.

    python benchmarks/ray_failover.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchlib import emit, machine_info, print_table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the tests' Ray cluster harness (starts and stops by PID)

import ray  # noqa: E402

from paramserver.cli.demos.digits import DigitsJob, load_digits_split  # noqa: E402
from paramserver.integrations.ray import RayJobConfig, RayShardGroup  # noqa: E402
from tests.harness.ray_cluster import HEAD_IP, NODES, LocalRayCluster  # noqa: E402

WORKERS, EPOCHS, BATCH = 3, 10, 32


def free_base_port(count: int) -> int:
    import socket

    for _ in range(200):
        with socket.socket() as s:
            s.bind((HEAD_IP, 0))
            base = int(s.getsockname()[1])
        if base + count > 65535:
            continue
        try:
            for _, host in NODES:
                for port in range(base, base + count):
                    with socket.socket() as s:
                        s.bind((host, port))
        except OSError:
            continue
        return base
    raise RuntimeError("no free port range")


def one_round(state: Path) -> dict[str, Any]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env |= {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3"}
    env |= {"RAY_health_check_timeout_ms": "1000", "RAY_health_check_initial_delay_ms": "1000"}
    steps = max(1, (len(load_digits_split(0).y_train) // WORKERS) // BATCH)
    planned = WORKERS * EPOCHS * steps
    with LocalRayCluster(env, num_cpus=4, nodes=4, head_cpus=0, timeout_s=300) as cluster:
        os.environ.update(cluster.auth_env)
        ray.init(address=cluster.address, log_to_driver=False)
        try:
            cfg = RayJobConfig(
                num_shards=2,
                num_workers=WORKERS,
                replicas=2,
                base_port=free_base_port(4),
                state_dir=str(state),
                server={"consistency": "ssp", "staleness": 2, "lease_ms": 20_000},
                worker_max_retries=3,
                job_timeout_s=900.0,
                stop_grace_s=2.0,
                name="bench-failover",
            )
            with RayShardGroup(cfg) as shards:
                before = shards.replica_infos()
                job = shards.submit(DigitsJob(epochs=EPOCHS, batch_size=BATCH, hidden=16,
                                              slow_factor=3.0))  # fmt: skip
                while max(s.applied_updates for s in shards.infos()) < planned // 3:
                    if job.done():
                        raise RuntimeError(f"the job ended early: {job.result().to_json()}")
                    time.sleep(0.2)
                lose = max(range(2), key=lambda i: shards.info(i).applied_updates)
                first = shards.primary(lose)
                assert first is not None
                lost = before[lose][first["index"]]
                assert lost is not None and lost.node_ip != HEAD_IP
                seen = shards.info(lose).applied_updates
                t_kill = time.monotonic()
                cluster.kill_node(lost.node_ip)
                shutil.rmtree(state / f"shard-{lose}" / f"replica-{first['index']}", True)
                while True:
                    now = shards.primary(lose)
                    if now is not None and now["index"] != first["index"]:
                        if shards.info(lose, timeout_s=30.0).applied_updates > seen:
                            break
                    if time.monotonic() - t_kill > 120:
                        raise RuntimeError("no failover within 120 s")
                    time.sleep(0.02)
                failover_s = time.monotonic() - t_kill
                reseeded_s = None
                while reseeded_s is None and time.monotonic() - t_kill < 300:
                    infos = shards.replica_infos()
                    back, primary = infos[lose][first["index"]], infos[lose][now["index"]]
                    if back is not None and primary is not None and primary.in_sync == [0, 1]:
                        reseeded_s = time.monotonic() - t_kill
                    time.sleep(0.2)
                result = job.result()
        finally:
            ray.shutdown()
    applied = [s.applied_updates for s in result.shards]
    return {
        "lost_node": lost.node_ip,
        "killed_at_applied": seen,
        "planned": planned,
        "applied": applied,
        "exactly_once": result.ok and applied[lose] == planned and set(applied) <= {0, planned},
        "failover_s": round(failover_s, 3),
        "reseeded_s": None if reseeded_s is None else round(reseeded_s, 3),
        "retried_workers": result.retried_workers,
        "failovers": result.failovers,
        "job_s": result.elapsed_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    emit({"machine": machine_info(), "load_avg_1m": os.getloadavg()[0]})
    rows = []
    for r in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="psray-bench-") as tmp:
            out = one_round(Path(tmp))
        emit({"round": r, **out, "load_avg_1m": round(os.getloadavg()[0], 2)})
        rows.append([r, out["failover_s"], out["reseeded_s"], out["retried_workers"],
                     out["exactly_once"]])  # fmt: skip
    print_table(
        "Ray node loss (kill -> first push applied at the new primary)",
        ["round", "failover s", "lost replica in sync s", "retried workers", "exactly once"],
        rows,
    )


if __name__ == "__main__":
    main()
