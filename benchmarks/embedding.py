"""Embedding-table pull+push throughput on tables that keep receiving new ids: paramserver beside
a torch.distributed.rpc PS, a Ray actor PS and a single-process numpy limit, every push verified
applied exactly once; plus server memory per stored row.

Workload (what users run: issue 30): one table over a 10M-id space, rows of ``dim`` float32 (64
and 128), starting EMPTY; W = 1 and 2 worker processes; worker ``k`` sends ``--rounds`` batches of
8,192 ids drawn from Zipf(1.05) over the 10M ids (``(zipf(1.05) - 1) mod 10M``, duplicates kept,
seed ``1000 + k``), so ids new to the table keep arriving (about half of the ids of the first 256
batches are new). No warm-up pass: the timed phase is every round, table growth included. Each
round pulls the rows of batch r and pushes one gradient row per id (row j of every batch is
``1 + (j mod 2)`` in every column; rule sgd, ``lr = 0.5``; duplicates summed). Every system
does the same pushes, so each is timed on the same work.

Exactly once: after the phase, every id touched is read back from the system and compared with
a numpy oracle of the same pushes (``init(id) - lr * sum of its gradient rows``, from the
regenerated batches): the gradient values make each push move a row by at least 0.5, so a push
applied twice or dropped shows; the tolerance (0.05) only absorbs float32 rounding of the
non-zero initial rows. A system that fails the check is reported ``verified: false``.

Systems (each config in its own processes; rows/s = ids pulled-and-pushed over all workers per
second of the slowest worker):

- ``numpy``: one process, no server: a dense (10M, dim) float32 array (pages touched lazily),
  gather ``rows[ids]``, then a scatter-add of the push (stable sort, ``np.add.reduceat``,
  ``rows[u] -= lr * sums``: the fastest numpy form measured, ahead of ``np.add.at``); all W
  workers' batches interleaved in the one process: the single-process numpy limit.
- ``paramserver``: ``paramserver serve --consistency asp``, a table (sgd, default uniform
  initializer) and W worker processes calling ``pull_rows`` then ``push_rows`` over the client's
  Session (same-host shared memory on); ``paramserver-net``: the same over the plain gRPC
  streams (``session=False``: shared memory off, as between hosts). ``paramserver-fused`` and
  ``paramserver-net-fused`` push batch r-1 and pull batch r in one ``push_pull_rows`` call
  per round (the first round a pull alone, then a last push alone).
  The server's CPU seconds over the phase are reported (``server_cpu_s``).
- ``torch_rpc``: PyTorch's "parameter server with distributed RPC" pattern: rank 0 holds the
  (10M, dim) tensor (pushes under a lock: ``index_add_`` from the RPC thread pool is not atomic);
  ``torch_rpc_fused`` makes one ``rpc_sync`` per round (pull batch r, push batch r-1),
  ``torch_rpc`` two (pull, then push); ``torch_rpc_tcp`` is the fused form with TensorPipe held
  to TCP on 127.0.0.1 (``_transports=["uv"]``, ``_channels=["basic"]``: no shared memory).
- ``ray``: a Ray actor holding the dense numpy table (pushes summed as the numpy limit does);
  trainers are Ray tasks making one fused call per round (local only:
  ``RAY_USAGE_STATS_ENABLED=0``, no dashboard, shut down by the script; skipped with the reason
  when ray is not installed).

Every system runs ``--runs`` times per dim and W (default 2; 1 with ``--quick``), and the
summary counts each one's best verified run: on a VM that hands memory left free for some
seconds back to its hypervisor, touching that memory again costs about 2 s per GB, so a
system's figure depends on what ran just before it (most for the dense-table systems, which
touch 2.5-5 GB); the best run is the fair one.

Memory phase (off with ``--no-memory``): per rule of ``--memory-rules`` (default sgd; also
adagrad, rowwise_adagrad, adam) a fresh server and a float32 table of dim 16 and 64, ids pushed
in batches of 65,536 until 1M and 10M rows are stored; reported: server RSS growth per stored
row, the table's Status ``size_bytes`` and ``state_size_bytes`` (the optimizer state alone) per
row beside it, and the bound ``1.25 * (raw row + raw state) + 24`` bytes.

Usage: ``python benchmarks/embedding.py [--quick] [--systems numpy,paramserver,...]
[--dims 64,128] [--workers 1,2] [--rounds 256] [--runs 2]
[--memory-rows 1000000,10000000] [--memory-rules sgd,adam]``.
``--quick`` (dim 64, W=1, 8 rounds, 20,000 memory rows) is small enough for a test, which runs
its correctness check only. ``EMBEDDING_BENCH_BATCH=512`` runs batches of 512 ids instead of
8,192 (where per-call costs weigh more). Prints one JSON line per measurement. Everything runs
on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

NUM_IDS = 10_000_000
#: Ids per batch; the environment variable ``EMBEDDING_BENCH_BATCH`` sets another (every
#: process of the run reads it, so workers and the verification agree).
BATCH = int(os.environ.get("EMBEDDING_BENCH_BATCH", "8192"))
LR = 0.5
TOLERANCE = 0.05
VERIFY_CHUNK = 1 << 18
ROOT = Path(__file__).resolve().parent.parent
TABLE = "emb"


def emit(**kw: Any) -> None:
    print(json.dumps(kw), flush=True)


# ------------------------------------------------------------------------------ workload
def worker_batches(index: int, rounds: int, batch: int = BATCH) -> list[np.ndarray]:
    """Worker ``index``'s id batches (int64 (batch,) each), Zipf(1.05) over NUM_IDS."""
    rng = np.random.default_rng(1000 + index)
    return [((rng.zipf(1.05, batch) - 1) % NUM_IDS).astype(np.int64) for _ in range(rounds)]


def gradient(dim: int, batch: int = BATCH) -> np.ndarray:
    """The gradient rows every push sends: row j is ``1 + (j mod 2)`` (float32 (batch, dim))."""
    g = np.ones((batch, dim), np.float32)
    g[1::2] = 2.0
    return g


def oracle(workers: int, rounds: int, batch: int = BATCH) -> tuple[np.ndarray, np.ndarray]:
    """Every id the run touched (sorted) and the sum of its gradient rows (float64 per id: the
    rows of one id are equal in every column)."""
    ids = np.concatenate([b for k in range(workers) for b in worker_batches(k, rounds, batch)])
    weight = np.tile(np.where(np.arange(batch) % 2 == 1, 2.0, 1.0), ids.shape[0] // batch)
    uniq, inverse = np.unique(ids, return_inverse=True)
    return uniq, np.bincount(inverse, weights=weight, minlength=uniq.shape[0])


def verify(
    get_rows: Callable[[np.ndarray], np.ndarray],
    workers: int,
    rounds: int,
    dim: int,
    init: Callable[[np.ndarray], np.ndarray] | None = None,
    batch: int = BATCH,
) -> dict[str, Any]:
    """Compare the system's rows of every touched id with the oracle (in chunks)."""
    uniq, sums = oracle(workers, rounds, batch)
    worst = 0.0
    for lo in range(0, uniq.shape[0], VERIFY_CHUNK):
        ids = uniq[lo : lo + VERIFY_CHUNK]
        got = np.asarray(get_rows(ids), np.float64)
        want = -LR * sums[lo : lo + VERIFY_CHUNK, None]
        if init is not None:
            want = want + init(ids).astype(np.float64)
        if got.shape != (ids.shape[0], dim):
            return {"verified": False, "rows_checked": int(lo), "why": f"shape {got.shape}"}
        worst = max(worst, float(np.abs(got - want).max(initial=0.0)))
    return {
        "verified": worst <= TOLERANCE,
        "rows_checked": int(uniq.shape[0]),
        "max_abs_err": worst,
    }


def scatter_sub(table: np.ndarray, ids: np.ndarray, grads: np.ndarray) -> None:
    """``table[id] -= lr * (sum of the id's rows)``, numpy only (stable sort + reduceat)."""
    order = np.argsort(ids, kind="stable")
    s = ids[order]
    first = np.empty(s.shape[0], bool)
    first[0] = True
    np.not_equal(s[1:], s[:-1], out=first[1:])
    starts = np.flatnonzero(first)
    table[s[starts]] -= np.float32(LR) * np.add.reduceat(grads[order], starts, axis=0)


def _rate(results: list[tuple[int, float]]) -> float:
    return sum(r for r, _ in results) * BATCH / max(s for _, s in results)


# ------------------------------------------------------------------------------ numpy limit
def run_numpy(dim: int, workers: int, rounds: int) -> tuple[float, dict[str, Any]]:
    table = np.zeros((NUM_IDS, dim), np.float32)  # calloc: pages become resident when touched
    per = [worker_batches(k, rounds) for k in range(workers)]
    grads = gradient(dim)
    t0 = time.monotonic()
    for r in range(rounds):
        for k in range(workers):
            ids = per[k][r]
            rows = table[ids]
            assert rows.shape == (BATCH, dim)
            scatter_sub(table, ids, grads)
    rate = workers * rounds * BATCH / (time.monotonic() - t0)
    return rate, verify(lambda ids: table[ids], workers, rounds, dim)


# ------------------------------------------------------------------------------ paramserver
def _ps_worker(
    address: str, dim: int, session: bool, fused: bool, index: int, rounds: int, sync: Any
) -> None:
    import uvloop

    from paramserver.worker_client import connect

    ready, start, out = sync

    async def main() -> tuple[int, float]:
        batches = worker_batches(index, rounds)
        grads = gradient(dim)
        async with connect(address, f"bench-{index}", session=session) as ps:
            ready.put(index)
            await asyncio.get_running_loop().run_in_executor(None, start.wait)
            t0 = time.monotonic()
            if fused:
                prev = None
                for ids in batches:
                    if prev is None:
                        rows = await ps.pull_rows(TABLE, ids)
                    else:
                        rows = await ps.push_pull_rows(TABLE, prev, grads, ids)
                    assert rows.shape == (BATCH, dim)
                    prev = ids
                await ps.push_rows(TABLE, prev, grads)
            else:
                for ids in batches:
                    rows = await ps.pull_rows(TABLE, ids)
                    assert rows.shape == (BATCH, dim)
                    await ps.push_rows(TABLE, ids, grads)
            return rounds, time.monotonic() - t0

    out.put(uvloop.run(main()))


def _proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _proc_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


@contextmanager
def _server() -> Iterator[tuple[str, int]]:
    with tempfile.TemporaryDirectory() as tmp:
        port_file = Path(tmp) / "port"
        server = subprocess.Popen(
            [sys.executable, "-m", "paramserver", "--log-level", "WARNING", "serve", "--port",
             "0", "--port-file", str(port_file), "--consistency", "asp"],
            cwd=ROOT,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 120
            while not port_file.exists() or not port_file.read_text().strip():
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("server did not start")
                time.sleep(0.05)
            yield f"127.0.0.1:{int(port_file.read_text())}", server.pid
        finally:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def _ps_spec(dim: int, **kw: Any) -> Any:
    from paramserver.core.tables import TableRule, TableSpec

    return TableSpec(TABLE, dim, rule=TableRule("sgd", lr=LR), **kw)


def run_paramserver(
    dim: int, workers: int, rounds: int, *, session: bool, fused: bool = False
) -> tuple[float, dict[str, Any]]:
    from paramserver.core.tables import initial_rows
    from paramserver.worker_client import connect_sync

    with _server() as (address, pid):
        spec = _ps_spec(dim, num_embeddings=NUM_IDS)
        with connect_sync(address, "bench-init", session=session) as ps:
            ps.init_table(spec)
        cpu0 = _proc_cpu_s(pid)
        results = _run_procs(_ps_worker, (address, dim, session, fused), workers, rounds)
        extra: dict[str, Any] = {"server_cpu_s": round(_proc_cpu_s(pid) - cpu0, 3)}
        # Read back over the plain streams: independent of the transport under test.
        with connect_sync(address, "bench-verify", session=False) as ps:
            extra.update(
                verify(
                    lambda ids: ps.pull_rows(TABLE, ids),
                    workers,
                    rounds,
                    dim,
                    init=lambda ids: initial_rows(spec.seed, ids, dim, spec.initializer),
                )
            )
        return _rate(results), extra


def _run_procs(
    target: Any, args: tuple[Any, ...], workers: int, rounds: int
) -> list[tuple[int, float]]:
    ctx = mp.get_context("spawn")
    ready, start, out = ctx.Queue(), ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=target, args=(*args, i, rounds, (ready, start, out)))
        for i in range(workers)
    ]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            ready.get(timeout=300)
        start.set()
        return [out.get(timeout=900) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
                p.join()


# ------------------------------------------------------------------------------ torch.rpc
_TABLE: Any = None
_LOCK = threading.Lock()


def _rpc_pull(ids: Any) -> Any:
    return _TABLE[ids]


def _rpc_push(ids: Any, grads: Any) -> None:
    with _LOCK:  # index_add_ from several RPC threads at once loses updates
        _TABLE.index_add_(0, ids, grads, alpha=-LR)


def _rpc_pull_push(pull_ids: Any, push_ids: Any, grads: Any) -> Any:
    _rpc_push(push_ids, grads)
    return _TABLE[pull_ids]


def _rpc_main(rank: int, world: int, dim: int, rounds: int, mode: str, port: int, out: Any) -> None:
    import torch
    from torch.distributed import rpc

    global _TABLE
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    kw: dict[str, Any] = {}
    if mode == "tcp":
        kw = {"_transports": ["uv"], "_channels": ["basic"]}
    opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=16, rpc_timeout=600, **kw)
    name = "ps" if rank == 0 else f"trainer{rank}"
    if rank == 0:
        _TABLE = torch.from_numpy(np.zeros((NUM_IDS, dim), np.float32))
    else:
        batches = [torch.from_numpy(b) for b in worker_batches(rank - 1, rounds)]
        grads = torch.from_numpy(gradient(dim))
    rpc.init_rpc(name, rank=rank, world_size=world, rpc_backend_options=opts)
    if rank != 0:
        out.put(("ready", rank))
        t0 = time.monotonic()
        if mode == "two":
            for ids in batches:
                rows = rpc.rpc_sync("ps", _rpc_pull, args=(ids,))
                assert rows.shape == (BATCH, dim)
                rpc.rpc_sync("ps", _rpc_push, args=(ids, grads))
        else:
            prev = None
            for ids in batches:
                if prev is None:
                    rows = rpc.rpc_sync("ps", _rpc_pull, args=(ids,))
                else:
                    rows = rpc.rpc_sync("ps", _rpc_pull_push, args=(ids, prev, grads))
                assert rows.shape == (BATCH, dim)
                prev = ids
            rpc.rpc_sync("ps", _rpc_push, args=(prev, grads))
        out.put(("done", (rounds, time.monotonic() - t0)))
    rpc.shutdown()  # waits for every rank: after it, rank 0's table holds every push
    if rank == 0:
        out.put(("verify", verify(lambda ids: _TABLE[torch.from_numpy(ids)].numpy(),
                                  world - 1, rounds, dim)))  # fmt: skip


def run_torch_rpc(dim: int, workers: int, rounds: int, mode: str) -> tuple[float, dict[str, Any]]:
    import socket

    import torch  # noqa: F401  (ImportError: skipped)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_rpc_main, args=(r, workers + 1, dim, rounds, mode, port, out))
        for r in range(workers + 1)
    ]
    for p in procs:
        p.start()
    try:
        got: dict[str, list[Any]] = {"ready": [], "done": [], "verify": []}
        while len(got["done"]) < workers or not got["verify"]:
            kind, value = out.get(timeout=900)
            got[kind].append(value)
        return _rate(got["done"]), got["verify"][0]
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
                p.join()


# ------------------------------------------------------------------------------ ray
def run_ray(dim: int, workers: int, rounds: int) -> tuple[float, dict[str, Any]]:
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    import ray

    ray.init(
        address="local",
        num_cpus=workers + 1,
        include_dashboard=False,
        log_to_driver=False,
    )
    try:

        @ray.remote
        class EmbeddingPS:
            def __init__(self, dim: int) -> None:
                self.table = np.zeros((NUM_IDS, dim), np.float32)

            def pull(self, ids: np.ndarray) -> np.ndarray:
                return self.table[ids]

            def push(self, ids: np.ndarray, grads: np.ndarray) -> None:
                scatter_sub(self.table, ids, grads)

            def pull_push(self, ids: np.ndarray, prev: np.ndarray, grads: np.ndarray) -> Any:
                scatter_sub(self.table, prev, grads)
                return self.table[ids]

        @ray.remote
        def trainer(ps: Any, index: int, dim: int, rounds: int, go: Any) -> tuple[int, float]:
            batches = worker_batches(index, rounds)
            grads = gradient(dim)
            ray.get(go.ready.remote())
            t0 = time.monotonic()
            prev = None
            for ids in batches:
                if prev is None:
                    rows = ray.get(ps.pull.remote(ids))
                else:
                    rows = ray.get(ps.pull_push.remote(ids, prev, grads))
                assert rows.shape == (BATCH, dim)
                prev = ids
            ray.get(ps.push.remote(prev, grads))
            return rounds, time.monotonic() - t0

        @ray.remote(num_cpus=0)
        class Gate:  # every trainer has its batches before any starts the clock
            def __init__(self, n: int) -> None:
                self.n = n
                self.event = asyncio.Event()

            async def ready(self) -> None:
                self.n -= 1
                if self.n <= 0:
                    self.event.set()
                await self.event.wait()

        ps = EmbeddingPS.options(num_cpus=0).remote(dim)  # type: ignore[attr-defined]
        go = Gate.remote(workers)  # type: ignore[attr-defined]
        results = ray.get(
            [
                trainer.options(num_cpus=0).remote(ps, i, dim, rounds, go)  # type: ignore[attr-defined]
                for i in range(workers)
            ]
        )
        return _rate(results), verify(
            lambda ids: ray.get(ps.pull.remote(ids)), workers, rounds, dim
        )
    finally:
        ray.shutdown()


# ------------------------------------------------------------------------------ memory
#: Optimizer state a rule keeps per stored float32 row of ``dim`` (its raw bytes): adagrad one
#: accumulator per column, rowwise_adagrad one per row, adam two moments per column and the
#: row's own step count (int64: lazy Adam corrects each row's bias by its own steps).
STATE_RAW_BYTES: dict[str, Callable[[int], int]] = {
    "sgd": lambda dim: 0,
    "adagrad": lambda dim: 4 * dim,
    "rowwise_adagrad": lambda dim: 4,
    "adam": lambda dim: 8 * dim + 8,
}


def run_memory(dim: int, sizes: list[int], rule: str = "sgd") -> list[dict[str, Any]]:
    """Server RSS growth per stored row of a ``rule`` float32 table of ``dim`` as rows are
    stored (``sizes``: rows stored at each reading), beside the raw row and state bytes, the
    target (raw x 1.25 + 24 B, state included) and Status' ``size_bytes`` /
    ``state_size_bytes``."""
    from paramserver.core.tables import TableRule, TableSpec
    from paramserver.worker_client import connect_sync

    step = 1 << 16
    out = []
    with _server() as (address, pid), connect_sync(address, "bench-mem") as ps:
        ps.init_table(TableSpec(TABLE, dim, rule=TableRule(rule, lr=LR)))
        grads = np.zeros((step, dim), np.float32)
        ps.push_rows(TABLE, np.arange(step, dtype=np.int64), grads)  # code paths loaded
        base_rows = step
        base_rss = _proc_rss_bytes(pid)
        base_size, base_state = _table_size_bytes(ps)
        stored = base_rows
        for target in sizes:
            while stored < target:
                n = min(step, target - stored)
                ps.push_rows(TABLE, np.arange(stored, stored + n, dtype=np.int64), grads[:n])
                stored += n
            rss = _proc_rss_bytes(pid)
            size, state = _table_size_bytes(ps)
            rows = stored - base_rows
            raw = 4 * dim
            raw_state = STATE_RAW_BYTES[rule](dim)
            out.append(
                {"phase": "memory", "rule": rule, "dtype": "float32", "dim": dim, "rows": stored,
                 "raw_bytes_per_row": raw, "raw_state_bytes_per_row": raw_state,
                 "rss_bytes_per_row": round((rss - base_rss) / rows, 1),
                 "status_size_bytes_per_row": round((size - base_size) / rows, 1),
                 "status_state_bytes_per_row": round((state - base_state) / rows, 1),
                 "size_vs_rss": round((size - base_size) / max(rss - base_rss, 1), 3),
                 "target_bytes_per_row": 1.25 * (raw + raw_state) + 24}
            )  # fmt: skip
    return out


def _table_size_bytes(ps: Any) -> tuple[int, int]:
    """The table's Status ``size_bytes`` and ``state_size_bytes``."""
    for info in ps.status().tables:
        if info.spec.name == TABLE:
            return int(info.size_bytes), int(info.state_size_bytes)
    raise RuntimeError("table missing from Status")


# ------------------------------------------------------------------------------ main
def _has_fused() -> bool:
    from paramserver.worker_client.client import WorkerClient

    return hasattr(WorkerClient, "push_pull_rows")


RULES = ",".join(STATE_RAW_BYTES)
RUNNERS: dict[str, Callable[[int, int, int], tuple[float, dict[str, Any]]]] = {
    "numpy": run_numpy,
    "paramserver": lambda d, w, r: run_paramserver(d, w, r, session=True),
    "paramserver-fused": lambda d, w, r: run_paramserver(d, w, r, session=True, fused=True),
    "paramserver-net": lambda d, w, r: run_paramserver(d, w, r, session=False),
    "paramserver-net-fused": lambda d, w, r: run_paramserver(d, w, r, session=False, fused=True),
    "torch_rpc_fused": lambda d, w, r: run_torch_rpc(d, w, r, "fused"),
    "torch_rpc": lambda d, w, r: run_torch_rpc(d, w, r, "two"),
    "torch_rpc_tcp": lambda d, w, r: run_torch_rpc(d, w, r, "tcp"),
    "ray": run_ray,
}
PEERS = ("torch_rpc_fused", "torch_rpc", "torch_rpc_tcp", "ray")


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--systems", default=",".join(RUNNERS))
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--rounds", type=int, default=256, help="batches per worker")
    ap.add_argument("--memory-rows", default="1000000,10000000")
    ap.add_argument("--memory-dims", default="16,64")
    ap.add_argument(
        "--memory-rules", default="sgd", help=f"table rules of the memory phase, of {RULES}"
    )
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument(
        "--runs",
        type=int,
        default=2,
        help="runs of each system per dim and W; each one's best verified run counts (a "
        "system's figure depends on what ran just before it on a shared host)",
    )
    ap.add_argument("--quick", action="store_true", help="dim 64, W=1, 8 rounds, 20k rows")
    args = ap.parse_args()
    if args.runs < 1:
        ap.error("--runs must be at least 1")
    if args.quick:
        args.dims, args.workers, args.rounds, args.runs = "64", "1", 8, 1
        args.memory_rows, args.memory_dims = "100000", "16"
    systems = [s for s in args.systems.split(",") if s]
    unknown = sorted(set(systems) - set(RUNNERS))
    if unknown:
        ap.error(f"unknown systems {unknown}; known: {sorted(RUNNERS)}")
    if not _has_fused():
        for s in ("paramserver-fused", "paramserver-net-fused"):
            if s in systems:
                systems.remove(s)
                emit(system=s, skipped="the client has no push_pull_rows")
    dims = [int(x) for x in args.dims.split(",")]
    ws = [int(x) for x in args.workers.split(",")]
    emit(phase="host", cpus=os.cpu_count(), load_avg=os.getloadavg(), rounds=args.rounds,
         batch=BATCH, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))  # fmt: skip
    for dim in dims:
        for w in ws:
            rates: dict[str, float] = {}
            for system in systems:
                for run in range(args.runs):
                    try:
                        rate, extra = RUNNERS[system](dim, w, args.rounds)
                    except ImportError as exc:
                        emit(system=system, dim=dim, workers=w, skipped=f"not installed: {exc}")
                        break
                    except Exception as exc:  # a peer that fails is recorded, not fatal
                        emit(system=system, dim=dim, workers=w, skipped=f"failed: {exc!r}")
                        continue
                    if extra.get("verified"):
                        rates[system] = max(rate, rates.get(system, 0.0))
                    emit(system=system, dim=dim, workers=w, run=run, rows_per_s=round(rate),
                         load_avg=round(os.getloadavg()[0], 2), **extra)  # fmt: skip
            _summary(dim, w, rates)
    if not args.no_memory:
        sizes = [int(x) for x in args.memory_rows.split(",")]
        for rule in args.memory_rules.split(","):
            if rule not in STATE_RAW_BYTES:
                ap.error(f"unknown rule {rule!r} in --memory-rules; known: {RULES}")
            for dim in (int(x) for x in args.memory_dims.split(",")):
                for line in run_memory(dim, sizes, rule):
                    emit(**line)
    return 0


def _summary(dim: int, w: int, rates: dict[str, float]) -> None:
    shm = {k: v for k, v in rates.items() if k in ("paramserver", "paramserver-fused")}
    net = {k: v for k, v in rates.items() if k.startswith("paramserver-net")}
    peers = {k: v for k, v in rates.items() if k in PEERS}
    line: dict[str, Any] = {"summary": "targets", "dim": dim, "workers": w}
    if shm and peers:
        best = max(peers, key=lambda k: peers[k])
        line.update(best_peer=best, vs_best_peer=round(max(shm.values()) / peers[best], 2),
                    target_vs_best_peer=2.0)  # fmt: skip
    if net and "torch_rpc_tcp" in rates:
        line.update(net_vs_torch_rpc_tcp=round(max(net.values()) / rates["torch_rpc_tcp"], 2),
                    target_net_vs_torch_rpc_tcp=1.0)  # fmt: skip
    if shm and "numpy" in rates:
        line.update(vs_numpy_limit=round(max(shm.values()) / rates["numpy"], 2),
                    target_vs_numpy_limit=1.5)  # fmt: skip
    emit(**line)


if __name__ == "__main__":
    sys.exit(main())
