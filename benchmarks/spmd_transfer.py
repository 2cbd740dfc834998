"""SPMD block-transfer throughput per path, one JSON line per (configuration, path).

Runs the ``paramserver spmd-demo`` pipeline (two instances x 2 rank servers on 127.0.0.1, real
processes) for several block sizes: fill, G2->G3, G2->G4, onboard A.G2->B.G2 through shared
memory and through a gRPC stream, A.G3->B.G2, G4->B.G2, read-back; every byte is verified.

Usage: ``python benchmarks/spmd_transfer.py [--blocks-mib 16]``. Not collected by pytest.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys

from paramserver.spmd.demo import run_demo

LAYOUTS = {
    "32KiB": "num_layers=4,outer_dim=2,page_size=16,inner_dim=128,dtype=float16",
    "256KiB": "num_layers=32,outer_dim=2,page_size=16,inner_dim=128,dtype=bfloat16",
    "1MiB": "num_layers=32,outer_dim=2,page_size=64,inner_dim=128,dtype=bfloat16",
}
BLOCK_BYTES = {"32KiB": 32 << 10, "256KiB": 256 << 10, "1MiB": 1 << 20}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib-per-rank", type=int, default=16, help="payload per rank and path")
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    args = parser.parse_args()
    rc = 0
    for name, layout in LAYOUTS.items():
        blocks = max(1, (args.mib_per_rank << 20) // BLOCK_BYTES[name])
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc |= run_demo(blocks=blocks, layout_text=layout, json_lines=True, loop=args.loop)
        sys.stdout.write(out.getvalue())
        sys.stdout.flush()
    return rc


if __name__ == "__main__":
    sys.exit(main())
