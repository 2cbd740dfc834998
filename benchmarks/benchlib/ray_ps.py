"""The push+pull workload as a Ray actor parameter server (Ray's documented pattern).

After the parameter-server example of the Ray documentation ("Parameter Server" in Ray's
examples): a ``ParameterServer`` actor holds the weights and offers ``apply_gradients(*grads)``,
which applies the update and returns the new weights, and ``get_weights()``; workers are actors
that call ``apply_gradients`` with their gradient and ``ray.get`` the returned weights (one call
per round: push and pull together). With several tensors (a real model's shapes) the worker
sends them all in one ``apply_gradient_list(grads)`` call that returns the list of weights (the
fused one-call pattern). Arrays travel through Ray's shared-memory object store
(zero-copy reads of numpy arrays on the same host). Every actor asks for ``num_cpus=0`` so
W + 1 actors fit on this 2-core machine; the ASP update ``w -= lr * g`` runs on the actor's single
thread, so no lock is needed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np


def run(
    configs: list[tuple[int, int]],
    lr: float,
    measure: Callable[..., dict[str, Any]],
    report: Callable[[int, int, dict[str, Any], dict[str, Any]], None],
    target_s: float,
    shapes: list[tuple[int, ...]] | None = None,
) -> None:
    """Measure every ``(n, workers)`` config in one Ray session; ``report`` gets each result."""
    import ray

    @ray.remote(num_cpus=0)
    class ParameterServer:
        def __init__(self, n: int, lr: float, shapes: list[tuple[int, ...]] | None) -> None:
            self.weights = np.zeros(n, dtype=np.float32)
            self.tensors = [np.zeros(s, dtype=np.float32) for s in shapes or []]
            self.lr = np.float32(lr)
            self.applied = 0

        def apply_gradient_list(self, grads: list[np.ndarray]) -> list[np.ndarray]:
            for w, g in zip(self.tensors, grads, strict=True):
                w -= self.lr * g
            self.applied += 1
            return self.tensors

        def all_exact(self, value: float) -> bool:
            return all(bool(np.all(w == np.float32(value))) for w in self.tensors)

        def apply_gradients(self, *gradients: np.ndarray) -> np.ndarray:
            for grad in gradients:
                self.weights -= self.lr * grad
                self.applied += 1
            return self.weights

        def get_weights(self) -> np.ndarray:
            return self.weights

        def applied_updates(self) -> int:
            return self.applied

    @ray.remote(num_cpus=0)
    class Worker:
        def __init__(self, ps: Any, n: int, shapes: list[tuple[int, ...]] | None) -> None:
            self.ps = ps
            self.grad = np.ones(n, dtype=np.float32)
            self.grads = [np.ones(s, dtype=np.float32) for s in shapes or []]
            self.pushes = 0

        def run_phase(self, rounds: int) -> tuple[float, float]:
            t0 = time.monotonic()
            if self.grads:
                for _ in range(rounds):
                    tensors = ray.get(self.ps.apply_gradient_list.remote(self.grads))
                    self.pushes += 1
                assert len(tensors) == len(self.grads)
                return t0, time.monotonic()
            for _ in range(rounds):
                weights = ray.get(self.ps.apply_gradients.remote(self.grad))
                self.pushes += 1
            assert weights.shape == self.grad.shape
            return t0, time.monotonic()

        def pushes_done(self) -> int:
            return self.pushes

    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
    try:
        for n, workers in configs:
            ps = ParameterServer.remote(0 if shapes else n, lr, shapes)
            pool = [Worker.remote(ps, n, shapes) for _ in range(workers)]
            ray.get([w.pushes_done.remote() for w in pool])  # every actor is up

            def phase(rounds: int, pool: list[Any] = pool) -> float:
                stamps = ray.get([w.run_phase.remote(rounds) for w in pool])
                return max(e for _, e in stamps) - min(s for s, _ in stamps)

            result = measure(phase, n_elements=n, target_s=target_s)
            pushes = sum(ray.get([w.pushes_done.remote() for w in pool]))
            applied = ray.get(ps.applied_updates.remote())
            if shapes:
                exact = bool(ray.get(ps.all_exact.remote(-lr * pushes)))
            else:
                weights = ray.get(ps.get_weights.remote())
                exact = bool(np.all(weights == np.float32(-lr * pushes)))
            check = {"pushes": pushes, "applied_updates": applied, "value_exact": exact}
            report(n, workers, result, check)
            for actor in [*pool, ps]:
                ray.kill(actor)
    finally:
        ray.shutdown()
