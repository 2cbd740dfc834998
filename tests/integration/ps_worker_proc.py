"""A real worker process for the kill / leave cases, and the test-side handle that runs it.

Run by path (not collected)::

    python ps_worker_proc.py ADDRESS NAME PLAN_JSON

``PLAN_JSON`` is ``{"key": "w", "dtype": "float32", "grads": [[...], ...], "then": "hang"}``:
the worker registers with :func:`paramserver.worker_client.connect` (heartbeats on, every
quarter lease), and for each gradient pulls ``key`` (waiting as the consistency model requires),
pushes the gradient and clocks. It then prints ``READY <worker id> <clock>`` and either waits
to be killed (``"hang"``, heartbeats keep running until SIGKILL) or leaves and exits 0
(``"leave"``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

SCRIPT = Path(__file__).resolve()


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


class WorkerProcess:
    """``ps_worker_proc.py`` as a subprocess; :meth:`ready` waits for its READY line."""

    def __init__(self, address: str, name: str, plan: dict[str, Any], log_dir: Path) -> None:
        self.name = name
        self.log_path = log_dir / f"worker-{name}-{time.monotonic_ns()}.log"
        self._log = open(self.log_path, "wb")  # closed in kill() / wait()
        self.proc = subprocess.Popen(
            [sys.executable, str(SCRIPT), address, name, json.dumps(plan)],
            stdout=subprocess.PIPE,
            stderr=self._log,
        )
        self.worker_id = ""
        self.clock = -1

    async def ready(self, timeout_s: float = 30.0) -> None:
        """Wait for ``READY <id> <clock>``; fail with the worker's log if it exits first."""
        assert self.proc.stdout is not None
        try:
            line = await asyncio.wait_for(asyncio.to_thread(self.proc.stdout.readline), timeout_s)
        except TimeoutError:
            self.kill()
            raise AssertionError(
                f"worker {self.name} not ready in {timeout_s} s: {self.log()}"
            ) from None
        parts = line.decode().split()
        if len(parts) != 3 or parts[0] != "READY":
            self.kill()
            raise AssertionError(f"worker {self.name} said {line!r}: {self.log()}")
        self.worker_id, self.clock = parts[1], int(parts[2])

    def kill(self) -> None:
        """SIGKILL (no leave, no goodbye) and reap."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._close()

    async def wait(self, timeout_s: float = 30.0) -> int:
        """Wait for a voluntary exit; returns the exit status."""
        rc = await asyncio.wait_for(asyncio.to_thread(self.proc.wait), timeout_s)
        self._close()
        return rc

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _close(self) -> None:
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        with contextlib.suppress(OSError):
            self._log.close()


if __name__ == "__main__":
    exit_with_parent()
    sys.exit(asyncio.run(_main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))))
