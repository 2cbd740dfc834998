"""A ``ServerOptimizer`` + ``ShardSampler`` training loop for ``paramserver run`` tests:
``torch_run_worker.py OUT_DIR [CRASH_STEP]``.

Each worker trains :func:`make_model` on :func:`dataset` for :data:`EPOCHS` epochs with
server-side SGD (momentum), its share of each :data:`BATCH`-example step, as a user script
would. After each completed step it appends ``STEP INDEX...`` (the step of its name and the
examples it trained) to ``OUT_DIR/trained-<name>.txt``; at the end it saves its parameters to
``OUT_DIR/final-<name>.npz`` and prints ``final applied N clock C``. It prints ``resumed N``
first: the steps its name had completed (``client.progress()``).

With CRASH_STEP, worker 1 SIGKILLs itself once (``OUT_DIR/crashed`` marks that it did) in its
step CRASH_STEP, after the optimizer pushed the gradients and before it ends the clock: a death
in the middle of a step.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

SIZE, FEATURES, CLASSES = 64, 6, 3
#: Examples per step, all workers together (each takes BATCH / NUM_WORKERS).
BATCH = 8
EPOCHS = 2
LR, MOMENTUM = 0.2, 0.9


def dataset() -> TensorDataset:
    """(x, y, index): ``SIZE`` random examples, the same in every process."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(SIZE, FEATURES, generator=gen)
    y = torch.randint(0, CLASSES, (SIZE,), generator=gen)
    return TensorDataset(x, y, torch.arange(SIZE))


def make_model() -> torch.nn.Module:
    torch.manual_seed(7)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, CLASSES)
    )


def main() -> None:
    from paramserver.integrations.torch import ServerOptimizer, ShardSampler
    from paramserver.worker_client import WorkerEnv

    out = Path(sys.argv[1])
    crash_step = int(sys.argv[2]) if len(sys.argv) > 2 else -1
    env = WorkerEnv.from_env()
    torch.set_num_threads(1)
    data, model = dataset(), make_model()
    opt = ServerOptimizer(model.named_parameters(), "sgd", lr=LR, momentum=MOMENTUM)
    batch = BATCH // env.num_workers
    loader = DataLoader(
        data, batch_size=batch, sampler=ShardSampler(data, batch_size=batch, progress=opt)
    )
    step = opt.client.progress().steps
    print(f"resumed {step}", flush=True)
    marker = out / "crashed"
    if env.worker_index == 1 and crash_step >= 0 and not marker.exists():
        clock = opt.client.clock

        def dying_clock() -> Any:
            if step == crash_step:  # the gradients of this step are pushed: die now
                marker.write_text(str(step))
                os.kill(os.getpid(), signal.SIGKILL)
            return clock()

        opt.client.clock = dying_clock  # type: ignore[method-assign]
    with open(out / f"trained-{env.worker_name}.txt", "a") as log:
        for _ in range(EPOCHS):
            for x, y, index in loader:
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                log.write(f"{step} {' '.join(str(i) for i in index.tolist())}\n")
                log.flush()
                step += 1
    final = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    np.savez(out / f"final-{env.worker_name}.npz", **final)
    applied = opt.client.status().applied_updates
    print(f"final applied {applied} clock {opt.client.clock_value}", flush=True)
    opt.close()


if __name__ == "__main__":
    main()
