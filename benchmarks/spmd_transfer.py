"""SPMD block-transfer throughput per path, one JSON line per (configuration, path).

Runs the ``paramserver spmd-demo`` pipeline (two instances x 2 rank servers on 127.0.0.1, real
processes) for blocks of 32 KiB, 256 KiB and 1 MiB, ``--mib-per-rank`` MiB per rank (64 by
default): fill, G2->G3, G2->G4, onboard A.G2->B.G2 through shared memory and through a gRPC
stream, A.G3->B.G2, G4->B.G2, read-back; every byte is verified.

Beside them, the ceilings of the same bytes on this host (one JSON line each):

- ``memcpy``: ``np.copyto`` of ``--mib-per-rank`` MiB (one core), GB/s;
- ``grpc_raw``: a raw grpc.aio bidirectional stream echo (no protobuf, 1 MiB chunks echoed as
  they arrive; ``benchlib.ceilings``) of the same bytes; ``one_way_gb_per_s`` is the bytes
  moved each way per second (the echo carries every byte twice).

both measured again just before each block size, and one ``summary`` line per block size:
shared-memory onboard / memcpy and gRPC onboard / the raw echo's one-way rate (targets: >= 0.3
and >= 0.8).

Usage: ``python benchmarks/spmd_transfer.py [--mib-per-rank 64]``. Not collected by pytest.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import multiprocessing as mp
import sys
import time
from typing import Any

import benchlib
import numpy as np

from paramserver.cli.demos.spmd_demo import run_demo

LAYOUTS = {
    "32KiB": "num_layers=4,outer_dim=2,page_size=16,inner_dim=128,dtype=float16",
    "256KiB": "num_layers=32,outer_dim=2,page_size=16,inner_dim=128,dtype=bfloat16",
    "1MiB": "num_layers=32,outer_dim=2,page_size=64,inner_dim=128,dtype=bfloat16",
}
BLOCK_BYTES = {"32KiB": 32 << 10, "256KiB": 256 << 10, "1MiB": 1 << 20}
SHM_PATH = "A.G2->B.G2 onboard (shared memory)"
GRPC_PATH = "A.G2->B.G2 onboard (gRPC stream)"


def _memcpy_gb_s(nbytes: int, repeats: int = 5) -> float:
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return nbytes / sorted(times)[len(times) // 2] / 1e9


def _grpc_echo(nbytes: int, phase_s: float) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    ports = ctx.Queue()
    from benchlib import ceilings

    proc = ctx.Process(target=ceilings.grpc_echo_serve, args=(ports,), daemon=True)
    proc.start()
    try:
        cfg = {"n": nbytes // 4, "port": int(ports.get(timeout=60))}
        with benchlib.WorkerPool("benchlib.ceilings:grpc_echo", cfg, 1) as pool:
            result = benchlib.measure(pool.phase, n_elements=nbytes // 4, target_s=phase_s)
            pool.finish()
    finally:
        proc.terminate()
        proc.join(timeout=10)
    seconds = result["median_s"] / result["rounds_per_phase"]
    return {"seconds_per_round": seconds, "one_way_gb_per_s": nbytes / seconds / 1e9}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib-per-rank", type=int, default=64, help="payload per rank and path")
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    parser.add_argument("--phase-s", type=float, default=1.0, help="raw echo phase length (s)")
    args = parser.parse_args()
    if benchlib.quick_from_env():  # make bench's smoke run
        args.mib_per_rank, args.phase_s = min(args.mib_per_rank, 8), min(args.phase_s, 0.25)
    nbytes = args.mib_per_rank << 20
    benchlib.emit({"bench": "spmd_transfer", "machine": benchlib.machine_info()})
    rc = 0
    for name, layout in LAYOUTS.items():
        # The ceilings are measured again beside each block size: on a shared machine they
        # drift by tens of percent within minutes, and a ratio is only as good as its pair.
        memcpy = _memcpy_gb_s(nbytes)
        benchlib.emit(
            {
                "bench": "spmd_transfer",
                "ceiling": "memcpy",
                "for": name,
                "bytes": nbytes,
                "gb_per_s": memcpy,
            }
        )
        echo = _grpc_echo(nbytes, args.phase_s)
        benchlib.emit(
            {"bench": "spmd_transfer", "ceiling": "grpc_raw", "for": name, "bytes": nbytes, **echo}
        )
        blocks = max(1, nbytes // BLOCK_BYTES[name])
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc |= run_demo(blocks=blocks, layout_text=layout, json_lines=True, loop=args.loop)
        rates: dict[str, float] = {}
        for line in out.getvalue().splitlines():
            sys.stdout.write(line + "\n")
            with contextlib.suppress(json.JSONDecodeError):
                rec = json.loads(line)
                if isinstance(rec, dict) and "path" in rec and "gb_per_s" in rec:
                    rates[rec["path"]] = float(rec["gb_per_s"])
        shm, grpc_gb = rates.get(SHM_PATH), rates.get(GRPC_PATH)
        benchlib.emit(
            {
                "bench": "spmd_transfer",
                "summary": name,
                "ranks": 2,
                "shm_onboard_gb_per_s": shm,
                "shm_over_memcpy": shm / memcpy if shm else None,
                "grpc_onboard_gb_per_s": grpc_gb,
                "grpc_over_raw_echo": grpc_gb / echo["one_way_gb_per_s"] if grpc_gb else None,
            }
        )
    return rc


if __name__ == "__main__":
    sys.exit(main())
