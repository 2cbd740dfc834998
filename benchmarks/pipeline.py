"""Training pipeline (TrainPipeline) against the plain loop, side by side in one run: the step
time of an embedding-bound recommendation step with and without the pipeline.

Workload (issue 33, item 2): F = 8 sparse features, each its own table of 64-dim float32 rows
(sgd, lr 0.01, rows created on first push), batches of B = 8,192 samples with one id per
feature drawn from Zipf(1.05) over 1,000,000 ids (``(zipf - 1) mod V``: each batch brings ids
never seen before, as production traffic does), pooled by a RemoteEmbeddingBagCollection on the
async client; the pooled features (B, 512) go through an MLP (512 -> H -> 1, ReLU, Adam) to a
squared loss; H (``--hidden``, several widths compared in turn) sets the step's compute. One
server process (asp tables) on this host; the worker is one process (torch with
``--torch-threads`` threads).

Each configuration runs ``--warmup`` steps, then ``--steps`` timed steps; the order is plain,
pipelined, plain, pipelined (``--rounds`` 2) so a drift of the machine's load hits both. Reported
per run: ``step_ms`` (timed wall time / steps), the phases' sums from PipelineStats
(``compute_ms``, ``pull_ms``, ``push_ms`` per step; ``wait_ms``: rows not there yet when a
pipelined compute ended; timed steps only), and per width the summary ``ratio`` = best
pipelined step_ms / best plain step_ms (target <= 0.6) beside ``overlap_bound`` = max(compute,
pull + push) / (compute + pull + push) of the plain run: what overlapping the two can give at
best, so a step whose compute is much shorter than its row traffic cannot reach 0.6.

Usage: ``python benchmarks/pipeline.py [--quick] [--steps 20] [--hidden 128,384]``; prints a
host line (cpus, load average, commit, date), one JSON line per run and a summary per width.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

F, DIM, V, ALPHA = 8, 64, 1_000_000, 1.05


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            check=True,
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


async def _run(
    address: str, pipelined: bool, tag: str, args: argparse.Namespace, *, hidden: int
) -> dict[str, Any]:
    import torch

    from paramserver.core.tables import Initializer, TableRule, TableSpec
    from paramserver.integrations.torch_collection import (
        KeyedJaggedIds,
        RemoteBagTable,
        RemoteEmbeddingBagCollection,
    )
    from paramserver.integrations.torch_pipeline import TrainPipeline
    from paramserver.worker_client import connect

    torch.manual_seed(0)
    batch = args.batch
    names = [f"{tag}_f{i}" for i in range(F)]
    rng = np.random.default_rng(1)

    def make_batch() -> tuple[Any, torch.Tensor]:
        values = ((rng.zipf(ALPHA, F * batch) - 1) % V).astype(np.int64)
        kjt = KeyedJaggedIds.from_lengths_sync(
            names, torch.from_numpy(values), torch.ones(F * batch, dtype=torch.int64)
        )
        return kjt, torch.from_numpy(rng.normal(size=(batch, 1)).astype(np.float32))

    n = args.warmup + args.steps
    batches = [make_batch() for _ in range(n)]
    async with connect(address, f"w-{tag}") as client:
        for name in names:
            await client.init_table(
                TableSpec(
                    name,
                    DIM,
                    rule=TableRule("sgd", lr=0.01),
                    initializer=Initializer("normal", 0.01),
                )
            )
        ebc = RemoteEmbeddingBagCollection(
            client, [RemoteBagTable(name, DIM, [name]) for name in names]
        )
        mlp = torch.nn.Sequential(
            torch.nn.Linear(F * DIM, hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(hidden, 1),
        )
        opt = torch.optim.Adam(mlp.parameters(), lr=1e-3)

        def step(b: tuple[Any, torch.Tensor]) -> float:
            kjt, y = b
            pooled = ebc(kjt)
            x = torch.cat([pooled[name] for name in names], dim=1)
            loss = torch.nn.functional.mse_loss(mlp(x), y)
            opt.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
            return float(loss.detach())

        pipe = TrainPipeline(ebc, step, features=lambda b: b[0], pipelined=pipelined)
        times: list[float] = []
        warm = dataclasses.replace(pipe.stats)
        t_last = time.perf_counter()
        async for _ in pipe.run(batches):
            now = time.perf_counter()
            times.append(now - t_last)
            t_last = now
            if len(times) == args.warmup:
                warm = dataclasses.replace(pipe.stats)
        timed = times[args.warmup :]
        st = pipe.stats
        st = dataclasses.replace(
            st,
            **{
                f: getattr(st, f) - getattr(warm, f)
                for f in ("steps", "compute_s", "pull_s", "push_s", "wait_s")
            },
        )
    per = 1000.0 / max(st.steps, 1)
    return {
        "benchmark": "pipeline",
        "pipelined": pipelined,
        "batch": batch,
        "features": F,
        "dim": DIM,
        "hidden": hidden,
        "steps": args.steps,
        "step_ms": round(1000.0 * sum(timed) / len(timed), 1),
        "step_ms_median": round(1000.0 * float(np.median(timed)), 1),
        "compute_ms": round(st.compute_s * per, 1),
        "pull_ms": round(st.pull_s * per, 1),
        "push_ms": round(st.push_s * per, 1),
        "wait_ms": round(st.wait_s * per, 1),
        "load_avg": round(os.getloadavg()[0], 2),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="2 warm-up, 4 timed steps, 1 round")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--batch", type=int, default=8192)
    p.add_argument(
        "--hidden",
        default="128,384",
        help="MLP widths, comma-separated: the step's compute, one comparison each",
    )
    p.add_argument("--torch-threads", type=int, default=1)
    args = p.parse_args(argv)
    if args.quick:
        args.warmup, args.steps, args.rounds = 2, 4, 1
    import torch

    torch.set_num_threads(args.torch_threads)
    from paramserver.cli.demos.local_cluster import start_servers, stop_servers

    print(
        json.dumps(
            {
                "benchmark": "pipeline_host",
                "cpus": os.cpu_count(),
                "load_avg": [round(x, 2) for x in os.getloadavg()],
                "commit": _commit(),
                "date": time.strftime("%Y-%m-%d"),
                "torch_threads": args.torch_threads,
            }
        ),
        flush=True,
    )
    serve = [sys.executable, "-m", "paramserver", "--log-level", "WARNING", "serve"]
    serve += ["--consistency", "asp"]
    widths = [int(w) for w in str(args.hidden).split(",")]
    best: dict[tuple[int, bool], dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as tmp:
        procs, addresses = start_servers(serve, 1, Path(tmp))
        try:
            for hidden in widths:
                for r in range(args.rounds):
                    for pipelined in (False, True):
                        tag = f"h{hidden}r{r}{'p' if pipelined else 'b'}"
                        got = asyncio.run(_run(addresses[0], pipelined, tag, args, hidden=hidden))
                        print(json.dumps(got), flush=True)
                        have = best.get((hidden, pipelined))
                        if have is None or got["step_ms"] < have["step_ms"]:
                            best[hidden, pipelined] = got
        finally:
            stop_servers(procs)
    for hidden in widths:
        plain, piped = best[hidden, False], best[hidden, True]
        io_ms = plain["pull_ms"] + plain["push_ms"]
        print(
            json.dumps(
                {
                    "benchmark": "pipeline_summary",
                    "hidden": hidden,
                    "plain_step_ms": plain["step_ms"],
                    "pipelined_step_ms": piped["step_ms"],
                    "ratio": round(piped["step_ms"] / plain["step_ms"], 3),
                    "target": 0.6,
                    # What overlap alone can give: max(compute, io) / (compute + io).
                    "overlap_bound": round(
                        max(plain["compute_ms"], io_ms) / (plain["compute_ms"] + io_ms), 3
                    ),
                    "load_avg": [round(x, 2) for x in os.getloadavg()],
                }
            ),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
