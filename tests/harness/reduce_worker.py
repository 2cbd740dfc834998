"""A reduction-service worker process for the integration tests (run by path, not collected).

``python reduce_worker.py --address HOST:PORT --name w0 --inputs in.npz --out out.npz``
registers, waits until ``--world`` workers are active, then for each step ``t`` in
``0 .. --steps - 1`` reduces the arrays ``"{t}/{layer}"`` of ``--inputs`` and writes every
aggregate it receives to ``--out`` under the same names (atomically, at the end). With
``--hang`` it registers, writes its worker id to ``--ready`` and heartbeats until killed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

import numpy as np

from paramserver.reduction.reduce_client import connect_reduction


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    Path(tmp).write_text(text)
    os.replace(tmp, path)


async def main(args: argparse.Namespace) -> int:
    async with connect_reduction(args.address, worker_name=args.name) as rs:
        if args.ready:
            _write_atomic(args.ready, rs.worker_id)
        if args.hang:
            await asyncio.Event().wait()  # heartbeats run until SIGKILL
        inputs = np.load(args.inputs)
        await rs.wait_for_workers(args.world, timeout_s=args.timeout_s)
        received: dict[str, np.ndarray] = {}
        for step in range(args.steps):
            grads = {
                name.split("/", 1)[1]: inputs[name]
                for name in inputs.files
                if name.startswith(f"{step}/")
            }
            aggregate = await rs.reduce(
                step, grads, num_samples=args.num_samples, timeout_s=args.timeout_s
            )
            received.update({f"{step}/{layer}": value for layer, value in aggregate.items()})
    tmp_out = f"{args.out}.tmp.npz"
    np.savez(tmp_out, **received)
    os.replace(tmp_out, args.out)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--address", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--inputs")
    parser.add_argument("--out")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--num-samples", type=int, default=1)
    parser.add_argument("--timeout-s", type=float, default=20.0)
    parser.add_argument("--ready")
    parser.add_argument("--hang", action="store_true")
    sys.exit(asyncio.run(main(parser.parse_args())))
