"""A real worker process for the kill / leave cases (its test-side handle is
:class:`tests.harness.processes.PlanWorker`).

Run by path (not collected)::

    python plan_worker.py ADDRESS NAME PLAN_JSON

``PLAN_JSON`` is ``{"key": "w", "dtype": "float32", "grads": [[...], ...], "then": "hang"}``:
the worker registers with :func:`paramserver.worker_client.connect` (heartbeats on, every
quarter lease), and for each gradient pulls ``key`` (waiting as the consistency model requires),
pushes the gradient and clocks. It then prints ``READY <worker id> <clock>`` and either waits
to be killed (``"hang"``, heartbeats keep running until SIGKILL) or leaves and exits 0
(``"leave"``).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time
from typing import Any

import numpy as np


def exit_with_parent() -> None:
    """End this process when the test that started it is gone (it was re-parented): a test
    that died before killing its worker must not leave it running. A daemon thread polls."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


async def _main(address: str, name: str, plan: dict[str, Any]) -> int:
    from paramserver.worker_client import connect

    key = plan.get("key", "w")
    async with connect(address, name, auto_reregister=False, wait_timeout_s=30.0) as ps:
        for grad in plan.get("grads", []):
            await ps.pull([key])
            await ps.push({key: np.asarray(grad, dtype=plan.get("dtype", "float32"))})
            await ps.clock()
        print(f"READY {ps.worker_id} {ps.clock_value}", flush=True)
        if plan.get("then", "hang") == "hang":
            await asyncio.Event().wait()  # heartbeats keep the lease until SIGKILL
    return 0  # leaving the `async with` leaves the cluster cleanly


if __name__ == "__main__":
    exit_with_parent()
    sys.exit(asyncio.run(_main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))))
