"""The push+pull workload as a torch.distributed.rpc parameter server (PyTorch's tutorial pattern).

After PyTorch's tutorials "Implementing a Parameter Server Using Distributed RPC Framework" and
"Implementing Batch RPC Processing Using Asynchronous Executions": ``rpc.init_rpc`` with the
TensorPipe backend on 127.0.0.1, rank 0 ("ps") owns a ``ParameterServer`` object held by an
``RRef``, and trainers call ``rpc_sync(ps_rref.owner(), ParameterServer.update_and_fetch_model,
args=(ps_rref, grad))``, which applies ``w -= lr * g`` under a lock and returns the weights (one
call per round: push and pull together). With several tensors (a real model's shapes) the
gradient is the list of tensors and the call returns the list of weights (the fused one-call
pattern of the batch-RPC tutorial). The ps drives the trainers with ``rpc_async`` as in the
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
    def __init__(self, n: int, lr: float, shapes: list[tuple[int, ...]] | None = None) -> None:
        import torch

        self.weights = torch.zeros(n, dtype=torch.float32)
        self.tensors = [torch.zeros(s, dtype=torch.float32) for s in shapes or []]
        self.lr = lr
        self.lock = threading.Lock()
        self.applied = 0

    @staticmethod
    def update_and_fetch_model(ps_rref: Any, grad: Any) -> Any:
        self: ParameterServer = ps_rref.local_value()
        with self.lock:
            if isinstance(grad, list):
                for w, g in zip(self.tensors, grad, strict=True):
                    w.add_(g, alpha=-self.lr)
                self.applied += 1
                return [w.clone() for w in self.tensors]
            self.weights.add_(grad, alpha=-self.lr)
            self.applied += 1
            return self.weights.clone()

    @staticmethod
    def stats(ps_rref: Any) -> tuple[int, Any]:
        self: ParameterServer = ps_rref.local_value()
        with self.lock:
            if self.tensors:
                return self.applied, [w.clone() for w in self.tensors]
            return self.applied, self.weights.clone()


def run_trainer_phase(
    ps_rref: Any, n: int, rounds: int, shapes: list[tuple[int, ...]] | None = None
) -> tuple[float, float, int]:
    """Runs on a trainer: ``rounds`` push+pull calls; returns (start, end, rounds)."""
    import torch
    from torch.distributed import rpc

    grad = GRAD_CACHE.get(n)
    if grad is None:
        GRAD_CACHE.clear()
        if shapes:
            grad = [torch.ones(s, dtype=torch.float32) for s in shapes]
        else:
            grad = torch.ones(n, dtype=torch.float32)
        GRAD_CACHE[n] = grad
    owner = ps_rref.owner()
    t0 = time.monotonic()
    for _ in range(rounds):
        weights = rpc.rpc_sync(owner, ParameterServer.update_and_fetch_model, args=(ps_rref, grad))
    assert len(weights) == len(grad)
    return t0, time.monotonic(), rounds


def _ps_main(
    configs: list[tuple[int, int]],
    lr: float,
    target_s: float,
    shapes: list[tuple[int, ...]] | None,
    layout: dict[str, Any],
) -> None:
    import numpy as np
    import torch
    from torch.distributed import rpc

    import benchlib

    for n, workers in configs:
        ps_rref = rpc.RRef(ParameterServer(0 if shapes else n, lr, shapes))
        trainers = [f"trainer{r}" for r in range(1, workers + 1)]
        pushes = 0

        def phase(
            rounds: int, ps_rref: Any = ps_rref, trainers: list[str] = trainers, n: int = n
        ) -> float:
            nonlocal pushes
            futs = [
                rpc.rpc_async(t, run_trainer_phase, args=(ps_rref, n, rounds, shapes))
                for t in trainers
            ]
            stamps = torch.futures.wait_all(futs)
            pushes += sum(r for _, _, r in stamps)
            return max(e for _, e, _ in stamps) - min(s for s, _, _ in stamps)

        result = benchlib.measure(phase, n_elements=n, target_s=target_s)
        applied, weights = ParameterServer.stats(ps_rref)
        want = np.float32(-lr * pushes)
        tensors = weights if isinstance(weights, list) else [weights]
        check = {
            "pushes": pushes,
            "applied_updates": applied,
            "value_exact": all(bool(np.all(w.numpy() == want)) for w in tensors),
        }
        benchlib.emit({**_record(n, workers, result, check), **layout})
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
    rank: int,
    world: int,
    port: int,
    configs: list[tuple[int, int]],
    lr: float,
    target_s: float,
    shapes: list[tuple[int, ...]] | None = None,
    layout: dict[str, Any] | None = None,
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
            _ps_main(configs, lr, target_s, shapes, layout or {})
    finally:
        rpc.shutdown()


def run(
    configs: list[tuple[int, int]],
    lr: float,
    target_s: float,
    shapes: list[tuple[int, ...]] | None = None,
    layout: dict[str, Any] | None = None,
) -> None:
    """Spawn the rpc world (ps + max W trainers) and measure every config.

    ``shapes``: one tensor per shape (a model's parameters) instead of one of ``n`` elements;
    ``layout``: fields added to every JSON line.
    """
    import torch.multiprocessing as tmp

    import benchlib

    world = 1 + max(w for _, w in configs)
    port = benchlib.free_port()
    spawn_args = (world, port, configs, lr, target_s, shapes, layout)
    tmp.spawn(_rank_main, args=spawn_args, nprocs=world, join=True)
