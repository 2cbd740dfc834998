"""Unit tests of the merged completion (TransferCompleteNotification) with in-process rank tasks.

No sockets; each test runs its own event loop, under asyncio and under uvloop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import pytest

from paramserver.cli.rank import run_event_loop
from paramserver.errors import ParamServerError, Unavailable, WaitTimeout
from paramserver.spmd.notification import TransferCompleteNotification
from paramserver.spmd.planning import Placement, RankTransferResult
from paramserver.spmd.transfer_errors import TransferFailed

LOOPS = ["asyncio", "uvloop"]


def run(loop: str, body: Callable[[], Awaitable[Any]]) -> Any:
    return run_event_loop(body(), loop)


def result(rank: int, n: int = 1) -> RankTransferResult:
    placements = tuple(Placement(k, 10 + k) for k in range(n))
    return RankTransferResult(rank, n * 4096, 0.001, placements, "local")


@pytest.mark.parametrize("loop", LOOPS)
def test_completes_only_when_every_rank_finished(loop: str) -> None:
    async def body() -> None:
        gates = {r: asyncio.Event() for r in range(3)}

        async def rank(r: int) -> RankTransferResult:
            await gates[r].wait()
            return result(r, r)

        tasks = {r: asyncio.create_task(rank(r)) for r in range(3)}
        note = TransferCompleteNotification("op", tasks, 3)
        assert note.poll() is None and not note.done()
        gates[0].set()
        gates[2].set()
        await asyncio.sleep(0.01)
        assert note.poll() is None
        assert note.pending_ranks == [1]
        gates[1].set()
        merged = await note
        assert note.done()
        assert sorted(merged.results) == [0, 1, 2]
        assert merged.results[0].placements == ()  # a rank with no blocks: empty completion
        assert merged.bytes_moved == (0 + 1 + 2) * 4096
        assert note.poll() is merged
        assert await note.wait(timeout_s=1) is merged

    run(loop, body)


@pytest.mark.parametrize("loop", LOOPS)
def test_fails_with_every_failing_rank_and_keeps_the_others(loop: str) -> None:
    async def body() -> None:
        async def ok(r: int) -> RankTransferResult:
            return result(r)

        async def fail(exc: BaseException) -> RankTransferResult:
            await asyncio.sleep(0.01)
            raise exc

        async def never() -> RankTransferResult:
            await asyncio.Event().wait()
            raise AssertionError

        tasks = {
            0: asyncio.create_task(ok(0)),
            1: asyncio.create_task(fail(WaitTimeout("rank 1 (a): deadline"))),
            2: asyncio.create_task(fail(Unavailable("rank 2 (b): gone"))),
            3: asyncio.create_task(fail(RuntimeError("boom"))),
            4: asyncio.create_task(never()),
        }
        note = TransferCompleteNotification("execute_local_transfer", tasks, 5)
        with pytest.raises(TimeoutError):
            await note.wait(timeout_s=0.05)  # rank 4 still running: no merged result yet
        tasks[4].cancel()
        with pytest.raises(TransferFailed) as info:
            await note
        err = info.value
        assert err.failed_ranks == [1, 2, 3, 4]
        assert list(err.results) == [0]
        assert err.failures[1].code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert err.failures[2].code == grpc.StatusCode.UNAVAILABLE
        assert "rank 3: RuntimeError: boom" in err.failures[3].message
        assert "rank 4: cancelled" in err.failures[4].message
        for r in (1, 2, 3, 4):
            assert f"rank {r}" in err.message
        assert err.code == grpc.StatusCode.INTERNAL  # the ranks failed with different codes
        assert note.failure is err
        with pytest.raises(TransferFailed):
            note.poll()

    run(loop, body)


def test_empty_group_completes() -> None:
    async def body() -> None:
        note = TransferCompleteNotification("op", {}, 0)
        merged = await note
        assert merged.results == {} and merged.bytes_moved == 0

    asyncio.run(body())


def test_failure_is_a_param_server_error() -> None:
    assert issubclass(TransferFailed, ParamServerError)
