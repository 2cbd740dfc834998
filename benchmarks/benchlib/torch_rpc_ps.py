"""The push+pull workload as a torch.distributed.rpc parameter server (PyTorch's tutorial pattern).

After PyTorch's tutorials "Implementing a Parameter Server Using Distributed RPC Framework" and
"Implementing Batch RPC Processing Using Asynchronous Executions": ``rpc.init_rpc`` with the
TensorPipe backend on 127.0.0.1, rank 0 ("ps") owns a ``ParameterServer`` object held by an
``RRef``, and trainers call ``rpc_sync(ps_rref.owner(), ParameterServer.update_and_fetch_model,
args=(ps_rref, grad))``, which applies ``w -= lr * g`` under a lock and returns the weights (one
call per round: push and pull together). The ps drives the trainers with ``rpc_async`` as in the
tutorial. TensorPipe keeps its defaults (it may pick its shared-memory transport on one host).

Process layout: ``mp.spawn`` of 1 + max(W) processes; rank 0 prints one JSON line per config.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

GRAD_CACHE: dict[int, Any] = {}


class ParameterServer:
    def __init__(self, n: int, lr: float) -> None:
        import torch

        self.weights = torch.zeros(n, dtype=torch.float32)
        self.lr = lr
        self.lock = threading.Lock()
        self.applied = 0

    @staticmethod
    def update_and_fetch_model(ps_rref: Any, grad: Any) -> Any:
        self: ParameterServer = ps_rref.local_value()
        with self.lock:
            self.weights.add_(grad, alpha=-self.lr)
            self.applied += 1
            return self.weights.clone()

    @staticmethod
    def stats(ps_rref: Any) -> tuple[int, Any]:
        self: ParameterServer = ps_rref.local_value()
        with self.lock:
            return self.applied, self.weights.clone()


def run_trainer_phase(ps_rref: Any, n: int, rounds: int) -> tuple[float, float, int]:
    """Runs on a trainer: ``rounds`` push+pull calls; returns (start, end, rounds)."""
    import torch
    from torch.distributed import rpc

    grad = GRAD_CACHE.get(n)
    if grad is None:
        GRAD_CACHE.clear()
        grad = GRAD_CACHE[n] = torch.ones(n, dtype=torch.float32)
    owner = ps_rref.owner()
    t0 = time.monotonic()
    for _ in range(rounds):
        weights = rpc.rpc_sync(owner, ParameterServer.update_and_fetch_model, args=(ps_rref, grad))
    assert weights.shape == grad.shape
    return t0, time.monotonic(), rounds


def _ps_main(configs: list[tuple[int, int]], lr: float, target_s: float) -> None:
    import numpy as np
    import torch
    from torch.distributed import rpc

    import benchlib

    for n, workers in configs:
        ps_rref = rpc.RRef(ParameterServer(n, lr))
        trainers = [f"trainer{r}" for r in range(1, workers + 1)]
        pushes = 0

        def phase(
            rounds: int, ps_rref: Any = ps_rref, trainers: list[str] = trainers, n: int = n
        ) -> float:
            nonlocal pushes
            futs = [
                rpc.rpc_async(t, run_trainer_phase, args=(ps_rref, n, rounds)) for t in trainers
            ]
            stamps = torch.futures.wait_all(futs)
            pushes += sum(r for _, _, r in stamps)
            return max(e for _, e, _ in stamps) - min(s for s, _, _ in stamps)

        result = benchlib.measure(phase, n_elements=n, target_s=target_s)
        applied, weights = ParameterServer.stats(ps_rref)
        check = {
            "pushes": pushes,
            "applied_updates": applied,
            "value_exact": bool(np.all(weights.numpy() == np.float32(-lr * pushes))),
        }
        benchlib.emit(_record(n, workers, result, check))
        del ps_rref


def _record(n: int, workers: int, result: dict[str, Any], check: dict[str, Any]) -> dict[str, Any]:
    import benchlib

    rec: dict[str, Any] = {"bench": "push_pull", "system": "torch_rpc", "n": n, "workers": workers}
    rec.update(benchlib.rates(n, workers, result["rounds_per_phase"], result["median_s"]))
    rec.update(result)
    rec.update(check)
    rec["verified"] = check["applied_updates"] == check["pushes"] and check["value_exact"]
    rec["pattern"] = "rpc_sync(update_and_fetch_model) returns weights: 1 call/round"
    return rec


def _rank_main(
    rank: int, world: int, port: int, configs: list[tuple[int, int]], lr: float, target_s: float
) -> None:
    from torch.distributed import rpc

    os.environ.setdefault("TP_SOCKET_IFNAME", "lo")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    options = rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=16, rpc_timeout=600, init_method=f"tcp://127.0.0.1:{port}"
    )
    name = "ps" if rank == 0 else f"trainer{rank}"
    rpc.init_rpc(name, rank=rank, world_size=world, rpc_backend_options=options)
    try:
        if rank == 0:
            _ps_main(configs, lr, target_s)
    finally:
        rpc.shutdown()


def run(configs: list[tuple[int, int]], lr: float, target_s: float) -> None:
    """Spawn the rpc world (ps + max W trainers) and measure every config."""
    import torch.multiprocessing as tmp

    import benchlib

    world = 1 + max(w for _, w in configs)
    port = benchlib.free_port()
    tmp.spawn(_rank_main, args=(world, port, configs, lr, target_s), nprocs=world, join=True)
