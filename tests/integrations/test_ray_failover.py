"""Losing a Ray node that holds a shard's primary, mid-training (issue 31, items 3 and 7).

A 4-node Ray cluster on this machine: the head (127.0.0.2, no CPUs: it runs the driver and the
job's authority actor only) and three nodes with CPUs (127.0.0.3-5). The job has 2 shards with
2 replicas each (each shard's replicas on different nodes) and 3 digits workers that Ray may
retry. Mid-training the test kills the whole node that holds a shard's primary (its ``ray
start`` process group and every process on it) **and deletes that replica's state
directory**. Then:

* that shard's backup is promoted within seconds (measured: kill -> the new primary applies);
* Ray places the lost replica again on the third node, where it is seeded from the new
  primary (no shared disk) and comes back in sync;
* worker tasks that ran on the lost node are retried by Ray and skip the batches already done;
* the job ends ok with every shard's applied updates equal to the planned count (workers x
  epochs x steps: nothing lost, nothing applied twice), and its result counts the failover
  and the retried workers.

Expected values come from the job's plan, not from the product.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="the Ray tests need Ray: pip install 'paramserver[ray]'")

from paramserver.cli.demos.digits import DigitsJob  # noqa: E402
from paramserver.integrations.ray import RayJobConfig, RayShardGroup  # noqa: E402
from tests.harness.ray_cluster import HEAD_IP, NODE3_IP, LocalRayCluster  # noqa: E402
from tests.harness.timing import scaled  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
WORKERS = 3
EPOCHS = 10
BATCH = 32


def free_base_port(count: int) -> int:
    import socket

    from tests.harness.ray_cluster import NODES

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


@pytest.fixture()  # a fresh cluster per test: each test loses one of its nodes
def cluster() -> Iterator[LocalRayCluster]:
    with _ray_cluster(nodes=4) as c:
        yield c


@pytest.fixture()
def cluster5() -> Iterator[LocalRayCluster]:
    """Five nodes (four with CPUs): two can be lost one after the other and each lost
    replica still finds a node without a replica of its shard."""
    with _ray_cluster(nodes=5) as c:
        yield c


@contextmanager
def _ray_cluster(nodes: int) -> Iterator[LocalRayCluster]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    # Ray declares a node dead after ~3 missed health checks of 1 s (default ~15-30 s).
    env |= {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3"}
    env |= {"RAY_health_check_timeout_ms": "1000", "RAY_health_check_initial_delay_ms": "1000"}
    t0 = time.monotonic()
    # 4 CPUs a node: the two nodes left after the loss hold every replica, the lost one
    # placed again, and every worker task, retried ones included.
    with LocalRayCluster(env, num_cpus=4, nodes=nodes, head_cpus=0, timeout_s=300) as c:
        saved = {k: os.environ.get(k) for k in c.auth_env}
        os.environ.update(c.auth_env)
        ray.init(address=c.address, log_to_driver=False)
        print(f"\n[ray] {nodes}-node cluster up in {time.monotonic() - t0:.1f} s {c.start_s}")
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


def _job_config(
    tmp_path: Path, server: dict[str, object], name: str, worker_retries: int, timeout_s: float
) -> RayJobConfig:
    """2 shards x 2 replicas, WORKERS workers Ray may retry ``worker_retries`` times."""
    return RayJobConfig(
        num_shards=2,
        num_workers=WORKERS,
        replicas=2,
        base_port=free_base_port(4),
        state_dir=str(tmp_path / "state"),
        server=server,
        shard_max_restarts=3,
        worker_max_retries=worker_retries,
        retry_deadline_s=scaled(120.0),
        start_timeout_s=scaled(180.0),
        job_timeout_s=scaled(timeout_s),
        stop_grace_s=2.0,
        name=name,
    )


@pytest.mark.parametrize("consistency", ["ssp", "bsp"])
def test_losing_the_node_of_a_primary_loses_nothing(
    cluster: LocalRayCluster, tmp_path: Path, consistency: str
) -> None:
    server = {"consistency": consistency, "lease_ms": 20_000, "election_ttl_s": 2}
    if consistency == "ssp":
        server["staleness"] = 2
    cfg = _job_config(tmp_path, server, f"failover-{consistency}", 3, 600.0)
    from paramserver.cli.demos.digits import load_digits_split

    steps = max(1, (len(load_digits_split(0).y_train) // WORKERS) // BATCH)
    planned = WORKERS * EPOCHS * steps
    job_spec = DigitsJob(epochs=EPOCHS, batch_size=BATCH, hidden=16, slow_factor=3.0)
    with RayShardGroup(cfg) as shards:
        before = shards.replica_infos()
        for i in range(2):  # each shard's replicas on different nodes
            assert len({r.node_ip for r in before[i] if r is not None}) == 2, before[i]
        job = shards.submit(job_spec)
        deadline = time.monotonic() + scaled(300.0)
        # the shard to lose: the busier one (which keys a shard holds is the hash's choice)
        while max(s.applied_updates for s in shards.infos()) < planned // 3:
            assert not job.done(), f"the job ended before the kill: {job.result().to_json()}"
            assert time.monotonic() < deadline, "training did not reach a third of its plan"
            time.sleep(0.2)
        lose = max(range(2), key=lambda i: shards.info(i).applied_updates)
        first = shards.primary(lose)
        assert first is not None
        lost_ip = before[lose][first["index"]].node_ip  # type: ignore[union-attr]
        assert lost_ip != HEAD_IP
        seen = shards.info(lose).applied_updates
        t_kill = time.monotonic()
        cluster.kill_node(lost_ip)
        lost_dir = Path(cfg.state_dir or "") / f"shard-{lose}" / f"replica-{first['index']}"
        shutil.rmtree(lost_dir, ignore_errors=True)  # its disk went with the node
        # Failover: the backup is primary under a higher epoch and applies new pushes.
        while True:
            now = shards.primary(lose)
            if now is not None and now["index"] != first["index"]:
                info = shards.info(lose, timeout_s=30.0)
                if info.applied_updates > seen:
                    break
            assert time.monotonic() - t_kill < scaled(60.0), "no failover"
            time.sleep(0.05)
        failover_s = time.monotonic() - t_kill
        assert now["epoch"] > first["epoch"]
        assert info.restored_applied_updates == 0 or info.applied_updates >= seen
        result = job.result()
        # The lost replica is placed again on the third node and seeded: back in sync.
        deadline = time.monotonic() + scaled(180.0)
        while True:
            infos = shards.replica_infos()
            back = infos[lose][first["index"]]
            primary = infos[lose][now["index"]]
            if back is not None and primary is not None and primary.in_sync == [0, 1]:
                break
            if time.monotonic() > deadline:
                from ray.util.placement_group import placement_group_table

                raise AssertionError(
                    f"the lost replica never came back: {infos[lose]}; its placement group: "
                    f"{placement_group_table(shards._pgs[lose])}; free: "
                    f"{ray.available_resources()}"
                )
            time.sleep(0.5)
    assert result.ok, result.to_json()
    assert back.node_ip not in (lost_ip, HEAD_IP) and back.role == "backup"
    assert back.node_ip == NODE3_IP or back.node_ip != primary.node_ip
    assert result.failovers >= 1
    for shard in result.shards:  # every push reaches every shard that holds a key
        assert shard.applied_updates in (0, planned), (shard, planned)
    assert result.shards[lose].applied_updates == planned
    retried = result.retried_workers
    print(
        f"\n[ray] {consistency}: shard {lose}'s primary node {lost_ip} killed at {seen}/{planned} "
        f"applied; failover (kill -> new primary applies) {failover_s:.2f} s; workers retried "
        f"{retried}; lost replica back on {back.node_ip}; elapsed {result.elapsed_s:.1f} s"
    )


def _in_sync_again(shards: RayShardGroup, shard: int, lost_index: int) -> tuple[object, object]:
    """Wait until the replica ``lost_index`` of ``shard`` is back (placed again) and in sync;
    returns (that replica's info, the primary's info)."""
    deadline = time.monotonic() + scaled(180.0)
    while True:
        infos = shards.replica_infos()
        primary = next((r for r in infos[shard] if r is not None and r.role == "primary"), None)
        back = infos[shard][lost_index]
        if back is not None and primary is not None and primary.in_sync == [0, 1]:
            return back, primary
        assert time.monotonic() < deadline, f"replica {lost_index} never came back: {infos}"
        time.sleep(0.5)


def test_losing_two_nodes_one_after_the_other_loses_nothing(
    cluster5: LocalRayCluster, tmp_path: Path
) -> None:
    """SSP(2). The node of shard S's primary is killed (its state directory deleted); the
    backup is promoted and the lost replica is placed again on another node and seeded; the
    workers' clients learn its new address from their heartbeats. Then the node of S's new
    primary is killed too: the replica that moved is promoted, and the workers reach it at
    its new address. The job ends ok with every shard's applied updates equal to the plan."""
    lease_ms = 8_000  # clients heartbeat every lease / 4 = 2 s: they follow a move within it
    server = {"consistency": "ssp", "staleness": 2, "lease_ms": lease_ms, "election_ttl_s": 2}
    cfg = _job_config(tmp_path, server, "failover-twice", 6, 900.0)
    from paramserver.cli.demos.digits import load_digits_split

    # long enough for two losses with a re-placement in between (~80 s on an idle 2-core host;
    # a 30-epoch job once ended before the second loss)
    epochs = 10 * EPOCHS
    steps = max(1, (len(load_digits_split(0).y_train) // WORKERS) // BATCH)
    planned = WORKERS * epochs * steps
    job_spec = DigitsJob(epochs=epochs, batch_size=BATCH, hidden=16, slow_factor=3.0)
    state = Path(cfg.state_dir or "")
    with RayShardGroup(cfg) as shards:
        job = shards.submit(job_spec)
        deadline = time.monotonic() + scaled(300.0)
        while max(s.applied_updates for s in shards.infos()) < planned // 20:
            assert not job.done(), f"the job ended before the kill: {job.result().to_json()}"
            assert time.monotonic() < deadline, "training did not reach a twentieth of its plan"
            time.sleep(0.2)
        lose = max(range(2), key=lambda i: shards.info(i).applied_updates)
        killed: list[str] = []
        for loss in (1, 2):
            first = shards.primary(lose)
            assert first is not None
            victim = shards.replica_infos()[lose][first["index"]]
            assert victim is not None and victim.node_ip != HEAD_IP
            assert not job.done(), f"the job ended before loss {loss}: {job.result().to_json()}"
            cluster5.kill_node(victim.node_ip)
            killed.append(victim.node_ip)
            shutil.rmtree(state / f"shard-{lose}" / f"replica-{first['index']}", True)
            t_kill = time.monotonic()
            while True:  # the other replica is promoted and applies new pushes
                now = shards.primary(lose)
                if now is not None and now["index"] != first["index"]:
                    break
                assert time.monotonic() - t_kill < scaled(60.0), f"no failover at loss {loss}"
                time.sleep(0.05)
            assert now["epoch"] > first["epoch"]
            print(f"\n[ray] loss {loss}: {victim.node_ip} killed, new primary after "
                  f"{time.monotonic() - t_kill:.2f} s")  # fmt: skip
            if loss == 1:
                back, _ = _in_sync_again(shards, lose, first["index"])
                assert back.node_ip not in killed  # type: ignore[attr-defined]
                # every worker's client has heard of the moved replica from a heartbeat
                time.sleep(scaled(2 * lease_ms / 4000.0 + 1.0))
        result = job.result()
    assert result.ok, result.to_json()
    assert result.failovers >= 2
    for shard in result.shards:
        assert shard.applied_updates in (0, planned), (shard, planned)
    assert result.shards[lose].applied_updates == planned
    print(
        f"\n[ray] two losses on shard {lose} ({killed}); applied {planned}/{planned}; "
        f"workers retried {result.retried_workers}; elapsed {result.elapsed_s:.1f} s"
    )
