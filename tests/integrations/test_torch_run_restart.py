"""``ServerOptimizer`` + ``ShardSampler`` under ``paramserver run`` with a worker killed in the
middle of a step and restarted by ``--max-restarts``.

Worker 1 SIGKILLs itself in its step 10 (of 16: the second epoch), after its gradients were
pushed and before the clock ended the step. ``paramserver run`` starts it again under its name;
it replaces the dead registration, learns from the cluster that its name completed 10 steps,
and trains the rest. Checked against torch alone, not against the code under test:

* every step of each worker is trained once (no batch twice, none skipped), and at each step
  the two workers' examples together are the batch a single process with torch's
  ``DistributedSampler`` takes at that step;
* the servers applied exactly the planned updates (2 workers x 16 steps);
* under BSP with mean aggregation both workers end on the parameters of single-process
  ``torch.optim.SGD`` (momentum) on those batches, as if nobody had died.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch integration needs torch")

from tests.harness import ScriptProcess  # noqa: E402
from tests.harness.processes import HERE  # noqa: E402
from tests.harness.torch_run_worker import (  # noqa: E402
    BATCH,
    EPOCHS,
    LR,
    MOMENTUM,
    SIZE,
    dataset,
    make_model,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

WORKERS = 2
CRASH_STEP = 10
STEPS = EPOCHS * SIZE // BATCH  # per worker


def single_process() -> tuple[list[set[int]], dict[str, np.ndarray]]:
    """The oracle: each step's batch and the final parameters of plain torch in one process."""
    data, model = dataset(), make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0, seed=0)
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, sampler=sampler)
    batches = []
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for x, y, index in loader:
            batches.append(set(index.tolist()))
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    return batches, {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def test_a_killed_worker_resumes_and_bsp_ends_on_the_single_process_parameters(
    tmp_path: Path,
) -> None:
    batches, want = single_process()
    assert len(batches) == STEPS
    argv = [
        "-m", "paramserver", "run", "--workers", str(WORKERS), "--consistency", "bsp",
        "--aggregation", "mean", "--max-restarts", "1",
        str(HERE / "torch_run_worker.py"), str(tmp_path), str(CRASH_STEP),
    ]  # fmt: skip
    with ScriptProcess(tmp_path, "run", argv, group=True) as proc:
        out, err = proc.communicate(timeout_s=100)
        assert proc.proc.returncode == 0, err[-3000:]
    lines = out.splitlines()
    assert (tmp_path / "crashed").read_text() == str(CRASH_STEP)
    assert "worker 1 exited with 137; restarting it (1 of 1)" in err, err
    assert "[worker 1] resumed 0" in lines and f"[worker 1] resumed {CRASH_STEP}" in lines, out

    # Every step of each worker trained once; the two shares of a step are its batch alone.
    trained: dict[int, set[int]] = {}
    for i in range(WORKERS):
        rows = (tmp_path / f"trained-worker-{i}.txt").read_text().split("\n")[:-1]
        steps = [int(row.split()[0]) for row in rows]
        assert steps == list(range(STEPS)), (i, steps)
        for row in rows:
            step, *index = (int(v) for v in row.split())
            assert len(index) == BATCH // WORKERS
            assert not trained.setdefault(step, set()) & set(index)
            trained[step] |= set(index)
    assert [trained[s] for s in range(STEPS)] == batches

    finals = [re.fullmatch(r"\[worker \d\] final applied (\d+) clock (\d+)", ln) for ln in lines]
    applied = [int(m.group(1)) for m in finals if m]
    planned = WORKERS * STEPS
    assert len(applied) == WORKERS and max(applied) == planned and min(applied) <= planned, out
    # The successor took its predecessor's clock: it redid step 10 in step 10, not later.
    assert [int(m.group(2)) for m in finals if m] == [STEPS] * WORKERS, out

    start = {k: v.detach().numpy() for k, v in make_model().state_dict().items()}
    for i in range(WORKERS):
        got = np.load(tmp_path / f"final-worker-{i}.npz")
        assert sorted(got.files) == sorted(want)
        for key, value in want.items():
            assert not np.allclose(value, start[key])  # training moved it
            np.testing.assert_allclose(got[key], value, rtol=1e-5, atol=1e-6, err_msg=key)
