"""Server apply throughput per update rule and dtype, and the server's peak RSS per parameter byte.

Part 1 calls :class:`paramserver.core.store.ParameterStore` directly (no network): one key of N
elements, ``store.apply(key, grad)`` repeated; a probe sizes each of 3 timed phases to about
``--phase-s`` seconds and the median is reported as GB/s of gradient bytes applied. Two
components are timed the same way: ``validate_gradient`` alone (shape/dtype checks and the
non-finite scan) and :func:`paramserver.core.optimizers.apply_update` alone (the rule's math),
next to a plain ``np.copyto`` of the parameter (memory bandwidth) as the ceiling.

Part 2 starts ``paramserver serve --consistency asp`` as a subprocess, declares one float32 key of
``--rss-mb`` MB (default 256) under the rule, pushes ``--rss-pushes`` gradients and pulls the key
once, reading the server's ``VmHWM`` (peak resident set, ``/proc/<pid>/status``) after each
stage. Reported: ``peak / parameter bytes`` (issue 7's targets: <= 3 for sgd, <= 5 for adam) and
the same with the idle server's resident set subtracted.

Usage: ``python benchmarks/apply_throughput.py [--quick]``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import benchlib
import ml_dtypes
import numpy as np

from paramserver.core.optimizers import UpdateRule, apply_update
from paramserver.core.store import ParameterStore

RULES: dict[str, Callable[[], UpdateRule]] = {
    "assign": lambda: UpdateRule("assign"),
    "add": lambda: UpdateRule("add"),
    "sgd": lambda: UpdateRule("sgd", lr=0.01),
    "sgd_momentum": lambda: UpdateRule("sgd", lr=0.01, momentum=0.9),
    "adam": lambda: UpdateRule("adam"),
    "adamw": lambda: UpdateRule("adamw"),
    "adagrad": lambda: UpdateRule("adagrad"),
}
FLOAT_DTYPES = {
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
}
INT_DTYPES = {"int32": np.dtype(np.int32), "int64": np.dtype(np.int64)}
RSS_RULES = ("sgd", "sgd_momentum", "adam")
RSS_TARGETS = {"sgd": 3.0, "sgd_momentum": 3.0, "adam": 5.0}


def _timed(fn: Callable[[], None], n: int, target_s: float) -> dict[str, Any]:
    def phase(rounds: int) -> float:
        t0 = time.perf_counter()
        for _ in range(rounds):
            fn()
        return time.perf_counter() - t0

    return benchlib.measure(phase, n_elements=n, target_s=target_s)


def apply_case(rule_name: str, dtype_name: str, n: int, target_s: float) -> dict[str, Any]:
    dtype = {**FLOAT_DTYPES, **INT_DTYPES}[dtype_name]
    rule = RULES[rule_name]()
    store = ParameterStore()
    store.init("w", np.zeros(n, dtype=dtype), rule)
    grad = np.full(n, 1 if dtype.kind == "i" else 1e-3, dtype=dtype)
    entry = store.get("w")
    nbytes = grad.nbytes
    full = _timed(lambda: store.apply("w", grad), n, target_s)
    validate = _timed(lambda: store.validate_gradient("w", grad), n, target_s)
    math_only = _timed(
        lambda: apply_update(entry.rule, entry.value, grad, entry.state), n, target_s
    )
    dst = np.empty_like(entry.value)
    copy = _timed(lambda: np.copyto(dst, entry.value), n, target_s)
    state_bytes = sum(a.nbytes for a in entry.state.values())

    def gbs(res: dict[str, Any]) -> float:
        return nbytes * res["rounds_per_phase"] / res["median_s"] / 1e9

    return {
        "bench": "apply_throughput",
        "rule": rule_name,
        "dtype": dtype_name,
        "n": n,
        "grad_bytes": nbytes,
        "state_bytes_per_param_byte": state_bytes / entry.value.nbytes,
        "apply_gb_s": gbs(full),
        "apply_ms": full["median_s"] / full["rounds_per_phase"] * 1e3,
        "validate_gb_s": gbs(validate),
        "math_gb_s": gbs(math_only),
        "memcpy_gb_s": gbs(copy),
        "apply_phase_s": full["phase_s"],
        "rounds_per_phase": full["rounds_per_phase"],
    }


async def _rss_client(
    address: str, pid: int, n: int, rule: UpdateRule, pushes: int
) -> dict[str, Any]:
    from paramserver.worker_client.client import WorkerClient

    stages: dict[str, dict[str, int]] = {"idle": benchlib.proc_status(pid)}
    client = WorkerClient(address, "rss-probe", rpc_timeout_s=600.0, heartbeat=False)
    await client.open()
    try:
        value = np.zeros(n, dtype=np.float32)
        await client.init({"w": value}, rule=rule)
        stages["after_init"] = benchlib.proc_status(pid)
        grad = np.full(n, 1e-3, dtype=np.float32)
        for _ in range(pushes):
            await client.push({"w": grad})
        stages["after_pushes"] = benchlib.proc_status(pid)
        pulled = await client.pull(["w"])
        assert pulled["w"].shape == (n,)
        del pulled
        stages["after_pull"] = benchlib.proc_status(pid)
    finally:
        await client.close()
    return stages


def rss_case(rule_name: str, mb: int, pushes: int) -> dict[str, Any]:
    n = mb * (1 << 20) // 4
    param_bytes = n * 4
    rule = RULES[rule_name]()
    with benchlib.paramserver(["--consistency", "asp", "--lease-ms", "600000"]) as server:
        time.sleep(0.5)  # settle after start
        stages = asyncio.run(_rss_client(server.address, server.pid, n, rule, pushes))
    idle = stages["idle"]["VmRSS"]
    rec: dict[str, Any] = {
        "bench": "server_rss",
        "rule": rule_name,
        "dtype": "float32",
        "param_bytes": param_bytes,
        "pushes": pushes,
        "idle_rss_bytes": idle,
    }
    for stage in ("after_init", "after_pushes", "after_pull"):
        hwm = stages[stage]["VmHWM"]
        rec[f"{stage}_peak_bytes"] = hwm
        rec[f"{stage}_peak_per_param_byte"] = hwm / param_bytes
        rec[f"{stage}_peak_minus_idle_per_param_byte"] = (hwm - idle) / param_bytes
    rec["peak_per_param_byte"] = rec["after_pull_peak_per_param_byte"]
    rec["target"] = RSS_TARGETS[rule_name]
    rec["met"] = rec["peak_per_param_byte"] <= rec["target"]
    return rec


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run")
    parser.add_argument("--n", type=int, help="elements per key (default 16,000,000)")
    parser.add_argument("--phase-s", type=float, help="target seconds per timed phase")
    parser.add_argument("--rules", help=f"subset of {','.join(RULES)}")
    parser.add_argument("--dtypes", help="subset of float32,float64,float16,bfloat16,int32,int64")
    parser.add_argument("--rss-mb", type=int, help="parameter MB held for the RSS part (256)")
    parser.add_argument("--rss-pushes", type=int, default=3)
    parser.add_argument("--skip-rss", action="store_true")
    args = parser.parse_args(argv)
    quick = args.quick or benchlib.quick_from_env()
    n = args.n or (1_000_000 if quick else 16_000_000)
    phase_s = args.phase_s or (0.1 if quick else 0.4)
    rss_mb = args.rss_mb or (32 if quick else 256)
    rules = args.rules.split(",") if args.rules else list(RULES)
    dtypes = args.dtypes.split(",") if args.dtypes else [*FLOAT_DTYPES, *INT_DTYPES]
    benchlib.emit({"bench": "apply_throughput", "machine": benchlib.machine_info()})
    records = []
    for rule_name in rules:
        for dtype_name in dtypes:
            if dtype_name in INT_DTYPES and rule_name not in ("assign", "add"):
                continue  # optimizer rules need floating parameters
            rec = apply_case(rule_name, dtype_name, n, phase_s)
            benchlib.emit(rec)
            records.append(rec)
    benchlib.print_table(
        f"apply_throughput: GB/s of gradients applied, N = {n:,} (median of 3 phases)",
        ["rule", "dtype", "store.apply", "ms/apply", "validate", "math", "memcpy", "state B/B"],
        [
            [
                r["rule"],
                r["dtype"],
                r["apply_gb_s"],
                r["apply_ms"],
                r["validate_gb_s"],
                r["math_gb_s"],
                r["memcpy_gb_s"],
                r["state_bytes_per_param_byte"],
            ]
            for r in records
        ],
    )
    if args.skip_rss:
        return 0
    rss = []
    for rule_name in RSS_RULES:
        if rule_name in rules:
            rec = rss_case(rule_name, rss_mb, args.rss_pushes)
            benchlib.emit(rec)
            rss.append(rec)
    benchlib.print_table(
        f"server_rss: peak RSS (VmHWM) / parameter bytes, one float32 key of {rss_mb} MB",
        ["rule", "after init", "after pushes", "after pull", "minus idle", "target", "met"],
        [
            [
                r["rule"],
                r["after_init_peak_per_param_byte"],
                r["after_pushes_peak_per_param_byte"],
                r["after_pull_peak_per_param_byte"],
                r["after_pull_peak_minus_idle_per_param_byte"],
                f"<= {r['target']:g}",
                "yes" if r["met"] else "NO",
            ]
            for r in rss
        ],
    )
    print(
        "apply GB/s median over rules (float32): "
        f"{statistics.median(r['apply_gb_s'] for r in records if r['dtype'] == 'float32'):.2f}"
        if any(r["dtype"] == "float32" for r in records)
        else "",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
