"""Push+pull throughput of a 64 MiB model against 1, 2 and 4 parameter-server shards.

For each shard count S, starts S ``paramserver serve`` processes on 127.0.0.1 (ASP, so no
consistency wait is timed; 4 MiB slices; SGD applied on every push), then W worker processes
(spawned) that each declare the same model (8 float32 keys of 8 MiB, each sliced in 2), warm
up, meet at a barrier and run R rounds of ``push(all keys)`` + ``pull(all keys)``. Reported per
configuration, one JSON line:

- ``push_pull_gbps``: bytes pushed + pulled by all workers / wall time from the earliest start
  to the latest end (GB = 1e9 bytes);
- ``push_s_median`` / ``pull_s_median``: median time of one worker's full-model push / pull.

The worker client routes each slice to its shard and talks to all shards concurrently; one
shard process is one core at most (the GIL), so more shards help as long as the machine has
cores for them and the workers.

Usage: ``python benchmarks/shards_throughput.py [--shards 1,2,4] [--workers 4] [--rounds 5]
[--quick]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

KEYS = 8
KEY_BYTES = 8 << 20


def _model() -> dict[str, np.ndarray]:
    return {f"layer{i}/weight": np.zeros(KEY_BYTES // 4, np.float32) for i in range(KEYS)}


def _worker(address: str, index: int, rounds: int, barrier: Any, out: Any) -> None:
    from paramserver.worker_client import UpdateRule, connect

    async def main() -> dict[str, Any]:
        async with connect(address, f"bench-{index}", rpc_timeout_s=600.0) as ps:
            model = _model()
            keys = sorted(model)
            await ps.init(model, rule=UpdateRule("sgd", lr=1e-6))
            grads = {k: np.full_like(v, 1e-3) for k, v in model.items()}
            await ps.push(grads)
            await ps.pull(keys)
            await asyncio.get_running_loop().run_in_executor(None, barrier.wait)
            pushes, pulls = [], []
            t0 = time.monotonic()
            for _ in range(rounds):
                a = time.monotonic()
                await ps.push(grads)
                b = time.monotonic()
                await ps.pull(keys)
                pulls.append(time.monotonic() - b)
                pushes.append(b - a)
            return {"t0": t0, "t1": time.monotonic(), "pushes": pushes, "pulls": pulls}

    try:
        out.put(asyncio.run(main()))
    except BaseException as exc:  # report, never hang the parent
        out.put({"error": repr(exc)})


def run(shards: int, workers: int, rounds: int) -> dict[str, Any]:
    from paramserver.cli.demos.local_cluster import start_servers, stop_servers

    serve = [sys.executable, "-m", "paramserver", "--log-level", "WARNING", "serve"]
    serve += ["--consistency", "asp", "--max-inflight-push-bytes", str(4 << 30)]
    with tempfile.TemporaryDirectory(prefix="bench-shards-") as tmp:
        procs, addresses = start_servers(serve, shards, Path(tmp))
        try:
            ctx = mp.get_context("spawn")
            barrier = ctx.Barrier(workers)
            out = ctx.Queue()
            ps = [
                ctx.Process(target=_worker, args=(addresses[i % shards], i, rounds, barrier, out))
                for i in range(workers)
            ]
            for p in ps:
                p.start()
            results = [out.get(timeout=900) for _ in ps]
            for p in ps:
                p.join(timeout=60)
        finally:
            stop_servers(procs)
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        return {"shards": shards, "workers": workers, "error": errors[0]}
    wall = max(r["t1"] for r in results) - min(r["t0"] for r in results)
    moved = 2 * workers * rounds * KEYS * KEY_BYTES
    return {
        "benchmark": "shards_throughput",
        "shards": shards,
        "workers": workers,
        "model_mib": KEYS * KEY_BYTES / (1 << 20),
        "slice_mib": 4,
        "rounds": rounds,
        "wall_s": round(wall, 3),
        "push_pull_gbps": round(moved / wall / 1e9, 3),
        "push_s_median": round(statistics.median(x for r in results for x in r["pushes"]), 4),
        "pull_s_median": round(statistics.median(x for r in results for x in r["pulls"]), 4),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", default="1,2,4", help="comma-separated shard counts")
    parser.add_argument("--workers", type=int, default=4, help="worker processes")
    parser.add_argument("--rounds", type=int, default=5, help="timed push+pull rounds")
    parser.add_argument("--quick", action="store_true", help="1 worker, 1 round (smoke run)")
    args = parser.parse_args()
    quick = args.quick or os.environ.get("PARAMSERVER_BENCH_QUICK", "") in ("1", "true", "yes")
    workers, rounds = (1, 1) if quick else (args.workers, args.rounds)
    for shards in (int(s) for s in args.shards.split(",") if s):
        print(json.dumps(run(shards, workers, rounds)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
