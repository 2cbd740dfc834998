"""Worker-side row cache (HET's bounded staleness): rows pulled over the wire and model quality,
no cache (s = 0) beside s = 1 and s = 2, in one run on the same server build.

Task (synthetic, with a known optimum): V = 100,000 ids, each with a hidden vector
``w*_id ~ N(0, I_16 / 16)``; a sample is an id drawn from Zipf(1.05) over the ids
(``(zipf(1.05) - 1) mod V``), a feature vector ``x ~ N(0, I_16)`` and a target
``y = w*_id . x + noise`` (noise N(0, 0.1^2)). The model is one table of 16-dim rows (zeros at
start, rule sgd, lr 0.05) learned by W = 2 workers (async clients in one process, each with its
own cache) on batches of 4,096 samples: pull the batch's rows, gradient ``(w_id . x - y) x``
per sample (summed per id by the server), push, clock. Test metric: mean squared error on
20,000 held-out samples from the same distribution, read from the server after training (the
Bayes optimum is the noise variance, 0.01; ids too rare to have been trained keep their error
``|w*|^2 ~ 1``, which is why the test MSE sits above it).

Reported per staleness s: ``rows_pulled`` (distinct rows sent over the wire, all workers),
``rows_requested`` (distinct rows the workers read), ``hit_rate``, ``rows_validated`` (cached
rows whose version the cache sent for validation), ``payload_bytes`` (ids, versions, rows and
bitmaps both ways), ``rows_pushed``, ``wall_s`` and ``test_mse``; then ``pulled_ratio_s2``
(rows pulled at s = 2 / at s = 0; target <= 0.5), ``payload_bytes_ratio_s2`` (the same for
``payload_bytes``) and
``mse_rel_diff_s2`` (|MSE(s=2) - MSE(s=0)| / MSE(s=0); target <= 0.01), and
``pulled_ratio_s2_vs_ids_sent`` (rows pulled at s = 2 / the ids a plain ``pull_rows`` of every
batch would send, duplicates included). Run for Zipf(1.05) (the issue's workload) and, for
contrast, Zipf(1.2).

Usage: ``python benchmarks/row_cache.py [--quick] [--steps 60] [--staleness 0,1,2]
[--zipf 1.05,1.2]``; prints one
JSON line per configuration and a summary line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

V, DIM, LR, NOISE = 100_000, 16, 0.05, 0.1


def _data(
    seed: int, n: int, truth: np.ndarray, alpha: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = ((rng.zipf(alpha, n) - 1) % V).astype(np.int64)
    x = rng.normal(size=(n, DIM)).astype(np.float32)
    y = (np.einsum("nd,nd->n", truth[ids], x) + NOISE * rng.normal(size=n)).astype(np.float32)
    return ids, x, y


async def _run(
    address: str, s: int, steps: int, batch: int, workers: int, alpha: float
) -> dict[str, Any]:
    from paramserver.core.tables import Initializer, TableRule, TableSpec
    from paramserver.worker_client import connect
    from paramserver.worker_client.row_cache import RowCache

    truth = np.random.default_rng(0).normal(size=(V, DIM)).astype(np.float32) / np.sqrt(DIM)
    table = f"emb_a{alpha}_s{s}"
    spec = TableSpec(table, DIM, rule=TableRule("sgd", lr=LR), initializer=Initializer("zeros"))

    async def worker(k: int) -> RowCache:
        async with connect(address, worker_name=f"w{k}-{table}") as ps:
            await ps.init_table(spec)
            cache = RowCache(ps, staleness=s)
            for step in range(steps):
                ids, x, y = _data(1000 * k + step, batch, truth, alpha)
                rows = (await cache.pull_rows_many({table: ids}))[table]
                err = np.einsum("nd,nd->n", rows, x) - y
                grads = (err[:, None] * x / np.float32(batch)).astype(np.float32)
                await cache.push_rows_many({table: ids}, {table: grads})
                await cache.clock()
            await cache.flush()
            return cache

    t0 = time.monotonic()
    caches = await asyncio.gather(*(worker(k) for k in range(workers)))
    wall = time.monotonic() - t0
    ids, x, y = _data(999_999, 20_000, truth, alpha)
    async with connect(address, worker_name=f"reader-{table}") as ps:
        rows = await ps.pull_rows(table, ids, observer=True)
    mse = float(np.mean((np.einsum("nd,nd->n", rows, x) - y) ** 2))
    st = [c.stats for c in caches]
    requested = sum(x.rows_requested for x in st)
    hits = sum(x.rows_hit for x in st)
    return {
        "benchmark": "row_cache",
        "zipf": alpha,
        "staleness": s,
        "workers": workers,
        "steps": steps,
        "batch": batch,
        "rows_requested": requested,
        "rows_pulled": sum(x.rows_pulled for x in st),
        "hit_rate": round(hits / requested, 4) if requested else 0.0,
        "rows_validated": sum(x.rows_validated for x in st),
        # row payload bytes both ways: ids (8 B) out; rows (4 * DIM B) back; with s >= 1 also
        # a held version (8 B) out per cached id and a version (8 B) back per row sent, plus
        # the resent bitmap (1 bit an id)
        "payload_bytes": _payload_bytes(st, s),
        "rows_pushed": sum(x.rows_pushed for x in st),
        "wall_s": round(wall, 3),
        "test_mse": round(mse, 6),
    }


def _payload_bytes(stats: list[Any], s: int) -> int:
    req = sum(x.rows_requested for x in stats)
    pulled = sum(x.rows_pulled for x in stats)
    if s == 0:
        return 8 * req + 4 * DIM * pulled
    validated = sum(x.rows_validated for x in stats)
    return 8 * req + 8 * validated + (4 * DIM + 8) * pulled + (req + 7) // 8


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="8 steps of 1,024 samples")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--staleness", default="0,1,2")
    p.add_argument("--zipf", default="1.05,1.2", help="Zipf exponents (1.05: the issue's)")
    args = p.parse_args(argv)
    steps, batch = (8, 1024) if args.quick else (args.steps, args.batch)
    levels = [int(v) for v in args.staleness.split(",")]
    alphas = [float(v) for v in args.zipf.split(",")]

    from paramserver.cli.demos.local_cluster import start_servers, stop_servers

    serve = [sys.executable, "-m", "paramserver", "--log-level", "WARNING", "serve"]
    serve += ["--consistency", "asp"]
    results: dict[tuple[float, int], dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-row-cache-") as tmp:
        procs, addresses = start_servers(serve, 1, Path(tmp))
        try:
            for alpha in alphas:
                for s in levels:
                    got = asyncio.run(_run(addresses[0], s, steps, batch, args.workers, alpha))
                    results[alpha, s] = got
                    print(json.dumps(got), flush=True)
        finally:
            stop_servers(procs)
    for alpha in alphas:
        if (alpha, 0) in results and (alpha, 2) in results:
            base, s2 = results[alpha, 0], results[alpha, 2]
            summary = {
                "benchmark": "row_cache_summary",
                "zipf": alpha,
                "pulled_ratio_s2": round(s2["rows_pulled"] / base["rows_pulled"], 4),
                "payload_bytes_ratio_s2": round(s2["payload_bytes"] / base["payload_bytes"], 4),
                "pulled_ratio_s2_vs_ids_sent": round(
                    s2["rows_pulled"] / (args.workers * steps * batch), 4
                ),
                "mse_rel_diff_s2": round(
                    abs(s2["test_mse"] - base["test_mse"]) / base["test_mse"], 5
                ),
                "noise_variance": NOISE**2,
            }
            print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
