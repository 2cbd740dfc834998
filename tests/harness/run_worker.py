"""A worker script for ``paramserver run`` tests: ``run_worker.py STEPS [CRASH_FILE|-] [ARGS...]``.

It connects from the environment, declares ``x`` (rule ``add``), resumes at the iterations its
name completed (``client.progress()``), and for each remaining step pulls, pushes a gradient
of 1 and clocks. With CRASH_FILE, worker 1 SIGKILLs itself once (the file marks that it did),
right after its push of step 2 and before that step's clock: a death in the middle of a step.
It prints ``resumed N``, then after its last step ``final x X applied N`` (pulled after its
last clock, so under BSP once every worker's last step closed) and ``done INDEX NUM_WORKERS
NAME ARGS``; it exits with
the code ``EXIT_CODE_<INDEX>`` names (default 0).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import numpy as np

import paramserver as ps
from paramserver.worker_client import WorkerEnv

steps = int(sys.argv[1])
crash = Path(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2] != "-" else None
env = WorkerEnv.from_env()
with ps.connect_sync_from_env() as worker:
    worker.init({"x": np.zeros(1, np.float32)}, rule=ps.UpdateRule("add"))
    done = worker.progress().steps
    print(f"resumed {done}", flush=True)
    worker.wait_for_workers(env.num_workers)
    for step in range(done, steps):
        worker.pull(["x"])
        worker.push({"x": np.ones(1, np.float32)})
        if crash is not None and env.worker_index == 1 and step == 2 and not crash.exists():
            crash.write_text("crashed")
            os.kill(os.getpid(), signal.SIGKILL)
        worker.clock()
    final = float(worker.pull(["x"])["x"][0])  # BSP: waits for every worker's last step
    applied = worker.status().applied_updates
    print(f"final x {final} applied {applied}", flush=True)
    print(f"done {env.worker_index} {env.num_workers} {env.worker_name} {sys.argv[3:]}", flush=True)
sys.exit(int(os.environ.get(f"EXIT_CODE_{env.worker_index}", "0")))
