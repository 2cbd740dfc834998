"""Embedding-table pull+push throughput: paramserver beside a torch.distributed.rpc PS, a Ray
actor PS and a single-process numpy limit; plus the id -> row index choice.

Workload (issue 16): a table of 10M ids, rows of ``dim`` float32 (64 and 128); W = 1 and 2
worker processes; each round a worker pulls the rows of a batch of 8,192 ids drawn from
Zipf(1.05) over the 10M ids (``(zipf(1.05) - 1) mod 10M``, duplicates kept) and pushes one
gradient row per id back (sgd ``w -= lr * g``, duplicates summed). Every system starts from zero
rows. A timed phase lasts about ``--phase-s`` seconds after a warm-up pass over the worker's 32
batches (every id it will send is then known to the table: the phase measures steady state,
not first-touch page faults); reported:

- ``rows_per_s``: ids pulled-and-pushed per second over all workers (rounds x 8192 / s);
- ``limit_ratio``: rows_per_s / the numpy limit's (same dim);
- ``vs_best_peer``: paramserver's rows_per_s / the best of torch_rpc and ray (same dim, W).

Systems, each config in its own subprocess(es):

- ``numpy``: one process, a dense (10M, dim) float32 array (pages touched lazily), gather
  ``rows[ids]``, then the server's duplicate summing (``paramserver.core.tables.coalesce``)
  and ``rows[u] -= lr * g``: the limit.
- ``paramserver``: ``paramserver serve --consistency asp``, a table (sgd, zeros) and W worker
  processes calling ``pull_rows`` / ``push_rows`` over the plain gRPC streams
  (``session=False``), on uvloop.
- ``paramserver-session``: the same over the client's Session (moved to the server's same-host
  local-link socket; ids, gradients and rows through its shared-memory segment).
- ``torch_rpc``: PyTorch's "parameter server with distributed RPC" pattern: rank 0 holds the
  (10M, dim) tensor; trainers ``rpc_sync`` a pull and a push (index_add_) per round.
- ``ray``: a Ray actor holding the dense numpy table (pushes summed as the numpy limit does);
  trainers are Ray tasks calling ``pull`` and ``push`` on it (skipped with the reason when
  ray is not installed).

Phase ``index`` times the id -> row index of the server (numpy open addressing) against a
sorted array (``np.searchsorted``, new ids merged in) and a Python dict, inserting 8,192-id
Zipf batches into an index growing to about 1M ids, then looking them up.

Usage: ``python benchmarks/embedding.py [--quick] [--systems numpy,paramserver,...]``.
Prints one JSON line per measurement. Everything runs on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

NUM_IDS = 10_000_000
BATCH = 8192
LR = 0.01
ROOT = Path(__file__).resolve().parent.parent


def zipf_batches(seed: int, count: int, batch: int = BATCH) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [((rng.zipf(1.05, batch) - 1) % NUM_IDS).astype(np.int64) for _ in range(count)]


def emit(**kw: Any) -> None:
    print(json.dumps(kw), flush=True)


# ------------------------------------------------------------------------------ numpy limit
def run_numpy(dim: int, phase_s: float) -> float:
    table = np.zeros((NUM_IDS, dim), np.float32)  # calloc: pages become resident when touched
    batches = zipf_batches(0, 32)
    grads = np.ones((BATCH, dim), np.float32)

    from paramserver.core.tables import coalesce

    def one(ids: np.ndarray) -> None:
        rows = table[ids]
        assert rows.shape == (BATCH, dim)
        u, summed = coalesce(ids, grads)  # the server's own duplicate summing
        table[u] -= LR * summed

    for ids in batches:  # warm-up: one pass over the batches
        one(ids)
    rounds, t0 = 0, time.monotonic()
    while time.monotonic() - t0 < phase_s:
        one(batches[rounds % len(batches)])
        rounds += 1
    return rounds * BATCH / (time.monotonic() - t0)


# ------------------------------------------------------------------------------ paramserver
def _ps_worker(
    address: str, dim: int, session: bool, index: int, phase_s: float, start: Any, out: Any
) -> None:
    import uvloop

    from paramserver.worker_client import connect

    async def main() -> tuple[int, float]:
        batches = zipf_batches(100 + index, 32)
        grads = np.ones((BATCH, dim), np.float32)
        async with connect(address, f"bench-{index}", session=session) as ps:
            for ids in batches:  # warm-up: one pass over the batches
                await ps.pull_rows("emb", ids)
                await ps.push_rows("emb", ids, grads)
            start.wait()
            rounds, t0 = 0, time.monotonic()
            while time.monotonic() - t0 < phase_s:
                ids = batches[rounds % len(batches)]
                rows = await ps.pull_rows("emb", ids)
                assert rows.shape == (BATCH, dim)
                await ps.push_rows("emb", ids, grads)
                rounds += 1
            return rounds, time.monotonic() - t0

    out.put(uvloop.run(main()))


def run_paramserver(dim: int, workers: int, phase_s: float, *, session: bool = False) -> float:
    from paramserver.core.tables import Initializer, TableRule, TableSpec
    from paramserver.worker_client import connect_sync

    with tempfile.TemporaryDirectory() as tmp:
        port_file = Path(tmp) / "port"
        server = subprocess.Popen(
            [sys.executable, "-m", "paramserver", "--log-level", "WARNING", "serve", "--port",
             "0", "--port-file", str(port_file), "--consistency", "asp"],
            cwd=ROOT,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 60
            while not port_file.exists():
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("server did not start")
                time.sleep(0.05)
            address = f"127.0.0.1:{int(port_file.read_text())}"
            with connect_sync(address, "bench-init") as ps:
                ps.init_table(
                    TableSpec("emb", dim, rule=TableRule("sgd", lr=LR),
                              initializer=Initializer("zeros"), num_embeddings=NUM_IDS)
                )  # fmt: skip
            return _run_procs(_ps_worker, (address, dim, session), workers, phase_s)
        finally:
            server.terminate()
            server.wait(timeout=30)


def _run_procs(target: Any, args: tuple[Any, ...], workers: int, phase_s: float) -> float:
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=target, args=(*args, i, phase_s, start, out)) for i in range(workers)
    ]
    for p in procs:
        p.start()
    try:
        time.sleep(0.5)
        start.set()
        results = [out.get(timeout=phase_s + 120) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return sum(r for r, _ in results) * BATCH / max(s for _, s in results)


# ------------------------------------------------------------------------------ torch.rpc
_TABLE: Any = None


def _rpc_pull(ids: Any) -> Any:
    return _TABLE[ids]


def _rpc_push(ids: Any, grads: Any) -> None:
    _TABLE.index_add_(0, ids, grads, alpha=-LR)


def _rpc_main(rank: int, world: int, dim: int, phase_s: float, port: int, out: Any) -> None:
    import torch
    from torch.distributed import rpc

    global _TABLE
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=16, rpc_timeout=300)
    name = "ps" if rank == 0 else f"trainer{rank}"
    if rank == 0:
        _TABLE = torch.from_numpy(np.zeros((NUM_IDS, dim), np.float32))
    rpc.init_rpc(name, rank=rank, world_size=world, rpc_backend_options=opts)
    if rank != 0:
        batches = [torch.from_numpy(b) for b in zipf_batches(100 + rank, 32)]
        grads = torch.ones(BATCH, dim)
        for ids in batches:  # warm-up: one pass over the batches
            rpc.rpc_sync("ps", _rpc_pull, args=(ids,))
            rpc.rpc_sync("ps", _rpc_push, args=(ids, grads))
        rounds, t0 = 0, time.monotonic()
        while time.monotonic() - t0 < phase_s:
            ids = batches[rounds % len(batches)]
            rows = rpc.rpc_sync("ps", _rpc_pull, args=(ids,))
            assert rows.shape == (BATCH, dim)
            rpc.rpc_sync("ps", _rpc_push, args=(ids, grads))
            rounds += 1
        out.put((rounds, time.monotonic() - t0))
    rpc.shutdown()


def run_torch_rpc(dim: int, workers: int, phase_s: float) -> float:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_rpc_main, args=(r, workers + 1, dim, phase_s, port, out))
        for r in range(workers + 1)
    ]
    for p in procs:
        p.start()
    try:
        results = [out.get(timeout=phase_s + 180) for _ in range(workers)]
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return sum(r for r, _ in results) * BATCH / max(s for _, s in results)


# ------------------------------------------------------------------------------ ray
def run_ray(dim: int, workers: int, phase_s: float) -> float:
    import ray

    ray.init(num_cpus=workers + 1, include_dashboard=False, log_to_driver=False)
    try:

        @ray.remote
        class EmbeddingPS:
            def __init__(self, dim: int) -> None:
                self.table = np.zeros((NUM_IDS, dim), np.float32)

            def pull(self, ids: np.ndarray) -> np.ndarray:
                return self.table[ids]

            def push(self, ids: np.ndarray, grads: np.ndarray) -> None:
                from paramserver.core.tables import coalesce

                u, summed = coalesce(ids, grads)
                self.table[u] -= LR * summed

        @ray.remote
        def trainer(ps: Any, index: int, dim: int, phase_s: float) -> tuple[int, float]:
            batches = zipf_batches(100 + index, 32)
            grads = np.ones((BATCH, dim), np.float32)
            for ids in batches:  # warm-up: one pass over the batches
                ray.get(ps.pull.remote(ids))
                ray.get(ps.push.remote(ids, grads))
            rounds, t0 = 0, time.monotonic()
            while time.monotonic() - t0 < phase_s:
                ids = batches[rounds % len(batches)]
                rows = ray.get(ps.pull.remote(ids))
                assert rows.shape == (BATCH, dim)
                ray.get(ps.push.remote(ids, grads))
                rounds += 1
            return rounds, time.monotonic() - t0

        ps = EmbeddingPS.remote(dim)
        results = ray.get([trainer.remote(ps, i, dim, phase_s) for i in range(workers)])
        return sum(r for r, _ in results) * BATCH / max(s for _, s in results)
    finally:
        ray.shutdown()


# ------------------------------------------------------------------------------ index
def run_index(target_ids: int) -> list[dict[str, Any]]:
    from paramserver.core.tables import IdIndex

    batches = zipf_batches(7, 256)  # numpy's Zipf sampler is slow near a = 1: 256 batches, reused
    out = []

    offsets = [np.int64(k * NUM_IDS) for k in range(64)]  # later passes: fresh ids, same skew

    def stream() -> Any:
        for off in offsets:
            for b in batches:
                yield b + off

    def numpy_hash() -> tuple[float, float, int]:
        index = IdIndex()
        t_ins = t_look = 0.0
        for b in stream():
            u = np.unique(b)
            t0 = time.perf_counter()
            fresh = u[index.lookup(u) < 0]
            index.insert(fresh, np.arange(index.size, index.size + fresh.shape[0]))
            t_ins += time.perf_counter() - t0
            t0 = time.perf_counter()
            index.lookup(b)
            t_look += time.perf_counter() - t0
            if index.size >= target_ids:
                break
        return t_ins, t_look, index.size

    def sorted_array() -> tuple[float, float, int]:
        keys = np.zeros(0, np.int64)
        t_ins = t_look = 0.0
        for b in stream():
            u = np.unique(b)
            t0 = time.perf_counter()
            if keys.shape[0]:
                pos = np.minimum(np.searchsorted(keys, u), keys.shape[0] - 1)
                fresh = u[keys[pos] != u]
            else:
                fresh = u
            if fresh.shape[0]:
                keys = np.union1d(keys, fresh)  # every later key moves
            t_ins += time.perf_counter() - t0
            t0 = time.perf_counter()
            np.searchsorted(keys, b)
            t_look += time.perf_counter() - t0
            if keys.shape[0] >= target_ids:
                break
        return t_ins, t_look, int(keys.shape[0])

    def py_dict() -> tuple[float, float, int]:
        d: dict[int, int] = {}
        t_ins = t_look = 0.0
        for b in stream():
            t0 = time.perf_counter()
            for i in np.unique(b).tolist():
                if i not in d:
                    d[i] = len(d)
            t_ins += time.perf_counter() - t0
            t0 = time.perf_counter()
            np.fromiter((d[i] for i in b.tolist()), np.int64, b.shape[0])
            t_look += time.perf_counter() - t0
            if len(d) >= target_ids:
                break
        return t_ins, t_look, len(d)

    for name, fn in (("numpy_open_addressing", numpy_hash), ("sorted_array", sorted_array),
                     ("python_dict", py_dict)):  # fmt: skip
        t_ins, t_look, size = fn()
        out.append(
            {"phase": "index", "structure": name, "ids": size, "insert_s": round(t_ins, 3),
             "lookup_s": round(t_look, 3)}
        )  # fmt: skip
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--systems", default="numpy,paramserver,paramserver-session,torch_rpc,ray")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--phase-s", type=float, default=3.0)
    ap.add_argument("--index-ids", type=int, default=500_000)
    ap.add_argument("--quick", action="store_true", help="dim 64, W=1, 1 s phases")
    args = ap.parse_args()
    if args.quick:
        args.dims, args.workers, args.phase_s, args.index_ids = "64", "1", 1.0, 200_000
    systems = args.systems.split(",")
    dims = [int(x) for x in args.dims.split(",")]
    ws = [int(x) for x in args.workers.split(",")]
    emit(phase="host", cpus=os.cpu_count(), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    if "index" in systems or "numpy" in systems:
        for row in run_index(args.index_ids):
            emit(**row)
    limits: dict[int, float] = {}
    for dim in dims:
        if "numpy" in systems:
            limits[dim] = run_numpy(dim, args.phase_s)
            emit(system="numpy", dim=dim, workers=1, rows_per_s=round(limits[dim]))
        for w in ws:
            peers: dict[str, float] = {}
            mine = None
            for system in systems:
                if system in ("numpy", "index"):
                    continue
                runner = {
                    "paramserver": run_paramserver,
                    "paramserver-session": lambda d, w, p: run_paramserver(d, w, p, session=True),
                    "torch_rpc": run_torch_rpc,
                    "ray": run_ray,
                }[system]
                try:
                    if system == "ray":
                        import ray  # noqa: F401
                    rate = runner(dim, w, args.phase_s)
                except ImportError as exc:
                    emit(system=system, dim=dim, workers=w, skipped=f"not installed: {exc}")
                    continue
                except Exception as exc:  # a peer that fails is recorded, not fatal
                    emit(system=system, dim=dim, workers=w, skipped=f"failed: {exc!r}")
                    continue
                line: dict[str, Any] = {"system": system, "dim": dim, "workers": w,
                                        "rows_per_s": round(rate)}  # fmt: skip
                if dim in limits:
                    line["limit_ratio"] = round(rate / limits[dim], 3)
                if system.startswith("paramserver"):
                    mine = rate if mine is None else max(mine, rate)
                else:
                    peers[system] = rate
                emit(**line)
            if mine is not None and peers:
                best = max(peers, key=lambda k: peers[k])
                emit(summary="paramserver_vs_best_peer", dim=dim, workers=w, best_peer=best,
                     vs_best_peer=round(mine / peers[best], 2),
                     target_vs_best_peer=3.0, target_limit_ratio=0.3)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
