"""One dedup window per registration for every mutation kind: a retried row push is applied
once after its worker re-registers with ``resume_worker_id`` (and with ``replace``), as a
retried dense push already was."""

from __future__ import annotations

import numpy as np
import pytest

from paramserver.core.dedup import DedupWindows
from paramserver.core.optimizers import UpdateRule
from paramserver.core.shard import ServerCore
from paramserver.protocol.table_spec import TableRule, TableSpec
from paramserver.server.config import ServerConfig

pytestmark = pytest.mark.timeout(60)

IDS = np.array([3, 3, 11], np.int64)
GRADS = np.array([[1.0, 2.0], [0.5, 0.5], [-1.0, 4.0]], np.float32)


def push_rows(core: ServerCore, worker_id: str, request_id: int) -> bool:
    prepared = core.tables.prepare(core.cluster, worker_id, request_id, 0, "emb", IDS, GRADS)
    return bool(core.tables.commit(prepared, now_s=0.0).duplicate)


def served_core() -> tuple[ServerCore, np.ndarray]:
    core = ServerCore(ServerConfig(consistency="asp"))
    core.tables.init(TableSpec("emb", 2, rule=TableRule("sgd", lr=1.0)))
    core.init({"w": np.zeros(2, np.float32)}, UpdateRule("add"))
    initial = core.tables.get("emb").pull(np.array([3, 11], np.int64)).copy()
    return core, initial


def expected_after_one_push(initial: np.ndarray) -> np.ndarray:
    # sgd, lr 1: duplicate ids summed first (numpy, independent of the table code)
    summed = np.stack([GRADS[0] + GRADS[1], GRADS[2]])
    return (initial - summed).astype(np.float32)


@pytest.mark.parametrize("how", ["resume", "resume_and_replace"])
def test_a_row_push_retried_under_a_new_registration_is_applied_once(how: str) -> None:
    core, initial = served_core()
    first = core.register("w0", 0.0).worker_id
    assert not push_rows(core, first, 7)
    assert core.push(first, 8, 0, {"w": np.ones(2, np.float32)}, 0.0).duplicate is False
    if how == "resume":  # the lease lapsed; the client re-registers and retries
        core.evict([first])
        second = core.register("w0", 1.0, resume_worker_id=first).worker_id
    else:  # a successor fences the live registration and resumes it
        second = core.register("w0", 1.0, replace=True, resume_worker_id=first).worker_id
    assert second != first
    assert push_rows(core, second, 7)  # the retry: a duplicate, nothing applied again
    assert core.push(second, 8, 0, {"w": np.ones(2, np.float32)}, 0.0).duplicate
    rows = core.tables.get("emb").pull(np.array([3, 11], np.int64))
    np.testing.assert_array_equal(rows, expected_after_one_push(initial))
    np.testing.assert_array_equal(core.store.get("w").value, np.ones(2, np.float32))


def test_a_new_registration_without_resume_numbers_afresh() -> None:
    core, initial = served_core()
    first = core.register("w0", 0.0).worker_id
    assert not push_rows(core, first, 7)
    second = core.register("w0", 1.0, replace=True).worker_id
    assert not push_rows(core, second, 7)  # a restarted worker's own request 7: applied
    rows = core.tables.get("emb").pull(np.array([3, 11], np.int64))
    twice = initial - 2 * (initial - expected_after_one_push(initial))
    np.testing.assert_allclose(rows, twice, rtol=0, atol=1e-6)


def test_windows_are_bounded_per_kind_and_carried_whole() -> None:
    windows = DedupWindows(("a", "b"), window=3)
    for rid in range(5):
        windows.remember("a", "w#1", rid, f"a{rid}")
    windows.remember("b", "w#1", 0, "b0")
    assert [windows.get("a", "w#1", r) for r in range(5)] == [None, None, "a2", "a3", "a4"]
    windows.remember("a", "w#2", 9, "a9")
    windows.carry_over("w#1", "w#2")
    assert windows.get("a", "w#1", 4) is None and windows.get("b", "w#2", 0) == "b0"
    assert [windows.get("a", "w#2", r) for r in (3, 4, 9)] == ["a3", "a4", "a9"]
    assert windows.get("a", "w#2", 2) is None  # merged, then bounded again (oldest first)
    windows.forget_except({"w#3"})
    assert windows.of("a") == {} and windows.of("b") == {}
