"""Heartbeat latency of a shard while it aggregates heavy BSP steps.

One ``paramserver serve --consistency bsp --aggregation mean`` shard. Two worker processes run
BSP iterations (pull, push, clock) whose push carries ``--keys`` small keys (16 float32 each)
plus one ``--big-mib`` MiB float32 key: the server reads many-key push streams, queues them,
and at each step close aggregates and applies every key. Meanwhile a probe client (a registered
worker in this process, its own thread and event loop) sends a Heartbeat RPC every 20 ms and
records each round trip (it also clocks after each, so it runs ahead of the BSP steps and is
never the worker they wait for). A heartbeat held up for longer than a lease would be a live worker
evicted by the server's own load.

Reported per phase (``idle``: the probe alone; ``bsp_load``: during the timed BSP steps):
heartbeat ``p50_ms``, ``p99_ms``, ``max_ms`` and the count; for ``bsp_load`` also the step
time. The run is checked afterwards: one BSP step closed per timed iteration.

Usage: ``python benchmarks/heartbeat_latency.py [--quick]``; everything on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
import time
from typing import Any

import benchlib
import numpy as np

from paramserver.core.optimizers import UpdateRule
from paramserver.errors import WaitTimeout
from paramserver.worker_client.client import WorkerClient

WORKERS = 2
PROBE_INTERVAL_S = 0.02


class ManyKeyStep:
    """One BSP iteration per round: pull the big key, push every key, clock."""

    def __init__(self, rank: int, cfg: dict[str, Any]) -> None:
        self.rank = rank
        self.cfg = cfg
        self.client = WorkerClient(
            cfg["address"], f"load-{rank}", rpc_timeout_s=300.0, wait_timeout_s=300.0
        )
        keys = int(cfg["keys"])
        self.grads = {f"k{i:06d}": np.ones(16, np.float32) for i in range(keys)}
        self.grads["big"] = np.ones(int(cfg["big_mib"]) << 18, np.float32)

    async def setup(self) -> None:
        await self.client.open()
        await self.client.init(
            {k: np.zeros_like(v) for k, v in self.grads.items()},
            rule=UpdateRule("sgd", lr=2.0**-10),
        )

    async def round(self) -> None:
        await self.client.pull(["big"])
        await self.client.push(self.grads)
        await self.client.clock()

    async def finish(self) -> dict[str, Any]:
        await self.client.close()
        return {}


def many_key_step(rank: int, cfg: dict[str, Any]) -> ManyKeyStep:
    return ManyKeyStep(rank, cfg)


class Probe:
    """Heartbeats every 20 ms from its own thread; ``mark()`` starts a new sample list."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        try:
            client = WorkerClient(self.address, "probe", heartbeat=False, rpc_timeout_s=60.0)
            await client.open()
            self._ready.set()
            while not self._stop.is_set():
                t0 = time.perf_counter()
                try:
                    await client.heartbeat()
                except WaitTimeout:  # counted at its full wait, not dropped
                    pass
                self.samples.append(time.perf_counter() - t0)
                await client.clock()  # runs ahead: never the worker a BSP step waits for
                await asyncio.sleep(PROBE_INTERVAL_S)
            await client.close()
        except BaseException as exc:  # reported by stop()
            self._error = exc
            self._ready.set()

    def start(self) -> None:
        self._thread.start()
        self._ready.wait(60)

    def take(self) -> list[float]:
        out, self.samples = self.samples, []
        return out

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(120)
        if self._error is not None:
            raise self._error


def summary(phase: str, samples: list[float]) -> dict[str, Any]:
    ms = np.asarray(samples) * 1e3
    return {
        "bench": "heartbeat_latency",
        "phase": phase,
        "heartbeats": int(ms.size),
        "p50_ms": float(np.percentile(ms, 50)) if ms.size else None,
        "p99_ms": float(np.percentile(ms, 99)) if ms.size else None,
        "max_ms": float(ms.max()) if ms.size else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run")
    parser.add_argument("--keys", type=int, help="small keys per push (default 20000)")
    parser.add_argument("--big-mib", type=int, default=16, help="MiB of the big key")
    parser.add_argument("--steps", type=int, help="timed BSP steps (default 10)")
    parser.add_argument("--idle-s", type=float, default=2.0, help="seconds of the idle phase")
    args = parser.parse_args(argv)
    quick = args.quick or benchlib.quick_from_env()
    keys = args.keys or (2_000 if quick else 20_000)
    steps = args.steps or (3 if quick else 10)
    benchlib.emit({"bench": "heartbeat_latency", "machine": benchlib.machine_info()})
    flags = ["--consistency", "bsp", "--aggregation", "mean", "--lease-ms", "60000"]
    with benchlib.paramserver(flags) as server:
        cfg = {"address": server.address, "keys": keys, "big_mib": args.big_mib}
        probe = Probe(server.address)
        probe.start()
        try:
            time.sleep(args.idle_s)
            idle = summary("idle", probe.take())
            with benchlib.WorkerPool(f"{__name__}:many_key_step", cfg, WORKERS) as pool:
                pool.phase(1)  # warm-up step
                before, _ = benchlib.observer_read(server.address)
                probe.take()
                span_s = pool.phase(steps)
                load = summary("bsp_load", probe.take())
                probe.stop()  # before the workers leave (not part of the measured load)
                pool.finish()
        finally:
            probe.stop()
        status, _ = benchlib.observer_read(server.address)
    load.update(
        keys=keys + 1,
        big_mib=args.big_mib,
        workers=WORKERS,
        steps=steps,
        step_ms=span_s / steps * 1e3,
        verified=status.bsp_step - before.bsp_step == steps,
    )
    benchlib.emit(idle)
    benchlib.emit(load)
    benchlib.print_table(
        f"heartbeat_latency: Heartbeat RPC round trip, {WORKERS} BSP workers",
        ["phase", "heartbeats", "p50 ms", "p99 ms", "max ms"],
        [
            [r["phase"], r["heartbeats"], r["p50_ms"], r["p99_ms"], r["max_ms"]]
            for r in (idle, load)
        ],
    )
    return 0 if load["verified"] else 1


if __name__ == "__main__":
    sys.exit(main())
