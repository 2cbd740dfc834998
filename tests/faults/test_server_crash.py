"""SIGKILL of the server with ``--wal``: restart on the same port, workers ride through, nothing
acknowledged is lost and nothing is applied twice (issue 5; case retried-push.md across a
restart).

The server is a real ``paramserver serve`` process (its first start takes an ephemeral port,
restarts reuse it), the workers real processes (``tests/harness/fault_worker.py``) using the
product client with its default retry policy. Expected values are computed here independently: a
single-process oracle of the BSP job, and closed forms for the ``add`` job.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from paramserver.api.v1 import parameter_server_pb2_grpc as pb_grpc
from paramserver.worker_client import RetryPolicy, UpdateRule, connect
from tests.harness import JsonWorker, ServerProcess, eventually, status, wait_serving
from tests.harness import raw_stubs as raw
from tests.harness.fault_worker import LR, MOMENTUM, batch, initial_w, quantised_grad
from tests.server.test_case_retried_push import _HTTP2_DATA, ReplyCuttingProxy

from .helpers import report

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(420),
    pytest.mark.asyncio(loop_factories=["asyncio"]),
]


def bsp_oracle(workers: int, steps: int, seed: int = 0) -> np.ndarray:
    """Single-process SGD with momentum (torch.optim.SGD, dampening 0) on the mean of the
    workers' quantised gradients: what the BSP cluster must compute, crash or no crash."""
    w = initial_w()
    buf = np.zeros_like(w)
    for t in range(steps):
        g = sum(quantised_grad(w, *batch(seed, t, i)) for i in range(workers)) / workers
        buf = MOMENTUM * buf + g
        w = w - LR * buf
    return w


async def run_bsp_job(
    tmp: Path, server: ServerProcess, *, workers: int, steps: int, crash_at_step: int | None
) -> tuple[list[str], dict[str, float]]:
    """Run the ``bsp-train`` job; optionally SIGKILL and restart the server at BSP step
    ``crash_at_step``. Returns the final parameters (float.hex) and the timings.

    The crash point is an ordering the test controls, not a race with the workers: they pause
    before that step until the test opens a gate file, and the test kills the server right
    after opening it (so the kill lands with the workers at that step, however busy the
    machine). Waits have deadlines far beyond their idle times (hang guards only)."""
    gate = tmp / "gate"
    pause = ("--pause-at", str(crash_at_step), "--gate", str(gate)) if crash_at_step else ()
    procs = [
        JsonWorker(
            tmp,
            "bsp-train",
            "--server",
            server.address,
            *("--index", str(i), "--workers", str(workers), "--steps", str(steps)),
            *("--retry-deadline-s", "180", *pause),
        )
        for i in range(workers)
    ]
    timings: dict[str, float] = {}
    try:
        if crash_at_step is not None:
            for p in procs:
                await p.wait_for("paused", timeout_s=180)
            at_pause = (await status(server.address)).bsp_step
            assert at_pause == crash_at_step, at_pause  # every worker holds before that step
            gate.touch()
            server.kill()
            timings["killed_at_step"] = at_pause
            timings["serving_s"] = await server.astart()
            restored = (await wait_serving(server.address, timeout_s=120)).bsp_step
            timings["first_call_s"] = time.monotonic() - server.spawned_at
            assert restored >= at_pause, "a step seen closed before the kill was lost"
            timings["restored_step"] = restored

            async def resumed() -> bool:
                return (await status(server.address, timeout_s=30)).bsp_step > restored

            await eventually(resumed, timeout_s=180, what="training resumes after the restart")
            timings["resumed_s"] = time.monotonic() - server.spawned_at
        finals = [(await p.wait_for("done", timeout_s=180))["w"] for p in procs]
        codes = [await p.wait_exit(timeout_s=60) for p in procs]
        assert codes == [0] * workers, [p.stderr()[-2000:] for p in procs]
    finally:
        for p in procs:
            p.close()
    assert all(f == finals[0] for f in finals), "workers disagree on the final parameters"
    return finals[0], timings


async def test_bsp_run_with_server_sigkill_equals_run_without(tmp_path: Path) -> None:
    """Deterministic BSP job (3 worker processes, fixed seeds, SGD with momentum, periodic
    checkpoints every 4 steps, ``--wal``): once without a crash, once with the server SIGKILLed
    at step 10 of 24 (between checkpoints: the restore replays the WAL's tail) and restarted on
    the same port. The workers ride through (retries, same request ids) and both runs end with
    bit-identical parameters, equal to the single-process oracle (gradients are quantised so
    any arrival order sums exactly)."""
    workers, steps = 3, 24
    oracle = bsp_oracle(workers, steps)
    results = []
    for crash in (None, 10):
        run_dir = tmp_path / f"crash-{crash}"
        run_dir.mkdir()
        args = ("--consistency", "bsp", "--wal", "--checkpoint-dir", str(run_dir / "ckpt"))
        with ServerProcess(run_dir, *args, "--checkpoint-every-steps", "4", start=False) as server:
            server.start()
            final, timings = await run_bsp_job(
                run_dir, server, workers=workers, steps=steps, crash_at_step=crash
            )
            results.append(final)
            if crash is not None:
                assert "restored checkpoint" in server.last_log()  # + the WAL's tail
                report("server SIGKILL mid-BSP-training (--wal)", **timings)
    no_crash, crashed = results
    assert crashed == no_crash
    got = np.array([float.fromhex(v) for v in crashed])
    np.testing.assert_allclose(got, oracle, rtol=1e-12, atol=1e-12)


async def test_asp_every_acknowledged_add_survives_sigkill(tmp_path: Path) -> None:
    """ASP, ``add`` rule, 3 worker processes x 150 pushes, ``--wal``: push (i, j) adds 1 at its
    own index of ``onehot`` and a distinct ``(index + 1) ** 2`` to ``total``. The server is
    SIGKILLed after >= 150 applied pushes and restarted. Right after the restart every push
    acknowledged before the kill is present exactly once (its onehot entry is 1, no entry
    exceeds 1); at the end every entry is exactly 1 and ``total`` equals the sum over all
    acknowledged pushes, exactly (int64)."""
    workers, pushes = 3, 150
    size = workers * pushes
    args = ("--consistency", "asp", "--wal", "--wal-dir", str(tmp_path / "wal"))
    with ServerProcess(tmp_path, *args, start=False) as server:
        server.start()
        procs = [
            JsonWorker(
                tmp_path,
                "asp-add",
                "--server",
                server.address,
                *("--index", str(i), "--workers", str(workers), "--pushes", str(pushes)),
            )
            for i in range(workers)
        ]
        try:

            async def far_enough() -> bool:
                return (await status(server.address)).applied_updates >= pushes

            await eventually(far_enough, timeout_s=60, what=f"{pushes} pushes applied")
            server.kill()
            acked_before = {e["index"] for p in procs for e in p.of("ack")}
            serving_s = await server.astart()
            async with connect(server.address, "observer", heartbeat=False) as ps:
                first_call_s = time.monotonic() - server.spawned_at
                after = (await ps.pull(["onehot"], observer=True))["onehot"]
                assert after.max() <= 1.0, "a push was applied twice"
                missing = sorted(i for i in acked_before if after[i] != 1.0)
                assert not missing, f"acknowledged pushes lost by the crash: {missing[:10]}"
                restored_count = int(after.sum())
                for p in procs:
                    await p.wait_for("done", timeout_s=60)
                resumed = [
                    e["received"] - server.spawned_at
                    for p in procs
                    for e in p.of("ack")
                    if e["index"] not in acked_before and e["received"] > server.spawned_at
                ]
                final = await ps.pull(["onehot", "total"], observer=True)
            codes = [await p.wait_exit() for p in procs]
            assert codes == [0] * workers, [p.stderr()[-2000:] for p in procs]
        finally:
            for p in procs:
                p.close()
    acked = [e["index"] for p in procs for e in p.of("ack")]
    assert sorted(acked) == list(range(size))  # every push was acknowledged once
    np.testing.assert_array_equal(final["onehot"], np.ones(size))
    assert int(final["total"]) == sum((i + 1) ** 2 for i in acked)
    report(
        "server SIGKILL mid-ASP-training (--wal)",
        acked_before_kill=len(acked_before),
        present_after_restart=restored_count,
        serving_s=serving_s,
        first_call_s=first_call_s,
        resumed_s=min(resumed),
    )


@pytest.mark.parametrize("stop", ["sigkill with --wal", "sigterm"])
async def test_checkpoint_in_open_bsp_step_keeps_queued_gradients(
    tmp_path: Path, stop: str
) -> None:
    """BSP, mean, SGD lr 1 from zeros, workers a and b. a pushes [2, 2] for step 0 (queued in
    the open step, acknowledged); a checkpoint is written (on demand, which truncates the
    WAL); the server is SIGKILLed (``--wal``) or stopped with SIGTERM (final checkpoint) and
    restarted. b pushes [4, 4], both clock: w == -(2 + 4) / 2 == -3 -- a's acknowledged
    gradient survived the checkpoint, and a's retry of it is still a duplicate."""
    import signal

    wal = ("--wal",) if stop.startswith("sigkill") else ()
    args = ("--consistency", "bsp", "--checkpoint-dir", str(tmp_path / "ckpt"), *wal)
    retry = RetryPolicy(initial_backoff_s=0.02, max_backoff_s=0.2, deadline_s=30.0)
    with ServerProcess(tmp_path, *args, "--grace-s", "1", start=False) as server:
        server.start()
        async with (
            connect(server.address, "a", retry=retry) as a,
            connect(server.address, "b", retry=retry) as b,
        ):
            await a.init({"w": np.zeros(2)}, UpdateRule("sgd", lr=1.0))
            await a.push({"w": np.full(2, 2.0)})
            async with raw.channel(server.address) as ch:
                resp = await pb_grpc.ParameterServerStub(ch).Checkpoint(
                    raw.pb.CheckpointRequest(), timeout=30
                )
            assert resp.path
            if stop.startswith("sigkill"):
                server.kill()
            else:
                server.signal(signal.SIGTERM)
                assert await server.wait_exit(timeout_s=15) == 0, server.log()
            await server.astart()
            await b.push({"w": np.full(2, 4.0)})
            await a.clock()
            await b.clock()
            got = (await a.pull(["w"]))["w"]
            st = await status(server.address)
    np.testing.assert_array_equal(got, [-3.0, -3.0])
    assert st.applied_updates == 2


async def test_retried_push_across_server_restart_is_applied_once(tmp_path: Path) -> None:
    """Case retried-push.md across a SIGKILL and restart (``--wal``): ASP, w = zeros(4), sgd
    lr 1. The push [1, 1, 1, 1] with request id r1 goes through a TCP proxy
    (:class:`integration.test_case_retried_push.ReplyCuttingProxy`) that holds the server's
    reply, sent only after the WAL record was durable, past the client's 200 ms deadline. The
    server is SIGKILLed and restarted on the same port; the retry of r1 by the same worker id
    is answered OK and marked duplicate, w == -1, applied 1; a fresh r2 is applied (w == -2).
    Then the product client does the same on its own: its push loses the reply, the server is
    killed and restarted while it retries (same request id), and the ack it finally gets is a
    duplicate: w == -3, applied 3."""
    ones = np.ones(4, np.float32)
    args = ("--consistency", "asp", "--wal", "--wal-dir", str(tmp_path / "wal"))
    with ServerProcess(tmp_path, *args, start=False) as server:
        server.start()
        async with ReplyCuttingProxy(server.port) as proxy:
            async with raw.channel(proxy.address) as ch:
                stub = pb_grpc.ParameterServerStub(ch)
                wid = await raw.register(stub, "worker")
                await raw.init(stub, {"w": np.zeros(4, np.float32)}, UpdateRule("sgd", lr=1.0))
                proxy.arm("hold", hold_s=60.0)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.Push(
                        iter(raw.push_arrays(wid, 0x5EED_0001, {"w": ones})), timeout=0.2
                    )
                assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                assert proxy.intercepted.is_set()
            server.kill()
            await server.astart()
            async with raw.channel(server.address) as ch:
                stub = pb_grpc.ParameterServerStub(ch)
                resp = await stub.Push(
                    iter(raw.push_arrays(wid, 0x5EED_0001, {"w": ones})), timeout=10
                )
                assert resp.duplicate
                assert resp.applied_updates == 1
                np.testing.assert_array_equal((await raw.pull(stub, ["w"]))["w"], -ones)
                resp = await stub.Push(
                    iter(raw.push_arrays(wid, 0x5EED_0002, {"w": ones})), timeout=10
                )
                assert not resp.duplicate
                np.testing.assert_array_equal((await raw.pull(stub, ["w"]))["w"], -2 * ones)

            retry = RetryPolicy(initial_backoff_s=0.05, max_backoff_s=0.5, deadline_s=30.0)
            # A connection of its own: gRPC would otherwise reuse the held one of the raw stub.
            own = [("grpc.use_local_subchannel_pool", 1)]
            async with connect(  # the proxy is on the gRPC path: no same-host local link
                proxy.address,
                "client",
                heartbeat=False,
                retry=retry,
                channel_options=own,
                local_link=False,
            ) as ps:
                # The first call opens the client's Session stream; the push's reply is then
                # the next DATA frame on it, and that is what the proxy holds.
                np.testing.assert_array_equal((await ps.pull(["w"]))["w"], -2 * ones)
                proxy.arm("hold", hold_s=60.0, frame_type=_HTTP2_DATA)
                push = asyncio.ensure_future(ps.push({"w": ones}, timeout_s=0.2))
                await eventually(proxy.intercepted.is_set, timeout_s=10, what="reply held")
                server.kill()
                await server.astart()
                ack = await push
                acked_s = time.monotonic() - server.spawned_at
                assert ack.duplicate
                assert ack.applied_updates == 3
            st = await status(server.address)
            async with raw.channel(server.address) as ch:
                got = (await raw.pull(pb_grpc.ParameterServerStub(ch), ["w"]))["w"]
    np.testing.assert_array_equal(got, -3 * ones)
    assert st.applied_updates == 3
    assert st.duplicate_pushes >= 1
    report("duplicate delivery across a server SIGKILL (--wal)", retry_acked_s=acked_s)
