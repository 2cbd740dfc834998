"""Per-key cost of one push_pull: K small keys against one key of the same bytes.

One ASP server (``paramserver serve``, a subprocess on 127.0.0.1) and one worker client in this
process (uvloop). Each round is one ``WorkerClient.push_pull`` of either K float32 keys of E
elements each (``many``) or one key of K*E elements (``one``): the same bytes, so the difference
per round divided by K - 1 is what each extra key costs. The two alternate phase by phase
(``--repeats`` phases of ``--rounds`` rounds each) so both see the same load on a shared host;
medians are reported. Besides wall time, the CPU time of the client (``time.process_time``) and of
the server process (``/proc/<pid>/stat`` utime + stime, clock ticks) per round is measured: on a
busy host wall time includes waiting for a core, CPU time does not.

Paths: ``shm`` (the default client on the server's host: Session on the local-link socket, tensor
bytes through shared memory when over 64 KiB) and ``net`` (shared memory off on both sides, as
between hosts: the bytes inline in the Session messages while they fit).

``--model resnet50`` (or resnet18, bert-base) uses that architecture's parameter shapes
(``benchlib/models.py``) for ``many`` instead of K equal keys.

Every round's update is checked afterwards: each key's value equals ``-lr * pushes`` exactly.

Usage: ``python benchmarks/per_key_cost.py [--keys 161] [--elements 256] [--paths shm,net]``.
One JSON line per path.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from typing import Any

import benchlib
import numpy as np
from benchlib import models

from paramserver.core.optimizers import UpdateRule
from paramserver.worker_client.client import WorkerClient

LR = 2.0**-10


def _server_cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(
    path: str, shapes: list[tuple[int, ...]], rounds: int, repeats: int
) -> dict[str, Any]:
    """One path's figures (see the module docstring)."""
    server_args = ["--consistency", "asp", "--lease-ms", "60000"]
    if path == "net":
        server_args.append("--no-shared-memory")
    with benchlib.paramserver(server_args) as server:
        client = WorkerClient(
            server.address,
            "per-key",
            rpc_timeout_s=120,
            wait_timeout_s=120,
            shared_memory=path != "net",
        )
        await client.open()
        try:
            many = {f"p{i:03d}": np.ones(s, np.float32) for i, s in enumerate(shapes)}
            one = {"w": np.ones(sum(a.size for a in many.values()), np.float32)}
            init = {k: np.zeros_like(v) for k, v in {**many, **one}.items()}
            await client.init(init, rule=UpdateRule("sgd", lr=LR))
            pushes = {"many": 0, "one": 0}
            wall: dict[str, list[float]] = {"many": [], "one": []}
            cpu_c: dict[str, list[float]] = {"many": [], "one": []}
            cpu_s: dict[str, list[float]] = {"many": [], "one": []}

            async def phase(name: str, grads: dict[str, np.ndarray], n: int, keep: bool) -> None:
                t0, c0, s0 = time.perf_counter(), time.process_time(), _server_cpu_s(server.pid)
                for _ in range(n):
                    await client.push_pull(grads)
                pushes[name] += n
                if keep:
                    wall[name].append((time.perf_counter() - t0) / n)
                    cpu_c[name].append((time.process_time() - c0) / n)
                    cpu_s[name].append((_server_cpu_s(server.pid) - s0) / n)

            await phase("many", many, max(5, rounds // 3), False)  # warm-up
            await phase("one", one, max(5, rounds // 3), False)
            for _ in range(repeats):
                await phase("many", many, rounds, True)
                await phase("one", one, rounds, True)
            _, values = await asyncio.to_thread(
                benchlib.observer_read, server.address, [*many, "w"]
            )
            verified = all(
                bool(np.all(values[k] == np.float32(-LR * pushes["many"]))) for k in many
            ) and bool(np.all(values["w"] == np.float32(-LR * pushes["one"])))
        finally:
            await client.close()

    keys = len(shapes)

    def per_key(series: dict[str, list[float]]) -> float:
        return (statistics.median(series["many"]) - statistics.median(series["one"])) / (keys - 1)

    return {
        "bench": "per_key_cost",
        "path": path,
        "keys": keys,
        "elements": sum(models.numel(s) for s in shapes),
        "rounds_per_phase": rounds,
        "phases": repeats,
        "us_per_round_many": statistics.median(wall["many"]) * 1e6,
        "us_per_round_one": statistics.median(wall["one"]) * 1e6,
        "us_per_key": per_key(wall) * 1e6,
        "many_over_one": statistics.median(wall["many"]) / statistics.median(wall["one"]),
        "cpu_us_per_key_client": per_key(cpu_c) * 1e6,
        "cpu_us_per_key_server": per_key(cpu_s) * 1e6,
        "wall_us_many": [round(x * 1e6) for x in wall["many"]],
        "wall_us_one": [round(x * 1e6) for x in wall["one"]],
        "verified": verified,
    }


def _run(coro: Any) -> dict[str, Any]:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)  # type: ignore[no-any-return]
    return uvloop.run(coro)  # type: ignore[no-any-return]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=161, help="K (ResNet-50 has 161 tensors)")
    parser.add_argument("--elements", type=int, default=256, help="float32 elements per key")
    parser.add_argument("--rounds", type=int, default=60, help="rounds per phase")
    parser.add_argument("--repeats", type=int, default=5, help="phases of each layout")
    parser.add_argument("--paths", default="shm,net", help="comma-separated subset of shm,net")
    parser.add_argument("--model", choices=models.MODELS, help="that model's shapes as the keys")
    args = parser.parse_args()
    if benchlib.quick_from_env():  # make bench's smoke run
        args.rounds, args.repeats = min(args.rounds, 10), min(args.repeats, 3)
    if args.keys < 2:
        parser.error("--keys must be at least 2")
    if args.model:
        shapes = models.shapes(args.model)
    else:
        shapes = [(args.elements,)] * args.keys
    benchlib.emit(
        {"bench": "per_key_cost", "machine": benchlib.machine_info(), "model": args.model}
    )
    ok = True
    for path in args.paths.split(","):
        if path not in ("shm", "net"):
            parser.error(f"unknown path {path!r}")
        rec = _run(measure(path, shapes, args.rounds, args.repeats))
        rec["model"] = args.model
        benchlib.emit(rec)
        ok &= bool(rec["verified"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
