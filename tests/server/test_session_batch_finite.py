"""The Session's one NaN/Inf scan per shared-memory slot batch (instead of one per key).

A real in-process server and a worker client on the same host (shared memory on); 40 float32
keys of 1000 elements (4000 bytes, so 32 bytes of padding after each slot): a push of them all
goes as one slot batch. The per-key scan of the store is counted to show which path ran.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import paramserver.core.store as store_module
from paramserver.errors import NonFiniteGradient
from paramserver.protocol import shm
from paramserver.worker_client import UpdateRule, WorkerClient
from tests.harness import running_server

pytestmark = pytest.mark.timeout(60)

KEYS = [f"k{i:02d}" for i in range(40)]
N = 1000
LR = 0.5


@pytest.fixture
def per_key_scans(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    calls: list[int] = []
    real = store_module.count_non_finite

    def counting(grad: Any) -> int:
        calls.append(1)
        return real(grad)

    monkeypatch.setattr(store_module, "count_non_finite", counting)
    yield calls


def _grads(fill: float) -> dict[str, np.ndarray]:
    return {k: np.full(N, fill * (i + 1), np.float32) for i, k in enumerate(KEYS)}


async def _client(address: str) -> WorkerClient:
    client = WorkerClient(address, "w0")
    await client.open()
    await client.init({k: np.ones(N, np.float32) for k in KEYS}, rule=UpdateRule("sgd", lr=LR))
    return client


def _expected(pushes: list[float]) -> dict[str, np.ndarray]:
    # Dyadic steps: exact in float32, computed in float64 independently of the server.
    return {
        k: np.full(N, 1.0 - sum(LR * f * (i + 1) for f in pushes), np.float64).astype(np.float32)
        for i, k in enumerate(KEYS)
    }


async def test_a_clean_batch_is_scanned_once_not_per_key(per_key_scans: list[int]) -> None:
    async with running_server(consistency="asp") as srv:
        client = await _client(srv.address)
        try:
            await client.push(_grads(0.25))
            assert client.fastpath is not None and client.fastpath.shm_active
            per_key_scans.clear()
            pulled = await client.push_pull(_grads(0.125))
            assert per_key_scans == []  # the batch's one scan stood for all 40 keys
            for k, v in _expected([0.25, 0.125]).items():
                np.testing.assert_array_equal(pulled[k], v)
        finally:
            await client.close()


async def test_a_nan_in_one_key_of_a_batch_is_refused_naming_it(per_key_scans: list[int]) -> None:
    async with running_server(consistency="asp") as srv:
        client = await _client(srv.address)
        try:
            await client.push(_grads(0.25))
            bad = _grads(0.125)
            bad["k07"][123] = np.nan
            with pytest.raises(NonFiniteGradient, match="k07"):
                await client.push(bad)
            assert per_key_scans  # the batch scan found it: the keys were scanned one by one
            pulled = await client.pull(KEYS)
            for k, v in _expected([0.25]).items():  # nothing of the refused push applied
                np.testing.assert_array_equal(pulled[k], v)
        finally:
            await client.close()


async def test_nan_bytes_in_the_padding_between_slots_refuse_nothing(
    per_key_scans: list[int],
) -> None:
    async with running_server(consistency="asp") as srv:
        client = await _client(srv.address)
        try:
            await client.push(_grads(0.25))
            seg = client.fastpath._segment  # type: ignore[union-attr]
            assert seg is not None
            slot = shm.align_up(N * 4)
            assert slot > N * 4  # there is padding after every slot
            for i in range(len(KEYS) - 1):
                seg.push.view(i * slot + N * 4, 4, np.dtype(np.float32), (1,))[0] = np.nan
            per_key_scans.clear()
            await client.push(_grads(0.125))
            assert len(per_key_scans) == len(KEYS)  # the span was not clean: per key, all clean
            pulled = await client.pull(KEYS)
            for k, v in _expected([0.25, 0.125]).items():
                np.testing.assert_array_equal(pulled[k], v)
        finally:
            await client.close()


async def test_under_bsp_the_queued_copies_are_scanned_not_the_region(
    per_key_scans: list[int],
) -> None:
    # BSP queues copies of the gradients: the scan must be of those copies (the bytes kept),
    # so the batch scan of the shared region does not stand for them.
    async with running_server(consistency="bsp") as srv:
        client = await _client(srv.address)
        try:
            await client.pull(KEYS)
            await client.push(_grads(0.25))  # the segment is set up by the first big request
            await client.clock()
            await client.pull(KEYS)
            per_key_scans.clear()
            await client.push(_grads(0.125))
            assert len(per_key_scans) >= len(KEYS)
            await client.clock()
            pulled = await client.pull(KEYS)
            for k, v in _expected([0.25, 0.125]).items():
                np.testing.assert_array_equal(pulled[k], v)
        finally:
            await client.close()


async def test_views_pulled_with_copy_false_are_new_arrays_each_time() -> None:
    async with running_server(consistency="asp") as srv:
        client = await _client(srv.address)
        try:
            await client.push(_grads(0.25))
            first = (await client.pull(KEYS, copy=False))["k03"]
            first.shape = (10, 100)  # the caller's own array object
            second = (await client.pull(KEYS, copy=False))["k03"]
            assert second is not first and second.shape == (N,) and second.flags.writeable
            np.testing.assert_array_equal(second, _expected([0.25])["k03"])
        finally:
            await client.close()
