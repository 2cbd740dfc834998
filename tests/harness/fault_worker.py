"""A worker process for the fault-injection suite: ``python fault_worker.py MODE --server ...``.

Each mode is a small, deterministic job built on the product client
(:class:`paramserver.worker_client.WorkerClient`, default retry policy: UNAVAILABLE and
RESOURCE_EXHAUSTED retried with backoff and jitter, re-registration when the server no longer
knows the worker). Progress is reported as one JSON object per line on stdout (flushed), so the
test that started the process can follow it, kill it at a chosen point and check what it was
told. Modes:

``hold``
    Register, push ``--value`` to ``--key`` and clock ``--steps`` times, report ``ready``, then
    keep the lease alive (heartbeats) until killed.
``loop``
    ASP: push ``+1`` to the int64 key ``n`` every ``--interval-ms``, reporting each ack (worker
    id, request id, duplicate flag). A fenced worker reports ``fenced`` and exits with 3.
``bsp-train``
    Deterministic BSP least squares (fixed seed per worker and step): pull, gradient quantised
    to multiples of 2**-24 (so a mean of pushes is exact in any arrival order), push, clock;
    reports every step and the final parameters as float.hex strings. With ``--pause-at N
    --gate FILE`` it reports ``paused`` before step N and waits until FILE exists (the test
    opens the gate and kills the server at once: the crash lands at step N on any machine).
``asp-add``
    ASP with the ``add`` rule: push ``j`` adds 1 at index ``i * pushes + j`` of ``onehot`` and
    ``(index + 1) ** 2`` to the int64 ``total``; reports every acknowledged push.
``streams``
    One channel (its own TCP connection) and one waiting pull per given worker id; reports
    ``ready`` and waits to be killed with every stream open.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from paramserver.api.v1 import parameter_server_pb2 as pb
from paramserver.api.v1 import parameter_server_pb2_grpc as pb_grpc
from paramserver.errors import WorkerNotFound
from paramserver.worker_client import RetryPolicy, UpdateRule, connect

#: Least-squares problem of ``bsp-train``: dimension, examples per worker per step, step size.
DIM, BATCH, LR, MOMENTUM = 6, 16, 0.05, 0.9
QUANTUM = 2.0**-24


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, "t": time.time(), **fields}), flush=True)


def batch(seed: int, step: int, index: int) -> tuple[np.ndarray, np.ndarray]:
    """Worker ``index``'s examples of ``step``: x (BATCH, DIM) float64, y (BATCH,) float64."""
    rng = np.random.default_rng([seed, step, index])
    x = rng.normal(size=(BATCH, DIM))
    y = x @ np.linspace(-1.0, 1.0, DIM) + 0.1 * rng.normal(size=BATCH)
    return x, y


def quantised_grad(w: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Gradient of mean 0.5 (x.w - y)^2, rounded to a multiple of 2**-24 (exactly summable)."""
    g = x.T @ (x @ w - y) / len(y)
    return np.round(g / QUANTUM) * QUANTUM


def initial_w() -> np.ndarray:
    return np.zeros(DIM, np.float64)


async def hold(args: argparse.Namespace) -> None:
    async with connect(args.server, args.name, rpc_timeout_s=10.0) as ps:
        shape = tuple(args.shape)
        await ps.init({args.key: np.zeros(shape, np.float32)}, UpdateRule("sgd", lr=1.0))
        for _ in range(args.steps):
            await ps.push({args.key: np.full(shape, args.value, np.float32)})
            await ps.clock()
        emit("ready", worker_id=ps.worker_id, clock=ps.clock_value)
        await asyncio.Event().wait()


async def loop(args: argparse.Namespace) -> int:
    async with connect(args.server, args.name, replace=args.replace, rpc_timeout_s=5.0) as ps:
        await ps.init({"n": np.zeros((), np.int64)}, UpdateRule("add"))
        emit("registered", worker_id=ps.worker_id, clock=ps.clock_value)
        sent = 0
        while args.count == 0 or sent < args.count:
            try:
                ack = await ps.push({"n": np.ones((), np.int64)})
            except WorkerNotFound as exc:
                emit("fenced", worker_id=ps.worker_id, error=str(exc))
                return 3
            sent += 1
            emit(
                "ack",
                worker_id=ps.worker_id,
                request_id=ack.request_id,
                duplicate=ack.duplicate,
                reregistrations=ps.reregistrations,
            )
            await asyncio.sleep(args.interval_ms / 1000.0)
        emit("done", worker_id=ps.worker_id)
    return 0


async def bsp_train(args: argparse.Namespace) -> None:
    rule = UpdateRule("sgd", lr=LR, momentum=MOMENTUM)
    # A restart on a busy machine may take far longer than the default 30 s retry deadline.
    retry = RetryPolicy(deadline_s=args.retry_deadline_s)
    async with connect(args.server, f"trainer-{args.index}", rpc_timeout_s=10.0, retry=retry) as ps:
        await ps.init({"w": initial_w()}, rule)
        await ps.wait_for_workers(args.workers, timeout_s=120.0)
        for step in range(args.steps):
            if step == args.pause_at and args.gate:
                emit("paused", step=step)
                deadline = time.monotonic() + 300
                while not await asyncio.to_thread(os.path.exists, args.gate):
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"gate {args.gate} not opened within 300 s")
                    await asyncio.sleep(0.005)
            w = (await ps.pull(["w"]))["w"]
            x, y = batch(args.seed, step, args.index)
            await ps.push({"w": quantised_grad(w, x, y)}, num_samples=BATCH)
            await ps.clock()
            emit("step", step=step, reregistrations=ps.reregistrations)
        final = (await ps.pull(["w"]))["w"]
        emit("done", w=[float(v).hex() for v in final], reregistrations=ps.reregistrations)


async def asp_add(args: argparse.Namespace) -> None:
    size = args.workers * args.pushes
    async with connect(args.server, f"adder-{args.index}", rpc_timeout_s=10.0) as ps:
        await ps.init(
            {"onehot": np.zeros(size, np.float64), "total": np.zeros((), np.int64)},
            UpdateRule("add"),
        )
        await ps.wait_for_workers(args.workers, timeout_s=60.0)
        for j in range(args.pushes):
            index = args.index * args.pushes + j
            onehot = np.zeros(size, np.float64)
            onehot[index] = 1.0
            total = np.array((index + 1) ** 2, np.int64)
            ack = await ps.push({"onehot": onehot, "total": total})
            emit("ack", index=index, duplicate=ack.duplicate)
        emit("done", reregistrations=ps.reregistrations)


async def streams(args: argparse.Namespace) -> None:
    """One channel (own TCP connection) and one waiting pull per worker id; then wait to be
    killed with every stream open."""
    ids = args.ids
    own = [("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.aio.insecure_channel(args.server, options=own) for _ in ids]
    calls = [
        pb_grpc.ParameterServerStub(ch).Pull(
            pb.PullRequest(worker_id=wid, keys=["w"], timeout_ms=600_000), timeout=600
        )
        for ch, wid in zip(channels, ids, strict=True)
    ]
    reads = [asyncio.ensure_future(call.read()) for call in calls]
    emit("ready", streams=len(reads))
    await asyncio.gather(*reads)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    h = sub.add_parser("hold")
    h.add_argument("--name", required=True)
    h.add_argument("--key", default="w")
    h.add_argument("--shape", type=int, nargs="*", default=[4])
    h.add_argument("--value", type=float, default=1.0)
    h.add_argument("--steps", type=int, default=0)
    lp = sub.add_parser("loop")
    lp.add_argument("--name", required=True)
    lp.add_argument("--replace", action="store_true")
    lp.add_argument("--interval-ms", type=float, default=20.0)
    lp.add_argument("--count", type=int, default=0, help="stop after N acks (0: never)")
    t = sub.add_parser("bsp-train")
    t.add_argument("--index", type=int, required=True)
    t.add_argument("--workers", type=int, required=True)
    t.add_argument("--steps", type=int, required=True)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--pause-at", type=int, default=-1, help="wait for --gate before this step")
    t.add_argument("--gate", default="", help="file whose existence ends the pause")
    t.add_argument("--retry-deadline-s", type=float, default=30.0)
    a = sub.add_parser("asp-add")
    a.add_argument("--index", type=int, required=True)
    a.add_argument("--workers", type=int, required=True)
    a.add_argument("--pushes", type=int, required=True)
    st = sub.add_parser("streams")
    st.add_argument("--ids-file", required=True, help="worker ids, whitespace-separated")
    for p in (h, lp, t, a, st):
        p.add_argument("--server", required=True)
    args = parser.parse_args(argv)
    if args.mode == "streams":
        args.ids = Path(args.ids_file).read_text().split()
    jobs = {"hold": hold, "loop": loop, "bsp-train": bsp_train, "asp-add": asp_add}
    job = {**jobs, "streams": streams}[args.mode]
    exit_with_parent()
    return int(asyncio.run(job(args)) or 0)


def exit_with_parent() -> None:
    """End this process when the test that started it is gone (it was re-parented): a test
    that died before killing its worker must not leave it running. A daemon thread polls."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


if __name__ == "__main__":
    sys.exit(main())
