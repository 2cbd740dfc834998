"""BSP step time with 4 workers, without and with one straggler.

One ``paramserver serve --consistency bsp`` shard holds one float32 tensor of N elements (sgd,
lr = 2**-10, mean aggregation). Four worker processes each run BSP iterations: pull (waits for
the previous step to close), a simulated compute of ``--compute-ms`` (an ``asyncio.sleep``, so
the 2 cores stay free for the transport), push a gradient of ones, clock. In the straggler case
rank 0 computes ``--slow-factor`` times longer. Every phase starts on a barrier; the step time is
the median phase duration divided by the steps per phase.

Reported per configuration: ``step_ms``, the slowest worker's compute ``compute_max_ms``, the
BSP overhead ``step_ms - compute_max_ms`` (pull wait + push + clock + aggregation), and the
slowdown against the no-straggler case. Afterwards the run is checked: the server counted 4
contributing pushes per step (``applied_updates``), closed one step per iteration (``bsp_step``)
and holds exactly ``-lr * steps`` (the mean of four unit gradients per step).

Usage: ``python benchmarks/bsp_straggler.py [--quick]``; everything on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import benchlib
import numpy as np

LR = 2.0**-10
WORKERS = 4


def run_case(n: int, compute_s: float, slow_factor: float, stragglers: tuple[int, ...], args: Any):
    flags = ["--consistency", "bsp", "--aggregation", "mean", "--lease-ms", "60000"]
    with benchlib.paramserver(flags) as server:
        cfg = {
            "address": server.address,
            "n": n,
            "lr": LR,
            "compute_s": compute_s,
            "slow_factor": slow_factor,
            "stragglers": stragglers,
        }
        with benchlib.WorkerPool("benchlib.ps_worker:bsp_step", cfg, WORKERS) as pool:
            pool.phase(args.warmup_steps)
            phases = [pool.phase(args.steps) for _ in range(benchlib.REPEATS)]
            reports = pool.finish()
        status, values = benchlib.observer_read(server.address, ["w"])
    steps = args.warmup_steps + benchlib.REPEATS * args.steps
    pushes = sum(r["pushes"] for r in reports)
    median_s = float(np.median(phases))
    step_s = median_s / args.steps
    compute_max_s = compute_s * (slow_factor if stragglers else 1.0)
    value_exact = bool(np.all(values["w"] == np.float32(-LR * steps)))
    return {
        "bench": "bsp_straggler",
        "n": n,
        "workers": WORKERS,
        "stragglers": list(stragglers),
        "slow_factor": slow_factor if stragglers else 1.0,
        "compute_ms": compute_s * 1e3,
        "compute_max_ms": compute_max_s * 1e3,
        "steps_per_phase": args.steps,
        "phase_s": [round(p, 6) for p in phases],
        "step_ms": step_s * 1e3,
        "overhead_ms": (step_s - compute_max_s) * 1e3,
        "steps_per_s": 1.0 / step_s,
        "pushes": pushes,
        "applied_updates": status.applied_updates,
        "bsp_step": status.bsp_step,
        "value_exact": value_exact,
        "verified": status.applied_updates == pushes == WORKERS * steps
        and status.bsp_step == steps
        and value_exact,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run")
    parser.add_argument("--sizes", help="N values, comma-separated (default 1000,1000000)")
    parser.add_argument("--compute-ms", type=float, default=20.0, help="compute per step (ms)")
    parser.add_argument("--slow-factor", type=float, default=3.0, help="straggler slowdown")
    parser.add_argument("--steps", type=int, help="steps per timed phase (default 30)")
    parser.add_argument("--warmup-steps", type=int, default=5)
    args = parser.parse_args(argv)
    quick = args.quick or benchlib.quick_from_env()
    sizes = [int(float(s)) for s in args.sizes.split(",")] if args.sizes else None
    sizes = sizes or ([1_000] if quick else [1_000, 1_000_000])
    args.steps = args.steps or (8 if quick else 30)
    if quick:
        args.warmup_steps = min(args.warmup_steps, 2)
    benchlib.emit({"bench": "bsp_straggler", "machine": benchlib.machine_info()})
    records = []
    for n in sizes:
        base = run_case(n, args.compute_ms / 1e3, 1.0, (), args)
        benchlib.emit(base)
        slow = run_case(n, args.compute_ms / 1e3, args.slow_factor, (0,), args)
        slow["slowdown_vs_none"] = slow["step_ms"] / base["step_ms"]
        benchlib.emit(slow)
        records += [base, slow]
    rows = [
        [
            r["n"],
            "none" if not r["stragglers"] else f"rank 0 x{r['slow_factor']:g}",
            r["compute_max_ms"],
            r["step_ms"],
            r["overhead_ms"],
            r.get("slowdown_vs_none"),
            r["verified"],
        ]
        for r in records
    ]
    benchlib.print_table(
        f"bsp_straggler: BSP step time, {WORKERS} workers (median of {benchlib.REPEATS} phases)",
        ["N", "straggler", "max compute ms", "step ms", "overhead ms", "slowdown", "verified"],
        rows,
    )
    return 0 if all(r["verified"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
