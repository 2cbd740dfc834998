"""A lost digits worker's replacement resumes its name's iterations instead of redoing them
(issue 31, item 4).

Two ``paramserver worker`` processes train the digits job under BSP on a real ``paramserver
serve`` (127.0.0.1, lease longer than the test). Worker 1 is SIGKILLed in the middle of its
second epoch (it is slowed with ``--slow-factor`` so the kill lands there); a replacement
starts with ``--replace`` under the same index. It asks the cluster how many iterations
``worker-1`` completed, skips them and trains the rest. Checked against values computed here:

* the shard applied exactly the planned updates, ``workers * epochs * steps`` (``steps`` from
  the data set's size), so no batch was trained twice and none was lost;
* the replacement reports it skipped exactly the iterations the cluster had counted for
  ``worker-1`` at the kill, and trained the rest;
* the final parameters equal, bit for bit, those of an uninterrupted run of the same job on a
  second server (the replacement trained the same batches in the same steps).

Before the change the replacement trained the whole plan again (applied > planned).
"""

from __future__ import annotations

import asyncio
import signal
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from paramserver.worker_client import connect
from tests.harness import JsonWorker, ScriptProcess, ServerProcess, eventually, status

from .helpers import report

pytest.importorskip("sklearn", reason="the digits job needs paramserver[demo] (scikit-learn)")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(240),
    pytest.mark.asyncio(loop_factories=["asyncio"]),
]

WORKERS, EPOCHS, BATCH, HIDDEN, SEED = 2, 4, 32, 8, 0
#: Worker 1 before the kill: each step sleeps at least 2 ms x this, so the test's SIGKILL lands
#: in its second epoch, mid-epoch (the replacement resumes inside an epoch's order).
SLOW_FACTOR = 20


class DigitsWorker(JsonWorker):
    """``paramserver worker --progress json`` with its JSON events collected."""

    def __init__(self, tmp: Path, address: str, index: int, *extra: str) -> None:
        argv = ["-m", "paramserver", "--log-level", "WARNING", "worker", "--progress", "json"]
        argv += ["--server", address, "--worker-index", str(index)]
        argv += ["--num-workers", str(WORKERS), "--epochs", str(EPOCHS)]
        argv += ["--batch-size", str(BATCH), "--hidden", str(HIDDEN), "--seed", str(SEED)]
        argv += ["--no-eval", "--min-accuracy", "0", *extra]
        ScriptProcess.__init__(self, tmp, f"worker-{index}", argv)
        self.events: list[dict[str, Any]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()


def steps_per_epoch() -> int:
    """Iterations per epoch: each worker's share of the training split in whole batches."""
    from sklearn.datasets import load_digits

    n = len(load_digits().target)
    n_train = n - round(n * 0.2)  # the job's 80/20 split
    return (n_train // WORKERS) // BATCH


async def final_params(address: str) -> dict[str, np.ndarray]:
    async with connect(address, "resume-test-reader", heartbeat=False) as ps:
        return await ps.pull(observer=True)


def progress_steps(st: Any, name: str) -> int:
    return next((int(p.steps) for p in st.progress if p.worker_name == name), 0)


async def test_a_replaced_worker_resumes_and_nothing_is_trained_twice(tmp_path: Path) -> None:
    steps = steps_per_epoch()
    per_worker = EPOCHS * steps
    planned = WORKERS * per_worker
    flags = ("--consistency", "bsp", "--lease-ms", "600000")
    (tmp_path / "job").mkdir()
    (tmp_path / "ref").mkdir()
    with (
        ServerProcess(tmp_path / "job", *flags) as server,
        ServerProcess(tmp_path / "ref", *flags) as ref_server,
        DigitsWorker(tmp_path, server.address, 0) as w0,
        DigitsWorker(tmp_path, server.address, 1, "--slow-factor", str(SLOW_FACTOR)) as w1,
        DigitsWorker(tmp_path, ref_server.address, 0) as r0,
        DigitsWorker(tmp_path, ref_server.address, 1) as r1,
    ):

        async def halfway_into_epoch_two() -> bool:
            if w1.proc.poll() is not None:
                raise AssertionError(f"worker 1 exited early: {w1.stderr()[-2000:]}")
            return progress_steps(await status(server.address), "worker-1") >= steps * 3 // 2

        await eventually(halfway_into_epoch_two, timeout_s=120, what="worker 1 in epoch 2")
        w1.kill()
        at_kill = progress_steps(await status(server.address), "worker-1")
        assert steps < at_kill < per_worker, at_kill
        with DigitsWorker(tmp_path, server.address, 1, "--replace") as successor:
            codes = await asyncio.gather(
                *(w.wait_exit(timeout_s=120) for w in (w0, successor, r0, r1))
            )
            assert codes == [0] * 4, [w.stderr()[-2000:] for w in (w0, successor, r0, r1)]
            start = await successor.wait_for("start")
            done = await successor.wait_for("done")
        assert w1.proc.returncode == -signal.SIGKILL

        assert (start["resumed_steps"], start["planned_steps"]) == (at_kill, per_worker)
        assert (done["steps"], done["resumed_steps"], done["trained_steps"]) == (
            per_worker,
            at_kill,
            per_worker - at_kill,
        )
        assert (await w0.wait_for("done"))["resumed_steps"] == 0
        st = await status(server.address)
        assert st.applied_updates == planned, (st.applied_updates, planned, at_kill)
        assert [progress_steps(st, f"worker-{i}") for i in range(WORKERS)] == [per_worker] * 2
        ref_status = await status(ref_server.address)
        assert ref_status.applied_updates == planned
        got, want = await final_params(server.address), await final_params(ref_server.address)
        assert sorted(got) == sorted(want)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    report(
        "digits worker SIGKILLed under BSP, replaced with --replace",
        applied=st.applied_updates,
        planned=planned,
        resumed_steps=at_kill,
        trained_by_successor=per_worker - at_kill,
    )
