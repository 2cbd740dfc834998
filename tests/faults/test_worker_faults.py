"""Worker processes that die or hang: SIGKILL while holding the slowest SSP clock, SIGSTOP past
the lease then SIGCONT (evicted, then re-registered or fenced).

SIGKILL of a worker in an open BSP step (case bsp-dead-worker.md, default ``shrink`` and strict
``fail_fast`` policies, with a real worker process) is covered by
``tests/server/test_case_bsp_dead_worker.py``; it is not repeated here.

What a hung worker becomes when it wakes up (asserted below):

- **re-registered** when its name is free: the server evicted it when its lease lapsed; its first
  call after SIGCONT is refused (FAILED_PRECONDITION, ``WorkerNotFound``), the client registers
  again under the same name (a new incarnation ``name#k`` starting at the live minimum clock) and
  retries with the same request id, so nothing is applied twice;
- **fenced** when a newer incarnation holds the name (a restarted worker registered with
  ``replace``): its re-registration is refused (ALREADY_EXISTS), the client marks itself evicted
  and its calls raise ``WorkerNotFound``; it never takes the name back.

Either way every push that carries the old incarnation's worker id is refused.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from paramserver.api.v1 import parameter_server_pb2_grpc as pb_grpc
from paramserver.errors import ERROR_CLASS_METADATA_KEY, WaitTimeout
from paramserver.worker_client import UpdateRule, WorkerClient, connect
from tests.harness import JsonWorker, ServerProcess, eventually, status
from tests.harness import raw_stubs as raw

from .helpers import report

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(240),
    pytest.mark.asyncio(loop_factories=["asyncio"]),
]

LEASE_S = 3.0  # live clients of a busy machine keep it; the dead one lapses


async def _worker_live(address: str, worker_id: str) -> bool | None:
    """Whether ``worker_id`` is live (None: unknown to the server)."""
    for w in (await status(address)).workers:
        if w.worker_id == worker_id:
            return bool(w.live)
    return None


async def _old_incarnation_push_refused(address: str, worker_id: str) -> None:
    """A push carrying ``worker_id`` is refused with FAILED_PRECONDITION / WorkerNotFound."""
    async with raw.channel(address) as ch:
        stub = pb_grpc.ParameterServerStub(ch)
        msgs = raw.push_arrays(worker_id, 0x0DD, {"n": np.ones((), np.int64)})
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Push(iter(msgs), timeout=10)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    classes = [v for k, v in info.value.trailing_metadata() or () if k == ERROR_CLASS_METADATA_KEY]
    assert classes == ["WorkerNotFound"], info.value


async def test_sigkill_of_the_worker_holding_the_slowest_ssp_clock(tmp_path: Path) -> None:
    """SSP s = 1, lease 3 s: A and B (clients here) push and clock twice (clock 2); C, a worker
    process, stays at clock 0, so A's and B's pulls wait for C (a short pull's WaitTimeout names
    C). C is SIGKILLed: once its lease, as the server reported it just before, has run out it is
    evicted (not before; the time is reported), the minimum clock becomes 2 and both waits
    return with every applied push (SGD lr 1: w == -sum of A's and B's pushes)."""
    args = ("--consistency", "ssp", "--staleness", "1", "--lease-ms", str(int(LEASE_S * 1000)))
    with ServerProcess(tmp_path, *args, start=False) as server:
        server.start()
        c = JsonWorker(tmp_path, "hold", "--server", server.address, "--name", "C")
        clients: list[WorkerClient] = []
        try:
            await c.wait_for("ready")
            for name in "AB":
                client = connect(server.address, name, auto_reregister=False)
                await client.open()
                clients.append(client)
            a, b = clients
            await a.init({"w": np.zeros(4, np.float32)}, UpdateRule("sgd", lr=1.0))
            for client, g in ((a, 1.0), (b, 2.0)):
                for _ in range(2):
                    await client.push({"w": np.full(4, g, np.float32)})
                    await client.clock()
            with pytest.raises(WaitTimeout, match=r"\bC\b"):
                await a.pull(["w"], timeout_s=0.3)
            idle = (await status(server.address)).asyncio_tasks
            pulls = [asyncio.ensure_future(cl.pull(["w"], timeout_s=60)) for cl in clients]
            # C's lease as the server reports it (read after this instant): the waits cannot be
            # released before it has run out, however busy the machine (load only delays).
            read_at = time.monotonic()
            (c_info,) = [w for w in (await status(server.address)).workers if w.worker_name == "C"]
            assert c_info.live and not any(p.done() for p in pulls)
            killed_at = time.monotonic()
            c.signal(signal.SIGKILL)
            # Released by the eviction, before the pulls' own 60 s deadline (hang guard: 120 s).
            results = await asyncio.wait_for(asyncio.gather(*pulls), 120)
            elapsed = time.monotonic() - killed_at
            since_read = time.monotonic() - read_at
            st = await status(server.address)

            async def no_task_left() -> bool:
                # The released waits leave no task behind. Compared against the count before
                # them once it settles: a heartbeat RPC in flight is a task for a moment.
                return (await status(server.address)).asyncio_tasks <= idle

            await eventually(no_task_left, timeout_s=30, what="server tasks back to the idle count")
        finally:
            for client in clients:
                await client.close()
            c.close()
    assert since_read >= c_info.lease_remaining_ms / 1000, (since_read, c_info.lease_remaining_ms)
    for got in results:
        np.testing.assert_array_equal(got["w"], np.full(4, -6.0, np.float32))
    assert {w.worker_name: w.live for w in st.workers} == {"A": True, "B": True, "C": False}
    assert st.view.min_clock == 2
    report("SIGKILL of the slowest SSP worker", pulls_released_after_kill_s=elapsed)


async def _stop_past_lease(server: ServerProcess, worker: JsonWorker) -> tuple[str, float]:
    """SIGSTOP ``worker`` once it has pushed; poll until the server evicts it. Returns its
    worker id and the seconds from SIGSTOP to the eviction."""
    await worker.wait_for("ack", count=5)
    old_id = worker.of("registered")[0]["worker_id"]
    worker.signal(signal.SIGSTOP)
    stopped_at = time.monotonic()

    async def evicted() -> bool:
        return await _worker_live(server.address, old_id) is False

    await eventually(evicted, timeout_s=20 * LEASE_S, what=f"{old_id} evicted")
    return old_id, time.monotonic() - stopped_at


async def test_sigstop_past_lease_then_sigcont_re_registers(tmp_path: Path) -> None:
    """ASP, lease 3 s. Worker W (a process pushing +1 to ``n`` every 20 ms, 60 pushes) is
    SIGSTOPped: evicted about a lease later. SIGCONT: W is re-registered under its name as a
    new incarnation (its acks carry the new worker id) and finishes its 60 pushes; a push
    carrying the old id is refused (FAILED_PRECONDITION, WorkerNotFound); the name has one live
    registration; n == 60 exactly (each push applied once across the re-registration)."""
    args = ("--consistency", "asp", "--lease-ms", str(int(LEASE_S * 1000)))
    with ServerProcess(tmp_path, *args, start=False) as server:
        server.start()
        w = JsonWorker(tmp_path, "loop", "--server", server.address, "--name", "W", "--count", "60")
        try:
            old_id, evicted_s = await _stop_past_lease(server, w)
            w.signal(signal.SIGCONT)
            resumed_at = time.monotonic()

            def as_new_incarnation() -> list[dict[str, object]]:
                return [e for e in w.of("ack") if e["worker_id"] != old_id]

            await eventually(
                lambda: bool(as_new_incarnation()), timeout_s=10, what="an ack after SIGCONT"
            )
            first_new = as_new_incarnation()[0]
            back_s = float(first_new["received"]) - resumed_at  # type: ignore[arg-type]
            new_id = first_new["worker_id"]
            await _old_incarnation_push_refused(server.address, old_id)
            live = [x for x in (await status(server.address)).workers if x.live]
            assert [x.worker_id for x in live] == [new_id]
            assert await w.wait_exit(timeout_s=20) == 0, w.stderr()
            async with raw.channel(server.address) as ch:
                n = int((await raw.pull(pb_grpc.ParameterServerStub(ch), ["n"]))["n"])
        finally:
            w.close()
    assert new_id != old_id and new_id.startswith("W#")
    assert int(new_id.split("#")[1]) > int(old_id.split("#")[1])
    assert w.of("ack")[-1]["reregistrations"] >= 1
    assert len({e["request_id"] for e in w.of("ack")}) == 60
    assert n == 60
    report(
        "SIGSTOP past the lease, SIGCONT (re-registered)",
        evicted_after_stop_s=evicted_s,
        first_ack_after_cont_s=back_s,
    )


async def test_sigstop_past_lease_then_sigcont_is_fenced_by_its_successor(tmp_path: Path) -> None:
    """ASP, lease 3 s. W is SIGSTOPped and evicted; its successor W' (same name, ``replace``)
    registers and pushes. SIGCONT: W is fenced -- its re-registration is refused, its push
    raises WorkerNotFound and it exits (code 3); W' keeps the name (the one live registration),
    a push carrying W's old id is refused, and no push of W was applied after the eviction
    (n is the acked pushes of both, plus at most the one push each had in flight)."""
    args = ("--consistency", "asp", "--lease-ms", str(int(LEASE_S * 1000)))
    with ServerProcess(tmp_path, *args, start=False) as server:
        server.start()
        w = JsonWorker(tmp_path, "loop", "--server", server.address, "--name", "W")
        successor: JsonWorker | None = None
        try:
            old_id, evicted_s = await _stop_past_lease(server, w)
            successor = JsonWorker(
                tmp_path, "loop", "--server", server.address, "--name", "W", "--replace"
            )
            new_id = (await successor.wait_for("registered"))["worker_id"]
            await successor.wait_for("ack")
            w.signal(signal.SIGCONT)
            resumed_at = time.monotonic()
            assert await w.wait_exit(timeout_s=10) == 3, w.stderr()
            fenced_s = time.monotonic() - resumed_at
            await _old_incarnation_push_refused(server.address, old_id)
            live = [x for x in (await status(server.address)).workers if x.live]
            assert [x.worker_id for x in live] == [new_id]
            successor.signal(signal.SIGSTOP)  # freeze its count while n is read
            async with raw.channel(server.address) as ch:
                n = int((await raw.pull(pb_grpc.ParameterServerStub(ch), ["n"]))["n"])
        finally:
            w.close()  # reaps the process and reads its reports to the end
            if successor is not None:
                successor.close()
    assert successor is not None
    acked = len(w.of("ack")) + len(successor.of("ack"))
    fenced = w.of("fenced")
    assert len(fenced) == 1 and fenced[0]["worker_id"] == old_id
    assert all(e["worker_id"] == old_id for e in w.of("ack"))
    assert new_id != old_id
    assert acked <= n <= acked + 2
    report(
        "SIGSTOP past the lease, SIGCONT (fenced by a successor)",
        evicted_after_stop_s=evicted_s,
        fenced_exit_after_cont_s=fenced_s,
    )
