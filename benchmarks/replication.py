"""Shard replicas: the cost of replication and the time a failover takes, in one run.

**Cost.** One ASP shard holding one float32 tensor of N elements (rule ``add``, ``--wal`` in
every configuration, since a replicated shard needs it), W concurrent workers in this process
each calling ``push_pull`` (push a gradient, pull the value) for a fixed time; replicas 1
(the baseline) vs 2 (the primary acknowledges once the backup holds the push durably). Both
replicas run on this host, so the backup competes with the primary for the same cores and
disk. After each run the shard's applied count is checked against the pushes acknowledged.

**Failover.** ``local_cluster(shards=1, replicas=2)`` with a private etcd (lease 1 s); one
worker pushes continuously; the primary is SIGKILLed and its state directory deleted; the time
from the kill to the first push acknowledged by the new primary is measured (the worker's
client finds it by itself), then the killed replica is restarted (seeded again) for the next
round. Needs an ``etcd`` binary (Debian: ``apt-get install etcd-server``); skipped without.

    python benchmarks/replication.py [--quick] [--model resnet50]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import signal
import tempfile
import time
import uuid
from typing import Any

import numpy as np
from benchlib import emit, machine_info, print_table, quick_from_env, timed_calls
from benchlib.models import MODELS, shapes

from paramserver.cli.demos.local_cluster import local_cluster
from paramserver.cli.demos.local_etcd import etcd_binary
from paramserver.worker_client import UpdateRule


def tensors_of(model: str | None) -> dict[str, np.ndarray]:
    """The pushed tensors: one of 1e6 float32, or every parameter of ``model`` (its real
    shapes, e.g. ResNet-50's 161 tensors, 25.6M float32)."""
    if model is None:
        return {"w": np.zeros(1_000_000, np.float32)}
    return {f"p{i:03d}": np.zeros(shape, np.float32) for i, shape in enumerate(shapes(model))}


async def _push_pull_for(
    cluster: Any, tensors: dict[str, np.ndarray], workers: int, seconds: float
) -> tuple[int, float]:
    grads = {k: np.ones_like(v) for k, v in tensors.items()}
    keys = list(tensors)
    clients = [cluster.connect(f"bench-{i}") for i in range(workers)]
    for c in clients:
        await c.open()
    try:
        await clients[0].init(tensors, UpdateRule("add"))
        return await timed_calls(clients, lambda c: c.push_pull(grads, keys), seconds)
    finally:
        for c in clients:
            await c.close()


def _rate(replicas: int, tensors: dict[str, np.ndarray], workers: int, seconds: float) -> float:
    with tempfile.TemporaryDirectory(prefix="paramserver-repl-bench-") as tmp:
        flags: dict[str, Any] = {"wal": True}
        if replicas == 1:
            flags["checkpoint_dir"] = tmp
        with local_cluster(
            consistency="asp", replicas=replicas, state_dir=tmp, election="none", **flags
        ) as c:
            time.sleep(1.0)  # the backup's seed (an empty shard) before timing
            pushes, elapsed = asyncio.run(_push_pull_for(c, tensors, workers, seconds))
    return pushes / elapsed


def cost(quick: bool, model: str | None = None) -> list[list[Any]]:
    """Replicas 1 and 2 alternately (the load of a shared machine drifts): the medians."""
    tensors = tensors_of(model)
    n = sum(t.size for t in tensors.values())
    seconds = 3.0 if quick else 8.0
    rounds = 2 if quick else 3
    workers = 2
    rates: dict[int, list[float]] = {1: [], 2: []}
    for r in range(rounds):
        for replicas in (1, 2):
            rate = _rate(replicas, tensors, workers, seconds)
            rates[replicas].append(rate)
            emit(
                {
                    "benchmark": "replication_cost",
                    "round": r,
                    "model": model or "1e6",
                    "n_elements": n,
                    "workers": workers,
                    "replicas": replicas,
                    "push_pulls_per_s": round(rate, 2),
                }
            )
    median = {k: float(np.median(v)) for k, v in rates.items()}
    rows = []
    for replicas, rate in median.items():
        ratio = rate / median[1]
        emit(
            {
                "benchmark": "replication_cost",
                "model": model or "1e6",
                "replicas": replicas,
                "median": round(rate, 2),
                "relative_to_1_replica": round(ratio, 3),
            }
        )
        rows.append([replicas, f"{rate:.1f}", f"{rate * n * 8 / 1e6:.0f}", f"{ratio:.2f}"])
    return rows


async def _one_failover(cluster: Any) -> float:
    victim = cluster.primary(0)
    assert victim is not None
    async with cluster.connect(f"failover-{uuid.uuid4().hex[:6]}") as ps:
        await ps.init({"f": np.zeros(16, np.float32)}, UpdateRule("add"))
        for _ in range(20):
            await ps.push({"f": np.ones(16, np.float32)})
        # The backup must be in sync before the kill, or there is nobody to take over.
        for _ in range(600):
            if cluster.in_sync(0) == [0, 1]:
                break
            await asyncio.sleep(0.05)
        else:
            raise RuntimeError("the backup did not come in sync within 30 s")
        proc = cluster.process(0, victim)
        proc.send_signal(signal.SIGKILL)
        t_kill = time.monotonic()
        proc.wait()
        shutil.rmtree(cluster.replica_dir(0, victim))
        await ps.push({"f": np.ones(16, np.float32)})
        took = time.monotonic() - t_kill
    cluster.restart(0, victim)
    return took


def failover(quick: bool) -> list[float]:
    rounds = 3 if quick else 5
    times: list[float] = []
    with (
        tempfile.TemporaryDirectory(prefix="paramserver-failover-bench-") as tmp,
        local_cluster(consistency="asp", replicas=2, state_dir=tmp, election="etcd") as cluster,
    ):
        while cluster.primary(0) is None:
            time.sleep(0.05)
        for _ in range(rounds):
            took = asyncio.run(_one_failover(cluster))
            times.append(took)
            emit({"benchmark": "failover", "kill_to_first_ack_s": round(took, 3)})
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--model",
        action="append",
        choices=MODELS,
        help="also measure the cost with this model's parameter shapes (repeatable)",
    )
    args = parser.parse_args()
    quick = args.quick or quick_from_env()
    emit({"benchmark": "replication", "machine": machine_info()})
    print_table(
        "Replication cost (ASP push_pull of 1e6 float32, 2 workers, --wal; medians)",
        ["replicas", "push_pulls/s", "MB/s (both ways)", "vs 1 replica"],
        cost(quick),
    )
    for model in args.model or []:
        print_table(
            f"Replication cost ({model}'s parameters, 2 workers, --wal; medians)",
            ["replicas", "push_pulls/s", "MB/s (both ways)", "vs 1 replica"],
            cost(quick, model),
        )
    if etcd_binary() is None:
        emit({"benchmark": "failover", "skipped": "no etcd binary"})
        return
    times = failover(quick)
    print_table(
        "Failover: SIGKILL of the primary (and its state dir) to the first acknowledged push",
        ["rounds", "min s", "median s", "max s"],
        [
            [
                len(times),
                f"{min(times):.2f}",
                f"{sorted(times)[len(times) // 2]:.2f}",
                f"{max(times):.2f}",
            ]
        ],
    )


if __name__ == "__main__":
    main()
