"""Case retried-push.md on the pure core: a retried push is applied once, fresh ids never refused.

Expected values are closed forms: SGD with lr 1 from zeros gives ``w = -sum(applied gradients)``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from paramserver.core.dedup import DEDUP_WINDOW
from paramserver.core.optimizers import UpdateRule
from paramserver.core.shard import ServerCore
from paramserver.errors import FailedPrecondition, NonFiniteGradient
from paramserver.server.checkpoint import CheckpointManager
from paramserver.server.config import ServerConfig

pytestmark = pytest.mark.timeout(60)

SGD1 = UpdateRule("sgd", lr=1.0)
ONES = np.ones(4, np.float32)


def _core(consistency: str = "asp") -> ServerCore:
    core = ServerCore(ServerConfig(consistency=consistency))
    core.init({"w": np.zeros(4, np.float32)}, SGD1)
    return core


def test_retry_with_same_request_id_is_applied_once() -> None:
    """Case retried-push.md: ASP, w = zeros(4), sgd lr 1, push [1,1,1,1] as r1, retry r1:
    w == [-1,-1,-1,-1], the retry is a duplicate, applied count 1."""
    core = _core()
    wid = core.register("worker", 0.0).worker_id
    first = core.push(wid, 1, 0, {"w": ONES}, 0.0)
    retry = core.push(wid, 1, 0, {"w": ONES}, 0.0)
    assert (first.duplicate, retry.duplicate) == (False, True)
    assert first.applied_updates == retry.applied_updates == 1
    np.testing.assert_array_equal(core.store.get("w").value, np.full(4, -1, np.float32))
    assert (core.applied_updates, core.duplicate_pushes) == (1, 1)


def test_dedup_survives_a_reregistration_that_resumes_the_old_one() -> None:
    """Case retried-push.md: a client whose registration was lost re-registers (new worker id,
    same name) resuming the old one and retries an applied request id: a duplicate, not a
    second application."""
    core = _core()
    old = core.register("worker", 0.0).worker_id
    core.push(old, 7, 0, {"w": ONES}, 0.0)
    new = core.register("worker", 1.0, replace=True, resume_worker_id=old).worker_id
    assert new != old
    assert core.push(new, 7, 0, {"w": ONES}, 1.0).duplicate
    np.testing.assert_array_equal(core.store.get("w").value, np.full(4, -1, np.float32))


def test_a_new_registration_of_the_same_name_numbers_its_pushes_afresh() -> None:
    """A worker process that restarts registers its name again (not resuming) and numbers its
    pushes from 1: every one is applied, none answered as a duplicate of its predecessor's."""
    core = _core()
    old = core.register("worker", 0.0).worker_id
    for rid in (1, 2, 3):
        core.push(old, rid, 0, {"w": ONES}, 0.0)
    core.leave(old)
    new = core.register("worker", 1.0).worker_id
    for rid in (1, 2, 3):
        assert not core.push(new, rid, 0, {"w": ONES}, 1.0).duplicate
    np.testing.assert_array_equal(core.store.get("w").value, np.full(4, -6, np.float32))
    assert (core.applied_updates, core.duplicate_pushes) == (6, 0)


def test_resume_of_another_names_registration_carries_nothing_over() -> None:
    """resume_worker_id only continues a departed registration of the same name."""
    core = _core()
    a = core.register("a", 0.0).worker_id
    core.push(a, 1, 0, {"w": ONES}, 0.0)
    core.leave(a)
    b = core.register("b", 1.0, resume_worker_id=a).worker_id
    assert not core.push(b, 1, 0, {"w": ONES}, 1.0).duplicate


def test_fresh_ids_beyond_the_dedup_window_are_all_applied() -> None:
    """Case retried-push.md: dedup never refuses new legitimate pushes, also after the window of
    remembered ids has filled and started to evict (DEDUP_WINDOW + 500 fresh ids)."""
    core = _core()
    wid = core.register("worker", 0.0).worker_id
    n = DEDUP_WINDOW + 500
    for rid in range(1, n + 1):
        assert not core.push(wid, rid, 0, {"w": ONES}, 0.0).duplicate
    assert core.applied_updates == n
    np.testing.assert_array_equal(core.store.get("w").value, np.full(4, -n, np.float32))
    assert core.push(wid, n, 0, {"w": ONES}, 0.0).duplicate  # the newest id is still remembered
    assert core.applied_updates == n


def test_request_ids_are_scoped_per_worker() -> None:
    """Case retried-push.md: two workers that both number their pushes 1..50 are both applied."""
    core = _core()
    a = core.register("a", 0.0).worker_id
    b = core.register("b", 0.0).worker_id
    for rid in range(1, 51):
        assert not core.push(a, rid, 0, {"w": ONES}, 0.0).duplicate
        assert not core.push(b, rid, 0, {"w": ONES}, 0.0).duplicate
    np.testing.assert_array_equal(core.store.get("w").value, np.full(4, -100, np.float32))


def test_refused_push_is_not_remembered() -> None:
    """Case retried-push.md: a push refused (NaN) under r1 is not recorded, so a corrected push
    under r1 is applied, not answered as a duplicate of something never applied."""
    core = _core()
    wid = core.register("worker", 0.0).worker_id
    bad = ONES.copy()
    bad[0] = np.nan
    with pytest.raises(NonFiniteGradient):
        core.push(wid, 1, 0, {"w": bad}, 0.0)
    assert not core.push(wid, 1, 0, {"w": ONES}, 0.0).duplicate
    np.testing.assert_array_equal(core.store.get("w").value, np.full(4, -1, np.float32))


def test_bsp_second_push_same_step_refused_retry_counted_once() -> None:
    """Case retried-push.md (BSP): a retry of r1 is a duplicate (before and after the step
    closes); a second push in the same step under r2 is refused and not in the mean."""
    core = _core("bsp")
    a = core.register("a", 0.0).worker_id
    b = core.register("b", 0.0).worker_id
    core.push(a, 1, 0, {"w": np.full(4, 2, np.float32)}, 0.0)
    assert core.push(a, 1, 0, {"w": np.full(4, 2, np.float32)}, 0.0).duplicate
    with pytest.raises(FailedPrecondition):
        core.push(a, 2, 0, {"w": np.full(4, 100, np.float32)}, 0.0)
    core.push(b, 1, 0, {"w": np.full(4, 4, np.float32)}, 0.0)
    core.clock(a, 0)
    core.clock(b, 0)
    expected = np.full(4, -(2 + 4) / 2, np.float32)
    np.testing.assert_array_equal(core.store.get("w").value, expected)
    assert core.push(a, 1, 0, {"w": np.full(4, 2, np.float32)}, 0.0).duplicate
    np.testing.assert_array_equal(core.store.get("w").value, expected)
    assert (core.applied_updates, core.duplicate_pushes, core.rejected_pushes) == (2, 2, 1)


def test_dedup_survives_checkpoint_restore(tmp_path: Path) -> None:
    """Case retried-push.md: after a checkpoint and a restore into a fresh core, a retry of r1
    is a duplicate and a fresh r2 is applied."""
    core = _core()
    wid = core.register("worker", 0.0).worker_id
    core.push(wid, 1, 0, {"w": ONES}, 0.0)
    CheckpointManager(tmp_path).save(core)

    restored = ServerCore(ServerConfig(consistency="asp"))
    assert CheckpointManager(tmp_path).restore_latest(restored) is not None
    assert restored.push(wid, 1, 0, {"w": ONES}, 0.0).duplicate
    np.testing.assert_array_equal(restored.store.get("w").value, np.full(4, -1, np.float32))
    assert not restored.push(wid, 2, 0, {"w": ONES}, 0.0).duplicate
    np.testing.assert_array_equal(restored.store.get("w").value, np.full(4, -2, np.float32))
    assert restored.applied_updates == 2
